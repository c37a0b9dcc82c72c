"""Benchmark worker processes: the roles by name (child side) and :class:`Worker`
(parent side, over :class:`p2pkv.workers.JsonLineProcess`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from p2pkv.bench.data import BenchError
from p2pkv.bench.kernel_roles import role_kernel_client, role_kernel_server
from p2pkv.bench.node_roles import role_node_client, role_node_server, role_soak_client
from p2pkv.bench.raw_roles import role_raw_client, role_raw_server
from p2pkv.workers import JsonLineProcess, WorkerExited, WorkerTimeout

_ROLES: dict[str, Callable[[dict[str, Any]], int]] = {
    "node-server": role_node_server,
    "node-client": role_node_client,
    "raw-server": role_raw_server,
    "raw-client": role_raw_client,
    "kernel-server": role_kernel_server,
    "kernel-client": role_kernel_client,
    "soak-client": role_soak_client,
}


def main_worker(argv: Sequence[str]) -> int:
    """Entry point of a worker process: ``python -m p2pkv.bench ROLE SPEC_JSON``."""
    if len(argv) != 2 or argv[0] not in _ROLES:
        print(f"usage: python -m p2pkv.bench {{{','.join(_ROLES)}}} SPEC_JSON", file=sys.stderr)
        return 2
    return _ROLES[argv[0]](json.loads(argv[1]))





_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Worker:
    """A worker process: JSON-line commands on stdin, replies on stdout, bounded waits.

    Every failure (no answer in time, the process gone, an error reply) is a
    :class:`BenchError` that carries the tail of the worker's stderr.
    """

    def __init__(self, name: str, role: str, spec: dict[str, Any]) -> None:
        self.name = name
        self._child = JsonLineProcess(
            [sys.executable, "-m", "p2pkv.bench", role, json.dumps(spec)],
            env={**os.environ, **_WORKER_ENV})
        self.proc = self._child.proc
        self.pid = self._child.pid

    def stderr_tail(self) -> str:
        return self._child.stderr_tail()

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return self._child.next(timeout)
        except WorkerTimeout:
            raise BenchError(f"{self.name}: no answer within {timeout:.0f} s; stderr:\n"
                             f"{self.stderr_tail()}") from None
        except WorkerExited:
            rc = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self.proc.wait(5)
            raise BenchError(f"{self.name} exited (rc={rc}); stderr:\n"
                             f"{self.stderr_tail()}") from None

    def poll_event(self) -> dict[str, Any] | None:
        return self._child.poll_line()

    def send_line(self, text: str) -> None:
        try:
            self._child.send_line(text)
        except OSError as exc:
            raise BenchError(f"{self.name} is gone ({exc}); stderr:\n"
                             f"{self.stderr_tail()}") from exc

    def ask(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.send_line(json.dumps(cmd))
        reply = self.next(timeout)
        if "error" in reply:
            raise BenchError(f"{self.name} {cmd.get('op')}: {reply['error']}")
        return reply

    def close_stdin(self) -> None:
        self._child.close_stdin()

    def stop(self, timeout: float = 30.0) -> int | None:
        """Close stdin (the stop signal), wait up to ``timeout``, kill if still alive."""
        self.close_stdin()
        try:
            return self._child.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    def kill(self) -> None:
        self._child.kill()

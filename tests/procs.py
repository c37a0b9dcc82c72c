"""``tests/nodeproc.py`` in a subprocess, speaking JSON lines; shared by the fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pkv.workers import JsonLineProcess, WorkerExited, WorkerTimeout

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def child_env() -> dict[str, str]:
    """The environment of a test's child process: the tests' helpers and this checkout's
    p2pkv come first on its path (where p2pkv is not installed, as on a machine that puts
    the checkout on PYTHONPATH, or is installed from another checkout), then the
    caller's PYTHONPATH (packages carried there)."""
    inherited = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join([str(TESTS), str(ROOT), *([inherited] if inherited else [])])
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


class NodeProcess:
    """A node role in its own process; its stdout JSON lines arrive on a queue.

    ``prefix`` runs it under another command (``ip netns exec NS``). Every wait is
    bounded and failures carry the child's stderr.
    """

    def __init__(self, role: str, spec: dict[str, Any], *extra: str,
                 prefix: Sequence[str] = ()) -> None:
        self._child = JsonLineProcess(
            [*prefix, sys.executable, str(TESTS / "nodeproc.py"), role, json.dumps(spec), *extra],
            env=child_env(), cwd=ROOT, stderr_lines=400)
        self.proc = self._child.proc

    def event(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next JSON event; AssertionError (with stderr) on timeout or exit."""
        try:
            return self._child.next(timeout)
        except WorkerTimeout:
            raise AssertionError(
                f"no event within {timeout}s; stderr:\n{self.stderr()}") from None
        except WorkerExited:
            raise AssertionError(
                f"process exited ({self.proc.poll()}); stderr:\n{self.stderr()}") from None

    def stderr(self) -> str:
        return self._child.stderr_tail(4000)

    def stop(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """Close stdin (the serve role's stop signal); return its final event."""
        self._child.close_stdin()
        try:
            return self.event(timeout)
        finally:
            self.kill()

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self._child.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"process did not exit within {timeout}s; stderr:\n{self.stderr()}") from None

    def kill(self) -> None:
        self._child.kill()


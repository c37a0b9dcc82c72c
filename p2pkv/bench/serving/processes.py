"""The processes of a serving cluster, and the bounded waits and reads around them.

Every process (an engine, nginx, vLLM's router) runs in a session of its own with its
output in a log file, so that stopping it stops its whole group (an engine's core and
workers included) and a failure can quote the log's tail. Nothing here knows what the
process is: :mod:`~p2pkv.bench.serving.balancers` and
:mod:`~p2pkv.bench.serving.cluster` say what to run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from p2pkv.bench.serving.leftovers import remove_vllm_shm, vllm_shm, wait_group_empty

__all__ = ["ServingProcess", "ServingStartError", "cpu_used", "group_cpu", "scrape",
           "wait_listening"]


class ServingStartError(RuntimeError):
    """A process of the cluster did not come up; the message names it and holds its log
    tail."""


class ServingProcess:
    """One command in a session of its own, its output appended to ``log``."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: Mapping[str, str],
                 cwd: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.log = log
        self._shm = vllm_shm()  # what /dev/shm held before: not this process's to remove
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=dict(env), cwd=cwd,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        # Children of the session (engine core, workers) go too, even when the leader
        # has already exited.
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        # The children are not ours to wait for (init reaps them): return once the group
        # is empty, so that "stopped" means no process of it is left. Bounded.
        if wait_group_empty(self.proc.pid, 10):
            remove_vllm_shm(self._shm)

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def group_cpu(pgid: int, proc: Path = Path("/proc")) -> dict[int, tuple[str, float]]:
    """The CPU time (user and system, seconds) each live process of process group
    ``pgid`` has used so far, by pid, with its name (``comm``: vLLM names an engine's
    core and workers ``VLLM::EngineCor`` and ``VLLM::Worker``). A process that exits
    while it is read is left out."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The name is in parentheses and may hold spaces; the fields follow its end.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:  # pgrp
            out[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_used(before: Mapping[int, tuple[str, float]],
             after: Mapping[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds used between two :func:`group_cpu` reads, summed by process name (a
    process that started in between counts from zero)."""
    out: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used = seconds - before.get(pid, (name, 0.0))[1]
        out[name] = round(out.get(name, 0.0) + used, 2)
    return out


def wait_listening(proc: ServingProcess, port: int, timeout: float) -> None:
    """Return once ``proc`` accepts connections on 127.0.0.1:``port``; raise
    :class:`ServingStartError` (with its log tail) when it exits first or ``timeout``
    seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise ServingStartError(f"{proc.name} exited with {proc.proc.returncode} "
                                    f"before listening on {port}; log tail:\n{proc.tail()}")
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        if time.monotonic() > deadline:
            raise ServingStartError(f"{proc.name} did not listen on {port} within "
                                    f"{timeout:.0f}s; log tail:\n{proc.tail()}")
        time.sleep(0.1)


def scrape(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> dict[str, float]:
    """A process's Prometheus ``/metrics`` on ``host``:``port`` as
    ``{'name{k=v,...}': value}`` (labels sorted, quotes dropped; the ``engine`` and
    ``model_name`` labels left out)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not m:
            continue
        name, labels, value = m.groups()
        pairs = sorted((k, v) for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"',
                                                        labels or "")
                       if k not in ("engine", "model_name"))
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in pairs) + "}" if pairs else "")
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(value)
    return out

"""The chaos run's holders (``serve`` processes) and the resources it watches for leaks.

A :class:`Holder` is one ``python -m p2pkv.cli serve --json --fill N`` process on a
fixed port, registered in the directory; it can be killed, stopped, continued, drained
and started again on the same port. Its output goes to a file in the run's temporary
directory (read for the ``directory`` event, never through a pipe that could fill).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Holder", "Resources", "shm_segments"]

_SHM_OWNER = re.compile(r"p2pkv-(\d+)-")


class Holder:
    """One ``serve`` process; ``advertise``: the address it registers (a proxy's);
    ``listen``: where it listens (default ``tcp://127.0.0.1:PORT``); ``prefix``: a
    command it runs under (``ip netns exec NS``)."""

    def __init__(self, name: str, *, directory: str, fill: int, port: int, metrics_port: int,
                 log_dir: Path, advertise: str | None = None, shm: bool = False,
                 listen: str | None = None, prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.port = port
        self.metrics_port = metrics_port
        self.log = log_dir / f"{name}.log"
        self.argv = [*prefix, sys.executable, "-m", "p2pkv.cli", "serve", "--json",
                     "--fill", str(fill), "--pool-blocks", str(fill + 16), "--directory", directory,
                     "--directory-ttl", "3", "--drain-timeout", "2",
                     "--listen", listen or f"tcp://127.0.0.1:{port}",
                     "--metrics-port", str(metrics_port),
                     *(["--advertise", advertise] if advertise else []),
                     *(["--shm"] if shm else [])]
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.pids.append(self.proc.pid)
        self.starts += 1

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Until this start printed its ``directory`` event (it is serving and tried to
        register); False when it exited or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._events().count("directory") >= self.starts:
                return True
            if not self.running:
                return False
            time.sleep(0.05)
        return False

    def _events(self) -> list[str]:
        out = []
        with contextlib.suppress(OSError):
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        out.append(str(json.loads(line).get("event")))
        return out

    def signal(self, sig: signal.Signals) -> None:
        if self.running and self.proc is not None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status, or None (after a SIGKILL) when it did not exit in time."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def pinned(self) -> float | None:
        """``p2pkv_pool_pinned_blocks`` from its metrics endpoint (None: unreadable)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=3) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("p2pkv_pool_pinned_blocks"):
                return float(line.split()[-1])
        return None


def shm_segments(pids: set[int]) -> list[str]:
    """``/dev/shm`` p2pkv segments whose owner is one of ``pids`` (ours, not others')."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names
                  if (m := _SHM_OWNER.match(n)) is not None and int(m.group(1)) in pids)


class Resources:
    """Open file descriptors and threads of this process, to compare start and end."""

    def __init__(self) -> None:
        self.fds = self.count_fds()
        self.threads = threading.active_count()
        self.tasks = self.count_tasks()

    @staticmethod
    def count_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    @staticmethod
    def count_tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    def leaked(self) -> dict[str, int]:
        return {"fds": max(0, self.count_fds() - self.fds),
                "threads": max(0, threading.active_count() - self.threads),
                "os_threads": max(0, self.count_tasks() - self.tasks)}

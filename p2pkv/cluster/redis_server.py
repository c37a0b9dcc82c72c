"""A private ``redis-server`` on 127.0.0.1: for the tests, the benchmark and the demo.

:class:`LocalRedis` starts the real server binary (Debian's ``redis-server``) on a free
port with a temporary directory, no persistence and no eviction, waits until it answers
``PING`` and stops it (or kills it) on request. Nothing about it is simulated.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["LocalRedis", "find_redis_server", "free_port"]


def find_redis_server() -> str | None:
    """The ``redis-server`` executable, or None when it is not installed."""
    found = shutil.which("redis-server")
    if found:
        return found
    for candidate in ("/usr/bin/redis-server", "/usr/sbin/redis-server",
                      "/usr/local/bin/redis-server"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pong(port: int, timeout: float) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """One ``redis-server`` process; use as a context manager or start()/stop()."""

    def __init__(self, port: int | None = None, *, executable: str | None = None) -> None:
        exe = executable or find_redis_server()
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install "
                                    "redis-server; `make test` installs it when run as root)")
        self.executable = exe
        self.port = port or free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="p2pkv-redis-")
        self.directory = Path(self._tmp.name)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> LocalRedis:
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            self.proc = subprocess.Popen(
                [self.executable, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                 "--daemonize", "no", "--protected-mode", "no", "--databases", "16",
                 "--maxmemory-policy", "noeviction"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while not _pong(self.port, 0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {tail}")
            time.sleep(0.02)
        return self

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "redis.log").read_text(errors="replace")[-2000:]
        return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL (a crash: no shutdown, no save)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

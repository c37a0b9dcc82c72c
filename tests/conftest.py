"""Shared fixtures: node processes with bounded waits, always cleaned up."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))


class NodeProcess:
    """``tests/nodeproc.py`` in a subprocess; its JSON stdout lines arrive on a queue."""

    def __init__(self, role: str, spec: dict[str, Any], *extra: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(TESTS)}
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "nodeproc.py"), role, json.dumps(spec), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=ROOT)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def event(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next JSON event; fails the test (with stderr) on timeout or exit."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no event within {timeout}s; stderr:\n{self.stderr()}")
            if line is None:
                pytest.fail(f"process exited ({self.proc.poll()}); stderr:\n{self.stderr()}")
            try:
                return json.loads(line)  # type: ignore[no-any-return]
            except json.JSONDecodeError:
                continue

    def stderr(self) -> str:
        return "".join(self._stderr)[-4000:]

    def stop(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """Close stdin (the serve role's stop signal); return its final event."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        final = None
        try:
            final = self.event(timeout)
        finally:
            self.kill()
        return final

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"process did not exit within {timeout}s; stderr:\n{self.stderr()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@pytest.fixture
def spawn() -> Iterator[Any]:
    """Start node processes; every one is killed at teardown."""
    procs: list[NodeProcess] = []

    def start(role: str, spec: dict[str, Any], *extra: str) -> NodeProcess:
        p = NodeProcess(role, spec, *extra)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc.stdin and not p.proc.stdin.closed:
            with contextlib.suppress(OSError):
                p.proc.stdin.close()
        p.kill()

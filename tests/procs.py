"""``tests/nodeproc.py`` in a subprocess, speaking JSON lines; shared by the fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


class NodeProcess:
    """A node role in its own process; its stdout JSON lines arrive on a queue.

    ``prefix`` runs it under another command (``ip netns exec NS``). Every wait is
    bounded and failures carry the child's stderr.
    """

    def __init__(self, role: str, spec: dict[str, Any], *extra: str,
                 prefix: Sequence[str] = ()) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(TESTS)}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(TESTS / "nodeproc.py"), role, json.dumps(spec),
             *extra],
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
        """The next JSON event; AssertionError (with stderr) on timeout or exit."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no event within {timeout}s; stderr:\n{self.stderr()}") from None
            if line is None:
                raise AssertionError(
                    f"process exited ({self.proc.poll()}); stderr:\n{self.stderr()}")
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)  # type: ignore[no-any-return]

    def stderr(self) -> str:
        return "".join(self._stderr)[-4000:]

    def stop(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """Close stdin (the serve role's stop signal); return its final event."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.event(timeout)
        finally:
            self.kill()

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"process did not exit within {timeout}s; stderr:\n{self.stderr()}") from None

    def kill(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

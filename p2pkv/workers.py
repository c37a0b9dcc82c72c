"""JSON-line worker processes: the one helper behind the demo, the benchmark and the
multi-process tests.

A worker is a child process that writes one JSON object per line on its stdout (events,
or replies to commands) and reads commands, one JSON line each, on its stdin; closing
its stdin tells it to stop.

* Parent side: :class:`JsonLineProcess` starts the child, reads its stdout and stderr on
  two daemon threads, and hands out the JSON lines with a deadline on every wait.
* Child side: :func:`say` writes one line, :func:`serve_commands` answers commands until
  stdin closes, :func:`stdin_closed` / :func:`wait_for_stdin_eof` watch for the stop
  signal.
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from p2pkv.errors import P2PKVError
from p2pkv.runtime.tuning import STOP_WAIT_S

__all__ = [
    "JsonLineProcess",
    "WorkerExited",
    "WorkerTimeout",
    "say",
    "serve_commands",
    "stdin_closed",
    "stdin_commands",
    "wait_for_stdin_eof",
]


class WorkerTimeout(P2PKVError, TimeoutError):
    """A worker wrote no line within the deadline."""


class WorkerExited(P2PKVError, EOFError):
    """A worker's stdout ended (it exited) while a line was awaited."""


class JsonLineProcess:
    """A child process speaking JSON lines; every wait is bounded.

    Non-JSON stdout lines are kept with the stderr tail (for error messages); a JSON
    value that is not an object arrives as ``{"value": ...}``.
    """

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, stderr_lines: int = 60) -> None:
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=dict(env) if env is not None else None, cwd=cwd)
        self.pid = self.proc.pid
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=stderr_lines)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read_stdout, args=(self.proc.stdout,),
                         name=f"worker-{self.pid}-stdout", daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(self.proc.stderr,),
                         name=f"worker-{self.pid}-stderr", daemon=True).start()

    def _read_stdout(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                obj = json.loads(line)
            except ValueError:
                self._stderr.append(f"(stdout) {line}")
                continue
            self._lines.put(obj if isinstance(obj, dict) else {"value": obj})
        self._lines.put(None)

    def _read_stderr(self, stream: IO[str]) -> None:
        for line in stream:
            self._stderr.append(line)

    def stderr_tail(self, chars: int = 3000) -> str:
        return "".join(self._stderr)[-chars:]

    def next(self, timeout: float) -> dict[str, Any]:
        """The next JSON line. :class:`WorkerTimeout` when none came within ``timeout``
        seconds, :class:`WorkerExited` once stdout ended."""
        try:
            obj = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise WorkerTimeout(f"no line within {timeout:.0f} s") from None
        if obj is None:
            self._lines.put(None)  # stays at the end for the next caller
            raise WorkerExited("the process closed its stdout")
        return obj

    def lines(self, timeout: float) -> Iterator[dict[str, Any]]:
        """Every JSON line until stdout ends, each within ``timeout`` of the last."""
        while True:
            try:
                yield self.next(timeout)
            except WorkerExited:
                return

    def poll_line(self) -> dict[str, Any] | None:
        """A line already received, without waiting (None when there is none)."""
        try:
            obj = self._lines.get_nowait()
        except queue.Empty:
            return None
        if obj is None:
            self._lines.put(None)
        return obj

    def send_line(self, text: str) -> None:
        """Write one line to the child's stdin (``OSError`` when it is gone)."""
        stdin = self.proc.stdin
        if stdin is None or stdin.closed:
            raise BrokenPipeError("stdin already closed")
        stdin.write(text + "\n")
        stdin.flush()

    def close_stdin(self) -> None:
        """The stop signal."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def wait(self, timeout: float) -> int:
        """The exit code (``subprocess.TimeoutExpired`` past ``timeout``)."""
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Kill the child if it still runs, and reap it (bounded)."""
        self.close_stdin()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_WAIT_S)


# ------------------------------------------------------------------ child side


def say(obj: Mapping[str, Any], *, default: Callable[[Any], Any] = str) -> None:
    """Write one JSON line on stdout and flush it."""
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=default) + "\n")
    sys.stdout.flush()


def stdin_commands() -> Iterator[dict[str, Any]]:
    """The JSON commands on stdin, one per non-empty line, until it closes."""
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


def serve_commands(handlers: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Answer one JSON line per command (``{"op": NAME, ...}``) until stdin closes:
    ``{"ok": true, ...}`` with the handler's reply, or ``{"error": ...}``."""
    for cmd in stdin_commands():
        op = cmd.get("op", "")
        try:
            handler = handlers[op]
        except KeyError:
            say({"error": f"unknown op {op!r}"})
            continue
        try:
            reply = handler(cmd)
        except Exception as exc:
            say({"error": f"{type(exc).__name__}: {exc}"})
            continue
        say({"ok": True, **reply})


def stdin_closed() -> threading.Event:
    """An event set once stdin closes (the parent's stop signal); a daemon thread reads
    stdin to its end, so call this after the last line was read from it."""
    done = threading.Event()

    def read_to_eof() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=read_to_eof, name="worker-stdin-eof", daemon=True).start()
    return done


def wait_for_stdin_eof(timeout: float) -> bool:
    """Wait until stdin closes, at most ``timeout`` seconds. True when it closed."""
    return stdin_closed().wait(timeout)

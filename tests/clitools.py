"""Helpers for the tests that run ``p2pkv-node`` in a subprocess: start it, read its
output and metrics, check a configuration error (used by test_cli*.py, test_cluster.py,
test_checkpoint.py, test_shm_cli.py)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "p2pkv.cli"]
MODEL = "test/cli-model"



def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any P2PKV_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PKV_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(*args: str, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else clean_env(), cwd=ROOT)


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env if env is not None else clean_env(), cwd=ROOT)


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args!r} did not finish in {timeout}s; stderr:\n{err[-3000:]}")
    return proc.returncode, out, err


def config_error(result: subprocess.CompletedProcess[str]) -> str:
    """Assert a clean exit 2: one stderr line, nothing on stdout; return that line."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("p2pkv-node: error: ")
    return lines[0]


class Serve:
    """A ``p2pkv-node serve`` process whose stdout lines arrive on a queue."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = start("serve", *args, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)

    def stderr(self) -> str:
        return "".join(self._err)[-3000:]

    def line(self, timeout: float = 60) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"serve printed nothing in {timeout}s; stderr:\n{self.stderr()}")
        if line is None:
            self.proc.wait(10)
            pytest.fail(f"serve exited {self.proc.returncode}; stderr:\n{self.stderr()}")
        return line

    def event(self, timeout: float = 60) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(self.line(timeout))
        return obj

    def stop(self, sig: int, timeout: float = 20) -> tuple[int, list[str]]:
        """Send ``sig``; return the exit code and the stdout lines printed after it."""
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"serve did not exit within {timeout}s of {sig!r}")
        rest: list[str] = []
        while True:
            line = self._lines.get(timeout=10)
            if line is None:
                return code, rest
            rest.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def read_metrics(port: int) -> dict[str, float]:
    """``/metrics`` as {sample with labels: value}."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@dataclass
class Probe:
    code: int
    out: str
    err: str

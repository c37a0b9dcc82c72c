"""Every ``examples/*.py`` runs to completion: each imports its module and calls ``main()``
(which asserts its own results) in a subprocess with a timeout.

The examples start together (each process spends seconds importing torch) and each test
waits for its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Examples that need an engine's own environment are run by that engine's tests
# (vllm_*.py: tests/test_vllm.py, with .venv-vllm).
#: Examples that run in the vLLM environment (vLLM, or transformers and the real model);
#: tests/test_vllm.py runs them.
VLLM_ENV_EXAMPLES = {"wrong_weights_kv.py"}
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py")
                  if not p.name.startswith("vllm_") and p.name not in VLLM_ENV_EXAMPLES)
TIMEOUT_S = 90

# Import the file as a module and call main(): the same code `python examples/X.py` runs,
# but a module without main() fails here instead of silently doing nothing.
RUNNER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("example", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
result = module.main()
sys.exit(0 if result in (None, 0) else result)
"""


class Examples:
    """The example processes, started together; each result is collected once.

    Each example runs in a process group of its own, and the whole group is ended: an
    example killed on its timeout (or one that forgot to) must not leave the ``serve``
    processes it started behind as orphans."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("P2PKV_")}
        self.procs = {
            path.name: subprocess.Popen([sys.executable, "-c", RUNNER, str(path)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, cwd=ROOT, env=env,
                                        start_new_session=True)
            for path in EXAMPLES
        }
        self._results: dict[str, tuple[int, str, str]] = {}

    def result(self, name: str) -> tuple[int, str, str]:
        if name not in self._results:
            proc = self.procs[name]
            try:
                out, err = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _end_group(proc)
                out, err = proc.communicate()
                pytest.fail(f"{name} did not finish within {TIMEOUT_S}s\n{out[-2000:]}\n"
                            f"{err[-3000:]}")
            _end_group(proc)  # whatever it started and did not stop
            self._results[name] = (proc.returncode, out, err)
        return self._results[name]

    def close(self) -> None:
        for proc in self.procs.values():
            _end_group(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def _end_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL every process left in the example's group (its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def examples() -> Iterator[Examples]:
    running = Examples()
    try:
        yield running
    finally:
        running.close()


def test_there_are_examples() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"v1_vs_v2_refusal.py", "handshake_debug.py", "layout_extension_refusal.py"} <= names, \
        names


@pytest.mark.parametrize("name", [p.name for p in EXAMPLES])
def test_example_runs(name: str, examples: Examples) -> None:
    code, out, err = examples.result(name)
    assert code == 0, f"{name} exited {code}\n{out[-2000:]}\n{err[-3000:]}"
    assert out.strip(), f"{name} printed nothing"


def test_refusal_example_shows_the_compact_table(examples: Examples) -> None:
    code, out, _ = examples.result("v1_vs_v2_refusal.py")
    assert code == 0
    assert "refused, as it must be:" in out
    assert "run_config.parallel_agnostic" in out
    assert "12 × 49152" in out  # geometry.segments, not cut off at the column width


def test_layout_extension_example_refuses_equal_digests(examples: Examples) -> None:
    code, out, _ = examples.result("layout_extension_refusal.py")
    assert code == 0
    assert "refused, as it must be" in out and "and from the HND node:" in out
    assert out.count('ext.kv_memory_layout  "NHD"  "HND"') == 1
    assert out.count('ext.kv_memory_layout  "HND"  "NHD"') == 1
    assert "{'kv_memory_layout_mismatch': 1}" in out
    assert "lenient policy: accepted" in out


def test_handshake_debug_example_probes_twice(examples: Examples) -> None:
    code, out, _ = examples.result("handshake_debug.py")
    assert code == 0
    assert "COMPATIBLE with" in out
    assert "REFUSED by handshake" in out
    assert "run_config.dtype" in out
    assert "node shut down cleanly" in out


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_an_example_killed_on_its_timeout_leaves_no_serve_behind() -> None:
    """handshake_debug.py starts ``p2pkv-node serve``; killed as a timeout kills it, the
    example leaves that child an orphan in its group, and ending the group ends it."""
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PKV_")}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER,
                             str(ROOT / "examples" / "handshake_debug.py")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env=env, start_new_session=True)
    try:
        children: list[int] = []
        deadline = time.monotonic() + TIMEOUT_S
        while not children and proc.poll() is None and time.monotonic() < deadline:
            children = _children(proc.pid)
            time.sleep(0.05)
        assert children, "the example started no child"
        proc.kill()
        proc.wait(10)
        assert any(_alive(c) for c in children)  # orphans now, still in the group
        _end_group(proc)
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(c) for c in children)
    finally:
        _end_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

"""What a harness removes from /dev/shm after killing a vLLM engine: the files vLLM made
since the snapshot that no live process uses, and nothing else; and what it reads of an
engine's process group while it runs (CPU time by process)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from p2pkv.bench.serving.leftovers import in_use, remove_vllm_shm, vllm_shm, wait_group_empty
from p2pkv.bench.serving.processes import cpu_used, group_cpu
from p2pkv.bench.serving.tables import engine_cpu

HOLD = ("import mmap, sys\n"
        "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
        "print('mapped', flush=True); sys.stdin.read()\n")


def test_only_new_unused_files_of_vllm_are_removed(tmp_path: Path) -> None:
    (tmp_path / "psm_old").write_bytes(b"x" * 4096)
    before = vllm_shm(tmp_path)
    assert before == {"psm_old"}
    for name in ("psm_new", "vllm_offload_gone.mmap", "vllm_offload_live.mmap", "other"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    live = tmp_path / "vllm_offload_live.mmap"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(live)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "mapped\n"
        assert "vllm_offload_live.mmap" in in_use(tmp_path)
        assert remove_vllm_shm(before, tmp_path) == ["psm_new", "vllm_offload_gone.mmap"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "other", "psm_old", "vllm_offload_live.mmap"]
    finally:
        holder.communicate("", timeout=30)
    assert wait_group_empty(holder.pid, 10)
    # Its holder gone, the file is a leftover too.
    assert remove_vllm_shm(before, tmp_path) == ["vllm_offload_live.mmap"]
    assert remove_vllm_shm(before, tmp_path) == []


def test_a_group_that_does_not_end_is_reported(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    try:
        assert not wait_group_empty(sleeper.pid, 0.2)
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait(30)
    assert wait_group_empty(sleeper.pid, 10)


BURN = ("import os, time\n"
        "os.fork()\n"  # leader and child alike: burn 0.4 s of CPU, say so, then sleep
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.4:\n"
        "    pass\n"
        # One write of under PIPE_BUF bytes: the two processes' lines never interleave
        # (print() may write the text and its newline apart).
        "os.write(1, b'burnt\\n')\n"
        "time.sleep(60)\n")


def test_a_groups_cpu_is_read_per_process_and_taken_between_two_reads() -> None:
    group = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE,
                             start_new_session=True)
    try:
        before = group_cpu(group.pid)
        assert group.pid in before
        assert group.stdout is not None
        deadline = time.monotonic() + 30
        said = b""
        # Raw reads of the pipe: both lines may come in one read, and a buffered
        # readline would keep the second where select() cannot see it.
        while said.count(b"burnt\n") < 2:
            ready, _, _ = select.select([group.stdout], [], [], deadline - time.monotonic())
            assert ready, "the two processes did not burn their CPU within 30 s"
            chunk = os.read(group.stdout.fileno(), 64)
            assert chunk, f"the group closed its output after {said!r}"
            said += chunk
        assert said == b"burnt\nburnt\n", said
        after = group_cpu(group.pid)
        assert len(after) == 2, after  # the leader and its child, nothing else
        assert all(seconds >= 0.35 for _, seconds in after.values()), after
        (name,) = {n for n, _ in after.values()}
        used = cpu_used(before, after)
        assert list(used) == [name]
        # The child was born after the first read: it counts from zero.
        assert used[name] >= 0.7
        assert group_cpu(os.getpid() + 10**7) == {}  # no such group
    finally:
        os.killpg(group.pid, signal.SIGKILL)
        group.wait(30)
    assert wait_group_empty(group.pid, 10)
    assert group_cpu(group.pid) == {}


def test_a_runs_cpu_is_summed_by_the_part_each_process_plays() -> None:
    row = engine_cpu({"engine-0": {"python": 1.25, "VLLM::EngineCor": 3.0, "VLLM::Worker": 20.0},
                      "engine-1": {"python": 1.0, "VLLM::EngineCor": 2.5, "VLLM::Worker": 19.5,
                                   "pt_main_thread": 0.25}})
    assert row == {"cpu_server_s": 2.5, "cpu_core_s": 5.5, "cpu_workers_s": 39.5,
                   "engine_cpu": "2.5 / 5.5 / 39.5"}

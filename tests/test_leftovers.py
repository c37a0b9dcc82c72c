"""What a harness removes from /dev/shm after killing a vLLM engine: the files vLLM made
since the snapshot that no live process uses, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from p2pkv.bench.serving.leftovers import in_use, remove_vllm_shm, vllm_shm, wait_group_empty

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

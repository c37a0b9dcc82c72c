"""What a vLLM engine leaves behind when it is killed, and how a harness clears it.

A process group's children are reparented to init when their leader dies, so "stopped"
means the group is empty (:func:`wait_group_empty`). And a vLLM process killed before it
shuts down cannot remove what it created in ``/dev/shm``: the executor's message queues
(Python shared memory, ``psm_*``) and the stock offloading connector's primary region
(``vllm_offload_*.mmap``; ``P2PKVTieringSpec`` unlinks its own at start). Each is
hundreds of MiB that stay until the host reboots, so a harness that kills engines takes
a snapshot (:func:`vllm_shm`) before it starts one and calls :func:`remove_vllm_shm`
once the engine's group is empty: it removes the files made since then that no live
process maps or holds open, which leaves another engine's files alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

__all__ = ["remove_vllm_shm", "vllm_shm", "wait_group_empty"]

SHM = Path("/dev/shm")
#: Names vLLM's processes create in /dev/shm.
PREFIXES = ("psm_", "vllm_offload_")


def wait_group_empty(pgid: int, timeout: float) -> bool:
    """Whether process group ``pgid`` has no process left, waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def vllm_shm(directory: Path = SHM) -> set[str]:
    """The names of vLLM's files in ``directory`` now."""
    with contextlib.suppress(OSError):
        return {p.name for p in directory.iterdir() if p.name.startswith(PREFIXES)}
    return set()


def in_use(directory: Path = SHM) -> set[str]:
    """Names of files in ``directory`` that a live process maps or holds open."""
    prefix = f"{directory}/"
    names: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    names.add(line[at + len(prefix):].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith(prefix):
                        names.add(target[len(prefix):].removesuffix(" (deleted)"))
    return names


def remove_vllm_shm(before: set[str], directory: Path = SHM) -> list[str]:
    """Remove vLLM's files in ``directory`` that are not in ``before`` (a
    :func:`vllm_shm` snapshot) and that no live process uses; their names."""
    new = vllm_shm(directory) - before
    if not new:
        return []
    removed = []
    for name in sorted(new - in_use(directory)):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
            removed.append(name)
    return removed

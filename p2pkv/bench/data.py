"""Benchmark data: the bulk cases, deterministic datasets that verify themselves, and
the measuring helpers every worker role shares."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from p2pkv.layout import SEED_GEOMETRY, Geometry, make_layout, preset
from p2pkv.protocol.flow import batch_limit

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


BASELINE_KIND = (
    "raw pyzmq ROUTER (sender, bound) -> DEALER (receiver, connected) over tcp://127.0.0.1, "
    "same frames as the node (blocks batched up to 1 MiB per message, send copy=False for "
    "frames >= 64 KiB, plain send below), recv_into preallocated buffers, one request per "
    "round, no credit flow control, no send tracking"
)

_KEY_GROUP = (0).to_bytes(4, "big")


class BenchError(Exception):
    """A benchmark step failed (a worker error, a timeout, wrong bytes)."""


# --------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class BulkCase:
    """One geometry to move in bulk."""

    name: str
    label: str
    layout: str
    geometry: Geometry
    target_ratio: float

    @property
    def segments(self) -> tuple[int, ...]:
        return tuple(make_layout(self.layout, self.geometry).segment_sizes)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.segments)


SMALL_16K = Geometry(num_layers=1, num_kv_heads=8, head_size=64, tokens_per_block=8)

BULK_CASES: tuple[BulkCase, ...] = (
    BulkCase("seed-v2", "seed V2 (12 x 48 KiB)", "v2", SEED_GEOMETRY, 0.9),
    BulkCase("seed-v1", "seed V1 (1 x 576 KiB)", "v1", SEED_GEOMETRY, 0.9),
    BulkCase("llama3-8b-v2", "Llama-3-8B V2 (32 x 64 KiB)", "v2", preset("llama-3-8b"), 0.9),
    BulkCase("small-16k", "16 KiB blocks (V1)", "v1", SMALL_16K, 0.6),
)


def node_spec(node_id: str, case: BulkCase, blocks: int, **extra: Any) -> dict[str, Any]:
    """A worker's spec of one node holding (or fetching) ``blocks`` blocks of ``case``;
    ``extra``: more of its options (``server``, ``shm``, ``nixl``, ``ucx_env``, ...; see
    :func:`p2pkv.bench.node_roles.make_node`)."""
    return {"id": node_id, "dataset": case.name, "segments": list(case.segments),
            "blocks": blocks, "layout": case.layout,
            "geometry": asdict(case.geometry), **extra}


KERNEL_KIND = "kernel TCP: sendmsg gather from the pool, recvmsg_into scatter into slots"
"""The ceiling baseline (``p2pkv.bench.kernel_roles``)."""
KERNEL_TARGETS: dict[str, float] = {"small-16k": 0.6}
"""The node's target against the kernel's ceiling per case (others: 0.9)."""
KERNEL_CPU_TARGETS: dict[str, float] = {"small-16k": 2.0}
"""The data stream's receiver CPU per GB at most this many times the kernel ceiling's
receiver, per case (others: 1.3)."""
DATA_CHANNEL_PREFIX = "dc-"
"""Client node ids of the data-channel rows: this prefix and the case's name."""
NOSUM_CASE = "seed-v1"
"""The case whose data-channel row is repeated with checksums off."""
MULTI_STREAMS = 4
"""Data streams of the multi-stream row (tcp-streams-v1), against one stream."""
MULTI_PREFIX = "dc4-"
"""Client node id prefix of the multi-stream row (its case is NOSUM_CASE)."""

SHM_CASES: tuple[BulkCase, ...] = (
    BulkCase("shm-seed-v2", "seed V2 (12 x 48 KiB)", "v2", SEED_GEOMETRY, 0.8),
    BulkCase("shm-seed-v1", "seed V1 (1 x 576 KiB)", "v1", SEED_GEOMETRY, 0.8),
)
"""Same-host fetches through shared memory (both nodes ``shm=True``); the baseline is a
plain memcpy of the same bytes in the fetching process, and the target a ratio to it."""

SHM_THREADS = 2
"""Copy threads of the same-host row that compares them with one (``shm_copy_threads``)."""
SHM_THREADS_PREFIX = "threads-"

RECEIVER_CPU_TARGET = 1.2
"""Receiver CPU seconds per GB moved over TCP: at most this multiple of raw pyzmq's."""


class MemcpyRound:
    """The same-host baseline: a plain memcpy of the bytes a fetch moves, block by block
    (one copy of ``bytes_per_block`` per block, as BRIEF's 8.8 GB/s for 576 KiB), between
    two buffers of this process that were touched beforehand.

    One copy of the whole dataset would be faster on this machine (glibc switches to
    non-temporal stores above a size of tens of MiB); ``whole()`` measures that too, for
    the record."""

    def __init__(self, nbytes: int, bytes_per_block: int) -> None:
        rng = np.random.default_rng(7)
        self.src: npt.NDArray[np.uint8] = rng.integers(0, 255, size=nbytes, dtype=np.uint8)
        self.dst: npt.NDArray[np.uint8] = np.zeros(nbytes, dtype=np.uint8)
        self.bpb = bytes_per_block

    def run(self) -> tuple[float, int]:
        self.dst[:1] = 1  # so each round's copy is seen by the check
        src, dst, bpb = self.src.data, self.dst.data, self.bpb
        t0 = time.perf_counter()
        for off in range(0, len(src), bpb):
            dst[off:off + bpb] = src[off:off + bpb]
        return time.perf_counter() - t0, int(self.src.nbytes)

    def whole(self) -> float:
        """GB/s of one memcpy of the whole buffer."""
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return self.src.nbytes / (time.perf_counter() - t0) / 1e9

    def check(self) -> bool:
        return bool(np.array_equal(self.dst, self.src))


def block_key(dataset: str, index: int) -> bytes:
    """A 20-byte block key (content hash + group index, like vLLM's)."""
    return xxhash.xxh3_128_digest(f"p2pkv-bench/{dataset}/{index}".encode()) + _KEY_GROUP


class Dataset:
    """``blocks`` deterministic blocks of a layout with the given segment sizes."""

    def __init__(self, name: str, segments: Sequence[int], blocks: int) -> None:
        if any(s % 8 for s in segments):
            raise ValueError(f"segment sizes must be multiples of 8, got {list(segments)}")
        self.name = name
        self.segments = tuple(segments)
        self.bpb = sum(self.segments)
        self.blocks = blocks
        self.keys = [block_key(name, i) for i in range(blocks)]
        rng = np.random.default_rng(xxhash.xxh3_64_intdigest(name.encode()))
        self.pattern: npt.NDArray[np.uint64] = rng.integers(
            0, np.iinfo(np.uint64).max, size=self.bpb // 8, dtype=np.uint64, endpoint=True)
        words: list[tuple[int, int]] = []
        start = 0
        for size in self.segments:
            words.append((start, start + size // 8))
            start += size // 8
        self.words = tuple(words)
        self.per_message = batch_limit(self.bpb)  # what the node batches too

    @property
    def nbytes(self) -> int:
        return self.blocks * self.bpb

    def salt(self, index: int) -> np.uint64:
        value: int = xxhash.xxh3_64_intdigest(self.keys[index])
        salt: np.uint64 = np.uint64(value | 1)
        return salt

    def block(self, index: int) -> npt.NDArray[np.uint64]:
        """The block's bytes (segments back to back) as uint64 words."""
        return self.pattern ^ self.salt(index)

    def check(self, index: int, views: Sequence[Any]) -> bool:
        """Whether ``views`` (one buffer per segment) hold exactly block ``index``."""
        if len(views) != len(self.words):
            return False
        salt = self.salt(index)
        for (lo, hi), view in zip(self.words, views, strict=True):
            got = np.frombuffer(view, dtype=np.uint8)
            if got.size != (hi - lo) * 8:
                return False
            if not np.array_equal(got.view(np.uint64), self.pattern[lo:hi] ^ salt):
                return False
        return True


def lookup_keys(ds: Dataset, n: int) -> tuple[list[bytes], list[bool]]:
    """``n`` keys, the dataset's first ones (hits) then unknown ones (misses), interleaved
    deterministically; and the expected answer."""
    hits = min(n, ds.blocks)
    keys = ds.keys[:hits] + [block_key(ds.name + "/missing", i) for i in range(n - hits)]
    expected = [True] * hits + [False] * (n - hits)
    order = np.random.default_rng(5).permutation(n)
    return [keys[i] for i in order], [expected[i] for i in order]


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM (KiB) of a process from ``/proc/PID/status``."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "VmHWM"):
                    out[name] = int(rest.split()[0])
    except OSError:
        pass
    if "VmHWM" not in out and pid == "self":
        import resource

        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def fd_count(pid: int | str = "self") -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def timed_lookups(call: Callable[[], list[bool]], expected: list[bool], count: int,
                   background: Callable[[threading.Event], int] | None) -> dict[str, Any]:
    """Time ``count`` calls; with ``background``, while it runs on another thread."""
    stop = threading.Event()
    box: dict[str, Any] = {}
    thread: threading.Thread | None = None
    if background is not None:
        def run() -> None:
            try:
                box["bytes"] = background(stop)
            except Exception as exc:
                box["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(0.2)  # let the stream get going
    ms: list[float] = []
    ok = True
    rng = np.random.default_rng(3)
    t_start = time.perf_counter()
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            got = call()
            ms.append((time.perf_counter() - t0) * 1e3)
            ok = ok and got == expected
            if background is not None:
                time.sleep(float(rng.uniform(0.0, 0.01)))  # sample different phases
    finally:
        stop.set()
        if thread is not None:
            thread.join(180)
    elapsed = time.perf_counter() - t_start
    if thread is not None and thread.is_alive():
        raise BenchError("background bulk transfer did not stop within 180 s")
    if "error" in box:
        raise BenchError(f"background bulk transfer failed: {box['error']}")
    return {"ms": ms, "verified": ok, "bulk_bytes": box.get("bytes", 0),
            "bulk_gbps": box.get("bytes", 0) / elapsed / 1e9 if elapsed else 0.0}

"""``p2pkv-node bench``: p2pkv measured side by side with raw pyzmq, in one run.

Every case is measured against a baseline taken in the same invocation, and the
baseline and the case alternate round by round (ABBA order) so that drift of a noisy
machine hits both. Compare the *ratios*; absolute numbers move from run to run.

Processes (all on 127.0.0.1, all started with :mod:`subprocess`, every wait bounded,
every child killed in a ``finally`` block):

* ``node-server``: one p2pkv :class:`~p2pkv.node.Node` per dataset, holding the blocks.
* ``node-client``: the matching fetching nodes (plus lookup and handshake loops).
* ``raw-server`` / ``raw-client``: the baseline. A bound ROUTER streams the *same frames*
  the node sends (blocks batched up to 1 MiB per message, ``copy=False`` for frames of
  at least 64 KiB, a plain copying send below) to a connected DEALER that
  ``recv_into``-s preallocated buffers. One request per round; no flow control beyond
  the high-water mark; no send tracking.
* ``mem-*``: fresh receiving processes whose peak RSS is read after moving 4 GiB.

Each worker speaks JSON lines: the parent writes one command per line on its stdin and
reads one reply per line from its stdout; closing stdin stops it. Workers are run as
``python -m p2pkv.bench ROLE SPEC_JSON``.

Block content is deterministic and position dependent (a random pattern XOR a
per-key salt), so a misplaced segment, a block landing in the wrong slot or a
stale slot is detected; every dataset is verified after the timed section.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import platform
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import numpy.typing as npt
import xxhash
import zmq

from p2pkv.layout import SEED_GEOMETRY, Geometry, make_layout, preset
from p2pkv.protocol.codes import MAX_BLOCKS_PER_MESSAGE

__all__ = ["BASELINE_KIND", "Row", "main_worker", "run_bench", "run_soak"]

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

#: The same thresholds the node uses (``p2pkv.node``): frames at least this large are
#: sent zero-copy; small blocks share one message up to this many payload bytes.
ZERO_COPY_MIN = 64 * KIB
BATCH_BYTES = 1 * MIB

BASELINE_KIND = (
    "raw pyzmq ROUTER (sender, bound) -> DEALER (receiver, connected) over tcp://127.0.0.1, "
    "same frames as the node (blocks batched up to 1 MiB per message, send copy=False for "
    "frames >= 64 KiB, plain send below), recv_into preallocated buffers, one request per "
    "round, no credit flow control, no send tracking"
)

_KEY_GROUP = (0).to_bytes(4, "big")
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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
    BulkCase("small-16k", "16 KiB blocks (V1)", "v1", SMALL_16K, 0.5),
)


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
        self.per_message = max(1, min(MAX_BLOCKS_PER_MESSAGE, BATCH_BYTES // self.bpb))

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


# --------------------------------------------------------------------------- helpers


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


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


def _stdin_commands() -> Iterator[dict[str, Any]]:
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


def _serve_commands(handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Answer one JSON line per command until stdin closes."""
    for cmd in _stdin_commands():
        op = cmd.get("op", "")
        try:
            handler = handlers[op]
        except KeyError:
            _say({"error": f"unknown op {op!r}"})
            continue
        try:
            reply = handler(cmd)
        except Exception as exc:
            _say({"error": f"{type(exc).__name__}: {exc}"})
            continue
        _say({"ok": True, **reply})


# --------------------------------------------------------------------------- node roles


def _geometry(spec: dict[str, Any]) -> Geometry:
    return Geometry(**spec)


def _node(spec: dict[str, Any], *, pool_blocks: int, checksums: bool = True,
          curve: Any = None) -> Any:
    from p2pkv.identity import RunConfig
    from p2pkv.node import Node, NodeConfig

    layout = make_layout(spec["layout"], _geometry(spec["geometry"]))
    g = layout.geometry
    groups = [{"tokens_per_block": g.tokens_per_block,
               "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(g.num_layers)]}]
    rc = RunConfig.resolve("p2pkv/bench", parallel_agnostic=True, dtype=g.dtype,
                           kv_cache_groups=groups, **layout.identity_flags())
    cfg = NodeConfig(checksums=checksums, curve=curve, fetch_timeout=120.0)
    return Node(rc, layout, pool_blocks=pool_blocks, config=cfg)


def _curve(spec: dict[str, Any] | None) -> Any:
    if not spec:
        return None
    from p2pkv.transport import CurveKeys

    server = spec.get("server_key")
    return CurveKeys(spec["public"].encode(), spec["secret"].encode(),
                     server.encode() if server else None, None)


def role_node_server(spec: dict[str, Any]) -> int:
    """One node per dataset, every block stored; answers ``stats``."""
    nodes: dict[str, Any] = {}
    try:
        for nspec in spec["nodes"]:
            ds = Dataset(nspec["dataset"], nspec["segments"], nspec["blocks"])
            node = _node(nspec, pool_blocks=ds.blocks, curve=_curve(nspec.get("curve")))
            nodes[nspec["id"]] = node
            for i, key in enumerate(ds.keys):
                node.put(key, ds.block(i))
        _say({"event": "ready", "pid": os.getpid(),
              "addresses": {name: n.address for name, n in nodes.items()}})

        def stats(cmd: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for name, n in nodes.items():
                s = n.stats()
                out[name] = {"blocks_sent": s.blocks_sent, "bytes_sent": s.bytes_sent,
                             "protocol_violations": s.protocol_violations,
                             "handshakes_accepted": s.handshakes_accepted,
                             "peers_in": s.peers_in}
            return {"nodes": out, **proc_status(), "fds": fd_count()}

        _serve_commands({"stats": stats})
    finally:
        for n in nodes.values():
            n.close()
    return 0


@dataclass
class _ClientNode:
    node: Any
    peer: Any
    ds: Dataset
    address: str
    chunk: int


def fetch_round(c: _ClientNode, *, depth: int = 2, clear: bool = False,
                timeout: float = 120.0) -> tuple[float, int]:
    """Discard every block locally, then fetch the whole dataset back (pipelined
    ``fetch_async`` of ``c.chunk`` keys each, ``depth`` in flight). Only the fetching is
    timed. Raises :class:`BenchError` unless every byte moved."""
    node, ds = c.node, c.ds
    for key in ds.keys:
        node.store.discard(key)
    if clear:
        # Every slot is free now: zero the pool so the check after this round proves
        # that this round's bytes landed.
        for tensor in node.store.pool.kv_tensors:
            tensor.zero_()
    inflight: collections.deque[tuple[Any, int]] = collections.deque()
    moved = 0

    def settle() -> int:
        fut, n = inflight.popleft()
        r = fut.result(timeout)
        if r.failed or r.missing or r.nbytes != n * ds.bpb:
            raise BenchError(f"fetch moved {r.nbytes} of {n * ds.bpb} bytes: "
                             f"{len(r.failed)} failed, {len(r.missing)} missing, "
                             f"errors {dict(list(r.errors.items())[:3])}")
        return int(r.nbytes)

    t0 = time.perf_counter()
    for start in range(0, ds.blocks, c.chunk):
        part = ds.keys[start:start + c.chunk]
        inflight.append((node.fetch_async(c.peer, part, timeout=timeout), len(part)))
        if len(inflight) >= depth:
            moved += settle()
    while inflight:
        moved += settle()
    return time.perf_counter() - t0, moved


def verify_node(c: _ClientNode) -> tuple[int, int]:
    """(good, bad) blocks of the dataset in the local store."""
    good = bad = 0
    for i, key in enumerate(c.ds.keys):
        reader = c.node.store.acquire_read(key)
        if reader is None:
            bad += 1
            continue
        try:
            if c.ds.check(i, reader.views):
                good += 1
            else:
                bad += 1
        finally:
            reader.release()
    return good, bad


def chunk_keys(bpb: int) -> int:
    """Keys per fetch: about 64 MiB, between 8 and 1024 keys."""
    return max(8, min(1024, (64 * MIB) // bpb))


def role_node_client(spec: dict[str, Any]) -> int:
    """Fetching nodes, one per server node; answers bulk/verify/lookup/handshake/mem."""
    import p2pkv.node  # noqa: F401  (import torch & co. before the "before" RSS reading)

    rss_before = proc_status().get("VmRSS", 0)
    clients: dict[str, _ClientNode] = {}
    try:
        for nspec in spec["nodes"]:
            ds = Dataset(nspec["dataset"], nspec["segments"], nspec["blocks"])
            node = _node(nspec, pool_blocks=ds.blocks, checksums=nspec.get("checksums", True),
                         curve=_curve(nspec.get("curve")))
            clients[nspec["id"]] = _ClientNode(node, None, ds, nspec["address"],
                                               chunk_keys(ds.bpb))
            clients[nspec["id"]].peer = node.connect(nspec["address"], timeout=30)
        _say({"event": "ready", "pid": os.getpid()})

        def bulk(cmd: dict[str, Any]) -> dict[str, Any]:
            c = clients[cmd["id"]]
            seconds, moved = fetch_round(c, clear=bool(cmd.get("clear")))
            return {"seconds": seconds, "bytes": moved}

        def verify(cmd: dict[str, Any]) -> dict[str, Any]:
            good, bad = verify_node(clients[cmd["id"]])
            return {"good": good, "bad": bad}

        def lookup(cmd: dict[str, Any]) -> dict[str, Any]:
            c = clients[cmd["id"]]
            keys, expected = lookup_keys(c.ds, int(cmd["n"]))
            return _timed_lookups(
                lambda: c.node.lookup(c.peer, keys, timeout=30), expected, int(cmd["count"]),
                (lambda stop: _node_bulk_loop(c, stop)) if cmd.get("during_bulk") else None)

        def handshake(cmd: dict[str, Any]) -> dict[str, Any]:
            c = clients[cmd["id"]]
            ms: list[float] = []
            ok = True
            for _ in range(int(cmd["count"])):
                t0 = time.perf_counter()
                peer = c.node.connect(c.address, timeout=10)
                ms.append((time.perf_counter() - t0) * 1e3)
                ok = ok and peer.remote_fingerprint == c.node.fingerprint
                peer.close()
            return {"ms": ms, "verified": ok}

        def mem(cmd: dict[str, Any]) -> dict[str, Any]:
            pool = sum(c.node.store.pool.nbytes for c in clients.values())
            return {"rss_before_kib": rss_before, **proc_status(), "pool_bytes": pool}

        _serve_commands({"bulk": bulk, "verify": verify, "lookup": lookup,
                         "handshake": handshake, "mem": mem})
    finally:
        for c in clients.values():
            c.node.close()
    return 0


def _node_bulk_loop(c: _ClientNode, stop: threading.Event) -> int:
    moved = 0
    while not stop.is_set():
        moved += fetch_round(c)[1]
    return moved


def _timed_lookups(call: Callable[[], list[bool]], expected: list[bool], count: int,
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


# --------------------------------------------------------------------------- raw roles


def _raw_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, hwm: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


class _RawBuffers:
    """Per-segment regions of ``ds.blocks`` rows and one memoryview per block segment."""

    def __init__(self, ds: Dataset, fill: bool) -> None:
        self.ds = ds
        self.regions = [np.empty((ds.blocks, size), dtype=np.uint8) for size in ds.segments]
        if fill:
            for i in range(ds.blocks):
                words = ds.block(i)
                for region, (lo, hi) in zip(self.regions, ds.words, strict=True):
                    region[i] = words[lo:hi].view(np.uint8)
        self.views = [[memoryview(region[i]) for region in self.regions]
                      for i in range(ds.blocks)]

    def clear(self) -> None:
        for region in self.regions:
            region.fill(0)

    def verify(self) -> tuple[int, int]:
        good = sum(1 for i in range(self.ds.blocks) if self.ds.check(i, self.views[i]))
        return good, self.ds.blocks - good


def _readable(sock: zmq.Socket[bytes]) -> bool:
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


def role_raw_server(spec: dict[str, Any]) -> int:
    """The baseline sender: streams datasets on request, answers lookups and pings."""
    datasets = {d["name"]: _RawBuffers(Dataset(d["name"], d["segments"], d["blocks"]), True)
                for d in spec["datasets"]}
    keysets = {name: frozenset(b.ds.keys) for name, b in datasets.items()}
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _raw_socket(ctx, zmq.ROUTER, int(spec["hwm"]))
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # block at the HWM instead of dropping
    sock.bind("tcp://127.0.0.1:*")
    address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()
    failure: list[str] = []
    pending: collections.deque[list[bytes]] = collections.deque()

    def answer_small(frames: list[bytes]) -> bool:
        rid, op = frames[0], frames[1]
        if op == b"L":
            blob, keys = frames[3], keysets[frames[2].decode()]
            hits = bytes(blob[i:i + 20] in keys for i in range(0, len(blob), 20))
            sock.send_multipart([rid, hits])
            return True
        if op == b"P":
            sock.send_multipart([rid, b"p"])
            return True
        return False

    def stream(rid: bytes, bufs: _RawBuffers, count: int) -> None:
        nseg = len(bufs.ds.segments)
        big = [size >= ZERO_COPY_MIN for size in bufs.ds.segments]
        per = bufs.ds.per_message
        views = bufs.views
        last_s = nseg - 1
        for first in range(0, count, per):
            nb = min(per, count - first)
            sock.send(rid, zmq.SNDMORE)
            sock.send(struct.pack("<II", first, nb), zmq.SNDMORE)
            last_b = nb - 1
            for b in range(nb):
                row = views[first + b]
                for s in range(nseg):
                    flags = 0 if (b == last_b and s == last_s) else zmq.SNDMORE
                    if big[s]:
                        sock.send(row[s], flags, copy=False)
                    else:
                        sock.send(row[s], flags)
            # Interleave small requests (lookups, pings) between messages, as the node
            # does between loop turns.
            while _readable(sock):
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if not answer_small(frames):
                    pending.append(frames)

    def loop() -> None:
        try:
            while not stop.is_set():
                if pending:
                    frames = pending.popleft()
                elif sock.poll(100):
                    frames = sock.recv_multipart()
                else:
                    continue
                if frames[1] == b"B":
                    stream(frames[0], datasets[frames[2].decode()], int(frames[3]))
                elif not answer_small(frames):
                    raise BenchError(f"unknown raw request {frames[1]!r}")
        except Exception as exc:
            failure.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        _say({"event": "ready", "pid": os.getpid(), "address": address})

        def stats(cmd: dict[str, Any]) -> dict[str, Any]:
            if failure:
                raise BenchError(failure[0])
            return {**proc_status(), "fds": fd_count()}

        _serve_commands({"stats": stats})
    finally:
        stop.set()
        thread.join(30)
        sock.close(0)
        ctx.term()
    return 0


def raw_fetch_round(sock: zmq.Socket[bytes], bufs: _RawBuffers, *,
                    clear: bool = False) -> tuple[float, int]:
    ds = bufs.ds
    if clear:
        bufs.clear()
    views = bufs.views
    sizes = ds.segments
    nseg = len(sizes)
    got = 0
    t0 = time.perf_counter()
    sock.send_multipart([b"B", ds.name.encode(), str(ds.blocks).encode()])
    while got < ds.blocks:
        if not sock.poll(30_000):
            raise BenchError(f"raw stream of {ds.name} stalled for 30 s")
        first, nb = struct.unpack("<II", sock.recv())
        for b in range(nb):
            row = views[first + b]
            for s in range(nseg):
                if sock.recv_into(row[s]) != sizes[s]:
                    raise BenchError("raw frame of the wrong size")
        got += nb
    return time.perf_counter() - t0, got * ds.bpb


def role_raw_client(spec: dict[str, Any]) -> int:
    """The baseline receiver."""
    rss_before = proc_status().get("VmRSS", 0)
    buffers = {d["name"]: _RawBuffers(Dataset(d["name"], d["segments"], d["blocks"]), False)
               for d in spec["datasets"]}
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    hwm = int(spec["hwm"])
    address = spec["address"]
    bulk_sock = _raw_socket(ctx, zmq.DEALER, hwm)
    bulk_sock.connect(address)
    lookup_sock = _raw_socket(ctx, zmq.DEALER, hwm)
    lookup_sock.connect(address)
    try:
        _say({"event": "ready", "pid": os.getpid()})

        def bulk(cmd: dict[str, Any]) -> dict[str, Any]:
            seconds, moved = raw_fetch_round(bulk_sock, buffers[cmd["id"]],
                                             clear=bool(cmd.get("clear")))
            return {"seconds": seconds, "bytes": moved}

        def verify(cmd: dict[str, Any]) -> dict[str, Any]:
            good, bad = buffers[cmd["id"]].verify()
            return {"good": good, "bad": bad}

        def lookup(cmd: dict[str, Any]) -> dict[str, Any]:
            bufs = buffers[cmd["id"]]
            keys, expected = lookup_keys(bufs.ds, int(cmd["n"]))
            blob = b"".join(keys)
            name = bufs.ds.name.encode()

            def call() -> list[bool]:
                lookup_sock.send_multipart([b"L", name, blob])
                if not lookup_sock.poll(30_000):
                    raise BenchError("raw lookup not answered within 30 s")
                return [bool(x) for x in lookup_sock.recv()]

            def background(stop: threading.Event) -> int:
                moved = 0
                while not stop.is_set():
                    moved += raw_fetch_round(bulk_sock, bufs)[1]
                return moved

            return _timed_lookups(call, expected, int(cmd["count"]),
                                  background if cmd.get("during_bulk") else None)

        def handshake(cmd: dict[str, Any]) -> dict[str, Any]:
            ms: list[float] = []
            for _ in range(int(cmd["count"])):
                t0 = time.perf_counter()
                s = _raw_socket(ctx, zmq.DEALER, hwm)
                try:
                    s.connect(address)
                    s.send(b"P")
                    if not s.poll(10_000):
                        raise BenchError("raw ping not answered within 10 s")
                    if s.recv() != b"p":
                        raise BenchError("raw ping got a wrong answer")
                    ms.append((time.perf_counter() - t0) * 1e3)
                finally:
                    s.close(0)
            return {"ms": ms, "verified": True}

        def mem(cmd: dict[str, Any]) -> dict[str, Any]:
            pool = sum(b.ds.nbytes for b in buffers.values())
            return {"rss_before_kib": rss_before, **proc_status(), "pool_bytes": pool}

        _serve_commands({"bulk": bulk, "verify": verify, "lookup": lookup,
                         "handshake": handshake, "mem": mem})
    finally:
        bulk_sock.close(0)
        lookup_sock.close(0)
        ctx.term()
    return 0


def _report(rows: list[Row], lines: Sequence[str], result: dict[str, Any], ok: bool,
            out: IO[str], json_path: str | None) -> int:
    """Print the table and the error lines, write the JSON when asked; the exit code."""
    print(format_table(rows), file=out)
    for line in lines:
        print(line, file=out)
    out.flush()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True, default=str)
    return 0 if ok else 1


# --------------------------------------------------------------------------- soak role


def role_soak_client(spec: dict[str, Any]) -> int:
    """Fetch the dataset again and again until stdin closes; progress every second."""
    ds = Dataset(spec["dataset"], spec["segments"], spec["blocks"])
    node = _node(spec, pool_blocks=ds.blocks)
    errors: list[str] = []
    moved = rounds = 0
    try:
        c = _ClientNode(node, node.connect(spec["address"], timeout=60), ds, spec["address"],
                        chunk_keys(ds.bpb))
        _say({"event": "ready", "pid": os.getpid()})
        if sys.stdin.readline().strip() != "go":
            return 0
        stop = threading.Event()

        def wait_eof() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=wait_eof, daemon=True).start()
        next_report = time.monotonic() + 1.0
        while not stop.is_set():
            try:
                moved += fetch_round(c, timeout=60)[1]
                rounds += 1
                if rounds % 4 == 0:
                    _, bad = verify_node(c)
                    if bad:
                        errors.append(f"round {rounds}: {bad} blocks with wrong bytes")
            except Exception as exc:
                errors.append(f"round {rounds}: {type(exc).__name__}: {exc}")
                time.sleep(0.2)
                if len(errors) > 100:
                    break
            now = time.monotonic()
            if now >= next_report:
                _say({"event": "progress", "t": now, "bytes": moved, "rounds": rounds,
                      "errors": len(errors)})
                next_report = now + 1.0
        good, bad = verify_node(c)
        if bad:
            errors.append(f"final check: {bad} of {good + bad} blocks with wrong bytes")
        _say({"event": "final", "t": time.monotonic(), "bytes": moved, "rounds": rounds,
              "errors": len(errors), "messages": errors[:5], "verified": bad == 0 and good > 0})
    finally:
        node.close()
    return 0


_ROLES: dict[str, Callable[[dict[str, Any]], int]] = {
    "node-server": role_node_server,
    "node-client": role_node_client,
    "raw-server": role_raw_server,
    "raw-client": role_raw_client,
    "soak-client": role_soak_client,
}


def main_worker(argv: Sequence[str]) -> int:
    """Entry point of a worker process: ``python -m p2pkv.bench ROLE SPEC_JSON``."""
    if len(argv) != 2 or argv[0] not in _ROLES:
        print(f"usage: python -m p2pkv.bench {{{','.join(_ROLES)}}} SPEC_JSON", file=sys.stderr)
        return 2
    return _ROLES[argv[0]](json.loads(argv[1]))


# --------------------------------------------------------------------------- parent side


class Worker:
    """A worker process: JSON-line commands on stdin, replies on stdout, bounded waits."""

    def __init__(self, name: str, role: str, spec: dict[str, Any]) -> None:
        self.name = name
        env = {**os.environ, **_WORKER_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2pkv.bench", role, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=env)
        self.pid = self.proc.pid
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=60)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._read_stdout, args=(self.proc.stdout,),
                         daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(self.proc.stderr,),
                         daemon=True).start()

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

    def stderr_tail(self) -> str:
        return "".join(self._stderr)[-3000:]

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            obj = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"{self.name}: no answer within {timeout:.0f} s; stderr:\n"
                             f"{self.stderr_tail()}") from None
        if obj is None:
            self._lines.put(None)
            rc = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self.proc.wait(5)
            raise BenchError(f"{self.name} exited (rc={rc}); stderr:\n{self.stderr_tail()}")
        return obj

    def poll_event(self) -> dict[str, Any] | None:
        try:
            return self._lines.get_nowait()
        except queue.Empty:
            return None

    def send_line(self, text: str) -> None:
        if self.proc.stdin is None or self.proc.stdin.closed:
            raise BenchError(f"{self.name}: stdin already closed")
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise BenchError(f"{self.name} is gone ({exc}); stderr:\n"
                             f"{self.stderr_tail()}") from exc

    def ask(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.send_line(json.dumps(cmd))
        reply = self.next(timeout)
        if "error" in reply:
            raise BenchError(f"{self.name} {cmd.get('op')}: {reply['error']}")
        return reply

    def close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def stop(self, timeout: float = 30.0) -> int | None:
        """Close stdin (the stop signal), wait up to ``timeout``, kill if still alive."""
        self.close_stdin()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@dataclass
class Row:
    """One line of the table (and one entry of the JSON ``cases``)."""

    case: str
    metric: str
    value: float | None
    baseline: float | None
    ratio: float | None
    target: str
    met: bool | None
    verified: bool
    baseline_kind: str = "raw pyzmq"
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (the default or ``--quick``)."""

    quick: bool
    dataset_bytes: int
    bulk_bytes: int
    mem_bytes: int
    curve_bytes: int
    lookup_counts: tuple[tuple[int, int], ...]
    batches: int
    handshakes: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(True, 32 * MIB, 64 * MIB, 128 * MIB, 32 * MIB,
                       ((1000, 20), (10_000, 10)), 2, 20)
        return cls(False, 256 * MIB, 2 * GIB, 4 * GIB, 512 * MIB,
                   ((1000, 200), (10_000, 100)), 4, 200)


def _rounds(total: int, per_round: int) -> int:
    return max(1, -(-total // per_round))


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _geometry_dict(g: Geometry) -> dict[str, Any]:
    return dataclasses.asdict(g)


def _node_spec(node_id: str, case: BulkCase, blocks: int, **extra: Any) -> dict[str, Any]:
    return {"id": node_id, "dataset": case.name, "segments": list(case.segments),
            "blocks": blocks, "layout": case.layout,
            "geometry": _geometry_dict(case.geometry), **extra}


def _bulk_timeout(nbytes: int) -> float:
    return 120.0 + nbytes / 20e6


def _alternate(rounds: int, a: Callable[[int], None], b: Callable[[int], None]) -> None:
    """a b, b a, a b, ... (ABBA) so linear drift hits both sides alike."""
    for r in range(rounds):
        first, second = (a, b) if r % 2 == 0 else (b, a)
        first(r)
        second(r)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of every thread of ``pids`` so far (``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _bulk_pair(name: str, rounds: int, nbytes: int, a: tuple[Worker, str],
               b: tuple[Worker, str], *, pids_a: Sequence[int] = (),
               pids_b: Sequence[int] = ()) -> dict[str, Any]:
    """Alternate bulk rounds of ``a`` (the baseline) and ``b`` (the case) after one
    untimed warm-up round each (first touch of the receiving pages); verify both.
    ``pids_*``: processes whose CPU time is charged to that side (sender + receiver)."""
    out: dict[str, Any] = {"a_s": [], "b_s": [], "a_bytes": 0, "b_bytes": 0,
                           "a_cpu": 0.0, "b_cpu": 0.0}
    timeout = _bulk_timeout(nbytes)

    def side(which: str, worker: Worker, wid: str, pids: Sequence[int],
             timed: bool = True) -> Callable[[int], None]:
        def run(r: int) -> None:
            cpu0 = cpu_seconds(pids)
            reply = worker.ask({"op": "bulk", "id": wid, "clear": r == rounds - 1}, timeout)
            cpu = cpu_seconds(pids) - cpu0
            if int(reply["bytes"]) != nbytes:
                raise BenchError(f"{worker.name} {wid}: round moved {reply['bytes']} of "
                                 f"{nbytes} bytes")
            if timed:
                out[f"{which}_s"].append(float(reply["seconds"]))
                out[f"{which}_bytes"] += int(reply["bytes"])
                out[f"{which}_cpu"] += cpu
        return run

    _log(f"{name}: warm-up, then {rounds} alternating rounds of {nbytes / MIB:.0f} MiB "
         "each side")
    side("a", *a, pids_a, timed=False)(-1)
    side("b", *b, pids_b, timed=False)(-1)
    _alternate(rounds, side("a", *a, pids_a), side("b", *b, pids_b))
    va = a[0].ask({"op": "verify", "id": a[1]}, 300)
    vb = b[0].ask({"op": "verify", "id": b[1]}, 300)
    out["a_verified"] = va["bad"] == 0 and va["good"] > 0
    out["b_verified"] = vb["bad"] == 0 and vb["good"] > 0
    out["a_gbps"] = out["a_bytes"] / sum(out["a_s"]) / 1e9
    out["b_gbps"] = out["b_bytes"] / sum(out["b_s"]) / 1e9
    out["a_cpu_s_per_gb"] = out["a_cpu"] / (out["a_bytes"] / 1e9) if pids_a else None
    out["b_cpu_s_per_gb"] = out["b_cpu"] / (out["b_bytes"] / 1e9) if pids_b else None
    return out


def _latency_pair(count: int, batches: int, cmd: dict[str, Any], a: tuple[Worker, str],
                  b: tuple[Worker, str]) -> dict[str, Any]:
    """Alternate batches of a latency command on ``a`` (baseline) and ``b`` (case)."""
    out: dict[str, Any] = {"a_ms": [], "b_ms": [], "a_verified": True, "b_verified": True,
                           "a_bulk_gbps": [], "b_bulk_gbps": []}
    per = max(1, count // batches)

    def side(which: str, worker: Worker, wid: str) -> Callable[[int], None]:
        def run(r: int) -> None:
            reply = worker.ask({**cmd, "id": wid, "count": per}, 600)
            out[f"{which}_ms"] += reply["ms"]
            out[f"{which}_verified"] = out[f"{which}_verified"] and bool(reply["verified"])
            if "bulk_gbps" in reply:
                out[f"{which}_bulk_gbps"].append(reply["bulk_gbps"])
        return run

    _alternate(batches, side("a", *a), side("b", *b))
    return out


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def format_table(rows: Sequence[Row]) -> str:
    head = ("case", "metric", "p2pkv", "baseline", "ratio", "target", "met", "bytes ok")
    body = []
    for r in rows:
        met = "-" if r.met is None else ("met" if r.met else "NOT MET")
        if r.error:
            met = "ERROR"
        body.append((r.case, r.metric, _fmt(r.value), _fmt(r.baseline),
                     "-" if r.ratio is None else f"{r.ratio:.2f}x", r.target, met,
                     "yes" if r.verified else "NO"))
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for x in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip())
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "platform": platform.platform()}


def _error_row(case: str, metric: str, target: str, exc: Exception) -> Row:
    return Row(case, metric, None, None, None, target, False, False, error=str(exc))


def _ratio(value: float, baseline: float) -> float | None:
    return value / baseline if baseline else None


def _bench_rows(plan: Plan, workers: dict[str, Worker], cases: Sequence[BulkCase],
                blocks: dict[str, int], curve_ok: bool) -> list[Row]:
    rows: list[Row] = []
    raw, node = workers["raw-client"], workers["node-client"]
    raw_pids = (workers["raw-server"].pid, raw.pid)
    node_pids = (workers["node-server"].pid, node.pid)

    # -- bulk fetch, one geometry at a time
    for case in cases:
        nbytes = blocks[case.name] * case.bytes_per_block
        rounds = _rounds(plan.bulk_bytes, nbytes)
        metric = "fetch GB/s"
        target = f">= {case.target_ratio:.1f}x raw"
        try:
            res = _bulk_pair(f"bulk {case.name}", rounds, nbytes, (raw, case.name),
                             (node, case.name), pids_a=raw_pids, pids_b=node_pids)
            ratio = _ratio(res["b_gbps"], res["a_gbps"])
            rows.append(Row(
                f"bulk {case.label}", metric, res["b_gbps"], res["a_gbps"], ratio, target,
                ratio is not None and ratio >= case.target_ratio,
                res["a_verified"] and res["b_verified"],
                details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                         "bytes_per_block": case.bytes_per_block, "segments": len(case.segments),
                         "keys_per_fetch": chunk_keys(case.bytes_per_block),
                         "pipelined_fetches": 2,
                         "node_round_gbps": [nbytes / s / 1e9 for s in res["b_s"]],
                         "raw_round_gbps": [nbytes / s / 1e9 for s in res["a_s"]],
                         "raw_verified": res["a_verified"], "node_verified": res["b_verified"],
                         "node_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                         "raw_cpu_s_per_gb": res["a_cpu_s_per_gb"]}))
        except BenchError as exc:
            rows.append(_error_row(f"bulk {case.label}", metric, target, exc))

    seed = cases[0]
    seed_bytes = blocks[seed.name] * seed.bytes_per_block

    # -- checksums on vs off (issue 8)
    target = ">= 0.90x off"
    try:
        rounds = _rounds(plan.bulk_bytes, seed_bytes)
        res = _bulk_pair("checksums on/off", rounds, seed_bytes, (node, "seed-v2-nosum"),
                         (node, seed.name), pids_a=node_pids, pids_b=node_pids)
        ratio = _ratio(res["b_gbps"], res["a_gbps"])
        rows.append(Row(
            f"checksums on vs off, {seed.label}", "fetch GB/s", res["b_gbps"], res["a_gbps"],
            ratio, target, ratio is not None and ratio >= 0.9,
            res["a_verified"] and res["b_verified"], baseline_kind="p2pkv, checksums=False",
            details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                     "cost_fraction": None if ratio is None else 1 - ratio,
                     "off_cpu_s_per_gb": res["a_cpu_s_per_gb"],
                     "on_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                     "note": "the producer hashes a block once and caches it; the "
                             "receiver hashes every block it lands"}))
    except BenchError as exc:
        rows.append(_error_row("checksums on vs off", "fetch GB/s", target, exc))

    # -- CURVE
    if curve_ok:
        try:
            rounds = _rounds(plan.curve_bytes, seed_bytes)
            res = _bulk_pair("curve", rounds, seed_bytes, (node, seed.name),
                             (node, "seed-v2-curve"), pids_a=node_pids, pids_b=node_pids)
            rows.append(Row(
                f"CURVE encryption, {seed.label}", "fetch GB/s", res["b_gbps"], res["a_gbps"],
                _ratio(res["b_gbps"], res["a_gbps"]), "(info)", None,
                res["a_verified"] and res["b_verified"], baseline_kind="p2pkv, plaintext",
                details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                         "plain_cpu_s_per_gb": res["a_cpu_s_per_gb"],
                         "curve_cpu_s_per_gb": res["b_cpu_s_per_gb"]}))
        except BenchError as exc:
            rows.append(_error_row("CURVE encryption", "fetch GB/s", "(info)", exc))

    # -- lookups, idle and during a bulk fetch from the same peer
    for during in (False, True):
        for n, count in plan.lookup_counts:
            when = "during bulk fetch" if during else "idle"
            limit = (100.0 if during else 20.0) if n >= 10_000 else None
            case_name = f"lookup {n:,} keys, {when}"
            try:
                _log(f"{case_name}: {count} lookups each side")
                res = _latency_pair(count, plan.batches,
                                    {"op": "lookup", "n": n, "during_bulk": during},
                                    (raw, seed.name), (node, seed.name))
                verified = res["a_verified"] and res["b_verified"]
                details: dict[str, Any] = {"samples": len(res["b_ms"]),
                                           "keys_held_by_peer": blocks[seed.name]}
                if during:
                    details["node_bulk_gbps_meanwhile"] = res["b_bulk_gbps"]
                    details["raw_bulk_gbps_meanwhile"] = res["a_bulk_gbps"]
                for q in (50, 99):
                    v, bl = percentile(res["b_ms"], q), percentile(res["a_ms"], q)
                    tgt = f"< {limit:.0f} ms" if (limit is not None and q == 99) else "-"
                    met = (v < limit) if (limit is not None and q == 99) else None
                    rows.append(Row(case_name, f"p{q} ms", v, bl, _ratio(v, bl), tgt, met,
                                    verified, details=details))
            except BenchError as exc:
                rows.append(_error_row(case_name, "p99 ms", "-", exc))

    # -- handshake
    try:
        _log(f"handshake: {plan.handshakes} connects each side")
        res = _latency_pair(plan.handshakes, plan.batches, {"op": "handshake"},
                            (raw, seed.name), (node, seed.name))
        verified = res["a_verified"] and res["b_verified"]
        for q in (50, 99):
            v, bl = percentile(res["b_ms"], q), percentile(res["a_ms"], q)
            rows.append(Row("handshake (connect to ready)", f"p{q} ms", v, bl, _ratio(v, bl),
                            "< 5 ms" if q == 50 else "-", (v < 5.0) if q == 50 else None,
                            verified, baseline_kind="raw pyzmq connect + one ping",
                            details={"samples": len(res["b_ms"])}))
    except BenchError as exc:
        rows.append(_error_row("handshake (connect to ready)", "p50 ms", "< 5 ms", exc))

    # -- receiver peak RSS while moving mem_bytes
    mem_name = f"receiver peak RSS, {plan.mem_bytes / GIB:g} GiB moved"
    try:
        rounds = _rounds(plan.mem_bytes, seed_bytes)
        res = _bulk_pair("memory", rounds, seed_bytes, (workers["mem-raw"], seed.name),
                         (workers["mem-node"], seed.name))
        mn = workers["mem-node"].ask({"op": "mem"}, 60)
        mr = workers["mem-raw"].ask({"op": "mem"}, 60)
        grow_n = (mn["VmHWM"] - mn["rss_before_kib"]) / KIB
        grow_r = (mr["VmHWM"] - mr["rss_before_kib"]) / KIB
        pool_mib = mn["pool_bytes"] / MIB
        rows.append(Row(
            mem_name, "MiB over pre-pool RSS", grow_n, grow_r, _ratio(grow_n, grow_r),
            f"<= pool {pool_mib:.0f} + 100 MiB", grow_n <= pool_mib + 100,
            res["a_verified"] and res["b_verified"],
            baseline_kind="raw pyzmq receiver, same buffer size",
            details={"node_vmhwm_mib": mn["VmHWM"] / KIB,
                     "node_rss_before_pool_mib": mn["rss_before_kib"] / KIB,
                     "raw_vmhwm_mib": mr["VmHWM"] / KIB,
                     "raw_rss_before_buffers_mib": mr["rss_before_kib"] / KIB,
                     "pool_mib": pool_mib, "bytes_moved": res["b_bytes"],
                     "node_gbps": res["b_gbps"], "raw_gbps": res["a_gbps"],
                     "note": "the RSS before the pool includes the interpreter, torch and "
                             "numpy (the node imports torch for its pool)"}))
    except BenchError as exc:
        rows.append(_error_row(mem_name, "MiB over pre-pool RSS", "<= pool + 100 MiB", exc))
    return rows


def run_bench(*, quick: bool = False, json_path: str | None = None,
              out: IO[str] | None = None) -> int:
    """Run every case; print the table; return 0 iff every case ran and verified."""
    out = out or sys.stdout
    plan = Plan.make(quick)
    cases = BULK_CASES
    blocks = {c.name: max(4, plan.dataset_bytes // c.bytes_per_block) for c in cases}
    seed = cases[0]
    curve_ok = bool(zmq.has("curve"))
    hwm = 16
    t_start = time.perf_counter()

    server_nodes = [_node_spec(c.name, c, blocks[c.name]) for c in cases]
    client_nodes = [_node_spec(c.name, c, blocks[c.name]) for c in cases]
    client_nodes.append(_node_spec("seed-v2-nosum", seed, blocks[seed.name], checksums=False))
    if curve_ok:
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        server_nodes.append(_node_spec("seed-v2-curve", seed, blocks[seed.name], curve={
            "public": spub.decode(), "secret": ssec.decode()}))
        client_nodes.append(_node_spec("seed-v2-curve", seed, blocks[seed.name], curve={
            "public": cpub.decode(), "secret": csec.decode(), "server_key": spub.decode()}))
    raw_sets = [{"name": c.name, "segments": list(c.segments), "blocks": blocks[c.name]}
                for c in cases]

    workers: dict[str, Worker] = {}
    rows: list[Row] = []
    errors: list[str] = []
    server_stats: dict[str, Any] = {}
    try:
        _log("starting servers")
        workers["node-server"] = Worker("node-server", "node-server", {"nodes": server_nodes})
        workers["raw-server"] = Worker("raw-server", "raw-server",
                                       {"datasets": raw_sets, "hwm": hwm})
        addresses = workers["node-server"].next(300)["addresses"]
        raw_address = workers["raw-server"].next(300)["address"]
        for spec in client_nodes:
            spec["address"] = addresses[spec["id"] if spec["id"] != "seed-v2-nosum"
                                        else seed.name]
        _log("starting clients")
        workers["node-client"] = Worker("node-client", "node-client", {"nodes": client_nodes})
        workers["raw-client"] = Worker("raw-client", "raw-client",
                                       {"datasets": raw_sets, "hwm": hwm, "address": raw_address})
        workers["mem-node"] = Worker("mem-node", "node-client",
                                     {"nodes": [n for n in client_nodes if n["id"] == seed.name]})
        workers["mem-raw"] = Worker("mem-raw", "raw-client", {
            "datasets": [d for d in raw_sets if d["name"] == seed.name], "hwm": hwm,
            "address": raw_address})
        for name in ("node-client", "raw-client", "mem-node", "mem-raw"):
            workers[name].next(300)
        rows = _bench_rows(plan, workers, cases, blocks, curve_ok)
        server_stats = {"node-server": workers["node-server"].ask({"op": "stats"}, 60),
                        "raw-server": workers["raw-server"].ask({"op": "stats"}, 60)}
    except BenchError as exc:
        errors.append(str(exc))
    finally:
        for w in workers.values():
            w.close_stdin()
        for name, w in workers.items():
            rc = w.stop(30)
            if rc not in (0, None) and not errors:
                errors.append(f"{name} exited with {rc}: {w.stderr_tail()}")
    elapsed = time.perf_counter() - t_start

    rows_failed = [r for r in rows if r.error or not r.verified]
    ok = not errors and not rows_failed and bool(rows)
    result = {
        "version": 1, "mode": "quick" if quick else "full", "ok": ok, "errors": errors,
        "seconds": elapsed, "machine": machine_info(), "baseline": BASELINE_KIND,
        "plan": dataclasses.asdict(plan), "server_stats": server_stats,
        "cases": [dataclasses.asdict(r) for r in rows],
    }
    print(f"p2pkv bench ({result['mode']}, {elapsed:.0f} s) -- baseline: {BASELINE_KIND}",
          file=out)
    lines = [f"error: {e}" for e in errors]
    lines += [f"failed: {r.case} {r.metric}: {r.error or 'bytes not verified'}"
              for r in rows_failed]
    return _report(rows, lines, result, ok, out, json_path)


# --------------------------------------------------------------------------- soak


def _buckets(progress: dict[int, list[tuple[float, int]]], t0: float, seconds: float,
             width: float = 10.0) -> list[tuple[float, float, int]]:
    """(start, end, bytes) per ``width``-second bucket from cumulative progress samples."""
    n = max(1, math.ceil(seconds / width))
    moved = [0] * n
    for samples in progress.values():
        prev = 0
        for t, total in sorted(samples):
            if t >= t0:  # bytes of the warm-up before t0 are not counted
                k = min(n - 1, int((t - t0) // width))
                moved[k] += total - prev
            prev = total
    return [(k * width, min(seconds, (k + 1) * width), moved[k]) for k in range(n)]


def _flat(samples: list[tuple[float, int]], seconds: float,
          tolerance: Callable[[float], float]) -> tuple[float, float, bool]:
    first = [v for t, v in samples if t < seconds / 4]
    last = [v for t, v in samples if t >= 3 * seconds / 4]
    if not first or not last:
        return math.nan, math.nan, False
    a, b = float(np.median(first)), float(np.median(last))  # robust to ramp-up samples
    return a, b, b - a <= tolerance(a)


def run_soak(seconds: float, *, json_path: str | None = None, consumers: int = 8,
             out: IO[str] | None = None) -> int:
    """Eight consumers fetch from one producer for ``seconds``; non-zero on any error."""
    out = out or sys.stdout
    if seconds <= 0:
        print("p2pkv-node bench: --soak needs a positive number of seconds", file=sys.stderr)
        return 2
    case = BULK_CASES[0]
    blocks = max(4, (32 * MIB) // case.bytes_per_block)
    spec = _node_spec("soak", case, blocks)
    workers: list[Worker] = []
    errors: list[str] = []
    progress: dict[int, list[tuple[float, int]]] = {}
    finals: list[dict[str, Any]] = []
    rss: list[tuple[float, int]] = []
    fds: list[tuple[float, int]] = []
    t0 = time.monotonic()
    try:
        producer = Worker("soak-producer", "node-server", {"nodes": [spec]})
        workers.append(producer)
        address = producer.next(300)["addresses"]["soak"]
        clients = [Worker(f"soak-consumer-{i}", "soak-client", {**spec, "address": address})
                   for i in range(consumers)]
        workers += clients
        for c in clients:
            c.next(600)
        _log(f"soak: {consumers} consumers, {seconds:g} s after a short warm-up")
        for c in clients:
            c.send_line("go")
        # A warm-up (first touch of every pool, libzmq buffers) is left out of the
        # throughput buckets and of the RSS/fd quarters: it lasts until every consumer
        # has finished two rounds.
        warm: set[int] = set()
        warm_deadline = time.monotonic() + 180
        while len(warm) < consumers:
            if time.monotonic() > warm_deadline:
                raise BenchError("soak consumers did not finish a first round within 180 s")
            for i, c in enumerate(clients):
                while (ev := c.poll_event()) is not None:
                    if ev.get("event") == "progress":
                        progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                        if int(ev["rounds"]) >= 2:
                            warm.add(i)
                if c.proc.poll() is not None:
                    raise BenchError(f"{c.name} died (rc={c.proc.returncode}): "
                                     f"{c.stderr_tail()}")
            time.sleep(0.1)
        t0 = time.monotonic()
        end = t0 + seconds
        next_sample = t0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                rss.append((now - t0, proc_status(producer.pid).get("VmRSS", 0)))
                fds.append((now - t0, fd_count(producer.pid)))
                next_sample = now + 1.0
            for i, c in enumerate(clients):
                while (ev := c.poll_event()) is not None:
                    if ev.get("event") == "progress":
                        progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                if c.proc.poll() is not None:
                    raise BenchError(f"{c.name} died (rc={c.proc.returncode}): "
                                     f"{c.stderr_tail()}")
            time.sleep(0.2)
        for c in clients:
            c.close_stdin()
        for i, c in enumerate(clients):
            deadline = time.monotonic() + 120
            while True:
                ev = c.next(max(1.0, deadline - time.monotonic()))
                if ev.get("event") == "progress":
                    progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                    continue
                if ev.get("event") == "final":
                    finals.append(ev)
                    progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                    break
        stats = producer.ask({"op": "stats"}, 60)
        if stats["nodes"]["soak"]["protocol_violations"]:
            errors.append(f"producer saw {stats['nodes']['soak']['protocol_violations']} "
                          "protocol violations")
    except BenchError as exc:
        errors.append(str(exc))
    finally:
        for w in workers:
            w.close_stdin()
        for w in workers:
            w.stop(30)
    fetch_errors = sum(int(f["errors"]) for f in finals)
    messages = [str(m) for f in finals for m in f.get("messages", [])]
    if len(finals) != consumers and not errors:
        errors.append(f"only {len(finals)} of {consumers} consumers reported")
    verified = len(finals) == consumers and all(f.get("verified") for f in finals)
    total_errors = fetch_errors + len(errors)
    errors += messages
    rows: list[Row] = [Row(f"soak {consumers} consumers, {case.label}", "errors",
                           float(total_errors), None, None, "= 0", total_errors == 0, verified,
                           baseline_kind="-", details={"messages": errors[:10]})]
    for start, stop, nbytes in _buckets(progress, t0, seconds):
        span = max(stop - start, 1e-9)
        rows.append(Row(f"soak throughput {start:.0f}-{stop:.0f} s", "GB/s (all consumers)",
                        nbytes / span / 1e9, None, None, "-", None, verified,
                        baseline_kind="-"))
    a, b, flat = _flat(rss, seconds, lambda first: max(16 * MIB / KIB, 0.05 * first))
    rows.append(Row("soak producer RSS (median), last vs first quarter", "MiB", b / KIB, a / KIB,
                    _ratio(b, a), "flat (+16 MiB or 5%)", flat, verified,
                    baseline_kind="first quarter"))
    a, b, flat = _flat([(t, v) for t, v in fds], seconds, lambda first: 0.0)
    fd_max_first = max((v for t, v in fds if t < seconds / 4), default=-1)
    fd_max_last = max((v for t, v in fds if t >= 3 * seconds / 4), default=-1)
    rows.append(Row("soak producer open fds, last vs first quarter", "count (max)",
                    float(fd_max_last), float(fd_max_first),
                    _ratio(fd_max_last, fd_max_first), "flat",
                    fd_max_first >= 0 and fd_max_last <= fd_max_first, verified,
                    baseline_kind="first quarter", details={"median_first": a, "median_last": b}))
    ok = total_errors == 0 and verified
    result = {"version": 1, "mode": "soak", "ok": ok, "errors": errors, "seconds": seconds,
              "consumers": consumers, "machine": machine_info(),
              "samples": {"rss_kib": rss, "fds": fds},
              "cases": [dataclasses.asdict(r) for r in rows]}
    print(f"p2pkv soak ({consumers} consumers, {seconds:g} s)", file=out)
    return _report(rows, [f"error: {e}" for e in errors[:10]], result, ok, out, json_path)


if __name__ == "__main__":
    sys.exit(main_worker(sys.argv[1:]))

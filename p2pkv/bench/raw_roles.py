"""Worker roles of the baseline: raw pyzmq moving the same frames as the node."""

from __future__ import annotations

import collections
import os
import struct
import threading
import time
from typing import Any

import numpy as np
import zmq

from p2pkv.bench.data import BenchError, Dataset, fd_count, lookup_keys, proc_status, timed_lookups
from p2pkv.runtime.tuning import ZERO_COPY_MIN
from p2pkv.workers import say, serve_commands


def serve_ready(address: str, failure: list[str]) -> None:
    """A bench server's main thread: say it is ready at ``address``, then answer
    ``stats`` until stdin closes (failing it with the first of ``failure``, what its
    serving threads caught)."""
    say({"event": "ready", "pid": os.getpid(), "address": address})

    def stats(cmd: dict[str, Any]) -> dict[str, Any]:
        if failure:
            raise BenchError(failure[0])
        return {**proc_status(), "fds": fd_count()}

    serve_commands({"stats": stats})


def _raw_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, hwm: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


class RawBuffers:
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
    datasets = {d["name"]: RawBuffers(Dataset(d["name"], d["segments"], d["blocks"]), True)
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

    def stream(rid: bytes, bufs: RawBuffers, count: int) -> None:
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
        serve_ready(address, failure)
    finally:
        stop.set()
        thread.join(30)
        sock.close(0)
        ctx.term()
    return 0


def raw_fetch_round(sock: zmq.Socket[bytes], bufs: RawBuffers, *,
                    clear: bool = False) -> tuple[float, int, float]:
    """One request for the whole dataset: seconds, bytes, this process's CPU seconds."""
    ds = bufs.ds
    if clear:
        bufs.clear()
    views = bufs.views
    sizes = ds.segments
    nseg = len(sizes)
    got = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
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
    return time.perf_counter() - t0, got * ds.bpb, time.process_time() - cpu0


def role_raw_client(spec: dict[str, Any]) -> int:
    """The baseline receiver."""
    rss_before = proc_status().get("VmRSS", 0)
    buffers = {d["name"]: RawBuffers(Dataset(d["name"], d["segments"], d["blocks"]), False)
               for d in spec["datasets"]}
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    hwm = int(spec["hwm"])
    address = spec["address"]
    bulk_sock = _raw_socket(ctx, zmq.DEALER, hwm)
    bulk_sock.connect(address)
    lookup_sock = _raw_socket(ctx, zmq.DEALER, hwm)
    lookup_sock.connect(address)
    try:
        say({"event": "ready", "pid": os.getpid()})

        def bulk(cmd: dict[str, Any]) -> dict[str, Any]:
            seconds, moved, cpu = raw_fetch_round(bulk_sock, buffers[cmd["id"]],
                                                  clear=bool(cmd.get("clear")))
            return {"seconds": seconds, "bytes": moved, "cpu": cpu}

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

            return timed_lookups(call, expected, int(cmd["count"]),
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

        serve_commands({"bulk": bulk, "verify": verify, "lookup": lookup,
                         "handshake": handshake, "mem": mem})
    finally:
        bulk_sock.close(0)
        lookup_sock.close(0)
        ctx.term()
    return 0

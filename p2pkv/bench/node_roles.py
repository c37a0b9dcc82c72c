"""Worker roles that run p2pkv nodes: the serving node, the fetching node (bulk,
lookups, handshakes, memory) and the soak consumer."""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from p2pkv.bench.data import (
    MIB,
    MULTI_STREAMS,
    BenchError,
    Dataset,
    MemcpyRound,
    fd_count,
    lookup_keys,
    proc_status,
    timed_lookups,
)
from p2pkv.layout import Geometry, make_layout
from p2pkv.workers import say, serve_commands, stdin_closed


def geometry_from(spec: dict[str, Any]) -> Geometry:
    return Geometry(**spec)


def make_node(spec: dict[str, Any], *, pool_blocks: int, checksums: bool = True,
              curve: Any = None) -> Any:
    from p2pkv.identity import RunConfig
    from p2pkv.node import Node, NodeConfig

    layout = make_layout(spec["layout"], geometry_from(spec["geometry"]))
    g = layout.geometry
    groups = [{"tokens_per_block": g.tokens_per_block,
               "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(g.num_layers)]}]
    rc = RunConfig.resolve("p2pkv/bench", parallel_agnostic=True, dtype=g.dtype,
                           kv_cache_groups=groups, **layout.identity_flags())
    # Clients use the data channel (tcp-data-v1) only where the case asks for it, so
    # the other rows measure the ZeroMQ path; servers offer it to whoever asks. NIXL
    # (nixl-v1) is off unless the case asks for it: "auto" would take it wherever the
    # host has an RDMA device, and every node it is on keeps an exporter thread busy.
    cfg = NodeConfig(checksums=checksums, curve=curve, fetch_timeout=120.0,
                     shm=bool(spec.get("shm", False)),
                     shm_copy_threads=int(spec.get("shm_copy_threads", 1)),
                     data_channel=bool(spec.get("data_channel", False)),
                     data_streams=int(spec.get("data_streams", 1)),
                     data_encryption=str(spec.get("data_encryption", "sealed")),
                     nixl=str(spec.get("nixl", "off")),
                     nixl_read_timeout=float(spec.get("nixl_read_timeout", 30.0)))
    # UCX reads its transports from the environment when a NIXL agent is made, which
    # the Node's constructor does (and waits for): the spec's "ucx_env" is in force for
    # this node's construction only.
    with ucx_env(spec.get("ucx_env") or {}):
        return Node(rc, layout, pool_blocks=pool_blocks, config=cfg)


@contextlib.contextmanager
def ucx_env(changes: dict[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (a None value: unset) until the block ends, then
    as it was. Only ``UCX_*`` variables."""
    for name in changes:
        if not name.startswith("UCX_"):
            raise BenchError(f"ucx_env sets {name!r}: only UCX_* variables")
    saved = {name: os.environ.get(name) for name in changes}

    def apply(values: dict[str, str | None]) -> None:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)

    apply(changes)
    try:
        yield
    finally:
        apply(saved)


def curve_keys(spec: dict[str, Any] | None) -> Any:
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
            # Servers take up to MULTI_STREAMS data streams from a client that opens
            # several (tcp-streams-v1); a client of one stream never sees the others.
            node = make_node({**nspec, "data_channel": True,
                              "data_streams": nspec.get("data_streams", MULTI_STREAMS)},
                             pool_blocks=ds.blocks,
                             curve=curve_keys(nspec.get("curve")))
            nodes[nspec["id"]] = node
            for i, key in enumerate(ds.keys):
                node.put(key, ds.block(i))
        say({"event": "ready", "pid": os.getpid(),
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

        serve_commands({"stats": stats})
    finally:
        for n in nodes.values():
            n.close()
    return 0


@dataclass
class ClientNode:
    node: Any
    peer: Any
    ds: Dataset
    address: str
    chunk: int


def fetch_round(c: ClientNode, *, depth: int = 2, clear: bool = False,
                timeout: float = 120.0) -> tuple[float, int, float]:
    """Discard every block locally, then fetch the whole dataset back (pipelined
    ``fetch_async`` of ``c.chunk`` keys each, ``depth`` in flight). Only the fetching is
    timed: seconds, bytes moved, and this process's CPU seconds (all threads) meanwhile.
    Raises :class:`BenchError` unless every byte moved."""
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

    cpu0, t0 = time.process_time(), time.perf_counter()
    for start in range(0, ds.blocks, c.chunk):
        part = ds.keys[start:start + c.chunk]
        inflight.append((node.fetch_async(c.peer, part, timeout=timeout), len(part)))
        if len(inflight) >= depth:
            moved += settle()
    while inflight:
        moved += settle()
    return time.perf_counter() - t0, moved, time.process_time() - cpu0


def verify_node(c: ClientNode) -> tuple[int, int]:
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
    clients: dict[str, ClientNode] = {}
    try:
        for nspec in spec["nodes"]:
            ds = Dataset(nspec["dataset"], nspec["segments"], nspec["blocks"])
            node = make_node(nspec, pool_blocks=ds.blocks,
                             checksums=nspec.get("checksums", True),
                             curve=curve_keys(nspec.get("curve")))
            clients[nspec["id"]] = ClientNode(node, None, ds, nspec["address"],
                                               chunk_keys(ds.bpb))
            clients[nspec["id"]].peer = node.connect(nspec["address"], timeout=30)
            peer = clients[nspec["id"]].peer
            want = ("nixl" if nspec.get("nixl") == "on" else "shm" if nspec.get("shm") else
                    "tcp-data" if nspec.get("data_channel") else "tcp")
            if peer.data_path != want:
                raise BenchError(f"{nspec['id']}: blocks move by {peer.data_path}, not "
                                 f"{want}: {peer.data_path_detail}")
            streams = int(nspec.get("data_streams", 1))
            if streams > 1 and not peer.data_path_detail.startswith(f"{streams} data streams"):
                raise BenchError(f"{nspec['id']}: not on {streams} data streams: "
                                 f"{peer.data_path_detail}")
        copies = {m["id"]: MemcpyRound(int(m["bytes"]), int(m["bytes_per_block"]))
                  for m in spec.get("memcpy", ())}
        say({"event": "ready", "pid": os.getpid()})

        def bulk(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["id"] in copies:
                seconds, moved = copies[cmd["id"]].run()
                return {"seconds": seconds, "bytes": moved}
            seconds, moved, cpu = fetch_round(clients[cmd["id"]], clear=bool(cmd.get("clear")))
            return {"seconds": seconds, "bytes": moved, "cpu": cpu}

        def verify(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["id"] in copies:
                ok = copies[cmd["id"]].check()
                return {"good": int(ok), "bad": int(not ok),
                        "whole_copy_gbps": copies[cmd["id"]].whole()}
            good, bad = verify_node(clients[cmd["id"]])
            return {"good": good, "bad": bad}

        def lookup(cmd: dict[str, Any]) -> dict[str, Any]:
            c = clients[cmd["id"]]
            keys, expected = lookup_keys(c.ds, int(cmd["n"]))
            return timed_lookups(
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

        serve_commands({"bulk": bulk, "verify": verify, "lookup": lookup,
                         "handshake": handshake, "mem": mem})
    finally:
        for c in clients.values():
            c.node.close()
    return 0


def _node_bulk_loop(c: ClientNode, stop: threading.Event) -> int:
    moved = 0
    while not stop.is_set():
        moved += fetch_round(c)[1]
    return moved




def role_soak_client(spec: dict[str, Any]) -> int:
    """Fetch the dataset again and again until stdin closes; progress every second."""
    ds = Dataset(spec["dataset"], spec["segments"], spec["blocks"])
    node = make_node(spec, pool_blocks=ds.blocks)
    errors: list[str] = []
    moved = rounds = 0
    try:
        c = ClientNode(node, node.connect(spec["address"], timeout=60), ds, spec["address"],
                        chunk_keys(ds.bpb))
        say({"event": "ready", "pid": os.getpid()})
        if sys.stdin.readline().strip() != "go":
            return 0
        stop = stdin_closed()
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
                say({"event": "progress", "t": now, "bytes": moved, "rounds": rounds,
                      "errors": len(errors)})
                next_report = now + 1.0
        good, bad = verify_node(c)
        if bad:
            errors.append(f"final check: {bad} of {good + bad} blocks with wrong bytes")
        say({"event": "final", "t": time.monotonic(), "bytes": moved, "rounds": rounds,
              "errors": len(errors), "messages": errors[:5], "verified": bad == 0 and good > 0})
    finally:
        node.close()
    return 0

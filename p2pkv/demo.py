"""``p2pkv-node demo``: three processes on 127.0.0.1 show what p2pkv does.

* a **producer** (V2 per-layer layout, seed geometry) stores synthetic KV blocks;
* a **compatible consumer** (same identity) fetches them all in one fetch, verifies every
  byte and reports blocks, bytes, the path they took and GB/s of the fetch alone;
* an **incompatible consumer** (V1 cross-layer layout: the same 589,824 bytes per block,
  another byte order) is refused at the handshake and shows the field-level diff.

Each role runs as ``python -m p2pkv.demo ROLE ...`` and speaks JSON lines on stdout;
the parent prints their results. Every wait has a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from p2pkv.reports import cell, plain
from p2pkv.workers import JsonLineProcess, WorkerExited, say, wait_for_stdin_eof

MODEL = "p2pkv/demo-seed"
_DEADLINE_S = 60.0


def demo_keys(count: int, *, seed: int = 0) -> list[bytes]:
    """Block keys of one synthetic prompt of ``count`` full blocks."""
    from p2pkv.keys import block_keys

    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, 32000, size=count * 16).tolist()
    return block_keys(tokens, tokens_per_block=16, seed=seed)


def block_bytes(key: bytes, size: int) -> bytes:
    """Deterministic synthetic block content derived from its key."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.bytes(size)


#: How ``PeerHandle.data_path`` reads in the demo's summary.
_PATHS = {"tcp-data": "the data stream beside ZeroMQ", "tcp": "ZeroMQ frames",
          "shm": "shared memory", "nixl": "one-sided NIXL reads"}


def _node(layout_name: str, pool_blocks: int) -> Any:
    from p2pkv.identity import RunConfig
    from p2pkv.layout import SEED_GEOMETRY, make_layout
    from p2pkv.node import Node, NodeConfig

    layout = make_layout(layout_name, SEED_GEOMETRY)
    groups = [{"tokens_per_block": 16,
               "layer_names": [f"model.layers.{i}.self_attn.attn" for i in range(12)]}]
    rc = RunConfig.resolve(MODEL, parallel_agnostic=True, kv_cache_groups=groups,
                           **layout.identity_flags())
    return Node(rc, layout, pool_blocks=pool_blocks, config=NodeConfig())


def role_producer(blocks: int) -> int:
    node = _node("v2", blocks + 8)
    try:
        size = node.layout.bytes_per_block
        for key in demo_keys(blocks):
            node.put(key, block_bytes(key, size))
        say({"event": "ready", "address": node.address, "fingerprint": node.fingerprint,
              "blocks": blocks})
        # Serve until the parent closes our stdin (or the deadline passes).
        wait_for_stdin_eof(_DEADLINE_S)
        stats = node.stats()
        say({"event": "served", "blocks_sent": stats.blocks_sent,
              "bytes_sent": stats.bytes_sent, "refused": stats.handshakes_refused})
    finally:
        node.close()
    return 0


def role_consumer(address: str, blocks: int, layout_name: str) -> int:
    from p2pkv.errors import PeerIncompatible

    node = _node(layout_name, blocks + 8)
    try:
        try:
            peer = node.connect(address)
        except PeerIncompatible as exc:
            say({"event": "refused", "fingerprint": node.fingerprint,
                  "reasons": [{"field": r.field, "local": plain(r.ours),
                               "remote": plain(r.theirs), "meaning": r.meaning}
                              for r in exc.reasons]})
            return 0
        keys = demo_keys(blocks)
        hits = peer.lookup(keys)
        say({"event": "lookup", "hits": sum(hits), "keys": len(keys)})
        size = node.layout.bytes_per_block
        # One fetch of every block, and only the fetch on the clock: no start-up, no
        # progress lines, no verification (that comes after, over every byte).
        t0 = time.perf_counter()
        result = peer.fetch(keys)
        seconds = time.perf_counter() - t0
        if result.failed or result.missing:
            say({"event": "error", "failed": len(result.failed),
                  "missing": len(result.missing), "errors": result.errors})
            return 1
        moved = result.blocks
        bad = sum(1 for k in keys if node.get(k) != block_bytes(k, size))
        say({"event": "fetched", "blocks": moved, "bytes": moved * size, "seconds": seconds,
              "gbps": moved * size / seconds / 1e9 if seconds else 0.0, "corrupt": bad,
              "path": peer.data_path})
        peer.close()
        return 0 if bad == 0 else 1
    finally:
        node.close()


def _child(*args: str) -> JsonLineProcess:
    """A role process; its stdout JSON lines are read by a thread into a queue."""
    return JsonLineProcess([sys.executable, "-m", "p2pkv.demo", *args],
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _events(child: JsonLineProcess, deadline: float) -> Iterator[dict[str, Any]]:
    """The child's events until it exits; :class:`TimeoutError` past ``deadline``."""
    while True:
        try:
            yield child.next(max(0.0, deadline - time.monotonic()))
        except WorkerExited:
            return


def run_demo(*, blocks: int = 256, as_json: bool = False) -> int:
    if blocks < 1 or blocks > 4096:
        print("p2pkv-node: error: --blocks: must be in [1, 4096]", file=sys.stderr)
        return 2
    deadline = time.monotonic() + _DEADLINE_S
    children: list[JsonLineProcess] = []
    summary: dict[str, Any] = {}
    try:
        producer = _child("producer", "--blocks", str(blocks))
        children.append(producer)
        ready = next(_events(producer, deadline))
        address = ready["address"]
        if not as_json:
            print(f"producer  V2 per-layer, seed geometry, {blocks} blocks on {address}")
            print(f"          fingerprint {ready['fingerprint']}")
        good = _child("consumer", address, "--blocks", str(blocks), "--layout", "v2")
        bad = _child("consumer", address, "--blocks", str(blocks), "--layout", "v1")
        children += [good, bad]
        for event in _events(good, deadline):
            if event["event"] in ("fetched", "error"):
                summary["compatible"] = event
        for event in _events(bad, deadline):
            if event["event"] in ("refused", "lookup", "fetched"):
                summary["incompatible"] = event
        producer.close_stdin()
        for event in _events(producer, deadline):
            if event["event"] == "served":
                summary["producer"] = event
        codes = [c.wait(max(0.1, deadline - time.monotonic())) for c in children]
    except (TimeoutError, StopIteration, KeyError, subprocess.TimeoutExpired) as exc:
        for c in children:
            c.kill()
        print(f"p2pkv-node demo: failed: {exc!r}", file=sys.stderr)
        for c in children:
            err = c.stderr_tail(2000)
            if err:
                print(err, file=sys.stderr)
        return 1
    finally:
        for c in children:
            c.kill()
    ok = (codes == [0, 0, 0]
          and summary.get("compatible", {}).get("event") == "fetched"
          and summary["compatible"].get("corrupt") == 0
          and summary.get("incompatible", {}).get("event") == "refused")
    if as_json:
        print(json.dumps({"ok": ok, **summary}, sort_keys=True, default=str))
        return 0 if ok else 1
    comp = summary.get("compatible", {})
    if comp.get("event") == "fetched":
        path = _PATHS.get(comp.get("path", ""), comp.get("path", "?"))
        print(f"consumer  V2 per-layer: fetched {comp['blocks']} blocks, "
              f"{comp['bytes'] / 1e6:.1f} MB in one fetch of {comp['seconds'] * 1e3:.0f} ms "
              f"over {path} ({comp['gbps']:.2f} GB/s), {comp['corrupt']} corrupt (every "
              "byte verified)")
        print("          one cold fetch on a shared machine: `p2pkv-node bench` measures "
              "every path against the kernel's ceiling")
    else:
        print(f"consumer  V2 per-layer: FAILED {comp}")
    inc = summary.get("incompatible", {})
    if inc.get("event") == "refused":
        print("consumer  V1 cross-layer: REFUSED at handshake (no block byte exchanged):")
        for r in inc["reasons"]:
            print(f"  - {r['field']}: local {cell(r['local'])} vs remote "
                  f"{cell(r['remote'])}\n      {r['meaning']}")
    else:
        print(f"consumer  V1 cross-layer: NOT refused: {inc}")
    prod = summary.get("producer", {})
    if prod:
        print(f"producer  sent {prod['blocks_sent']} blocks; refusals by reason: "
              f"{prod['refused']}")
    print("demo OK" if ok else "demo FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pkv.demo")
    sub = parser.add_subparsers(dest="role", required=True)
    p = sub.add_parser("producer")
    p.add_argument("--blocks", type=int, required=True)
    p = sub.add_parser("consumer")
    p.add_argument("address")
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--layout", choices=("v1", "v2"), required=True)
    args = parser.parse_args(argv)
    if args.role == "producer":
        return role_producer(args.blocks)
    return role_consumer(args.address, args.blocks, args.layout)


if __name__ == "__main__":
    sys.exit(main())

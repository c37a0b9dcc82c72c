"""A p2pkv node in its own process, for multi-process tests.

Usage: ``python tests/nodeproc.py ROLE SPEC_JSON [ADDRESS]`` where ROLE is

* ``serve``: build a node from SPEC, store ``spec["blocks"]`` deterministic blocks,
  print ``{"event": "ready", "address": ...}``, serve until stdin closes, then print
  ``{"event": "stats", ...}`` and exit 0.
* ``fetch``: connect to ADDRESS, fetch every block, verify each byte, print
  ``{"event": "fetched", ...}`` (or ``{"event": "refused", ...}``) and exit 0.

SPEC keys: layout (v1|v2|replicated), geometry ("seed", "mla-small" or a dict of
Geometry fields), tp, blocks, pool (blocks), model, key_seed, agnostic (opt-in).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import numpy as np

from p2pkv.errors import P2PKVError, PeerIncompatible
from p2pkv.identity import ABSENT, RunConfig
from p2pkv.keys import block_keys
from p2pkv.layout import SEED_GEOMETRY, Geometry, make_layout
from p2pkv.node import Node, NodeConfig

MLA_SMALL = Geometry(num_layers=4, num_kv_heads=1, head_size=96, kv_kind="mla")


def geometry(spec: Any) -> Geometry:
    if spec in (None, "seed"):
        return SEED_GEOMETRY
    if spec == "mla-small":
        return MLA_SMALL
    if spec == "small":
        return Geometry(num_layers=4, num_kv_heads=2, head_size=16)
    return Geometry(**spec)


def make_node(spec: dict[str, Any], **config: Any) -> Node:
    layout = make_layout(spec.get("layout", "v2"), geometry(spec.get("geometry")))
    g = layout.geometry
    groups = [{"tokens_per_block": g.tokens_per_block,
               "layer_names": [f"model.layers.{i}.attn" for i in range(g.num_layers)]}]
    rc = RunConfig.resolve(spec.get("model", "test/model"),
                           parallel_agnostic=spec.get("agnostic", True),
                           tp_size=spec.get("tp", 1), rank=spec.get("rank", 0),
                           dtype=g.dtype, kv_cache_groups=groups, **layout.identity_flags())
    cfg = NodeConfig(key_hash_seed=spec.get("key_seed", 0), **config)
    return Node(rc, layout, pool_blocks=spec.get("pool", spec.get("blocks", 8) + 8), config=cfg)


def keys_for(count: int, offset: int = 0) -> list[bytes]:
    rng = np.random.default_rng(99)
    tokens = rng.integers(0, 50000, size=(count + offset) * 16).tolist()
    return block_keys(tokens, tokens_per_block=16, seed=0)[offset:]


def content(key: bytes, size: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, sort_keys=True, default=repr), flush=True)


def serve(spec: dict[str, Any]) -> int:
    node = make_node(spec)
    try:
        size = node.layout.bytes_per_block
        for key in keys_for(spec["blocks"]):
            node.put(key, content(key, size))
        say({"event": "ready", "address": node.address, "fingerprint": node.fingerprint})
        done = threading.Event()

        def wait_for_eof() -> None:
            sys.stdin.read()
            done.set()

        threading.Thread(target=wait_for_eof, daemon=True).start()
        done.wait(spec.get("lifetime", 120))
        s = node.stats()
        say({"event": "stats", "blocks_sent": s.blocks_sent, "bytes_sent": s.bytes_sent,
             "refused": s.handshakes_refused, "accepted": s.handshakes_accepted})
    finally:
        node.close()
    return 0


def fetch(spec: dict[str, Any], address: str) -> int:
    node = make_node(spec)
    try:
        try:
            peer = node.connect(address)
        except PeerIncompatible as exc:
            say({"event": "refused", "reasons": [
                {"field": r.field, "code": int(r.code),
                 "ours": "(absent)" if r.ours is ABSENT else r.ours,
                 "theirs": "(absent)" if r.theirs is ABSENT else r.theirs}
                for r in exc.reasons], "used": node.store.stats().used})
            return 0
        keys = keys_for(spec["blocks"])
        t0 = time.perf_counter()
        result = peer.fetch(keys, timeout=60)
        seconds = time.perf_counter() - t0
        size = node.layout.bytes_per_block
        corrupt = sum(1 for k in keys if node.get(k) != content(k, size))
        say({"event": "fetched", "stored": len(result.stored), "missing": len(result.missing),
             "failed": len(result.failed), "corrupt": corrupt, "seconds": seconds})
    except P2PKVError as exc:
        say({"event": "error", "error": repr(exc)})
        return 1
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    role, spec_json = sys.argv[1], sys.argv[2]
    spec = json.loads(spec_json)
    sys.exit(serve(spec) if role == "serve" else fetch(spec, sys.argv[3]))

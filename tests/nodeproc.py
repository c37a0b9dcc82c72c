"""A p2pkv node in its own process, for multi-process tests.

Usage: ``python tests/nodeproc.py ROLE SPEC_JSON [ADDRESS]`` where ROLE is

* ``serve``: build a node from SPEC, store ``spec["blocks"]`` deterministic blocks,
  print ``{"event": "ready", "address": ...}``, serve until stdin closes, then print
  ``{"event": "stats", ...}`` and exit 0.
* ``fetch``: connect to ADDRESS, fetch every block, verify each byte, print
  ``{"event": "fetched", ...}`` (or ``{"event": "refused", ...}``) and exit 0.
* ``watch``: connect to ADDRESS, fetch ``spec["first"]`` blocks (default 0) and verify
  them (``{"event": "fetched", ...}``), then fetch the rest asynchronously, print
  ``{"event": "flowing", ...}`` once ``spec["flowing"]`` more blocks (default 8) are
  visible, and finally ``{"event": "finished", ...}`` or ``{"event": "failed", ...}``
  (the exception type) with a consistency report of the local store.

SPEC keys: layout (v1|v2|replicated), geometry ("seed", "mla-small" or a dict of
Geometry fields), tp, blocks, pool (blocks), model, key_seed, agnostic (opt-in),
config (a dict of NodeConfig keyword arguments), key_offset (index of the first key),
ext (a dict of IdentityExtension fields).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from p2pkv import workers
from p2pkv.errors import P2PKVError, PeerIncompatible
from p2pkv.identity import IdentityExtension, RunConfig
from p2pkv.keys import block_keys
from p2pkv.layout import SEED_GEOMETRY, Geometry, make_layout
from p2pkv.node import Node, NodeConfig
from p2pkv.reports import plain

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
    ext = IdentityExtension(**spec["ext"]) if "ext" in spec else None
    return Node(rc, layout, pool_blocks=spec.get("pool", spec.get("blocks", 8) + 8), config=cfg,
                extension=ext)


def pooled_node(spec: dict[str, Any], **config: Any) -> Node:
    """:func:`make_node` with a 64-block pool unless the spec names one."""
    return make_node({**spec, "pool": spec.get("pool", 64)}, **config)


def fill(n: Node, count: int, offset: int = 0) -> list[bytes]:
    """Put ``count`` blocks of known content into ``n``; their keys."""
    keys = keys_for(count, offset)
    for k in keys:
        n.put(k, content(k, n.layout.bytes_per_block))
    return keys


def keys_for(count: int, offset: int = 0) -> list[bytes]:
    rng = np.random.default_rng(99)
    tokens = rng.integers(0, 50000, size=(count + offset) * 16).tolist()
    return block_keys(tokens, tokens_per_block=16, seed=0)[offset:]


def content(key: bytes, size: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def moves_both_ways(producer: Node, consumer: Node, peer: Any, keys: list[bytes]) -> None:
    """``keys`` (from :func:`fill`) move from ``producer`` into ``consumer``'s store and
    into caller buffers, byte for byte, all on the data stream, and nothing stays pinned
    on the producer."""
    from p2pkv.node import KeyOutcome

    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)
    bpb = consumer.layout.bytes_per_block
    assert all(consumer.get(k) == content(k, bpb) for k in keys)
    bufs = [[bytearray(s) for s in consumer.layout.segment_sizes] for _ in keys]
    into = consumer.fetch_into(peer, keys, bufs)
    assert into.outcomes == (KeyOutcome.LANDED,) * len(keys)
    assert [bytes(b[0]) for b in bufs] == [content(k, bpb) for k in keys]
    assert consumer.stats().paths["stream"].blocks_received == 2 * len(keys)
    assert producer.store.stats().pinned == 0


def say(obj: dict[str, Any]) -> None:
    workers.say(obj, default=repr)


def serve(spec: dict[str, Any]) -> int:
    node = make_node(spec, **spec.get("config", {}))
    try:
        size = node.layout.bytes_per_block
        for key in keys_for(spec["blocks"], spec.get("key_offset", 0)):
            node.put(key, content(key, size))
        say({"event": "ready", "address": node.address, "fingerprint": node.fingerprint})
        workers.wait_for_stdin_eof(spec.get("lifetime", 120))
        s = node.stats()
        say({"event": "stats", "blocks_sent": s.blocks_sent, "bytes_sent": s.bytes_sent,
             "refused": s.handshakes_refused, "accepted": s.handshakes_accepted,
             "identity_undeclared": s.identity_undeclared})
    finally:
        node.close()
    return 0


def fetch(spec: dict[str, Any], address: str) -> int:
    node = make_node(spec, **spec.get("config", {}))
    try:
        try:
            peer = node.connect(address)
        except PeerIncompatible as exc:
            say({"event": "refused", "reasons": [
                {"field": r.field, "code": int(r.code), "ours": plain(r.ours),
                 "theirs": plain(r.theirs), "meaning": r.meaning}
                for r in exc.reasons], "used": node.store.stats().used})
            return 0
        keys = keys_for(spec["blocks"], spec.get("key_offset", 0))
        t0 = time.perf_counter()
        result = peer.fetch(keys, timeout=60)
        seconds = time.perf_counter() - t0
        size = node.layout.bytes_per_block
        corrupt = sum(1 for k in keys if node.get(k) != content(k, size))
        say({"event": "fetched", "stored": len(result.stored), "missing": len(result.missing),
             "failed": len(result.failed), "corrupt": corrupt, "seconds": seconds,
             "data_path": peer.data_path, "data_path_detail": peer.data_path_detail})
    except P2PKVError as exc:
        say({"event": "error", "error": repr(exc)})
        return 1
    finally:
        node.close()
    return 0


def consistency(node: Node, keys: list[bytes]) -> dict[str, Any]:
    """What the local store shows: visible blocks, how many are not byte-exact, pins."""
    size = node.layout.bytes_per_block
    visible = [k for k, hit in zip(keys, node.lookup_local(keys), strict=True) if hit]
    corrupt = sum(1 for k in visible if node.get(k) != content(k, size))
    st = node.store.stats()
    return {"visible": len(visible), "corrupt": corrupt, "used": st.used, "pinned": st.pinned,
            "stored": st.stored}


def watch(spec: dict[str, Any], address: str) -> int:
    node = make_node(spec, **spec.get("config", {}))
    try:
        keys = keys_for(spec["blocks"], spec.get("key_offset", 0))
        first = spec.get("first", 0)
        try:
            peer = node.connect(address)
            if first:
                result = peer.fetch(keys[:first], timeout=60)
                say({"event": "fetched", "stored": len(result.stored),
                     "failed": len(result.failed), **consistency(node, keys)})
        except P2PKVError as exc:
            say({"event": "error", "type": type(exc).__name__, "error": repr(exc)})
            return 1
        timeout = spec.get("timeout", 120)
        future = node.fetch_async(peer, keys[first:], timeout=timeout)
        target = first + spec.get("flowing", 8)
        deadline = time.monotonic() + 60
        # Flowing means landed and visible: a slot taken for a block still on its way
        # (a data-stream message reserves its slots before its bytes arrive) is not.
        while (sum(node.lookup_local(keys)) < target and not future.done()
               and time.monotonic() < deadline):
            time.sleep(0.005)
        say({"event": "flowing", "done": future.done(), "used": node.store.stats().used,
             "data_path": peer.data_path})
        try:
            result = future.result(timeout=timeout + 5)
        except Exception as exc:  # reported; the parent judges the type and the timing
            say({"event": "failed", "type": type(exc).__name__, "error": repr(exc),
                 "p2pkv": isinstance(exc, P2PKVError), **consistency(node, keys)})
            return 0
        say({"event": "finished", "stored": len(result.stored), "failed": len(result.failed),
             **consistency(node, keys)})
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    role, spec_json = sys.argv[1], sys.argv[2]
    spec = json.loads(spec_json)
    if role == "serve":
        sys.exit(serve(spec))
    if role == "watch":
        sys.exit(watch(spec, sys.argv[3]))
    sys.exit(fetch(spec, sys.argv[3]))

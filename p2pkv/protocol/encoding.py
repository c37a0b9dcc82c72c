"""Typed messages → frames (``protocol/SPEC.md`` §3): what this node writes.

Each message type has a small encoder in a dispatch dict. A field added by a minor
version or a capability is written only when set, so a message without it keeps the
bytes older peers know. :func:`encode` hands a ``block``'s payload frames on without
copying them. Decoding, the direction peer bytes take, is :mod:`p2pkv.protocol.codec`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgpack

from p2pkv.protocol.codes import PROTOCOL_MAJOR, VIA_SHM
from p2pkv.protocol.messages import (
    Abort,
    AbortAck,
    Attach,
    Attached,
    Block,
    Bye,
    Credit,
    Done,
    Error,
    Fetch,
    Frame,
    Geometry,
    Greeting,
    Hello,
    Hits,
    KeyHash,
    Located,
    Lookup,
    Message,
    Ping,
    Pong,
    Refuse,
    Release,
    Welcome,
)

__all__ = ["encode", "encode_head"]


def _e_block(m: Block) -> dict[str, Any]:
    out = {"t": "block", "v": PROTOCOL_MAJOR, "req": m.req, "idx": m.idx, "sums": m.sums}
    if m.pk:  # written only when set: an unpacked block keeps its 1.1 bytes
        out["pk"] = True
    return out


def _e_geometry(geo: Geometry) -> dict[str, Any]:
    return {"bpb": geo.bpb, "seg": list(geo.seg)}


def _e_key_hash(khash: KeyHash) -> dict[str, Any]:
    return {"algo": khash.algo, "seed": khash.seed}


def _e_greeting(msg: Greeting) -> dict[str, Any]:
    out: dict[str, Any] = {
        "t": msg.TAG,
        "v": msg.v,
        "node": msg.node,
        "minor": msg.minor,
        "rc": msg.rc,
        "fp": msg.fp,
        "geo": _e_geometry(msg.geo),
        "khash": _e_key_hash(msg.khash),
        "caps": list(msg.caps),
    }
    if msg.limits is not None:
        lim = {
            name: value
            for name, value in (
                ("max_keys", msg.limits.max_keys),
                ("window", msg.limits.window),
                ("in_flight", msg.limits.in_flight),
            )
            if value is not None
        }
        out["limits"] = lim
    if msg.ext is not None and not msg.ext.is_empty:
        out["ext"] = msg.ext.to_wire()
    if msg.shm is not None:
        out["shm"] = {"name": msg.shm.name, "size": msg.shm.size}
    if msg.nixl is not None:
        out["nixl"] = {"agent": msg.nixl.agent, "meta": msg.nixl.meta,
                       "regions": [list(r) for r in msg.nixl.regions],
                       "slots": msg.nixl.slots, "nonce": msg.nixl.nonce}
    if msg.data is not None:
        data: dict[str, Any] = {"port": msg.data.port, "token": msg.data.token,
                                "cport": msg.data.cport}
        if msg.data.more:  # written only when set: one stream keeps its bytes
            data["more"] = list(msg.data.more)
        if msg.data.cert is not None:  # likewise (tcp-data-tls-v1)
            data["cert"] = msg.data.cert
        if msg.data.key is not None:  # likewise (tcp-data-aead-v1)
            data["key"] = msg.data.key
        out["data"] = data
    return out


def _e_fetch(m: Fetch) -> dict[str, Any]:
    out = {"t": "fetch", "v": PROTOCOL_MAJOR, "req": m.req, "keys": m.keys, "window": m.window}
    if m.shm:  # written only when set: a plain fetch keeps its 1.1 bytes
        out["shm"] = True
    if m.stream:  # likewise (tcp-streams-v1)
        out["stream"] = m.stream
    return out


def _e_refuse(msg: Refuse) -> dict[str, Any]:
    out: dict[str, Any] = {
        "t": "refuse",
        "v": PROTOCOL_MAJOR,
        "code": int(msg.code),
        "msg": msg.msg,
        "reasons": [r.to_wire() for r in msg.reasons],
    }
    if msg.node is not None:
        out["node"] = msg.node
    if msg.rc is not None:
        out["rc"] = msg.rc
    if msg.fp is not None:
        out["fp"] = msg.fp
    if msg.geo is not None:
        out["geo"] = _e_geometry(msg.geo)
    if msg.khash is not None:
        out["khash"] = _e_key_hash(msg.khash)
    if msg.ext is not None and not msg.ext.is_empty:
        out["ext"] = msg.ext.to_wire()
    return out


_ENCODERS: Final[dict[type, Callable[[Any], dict[str, Any]]]] = {
    Hello: _e_greeting,
    Welcome: _e_greeting,
    Refuse: _e_refuse,
    Lookup: lambda m: {"t": "lookup", "v": PROTOCOL_MAJOR, "req": m.req, "keys": m.keys},
    Hits: lambda m: {"t": "hits", "v": PROTOCOL_MAJOR, "req": m.req, "hits": m.hits,
                     **({} if m.due is None else {"due": m.due})},
    Fetch: _e_fetch,
    Credit: lambda m: {"t": "credit", "v": PROTOCOL_MAJOR, "req": m.req, "n": m.n},
    Block: _e_block,
    Done: lambda m: {"t": "done", "v": PROTOCOL_MAJOR, "req": m.req, "outcomes": m.outcomes},
    Abort: lambda m: {"t": "abort", "v": PROTOCOL_MAJOR, "req": m.req},
    AbortAck: lambda m: {"t": "abort_ack", "v": PROTOCOL_MAJOR, "req": m.req},
    Ping: lambda m: {"t": "ping", "v": PROTOCOL_MAJOR, "nonce": m.nonce},
    Pong: lambda m: {"t": "pong", "v": PROTOCOL_MAJOR, "nonce": m.nonce},
    Bye: lambda m: {"t": "bye", "v": PROTOCOL_MAJOR, "code": int(m.code), "msg": m.msg},
    Error: lambda m: {
        "t": "error", "v": PROTOCOL_MAJOR, "req": m.req, "code": int(m.code), "msg": m.msg,
    },
    Located: lambda m: {
        "t": "located", "v": PROTOCOL_MAJOR, "req": m.req, "idx": m.idx, "slots": m.slots,
        "sums": m.sums,
    },
    Release: lambda m: {"t": "release", "v": PROTOCOL_MAJOR, "req": m.req, "idx": m.idx},
    Attach: lambda m: {"t": "attach", "v": PROTOCOL_MAJOR, "nonce": m.nonce,
                       # written only for NIXL: a shared-memory attach keeps its bytes
                       **({"via": m.via} if m.via != VIA_SHM else {})},
    Attached: lambda m: {"t": "attached", "v": PROTOCOL_MAJOR, "ok": m.ok, "msg": m.msg},
}


def encode_head(msg: Message) -> bytes:
    """Frame 0 of ``msg`` (for a ``block``, without its payload frames)."""
    try:
        encoder = _ENCODERS[type(msg)]
    except KeyError:
        raise TypeError(f"not a p2pkv message: {type(msg).__name__}") from None
    packed: bytes = msgpack.packb(encoder(msg), use_bin_type=True)
    return packed


def encode(msg: Message) -> list[Frame]:
    """Every frame of ``msg``: frame 0, then a ``block``'s payload frames (not copied)."""
    head = encode_head(msg)
    if type(msg) is Block and msg.payload:
        return [head, *msg.payload]
    return [head]


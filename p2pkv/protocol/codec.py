"""Frames ⇄ typed messages: the single place where peer bytes enter (``protocol/SPEC.md``).

Decoding is here; encoding, the other direction, is :mod:`p2pkv.protocol.encoding`
(re-exported here: ``codec.encode``, ``codec.encode_head``).

:func:`decode` turns any input into a typed message or raises
:class:`p2pkv.errors.ProtocolError` with a wire code; nothing else escapes it (the fuzz
tests in ``tests/test_codec_fuzz.py`` hold it to that). Validation is by exact msgpack
type: a bool is not an int, bin is not str, and every length and value has a bound from
:mod:`p2pkv.protocol.codes`.

The hot path is one ``block`` header per block (up to ~100k/s), so each message type has
a small hand-written validator in a dispatch dict; no reflection over dataclass fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack

import p2pkv.protocol.fields as f
from p2pkv.checksum import block_checksum
from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import (
    MAX_BLOCKS_PER_MESSAGE,
    MAX_DUE_MS,
    MAX_HEAD_BYTES,
    MAX_KEYS,
    MAX_MAP_LEN,
    MAX_NODE_ID_LEN,
    MAX_REASONS,
    MAX_RUN_CONFIG_ITEMS,
    MAX_STR_LEN,
    MAX_STREAMS,
    MAX_WINDOW,
    OUTCOME_FAILED,
    PROTOCOL_MAJOR,
    U32_MAX,
    U64_MAX,
    Code,
)
from p2pkv.protocol.encoding import encode, encode_head
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
    Greeting,
    Hello,
    Hits,
    Located,
    Lookup,
    Message,
    Ping,
    Pong,
    Reason,
    Refuse,
    Release,
    Welcome,
    value_from_wire,
)
from p2pkv.protocol.payload import (
    check_block_frames,
    check_payload_sizes,
    frame_size,
    segments_for,
)

__all__ = [
    "MajorVersionMismatch",
    "block_checksum",
    "decode",
    "decode_head",
    "encode",
    "encode_head",
    "frame_size",
    "segments_for",
]


class MajorVersionMismatch(ProtocolError):
    """Frame 0 carries another protocol major (``remote_major``) and could not be read.

    Raised with code ``PROTOCOL_MAJOR_MISMATCH``. A ``hello``/``welcome``/``refuse`` of
    another major whose version-1 fields are readable is returned as a message instead
    (``Greeting.v`` holds the major), so the handshake can refuse it with reasons.
    """

    def __init__(self, remote_major: int, message: str) -> None:
        super().__init__(Code.PROTOCOL_MAJOR_MISMATCH, message)
        self.remote_major = remote_major


# ---------------------------------------------------------------------------- decoders


def _d_greeting(cls: type[Greeting], m: dict[Any, Any], v: int) -> Greeting:
    node = f.string(m, "node", 1, MAX_NODE_ID_LEN)
    minor = f.integer(m, "minor", 0, U32_MAX)
    rc = f.run_config(f.field(m, "rc"))
    fp = f.fingerprint(f.field(m, "fp"))
    geo = f.geometry(f.field(m, "geo"))
    return cls(
        node=node,
        minor=minor,
        rc=rc,
        fp=fp,
        geo=geo,
        khash=f.key_hash(f.field(m, "khash")),
        caps=f.caps(m),
        limits=f.limits(m.get("limits")),
        v=v,
        ext=f.extension(m.get("ext")),
        shm=f.shm_offer(m.get("shm")),
        data=f.data_offer(m.get("data")),
        nixl=f.nixl_offer(m.get("nixl"), geo),
    )


def _d_hello(m: dict[Any, Any], v: int) -> Message:
    return _d_greeting(Hello, m, v)  # type: ignore[return-value]


def _d_welcome(m: dict[Any, Any], v: int) -> Message:
    return _d_greeting(Welcome, m, v)  # type: ignore[return-value]


def _reason(value: object) -> Reason:
    r = f.mapping(value, "reasons[]")
    for name in ("ours", "theirs"):
        if name not in r:
            raise f.missing(f"reasons[].{name}")
    return Reason(
        code=f.code(r),
        field=f.string(r, "field", 0, MAX_STR_LEN),
        ours=value_from_wire(f.plain(r["ours"], "reasons[].ours", 0, [MAX_RUN_CONFIG_ITEMS])),
        theirs=value_from_wire(
            f.plain(r["theirs"], "reasons[].theirs", 0, [MAX_RUN_CONFIG_ITEMS])
        ),
        meaning=f.string(r, "meaning", 0, MAX_STR_LEN),
    )


def _d_refuse(m: dict[Any, Any], v: int) -> Message:
    reasons = f.array(m.get("reasons", ()), "reasons", 0, MAX_REASONS)
    return Refuse(
        code=f.code(m),
        msg=f.string(m, "msg", 0, MAX_STR_LEN),
        reasons=tuple(_reason(r) for r in reasons),
        node=None if m.get("node") is None else f.string(m, "node", 1, MAX_NODE_ID_LEN),
        rc=None if m.get("rc") is None else f.run_config(m["rc"]),
        fp=None if m.get("fp") is None else f.fingerprint(m["fp"]),
        geo=None if m.get("geo") is None else f.geometry(m["geo"]),
        khash=None if m.get("khash") is None else f.key_hash(m["khash"]),
        ext=f.extension(m.get("ext")),
    )


def _d_lookup(m: dict[Any, Any], v: int) -> Message:
    return Lookup(f.u64(m, "req"), f.keys(m))


_BOOL_ONLY: Final = frozenset({bool})


def _d_hits(m: dict[Any, Any], v: int) -> Message:
    hits = f.array(f.field(m, "hits"), "hits", 0, MAX_KEYS)
    if not set(map(type, hits)) <= _BOOL_ONLY:  # C-level pass; walk only to name the culprit
        for h in hits:
            if type(h) is not bool:
                raise f.wrong("hits[]", "a bool", h)
    due = m.get("due")
    return Hits(f.u64(m, "req"), hits, None if due is None else _due(due, hits))


def _due(value: object, hits: tuple[bool, ...]) -> tuple[int, ...]:
    """``hits.due`` (``pending-v1``): one u32 per key, 0 where the key is a hit."""
    due = f.array(value, "due", len(hits), len(hits))
    for d, hit in zip(due, hits, strict=True):
        if type(d) is not int:
            raise f.wrong("due[]", "a u32", d)
        if not 0 <= d <= MAX_DUE_MS:
            raise f.bounds("due[]", f"must be in 0..{MAX_DUE_MS}, got {d}")
        if hit and d:
            raise f.bounds("due[]", f"must be 0 for a key that is a hit, got {d}")
    return due


def _d_fetch(m: dict[Any, Any], v: int) -> Message:
    stream = f.integer(m, "stream", 0, MAX_STREAMS - 1) if "stream" in m else 0
    return Fetch(f.u64(m, "req"), f.keys(m), f.integer(m, "window", 1, MAX_WINDOW),
                 f.flag(m, "shm"), stream)


def _d_credit(m: dict[Any, Any], v: int) -> Message:
    return Credit(f.u64(m, "req"), f.integer(m, "n", 1, MAX_WINDOW))


def _d_block(m: dict[Any, Any], v: int) -> Message:
    # Fast path for the one message decoded per block: all checks inline, no calls.
    req = m.get("req")
    idx = m.get("idx")
    sums = m.get("sums")
    pk = m.get("pk", False)
    if (
        type(req) is int and 0 <= req <= U64_MAX
        and type(idx) is tuple and 0 < len(idx) <= MAX_BLOCKS_PER_MESSAGE
        and type(sums) is tuple and len(sums) == len(idx)
        and (pk is False or pk is True)
    ):
        for i in idx:
            if type(i) is not int or i < 0 or i >= MAX_KEYS:
                break
        else:
            for s in sums:
                if s is not None and (type(s) is not int or s < 0):
                    break
            else:
                return Block(req, idx, sums, (), pk)
    return _d_block_checked(m)


def _d_block_checked(m: dict[Any, Any]) -> Message:
    """The slow path of :func:`_d_block`: same rules, names the first broken one."""
    req = f.u64(m, "req")
    idx = f.array(f.field(m, "idx"), "idx", 1, MAX_BLOCKS_PER_MESSAGE)
    for i in idx:
        if type(i) is not int:
            raise f.wrong("idx[]", "an int", i)
        if i < 0 or i >= MAX_KEYS:
            raise f.bounds("idx[]", f"must be in [0, {MAX_KEYS - 1}], got {i}")
    sums = f.array(f.field(m, "sums"), "sums", len(idx), len(idx))
    for s in sums:
        if s is not None and (type(s) is not int or s < 0):
            raise f.wrong("sums[]", "nil or a u64", s)
    return Block(req, idx, sums, (), f.flag(m, "pk"))


def _d_located(m: dict[Any, Any], v: int) -> Message:
    if "pk" in m:  # a block's key, unknown to located: ignored (§3)
        m = {k: x for k, x in m.items() if k != "pk"}
    blk = _d_block(m, v)  # req, idx and sums follow the rules of a block header
    assert type(blk) is Block
    slots = f.array(f.field(m, "slots"), "slots", len(blk.idx), len(blk.idx))
    for s in slots:
        if type(s) is not int:
            raise f.wrong("slots[]", "an int", s)
        if s < 0 or s > U64_MAX:
            raise f.bounds("slots[]", f"must be a u64, got {s}")
    return Located(blk.req, blk.idx, slots, blk.sums)


def _d_release(m: dict[Any, Any], v: int) -> Message:
    return Release(f.u64(m, "req"), f.indices(m, "idx", 1, MAX_KEYS))


def _d_attach(m: dict[Any, Any], v: int) -> Message:
    return Attach(f.nonce(m), f.via(m))


def _d_attached(m: dict[Any, Any], v: int) -> Message:
    ok = f.field(m, "ok")
    if type(ok) is not bool:
        raise f.wrong("ok", "a bool", ok)
    return Attached(ok, f.string(m, "msg", 0, MAX_STR_LEN))


def _d_done(m: dict[Any, Any], v: int) -> Message:
    outcomes = f.array(f.field(m, "outcomes"), "outcomes", 1, MAX_KEYS)
    for o in outcomes:
        if type(o) is not int:
            raise f.wrong("outcomes[]", "an int", o)
        if o < 0 or o > OUTCOME_FAILED:
            raise f.bounds("outcomes[]", f"must be 0, 1 or 2, got {o}")
    return Done(f.u64(m, "req"), outcomes)


def _d_abort(m: dict[Any, Any], v: int) -> Message:
    return Abort(f.u64(m, "req"))


def _d_abort_ack(m: dict[Any, Any], v: int) -> Message:
    return AbortAck(f.u64(m, "req"))


def _d_ping(m: dict[Any, Any], v: int) -> Message:
    return Ping(f.u64(m, "nonce"))


def _d_pong(m: dict[Any, Any], v: int) -> Message:
    return Pong(f.u64(m, "nonce"))


def _d_bye(m: dict[Any, Any], v: int) -> Message:
    return Bye(f.code(m), f.string(m, "msg", 0, MAX_STR_LEN))


def _d_error(m: dict[Any, Any], v: int) -> Message:
    req = None if m.get("req") is None else f.u64(m, "req")
    return Error(req, f.code(m), f.string(m, "msg", 0, MAX_STR_LEN))


_DECODERS: Final[dict[str, Callable[[dict[Any, Any], int], Message]]] = {
    "hello": _d_hello,
    "welcome": _d_welcome,
    "refuse": _d_refuse,
    "lookup": _d_lookup,
    "hits": _d_hits,
    "fetch": _d_fetch,
    "credit": _d_credit,
    "block": _d_block,
    "done": _d_done,
    "abort": _d_abort,
    "abort_ack": _d_abort_ack,
    "ping": _d_ping,
    "pong": _d_pong,
    "bye": _d_bye,
    "error": _d_error,
    "located": _d_located,
    "release": _d_release,
    "attach": _d_attach,
    "attached": _d_attached,
}

# Messages whose version-1 fields every future major keeps readable, so that peers of
# different majors can still tell each other why they cannot talk.
_VERSION_STABLE: Final = frozenset({"hello", "welcome", "refuse"})

_UNPACK_OPTIONS: Final[dict[str, Any]] = {
    "raw": False,
    "use_list": False,
    "strict_map_key": True,
    "max_str_len": MAX_HEAD_BYTES,
    "max_bin_len": MAX_HEAD_BYTES,
    "max_array_len": MAX_KEYS,
    "max_map_len": MAX_MAP_LEN,
    "max_ext_len": 0,
}


def _unpack_head(frame0: object) -> dict[Any, Any]:
    size = frame_size(frame0)  # type: ignore[arg-type]
    if size > MAX_HEAD_BYTES:
        raise ProtocolError(Code.TOO_LARGE, f"frame 0 is {size} bytes (max {MAX_HEAD_BYTES})")
    try:
        head = msgpack.unpackb(frame0, **_UNPACK_OPTIONS)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # StackError, ExtraData, ...
        raise ProtocolError(
            Code.MALFORMED, f"frame 0 is not valid msgpack: {type(exc).__name__}: {exc}"[:300]
        ) from None
    if type(head) is not dict:
        raise ProtocolError(Code.MALFORMED, f"frame 0 must be a msgpack map, got {f.kind(head)}")
    return head


def decode_head(
    frame0: Frame,
    more_frames: int | None = None,
    segments: Sequence[int] | None = None,
) -> Message:
    """Decode frame 0 alone; a ``block`` comes back with an empty ``payload``.

    ``more_frames``, when known, is the number of frames that followed frame 0; it is
    checked against the message type (only ``block`` has payload frames) and, with
    ``segments`` (the negotiated ``geo.seg``), against ``len(idx) * len(segments)``.
    """
    head = _unpack_head(frame0)
    if "t" not in head:
        raise f.missing("t")
    tag = head["t"]
    if type(tag) is not str:
        raise f.wrong("t", "a str", tag)
    if "v" not in head:
        raise f.missing("v")
    v = head["v"]
    if type(v) is not int:
        raise f.wrong("v", "an int", v)
    decoder = _DECODERS.get(tag)
    if v != PROTOCOL_MAJOR:
        if decoder is None or tag not in _VERSION_STABLE or v < 1:
            raise MajorVersionMismatch(
                v, f"{tag[:40]!r}: protocol major {v}, this node speaks {PROTOCOL_MAJOR}"
            )
        try:
            return decoder(head, v)
        except ProtocolError as exc:
            raise MajorVersionMismatch(
                v, f"{tag}: protocol major {v} (unreadable as major {PROTOCOL_MAJOR}: "
                f"{exc.message}), this node speaks {PROTOCOL_MAJOR}"
            ) from None
    if decoder is None:
        raise ProtocolError(Code.UNKNOWN_TYPE, f"unknown message type {tag[:64]!r}")
    try:
        msg = decoder(head, v)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{tag}: {exc.message}") from None
    if type(msg) is Block:
        check_block_frames(msg, more_frames, segments)
    elif more_frames:
        raise ProtocolError(
            Code.FRAME_COUNT, f"{tag}: takes no payload frames, got {more_frames}"
        )
    return msg


def decode(
    frames: Sequence[Frame],
    segments: Sequence[int] | None = None,
) -> Message:
    """Decode one multipart message (frame 0 and its payload frames, no routing id).

    ``segments`` is the negotiated ``geo.seg``: when given, the payload frames of a
    ``block`` must be exactly ``len(idx) * len(segments)`` and each frame must have the
    size of its segment. Raises :class:`~p2pkv.errors.ProtocolError` and nothing else.
    """
    try:
        payload = tuple(frames)
    except TypeError:
        raise ProtocolError(Code.MALFORMED, "frames must be a sequence of bytes") from None
    if not payload:
        raise ProtocolError(Code.FRAME_COUNT, "a message needs at least frame 0")
    msg = decode_head(payload[0], len(payload) - 1, segments)
    if type(msg) is not Block:
        return msg
    payload = payload[1:]
    check_payload_sizes(msg, payload, segments)
    return Block(msg.req, msg.idx, msg.sums, payload, msg.pk)

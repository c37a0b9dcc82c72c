"""Frames ⇄ typed messages: the single place where peer bytes enter (``protocol/SPEC.md``).

:func:`decode` turns any input into a typed message or raises
:class:`p2pkv.errors.ProtocolError` with a wire code; nothing else escapes it (the fuzz
tests in ``tests/test_codec_fuzz.py`` hold it to that). Validation is by exact msgpack
type: a bool is not an int, bin is not str, and every length and value has a bound from
:mod:`p2pkv.protocol.codes`.

The hot path is one ``block`` header per block (up to ~100k/s), so each message type has
a small hand-written validator in a dispatch dict; no reflection over dataclass fields.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack

from p2pkv.checksum import block_checksum
from p2pkv.errors import ProtocolError
from p2pkv.keys import find_bad_key
from p2pkv.protocol.codes import (
    MAX_BLOCK_BYTES,
    MAX_BLOCKS_PER_MESSAGE,
    MAX_CAP_LEN,
    MAX_CAPS,
    MAX_CODE,
    MAX_HEAD_BYTES,
    MAX_KEY_HASH_ALGO_LEN,
    MAX_KEY_LEN,
    MAX_KEYS,
    MAX_MAP_LEN,
    MAX_NODE_ID_LEN,
    MAX_PAYLOAD_FRAMES,
    MAX_REASONS,
    MAX_RUN_CONFIG_DEPTH,
    MAX_RUN_CONFIG_ITEMS,
    MAX_SEGMENTS,
    MAX_STR_LEN,
    MAX_WINDOW,
    OUTCOME_FAILED,
    PROTOCOL_MAJOR,
    U32_MAX,
    U64_MAX,
    Code,
)
from p2pkv.protocol.messages import (
    Abort,
    AbortAck,
    AdvertisedLimits,
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
    Lookup,
    Message,
    Ping,
    Pong,
    Reason,
    Refuse,
    Welcome,
    value_from_wire,
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


# ---------------------------------------------------------------------------- helpers

_MSGPACK_NAMES: Final[dict[type, str]] = {
    type(None): "nil", bool: "bool", int: "int", float: "float", str: "str",
    bytes: "bin", tuple: "array", list: "array", dict: "map",
}


def _kind(value: object) -> str:
    return _MSGPACK_NAMES.get(type(value), "ext")


def _missing(name: str) -> ProtocolError:
    return ProtocolError(Code.MISSING_FIELD, f"missing field {name!r}")


def _wrong(name: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(Code.WRONG_TYPE, f"{name} must be {expected}, got {_kind(value)}")


def _bounds(name: str, detail: str) -> ProtocolError:
    return ProtocolError(Code.OUT_OF_BOUNDS, f"{name} {detail}")


def _field(m: dict[Any, Any], name: str) -> Any:
    try:
        return m[name]
    except KeyError:
        raise _missing(name) from None


def _int(m: dict[Any, Any], name: str, lo: int, hi: int) -> int:
    x = _field(m, name)
    if type(x) is not int:
        raise _wrong(name, "an int", x)
    if x < lo or x > hi:
        raise _bounds(name, f"must be in [{lo}, {hi}], got {x}")
    return x


def _u64(m: dict[Any, Any], name: str) -> int:
    return _int(m, name, 0, U64_MAX)


def _code(m: dict[Any, Any]) -> int:
    return _int(m, "code", 0, MAX_CODE)


def _str(m: dict[Any, Any], name: str, lo: int, hi: int) -> str:
    x = _field(m, name)
    if type(x) is not str:
        raise _wrong(name, "a str", x)
    if len(x) < lo or len(x) > hi:
        raise _bounds(name, f"length must be in [{lo}, {hi}], got {len(x)}")
    return x


def _map(value: object, name: str) -> dict[Any, Any]:
    if type(value) is not dict:
        raise _wrong(name, "a map", value)
    return value


def _array(value: object, name: str, lo: int, hi: int) -> tuple[Any, ...]:
    if type(value) is not tuple:
        raise _wrong(name, "an array", value)
    if len(value) < lo or len(value) > hi:
        raise _bounds(name, f"must have {lo}..{hi} entries, got {len(value)}")
    return value


def _keys(m: dict[Any, Any]) -> tuple[bytes, ...]:
    keys = _array(_field(m, "keys"), "keys", 1, MAX_KEYS)
    bad = find_bad_key(keys, MAX_KEY_LEN)
    if bad is None:
        return keys
    key = keys[bad[0]]
    if bad[1] == "type":
        raise _wrong("keys[]", "bin", key)
    raise _bounds("keys[]", f"length must be in [1, {MAX_KEY_LEN}], got {len(key)}")


def _plain(value: Any, name: str, depth: int, budget: list[int]) -> Any:
    """A JSON-valued msgpack value with arrays as lists; bounded depth and size."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _bounds(name, f"has more than {MAX_RUN_CONFIG_ITEMS} values")
    kind = type(value)
    if kind is str or kind is int or kind is bool or kind is float or value is None:
        return value
    if kind is tuple or kind is dict:
        if depth >= MAX_RUN_CONFIG_DEPTH:
            raise _bounds(name, f"is nested deeper than {MAX_RUN_CONFIG_DEPTH} levels")
        if kind is tuple:
            return [_plain(v, name, depth + 1, budget) for v in value]
        out: dict[str, Any] = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _wrong(f"{name} map key", "a str", k)
            out[k] = _plain(v, name, depth + 1, budget)
        return out
    raise _wrong(name, "nil, bool, int, float, str, array or map", value)


def _run_config(value: object) -> dict[str, Any]:
    rc = _map(value, "rc")
    out: dict[str, Any] = _plain(rc, "rc", 0, [MAX_RUN_CONFIG_ITEMS])
    return out


_HEX16: Final = re.compile(r"[0-9a-f]{16}")


def _fingerprint(value: object) -> str:
    if type(value) is not str:
        raise _wrong("fp", "a str", value)
    if _HEX16.fullmatch(value) is None:
        raise _bounds("fp", f"must be 16 lowercase hex digits, got {value[:32]!r}")
    return value


def _geometry(value: object) -> Geometry:
    geo = _map(value, "geo")
    bpb = _int(geo, "bpb", 1, MAX_BLOCK_BYTES)
    seg = _array(_field(geo, "seg"), "seg", 1, MAX_SEGMENTS)
    for s in seg:
        if type(s) is not int:
            raise _wrong("seg[]", "an int", s)
        if s < 1 or s > MAX_BLOCK_BYTES:
            raise _bounds("seg[]", f"must be in [1, {MAX_BLOCK_BYTES}], got {s}")
    total = sum(seg)
    if total != bpb:
        raise _bounds("seg", f"sums to {total} bytes, not bpb={bpb}")
    return Geometry(bpb, seg)


def _key_hash(value: object) -> KeyHash:
    khash = _map(value, "khash")
    return KeyHash(_str(khash, "algo", 1, MAX_KEY_HASH_ALGO_LEN), _u64(khash, "seed"))


def _caps(m: dict[Any, Any]) -> tuple[str, ...]:
    caps = _array(_field(m, "caps"), "caps", 0, MAX_CAPS)
    for cap in caps:
        if type(cap) is not str:
            raise _wrong("caps[]", "a str", cap)
        if not 0 < len(cap) <= MAX_CAP_LEN:
            raise _bounds("caps[]", f"length must be in [1, {MAX_CAP_LEN}], got {len(cap)}")
    return caps


def _optional_positive(m: dict[Any, Any], name: str, hi: int) -> int | None:
    if m.get(name) is None:
        return None
    return _int(m, name, 1, hi)


def _limits(value: object) -> AdvertisedLimits | None:
    if value is None:
        return None
    lim = _map(value, "limits")
    return AdvertisedLimits(
        max_keys=_optional_positive(lim, "max_keys", MAX_KEYS),
        window=_optional_positive(lim, "window", MAX_WINDOW),
        in_flight=_optional_positive(lim, "in_flight", U32_MAX),
    )


# ---------------------------------------------------------------------------- decoders


def _d_greeting(cls: type[Greeting], m: dict[Any, Any], v: int) -> Greeting:
    return cls(
        node=_str(m, "node", 1, MAX_NODE_ID_LEN),
        minor=_int(m, "minor", 0, U32_MAX),
        rc=_run_config(_field(m, "rc")),
        fp=_fingerprint(_field(m, "fp")),
        geo=_geometry(_field(m, "geo")),
        khash=_key_hash(_field(m, "khash")),
        caps=_caps(m),
        limits=_limits(m.get("limits")),
        v=v,
    )


def _d_hello(m: dict[Any, Any], v: int) -> Message:
    return _d_greeting(Hello, m, v)  # type: ignore[return-value]


def _d_welcome(m: dict[Any, Any], v: int) -> Message:
    return _d_greeting(Welcome, m, v)  # type: ignore[return-value]


def _reason(value: object) -> Reason:
    r = _map(value, "reasons[]")
    for name in ("ours", "theirs"):
        if name not in r:
            raise _missing(f"reasons[].{name}")
    return Reason(
        code=_code(r),
        field=_str(r, "field", 0, MAX_STR_LEN),
        ours=value_from_wire(_plain(r["ours"], "reasons[].ours", 0, [MAX_RUN_CONFIG_ITEMS])),
        theirs=value_from_wire(
            _plain(r["theirs"], "reasons[].theirs", 0, [MAX_RUN_CONFIG_ITEMS])
        ),
        meaning=_str(r, "meaning", 0, MAX_STR_LEN),
    )


def _d_refuse(m: dict[Any, Any], v: int) -> Message:
    reasons = _array(m.get("reasons", ()), "reasons", 0, MAX_REASONS)
    return Refuse(
        code=_code(m),
        msg=_str(m, "msg", 0, MAX_STR_LEN),
        reasons=tuple(_reason(r) for r in reasons),
        node=None if m.get("node") is None else _str(m, "node", 1, MAX_NODE_ID_LEN),
        rc=None if m.get("rc") is None else _run_config(m["rc"]),
        fp=None if m.get("fp") is None else _fingerprint(m["fp"]),
        geo=None if m.get("geo") is None else _geometry(m["geo"]),
        khash=None if m.get("khash") is None else _key_hash(m["khash"]),
    )


def _d_lookup(m: dict[Any, Any], v: int) -> Message:
    return Lookup(_u64(m, "req"), _keys(m))


_BOOL_ONLY: Final = frozenset({bool})


def _d_hits(m: dict[Any, Any], v: int) -> Message:
    hits = _array(_field(m, "hits"), "hits", 0, MAX_KEYS)
    if not set(map(type, hits)) <= _BOOL_ONLY:  # C-level pass; walk only to name the culprit
        for h in hits:
            if type(h) is not bool:
                raise _wrong("hits[]", "a bool", h)
    return Hits(_u64(m, "req"), hits)


def _d_fetch(m: dict[Any, Any], v: int) -> Message:
    return Fetch(_u64(m, "req"), _keys(m), _int(m, "window", 1, MAX_WINDOW))


def _d_credit(m: dict[Any, Any], v: int) -> Message:
    return Credit(_u64(m, "req"), _int(m, "n", 1, MAX_WINDOW))


def _d_block(m: dict[Any, Any], v: int) -> Message:
    # Fast path for the one message decoded per block: all checks inline, no calls.
    req = m.get("req")
    idx = m.get("idx")
    sums = m.get("sums")
    if (
        type(req) is int and 0 <= req <= U64_MAX
        and type(idx) is tuple and 0 < len(idx) <= MAX_BLOCKS_PER_MESSAGE
        and type(sums) is tuple and len(sums) == len(idx)
    ):
        for i in idx:
            if type(i) is not int or i < 0 or i >= MAX_KEYS:
                break
        else:
            for s in sums:
                if s is not None and (type(s) is not int or s < 0):
                    break
            else:
                return Block(req, idx, sums)
    return _d_block_checked(m)


def _d_block_checked(m: dict[Any, Any]) -> Message:
    """The slow path of :func:`_d_block`: same rules, names the first broken one."""
    req = _u64(m, "req")
    idx = _array(_field(m, "idx"), "idx", 1, MAX_BLOCKS_PER_MESSAGE)
    for i in idx:
        if type(i) is not int:
            raise _wrong("idx[]", "an int", i)
        if i < 0 or i >= MAX_KEYS:
            raise _bounds("idx[]", f"must be in [0, {MAX_KEYS - 1}], got {i}")
    sums = _array(_field(m, "sums"), "sums", len(idx), len(idx))
    for s in sums:
        if s is not None and (type(s) is not int or s < 0):
            raise _wrong("sums[]", "nil or a u64", s)
    return Block(req, idx, sums)


def _d_done(m: dict[Any, Any], v: int) -> Message:
    outcomes = _array(_field(m, "outcomes"), "outcomes", 1, MAX_KEYS)
    for o in outcomes:
        if type(o) is not int:
            raise _wrong("outcomes[]", "an int", o)
        if o < 0 or o > OUTCOME_FAILED:
            raise _bounds("outcomes[]", f"must be 0, 1 or 2, got {o}")
    return Done(_u64(m, "req"), outcomes)


def _d_abort(m: dict[Any, Any], v: int) -> Message:
    return Abort(_u64(m, "req"))


def _d_abort_ack(m: dict[Any, Any], v: int) -> Message:
    return AbortAck(_u64(m, "req"))


def _d_ping(m: dict[Any, Any], v: int) -> Message:
    return Ping(_u64(m, "nonce"))


def _d_pong(m: dict[Any, Any], v: int) -> Message:
    return Pong(_u64(m, "nonce"))


def _d_bye(m: dict[Any, Any], v: int) -> Message:
    return Bye(_code(m), _str(m, "msg", 0, MAX_STR_LEN))


def _d_error(m: dict[Any, Any], v: int) -> Message:
    req = None if m.get("req") is None else _u64(m, "req")
    return Error(req, _code(m), _str(m, "msg", 0, MAX_STR_LEN))


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


def frame_size(frame: Frame) -> int:
    """Size of a frame in bytes (a memoryview's ``nbytes``, not its item count).

    Raises :class:`~p2pkv.errors.ProtocolError` (``MALFORMED``) for a non-buffer.
    """
    kind = type(frame)
    if kind is bytes or kind is bytearray:
        return len(frame)
    try:
        return memoryview(frame).nbytes
    except TypeError:
        raise ProtocolError(
            Code.MALFORMED, f"a frame must be bytes-like, got {kind.__name__}"
        ) from None


def _unpack_head(frame0: object) -> dict[Any, Any]:
    size = frame_size(frame0)  # type: ignore[arg-type]
    if size > MAX_HEAD_BYTES:
        raise ProtocolError(Code.TOO_LARGE, f"frame 0 is {size} bytes (max {MAX_HEAD_BYTES})")
    try:
        head = msgpack.unpackb(frame0, **_UNPACK_OPTIONS)
    except Exception as exc:  # msgpack raises ValueError, StackError, ExtraData, ...
        raise ProtocolError(
            Code.MALFORMED, f"frame 0 is not valid msgpack: {type(exc).__name__}: {exc}"[:300]
        ) from None
    if type(head) is not dict:
        raise ProtocolError(Code.MALFORMED, f"frame 0 must be a msgpack map, got {_kind(head)}")
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
        raise _missing("t")
    tag = head["t"]
    if type(tag) is not str:
        raise _wrong("t", "a str", tag)
    if "v" not in head:
        raise _missing("v")
    v = head["v"]
    if type(v) is not int:
        raise _wrong("v", "an int", v)
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
        per_block = None if segments is None else len(segments)
        if per_block is not None and len(msg.idx) * per_block > MAX_PAYLOAD_FRAMES:
            raise ProtocolError(
                Code.OUT_OF_BOUNDS,
                f"block: {len(msg.idx)} blocks × {per_block} segments exceed "
                f"{MAX_PAYLOAD_FRAMES} payload frames",
            )
        if more_frames is not None:
            _check_block_frame_count(len(msg.idx), more_frames, per_block)
    elif more_frames:
        raise ProtocolError(
            Code.FRAME_COUNT, f"{tag}: takes no payload frames, got {more_frames}"
        )
    return msg


def _check_block_frame_count(blocks: int, frames: int, per_block: int | None) -> None:
    if per_block is not None:
        if frames != blocks * per_block:
            raise ProtocolError(
                Code.FRAME_COUNT,
                f"block: {blocks} block(s) × {per_block} segment(s) need "
                f"{blocks * per_block} payload frames, got {frames}",
            )
        return
    if frames < blocks or frames % blocks or frames // blocks > MAX_SEGMENTS:
        raise ProtocolError(
            Code.FRAME_COUNT,
            f"block: {frames} payload frames is not 1..{MAX_SEGMENTS} per block "
            f"for {blocks} block(s)",
        )


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
    except Exception:
        raise ProtocolError(Code.MALFORMED, "frames must be a sequence of bytes") from None
    if not payload:
        raise ProtocolError(Code.FRAME_COUNT, "a message needs at least frame 0")
    msg = decode_head(payload[0], len(payload) - 1, segments)
    if type(msg) is not Block:
        return msg
    payload = payload[1:]
    sizes = [frame_size(frame) for frame in payload]
    if segments is not None:
        per_block = len(segments)
        for i, got in enumerate(sizes):
            want = segments[i % per_block]
            if got != want:
                raise ProtocolError(
                    Code.FRAME_COUNT,
                    f"block: payload frame {i} (block {i // per_block}, segment "
                    f"{i % per_block}) is {got} bytes, segment size is {want}",
                )
    return Block(msg.req, msg.idx, msg.sums, payload)


def segments_for(block: Block, segments: Sequence[int]) -> tuple[int, ...]:
    """The size of each payload frame of ``block``, in wire order (block-major)."""
    return tuple(segments) * len(block.idx)


# ---------------------------------------------------------------------------- encoders


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
    return out


_ENCODERS: Final[dict[type, Callable[[Any], dict[str, Any]]]] = {
    Hello: _e_greeting,
    Welcome: _e_greeting,
    Refuse: _e_refuse,
    Lookup: lambda m: {"t": "lookup", "v": PROTOCOL_MAJOR, "req": m.req, "keys": m.keys},
    Hits: lambda m: {"t": "hits", "v": PROTOCOL_MAJOR, "req": m.req, "hits": m.hits},
    Fetch: lambda m: {
        "t": "fetch", "v": PROTOCOL_MAJOR, "req": m.req, "keys": m.keys, "window": m.window,
    },
    Credit: lambda m: {"t": "credit", "v": PROTOCOL_MAJOR, "req": m.req, "n": m.n},
    Block: lambda m: {
        "t": "block", "v": PROTOCOL_MAJOR, "req": m.req, "idx": m.idx, "sums": m.sums,
    },
    Done: lambda m: {"t": "done", "v": PROTOCOL_MAJOR, "req": m.req, "outcomes": m.outcomes},
    Abort: lambda m: {"t": "abort", "v": PROTOCOL_MAJOR, "req": m.req},
    AbortAck: lambda m: {"t": "abort_ack", "v": PROTOCOL_MAJOR, "req": m.req},
    Ping: lambda m: {"t": "ping", "v": PROTOCOL_MAJOR, "nonce": m.nonce},
    Pong: lambda m: {"t": "pong", "v": PROTOCOL_MAJOR, "nonce": m.nonce},
    Bye: lambda m: {"t": "bye", "v": PROTOCOL_MAJOR, "code": int(m.code), "msg": m.msg},
    Error: lambda m: {
        "t": "error", "v": PROTOCOL_MAJOR, "req": m.req, "code": int(m.code), "msg": m.msg,
    },
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


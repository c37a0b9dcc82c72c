"""Field readers for the decoder: exact msgpack types, bounded lengths and values.

Each reader takes a decoded msgpack value (or a map and a field name) and returns the
typed value or raises :class:`p2pkv.errors.ProtocolError` with the wire code that names
the problem (``MISSING_FIELD``, ``WRONG_TYPE``, ``OUT_OF_BOUNDS``). Used only by
:mod:`p2pkv.protocol.codec`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

from p2pkv.errors import ProtocolError
from p2pkv.identity import EXTENSION_FIELDS, IdentityExtension
from p2pkv.keys import find_bad_key
from p2pkv.protocol.codes import (
    CERT_PIN_LEN,
    DATA_KEY_LEN,
    DATA_TOKEN_LEN,
    MAX_BLOCK_BYTES,
    MAX_CAP_LEN,
    MAX_CAPS,
    MAX_CODE,
    MAX_KEY_HASH_ALGO_LEN,
    MAX_KEY_LEN,
    MAX_KEYS,
    MAX_NIXL_AGENT_LEN,
    MAX_NIXL_META,
    MAX_RUN_CONFIG_DEPTH,
    MAX_RUN_CONFIG_ITEMS,
    MAX_SEGMENTS,
    MAX_STREAMS,
    MAX_WINDOW,
    SHM_NAME_PATTERN,
    SHM_NONCE_LEN,
    U32_MAX,
    U64_MAX,
    VIA_NIXL,
    VIA_SHM,
    Code,
)
from p2pkv.protocol.messages import (
    AdvertisedLimits,
    DataOffer,
    Geometry,
    KeyHash,
    NixlOffer,
    ShmOffer,
)

_MSGPACK_NAMES: Final[dict[type, str]] = {
    type(None): "nil", bool: "bool", int: "int", float: "float", str: "str",
    bytes: "bin", tuple: "array", list: "array", dict: "map",
}


def kind(value: object) -> str:
    return _MSGPACK_NAMES.get(type(value), "ext")


def missing(name: str) -> ProtocolError:
    return ProtocolError(Code.MISSING_FIELD, f"missing field {name!r}")


def wrong(name: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(Code.WRONG_TYPE, f"{name} must be {expected}, got {kind(value)}")


def bounds(name: str, detail: str) -> ProtocolError:
    return ProtocolError(Code.OUT_OF_BOUNDS, f"{name} {detail}")


def field(m: dict[Any, Any], name: str) -> Any:
    try:
        return m[name]
    except KeyError:
        raise missing(name) from None


def integer(m: dict[Any, Any], name: str, lo: int, hi: int) -> int:
    x = field(m, name)
    if type(x) is not int:
        raise wrong(name, "an int", x)
    if x < lo or x > hi:
        raise bounds(name, f"must be in [{lo}, {hi}], got {x}")
    return x


def u64(m: dict[Any, Any], name: str) -> int:
    return integer(m, name, 0, U64_MAX)


def code(m: dict[Any, Any]) -> int:
    return integer(m, "code", 0, MAX_CODE)


def string(m: dict[Any, Any], name: str, lo: int, hi: int) -> str:
    x = field(m, name)
    if type(x) is not str:
        raise wrong(name, "a str", x)
    if len(x) < lo or len(x) > hi:
        raise bounds(name, f"length must be in [{lo}, {hi}], got {len(x)}")
    return x


def mapping(value: object, name: str) -> dict[Any, Any]:
    if type(value) is not dict:
        raise wrong(name, "a map", value)
    return value


def array(value: object, name: str, lo: int, hi: int) -> tuple[Any, ...]:
    if type(value) is not tuple:
        raise wrong(name, "an array", value)
    if len(value) < lo or len(value) > hi:
        raise bounds(name, f"must have {lo}..{hi} entries, got {len(value)}")
    return value


def keys(m: dict[Any, Any]) -> tuple[bytes, ...]:
    keys = array(field(m, "keys"), "keys", 1, MAX_KEYS)
    bad = find_bad_key(keys, MAX_KEY_LEN)
    if bad is None:
        return keys
    key = keys[bad[0]]
    if bad[1] == "type":
        raise wrong("keys[]", "bin", key)
    raise bounds("keys[]", f"length must be in [1, {MAX_KEY_LEN}], got {len(key)}")


def plain(value: Any, name: str, depth: int, budget: list[int]) -> Any:
    """A JSON-valued msgpack value with arrays as lists; bounded depth and size."""
    budget[0] -= 1
    if budget[0] < 0:
        raise bounds(name, f"has more than {MAX_RUN_CONFIG_ITEMS} values")
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is float:
        if not math.isfinite(value):
            # JSON has no NaN or infinity; NaN is not even equal to itself, so a run
            # config holding one could never be compared, hashed or restated.
            raise bounds(name, f"holds a non-finite float ({value!r}), which JSON cannot carry")
        return value
    if kind is tuple or kind is dict:
        if depth >= MAX_RUN_CONFIG_DEPTH:
            raise bounds(name, f"is nested deeper than {MAX_RUN_CONFIG_DEPTH} levels")
        if kind is tuple:
            return [plain(v, name, depth + 1, budget) for v in value]
        out: dict[str, Any] = {}
        for k, v in value.items():
            if type(k) is not str:
                raise wrong(f"{name} map key", "a str", k)
            out[k] = plain(v, name, depth + 1, budget)
        return out
    raise wrong(name, "nil, bool, int, float, str, array or map", value)


def run_config(value: object) -> dict[str, Any]:
    rc = mapping(value, "rc")
    out: dict[str, Any] = plain(rc, "rc", 0, [MAX_RUN_CONFIG_ITEMS])
    return out


_HEX16: Final = re.compile(r"[0-9a-f]{16}")


def fingerprint(value: object) -> str:
    if type(value) is not str:
        raise wrong("fp", "a str", value)
    if _HEX16.fullmatch(value) is None:
        raise bounds("fp", f"must be 16 lowercase hex digits, got {value[:32]!r}")
    return value


def geometry(value: object) -> Geometry:
    geo = mapping(value, "geo")
    bpb = integer(geo, "bpb", 1, MAX_BLOCK_BYTES)
    seg = array(field(geo, "seg"), "seg", 1, MAX_SEGMENTS)
    for s in seg:
        if type(s) is not int:
            raise wrong("seg[]", "an int", s)
        if s < 1 or s > MAX_BLOCK_BYTES:
            raise bounds("seg[]", f"must be in [1, {MAX_BLOCK_BYTES}], got {s}")
    total = sum(seg)
    if total != bpb:
        raise bounds("seg", f"sums to {total} bytes, not bpb={bpb}")
    return Geometry(bpb, seg)


def key_hash(value: object) -> KeyHash:
    khash = mapping(value, "khash")
    return KeyHash(string(khash, "algo", 1, MAX_KEY_HASH_ALGO_LEN), u64(khash, "seed"))


def caps(m: dict[Any, Any]) -> tuple[str, ...]:
    caps = array(field(m, "caps"), "caps", 0, MAX_CAPS)
    for cap in caps:
        if type(cap) is not str:
            raise wrong("caps[]", "a str", cap)
        if not 0 < len(cap) <= MAX_CAP_LEN:
            raise bounds("caps[]", f"length must be in [1, {MAX_CAP_LEN}], got {len(cap)}")
    return caps


def extension(value: object) -> IdentityExtension | None:
    """The ``ext`` map (protocol 1.1): absent, nil or empty all mean "nothing declared".

    Unknown keys are ignored like any minor-version addition; a known key must be a str
    that :class:`~p2pkv.identity.IdentityExtension` accepts.
    """
    if value is None:
        return None
    ext = mapping(value, "ext")
    declared: dict[str, str] = {}
    for name in EXTENSION_FIELDS:
        if name in ext:
            item = ext[name]
            if type(item) is not str:
                raise wrong(f"ext.{name}", "a str", item)
            declared[name] = item
    if not declared:
        return None
    try:
        return IdentityExtension(**declared)
    except ValueError as exc:
        raise bounds("ext:", str(exc)[:300]) from None


def optional_positive(m: dict[Any, Any], name: str, hi: int) -> int | None:
    if m.get(name) is None:
        return None
    return integer(m, name, 1, hi)


def limits(value: object) -> AdvertisedLimits | None:
    if value is None:
        return None
    lim = mapping(value, "limits")
    return AdvertisedLimits(
        max_keys=optional_positive(lim, "max_keys", MAX_KEYS),
        window=optional_positive(lim, "window", MAX_WINDOW),
        in_flight=optional_positive(lim, "in_flight", U32_MAX),
    )


def flag(m: dict[Any, Any], name: str) -> bool:
    """An optional bool: absent or nil is False."""
    x = m.get(name)
    if x is None:
        return False
    if type(x) is not bool:
        raise wrong(name, "a bool", x)
    return x


_SHM_NAME: Final = re.compile(SHM_NAME_PATTERN)


def shm_offer(value: object) -> ShmOffer | None:
    """``welcome.shm`` (capability ``shm-v1``): absent or nil is no offer."""
    if value is None:
        return None
    shm = mapping(value, "shm")
    name = string(shm, "name", 1, 255)
    if _SHM_NAME.fullmatch(name) is None:
        raise bounds("shm.name", f"must be a plain shm name ({SHM_NAME_PATTERN}), "
                     f"got {name[:64]!r}")
    return ShmOffer(name, integer(shm, "size", 1, U64_MAX))


def data_offer(value: object) -> DataOffer | None:
    """``welcome.data`` (capability ``tcp-data-v1``): absent or nil is no offer."""
    if value is None:
        return None
    data = mapping(value, "data")
    token = field(data, "token")
    if type(token) is not bytes:
        raise wrong("data.token", "bin", token)
    if len(token) != DATA_TOKEN_LEN:
        raise bounds("data.token", f"must be {DATA_TOKEN_LEN} bytes, got {len(token)}")
    more = data.get("more", ())
    if type(more) is not tuple:  # msgpack arrays decode as tuples
        raise wrong("data.more", "an array", more)
    if len(more) > MAX_STREAMS - 1:
        raise bounds("data.more", f"at most {MAX_STREAMS - 1} tokens, got {len(more)}")
    for extra in more:
        if type(extra) is not bytes:
            raise wrong("data.more[]", "bin", extra)
        if len(extra) != DATA_TOKEN_LEN:
            raise bounds("data.more[]", f"must be {DATA_TOKEN_LEN} bytes, got {len(extra)}")
    return DataOffer(integer(data, "port", 1, 65535), token, integer(data, "cport", 1, 65535),
                     tuple(more), _fixed_bin(data, "cert", CERT_PIN_LEN),
                     _fixed_bin(data, "key", DATA_KEY_LEN))


def nixl_offer(value: object, geo: Geometry) -> NixlOffer | None:
    """``welcome.nixl`` (capability ``nixl-v1``): absent or nil is no offer. One region
    per segment of ``geo``, each large enough for ``slots`` of its segments, and no
    region that wraps past the end of a 64-bit address space (SPEC §20.2)."""
    if value is None:
        return None
    nixl = mapping(value, "nixl")
    agent = string(nixl, "agent", 1, MAX_NIXL_AGENT_LEN)
    meta = field(nixl, "meta")
    if type(meta) is not bytes:
        raise wrong("nixl.meta", "bin", meta)
    if not 1 <= len(meta) <= MAX_NIXL_META:
        raise bounds("nixl.meta", f"must be 1..{MAX_NIXL_META} bytes, got {len(meta)}")
    slots = integer(nixl, "slots", 1, U64_MAX)
    raw = array(field(nixl, "regions"), "nixl.regions", 1, MAX_SEGMENTS)
    if len(raw) != len(geo.seg):
        raise bounds("nixl.regions", f"must have one entry per geo.seg segment "
                     f"({len(geo.seg)}), got {len(raw)}")
    regions = []
    for entry, seg in zip(raw, geo.seg, strict=True):
        pair = array(entry, "nixl.regions[]", 2, 2)
        if any(type(x) is not int for x in pair):
            raise wrong("nixl.regions[]", "two ints", entry)
        addr, size = pair
        if not (0 <= addr <= U64_MAX and 1 <= size <= U64_MAX) or addr + size > U64_MAX + 1:
            raise bounds("nixl.regions[]", f"must be an address and a size inside a 64-bit "
                         f"address space, got {entry!r}")
        if size < slots * seg:
            raise bounds("nixl.regions[]", f"a region of {size} bytes cannot hold {slots} "
                         f"segments of {seg} bytes")
        regions.append((addr, size))
    return NixlOffer(agent, meta, tuple(regions), slots, integer(nixl, "nonce", 0, U64_MAX))


def via(m: dict[Any, Any]) -> str:
    """``attach.via``: absent or nil is ``shm-v1``."""
    value = m.get("via")
    if value is None:
        return VIA_SHM
    if type(value) is not str:
        raise wrong("via", "a str", value)
    if value not in (VIA_SHM, VIA_NIXL):
        raise bounds("via", f"must be {VIA_SHM!r} or {VIA_NIXL!r}, got {value[:64]!r}")
    return value


def _fixed_bin(data: dict[Any, Any], name: str, size: int) -> bytes | None:
    """``data.<name>``, absent or bin of exactly ``size`` bytes (``cert``, ``key``)."""
    value = data.get(name)
    if value is None:
        return None
    if type(value) is not bytes:
        raise wrong(f"data.{name}", "bin", value)
    if len(value) != size:
        raise bounds(f"data.{name}", f"must be {size} bytes, got {len(value)}")
    return value


def nonce(m: dict[Any, Any]) -> bytes:
    x = field(m, "nonce")
    if type(x) is not bytes:
        raise wrong("nonce", "bin", x)
    if len(x) != SHM_NONCE_LEN:
        raise bounds("nonce", f"must be {SHM_NONCE_LEN} bytes, got {len(x)}")
    return x


def indices(m: dict[Any, Any], name: str, lo: int, hi: int) -> tuple[int, ...]:
    """An array of ``lo..hi`` ints, each a key index in [0, MAX_KEYS)."""
    out = array(field(m, name), name, lo, hi)
    for i in out:
        if type(i) is not int:
            raise wrong(f"{name}[]", "an int", i)
        if i < 0 or i >= MAX_KEYS:
            raise bounds(f"{name}[]", f"must be in [0, {MAX_KEYS - 1}], got {i}")
    return out

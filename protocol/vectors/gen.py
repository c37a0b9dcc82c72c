"""Generate the golden vectors in this folder: ``python protocol/vectors/gen.py``.

The frames are packed here with plain ``msgpack`` from hand-written wire maps, and the
expected decoded messages are written out from those maps, never by calling the p2pkv
codec, so ``tests/test_protocol_vectors.py`` is a real cross-check of the decoder. The
identity vectors build the canonical JSON by hand (``json.dumps(sort_keys=True,
separators=(",", ":"))`` + SHA-256) rather than calling ``RunConfig``. The block-key and
fill vectors are computed here with plain ``xxhash`` and integer arithmetic from the text
of SPEC §15 and Appendix A, never by calling ``p2pkv.keys`` or ``p2pkv.fill``. The sealed
stream's vectors (SPEC §18.8) are computed with HMAC-SHA256 and ``cryptography``'s HKDF and
AES-GCM from the text of §18.8, never by calling ``p2pkv.protocol.seal``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path
from typing import Any

import msgpack
import xxhash
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

HERE = Path(__file__).resolve().parent

# Codes as numbers on purpose: the vectors pin the wire values (see SPEC.md, "Codes").
MALFORMED, MISSING_FIELD, WRONG_TYPE, OUT_OF_BOUNDS = 200, 201, 202, 203
UNKNOWN_TYPE, FRAME_COUNT, TOO_LARGE, MAJOR_MISMATCH = 204, 206, 207, 103


def pack(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def jsonable(value: Any) -> Any:
    """The JSON form used by the vectors: bin as {"bin": hex}, arrays as lists."""
    if isinstance(value, (bytes, bytearray)):
        return {"bin": bytes(value).hex()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def rc_of(fields: dict[str, Any]) -> tuple[dict[str, Any], str]:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return fields, hashlib.sha256(text.encode()).hexdigest()[:16]


# tcp-data-aead-v1 (SPEC 18.8): the session secret of the sealed welcome in
# datachannel.json, and its first token, from which sealed.json derives its keys.
SEAL_SECRET = bytes(range(32))
SEAL_TOKEN = bytes(range(0xA0, 0xB0))

BASE_RC = {
    "model_name": "m", "tokens_per_hash": 16, "blocks_per_file": 1, "tp_size": 1,
    "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "dtype": "float16",
    "kv_cache_groups": [], "inference_engine": "vllm",
}
def sha16(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# SPEC 1.4, model_overrides: the canonical text is written out by hand here.
OVERRIDES_CANONICAL = ('{"kv_cache_dtype":"fp8_e4m3","rope_scaling":{"factor":8,'
                       '"rope_type":"llama3"},"rope_theta":500000}')
OVERRIDES_DIGEST = sha16(OVERRIDES_CANONICAL)
V1_RC, V1_FP = rc_of(dict(BASE_RC))
V2_RC, V2_FP = rc_of({**BASE_RC, "parallel_agnostic": False})
CHECKSUM = "checksum-xxh3-64"


def greeting(tag: str, node: str, rc: dict[str, Any], fp: str, seg: list[int],
             minor: int = 0, **extra: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "t": tag, "v": 1, "node": node, "minor": minor, "rc": rc, "fp": fp,
        "geo": {"bpb": sum(seg), "seg": seg}, "khash": {"algo": "xxh3-128", "seed": 0},
        "caps": [CHECKSUM],
    }
    m.update(extra)
    return m


def expected(wire: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    fields = {k: v for k, v in wire.items() if k not in ("t", "v")}
    if wire["t"] in ("hello", "welcome", "refuse"):
        fields.setdefault("ext", None)  # protocol 1.1: no ext map = nothing declared
    if wire["t"] in ("hello", "welcome"):
        fields.setdefault("shm", None)  # shm-v1 (section 16): no segment offered
        fields.setdefault("data", None)  # tcp-data-v1 (section 18): no stream offered
        fields.setdefault("nixl", None)  # nixl-v1 (section 20): no NIXL pool offered
        if isinstance(fields["data"], dict):  # 18.6: one stream; 18.7: no pin; 18.8
            fields["data"] = {**fields["data"], "more": fields["data"].get("more", []),
                              "cert": fields["data"].get("cert"),
                              "key": fields["data"].get("key")}  # 18.8: no secret
    if wire["t"] == "attach":
        fields.setdefault("via", "shm-v1")  # nixl-v1 (section 20): absent = the segment
    if wire["t"] == "hits":
        fields.setdefault("due", None)  # pending-v1 (section 19): nothing pending
    if wire["t"] == "fetch":
        fields.setdefault("shm", False)  # shm-v1: absent = served with block messages
        fields.setdefault("stream", 0)  # tcp-streams-v1: absent = the first stream
    fields.update(overrides)
    return {"type": wire["t"], "fields": jsonable(fields)}


def message_vectors() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, wire: dict[str, Any], exp: dict[str, Any],
            payload: list[bytes] | None = None, segments: list[int] | None = None) -> None:
        frames = [pack(wire), *(payload or [])]
        out.append({"name": name, "frames": [f.hex() for f in frames],
                    "segments": segments, "message": exp})

    h = greeting("hello", "node-a", V1_RC, V1_FP, [589824],
                 limits={"max_keys": 4096, "window": 64})
    add("hello_v1_cross_layer", h,
        expected(h, limits={"max_keys": 4096, "window": 64, "in_flight": None}, v=1))
    h2 = greeting("hello", "node-b", V2_RC, V2_FP, [49152] * 12, caps=[])
    add("hello_v2_per_layer_no_limits", h2, expected(h2, limits=None, v=1))
    w = greeting("welcome", "node-b", V1_RC, V1_FP, [589824])
    add("welcome", w, expected(w, limits=None, v=1))
    h_future = greeting("hello", "node-c", V1_RC, V1_FP, [4096], v=2, extra_field=[1, 2])
    exp = expected(h_future, limits=None, v=2)
    del exp["fields"]["extra_field"]
    add("hello_other_major_still_readable", h_future, exp)
    reasons = [
        {"code": 100, "field": "fingerprint", "ours": V2_FP, "theirs": V1_FP,
         "meaning": "run configurations differ"},
        {"code": 100, "field": "run_config.parallel_agnostic", "ours": False,
         "theirs": {"absent": True},
         "meaning": "V2 per-layer (parallel-specific) vs V1 cross-layer (parallel-agnostic) "
                    "layout"},
        {"code": 105, "field": "geometry.segments", "ours": [49152] * 12, "theirs": [589824],
         "meaning": "V2 per-layer (12 × 49152-byte segments) vs V1 cross-layer "
                    "(one 589824-byte segment)"},
    ]
    r = {"t": "refuse", "v": 1, "code": 100, "msg": "refused", "reasons": reasons,
         "node": "node-b", "rc": V2_RC, "fp": V2_FP,
         "geo": {"bpb": 589824, "seg": [49152] * 12}, "khash": {"algo": "xxh3-128", "seed": 0}}
    add("refuse_v2_refuses_v1", r, expected(r))
    r_min = {"t": "refuse", "v": 1, "code": 103, "msg": "major"}
    add("refuse_minimal", r_min, expected(r_min, reasons=[], node=None, rc=None, fp=None,
                                          geo=None, khash=None))
    # Protocol 1.1: the identity extension. The hellos above (minor 0, no ext) are what a
    # 1.0 peer sends; these carry an ext map.
    ext = {"kv_memory_layout": "NHD", "model_revision": "5f2b1c0", "model_overrides":
           OVERRIDES_DIGEST, "key_hash": "sha256:" + sha16("vllm-none-hash"),
           "engine": "vllm 0.32.0"}
    h11 = greeting("hello", "node-a", V2_RC, V2_FP, [49152] * 12, minor=1, ext=ext)
    add("hello_1_1_identity_extension", h11, expected(h11, limits=None, v=1))
    h11b = greeting("hello", "node-a", V2_RC, V2_FP, [49152] * 12, minor=1,
                    ext={"kv_memory_layout": "lbhnc", "x-future": [1]})
    add("hello_ext_alias_folded_unknown_key_ignored", h11b,
        expected(h11b, limits=None, v=1, ext={"kv_memory_layout": "HND"}))
    h11c = greeting("hello", "node-a", V2_RC, V2_FP, [49152] * 12, minor=1, ext={})
    add("hello_ext_empty_declares_nothing", h11c, expected(h11c, limits=None, v=1, ext=None))
    # Only entries this version does not know: nothing declared, as for an empty map.
    h11d = greeting("hello", "node-a", V2_RC, V2_FP, [49152] * 12, minor=1,
                    ext={"x-future": "NHD", "x-other": [1]})
    add("hello_ext_only_unknown_entries_declares_nothing", h11d,
        expected(h11d, limits=None, v=1, ext=None))
    # "Printable" is Unicode's (section 1.4): letters outside ASCII and inner spaces pass.
    h11e = greeting("hello", "node-a", V2_RC, V2_FP, [49152] * 12, minor=1,
                    ext={"model_revision": "révision 5 \U0001f600"})
    add("hello_ext_unicode_revision", h11e, expected(h11e, limits=None, v=1))
    # Bounds count characters, not UTF-8 bytes: 256 characters of 2 bytes each pass.
    h11f = greeting("hello", "node-a", V2_RC, V2_FP, [49152] * 12, minor=1,
                    ext={"model_revision": "é" * 256})
    add("hello_ext_revision_256_chars_512_bytes", h11f, expected(h11f, limits=None, v=1))
    ext_reasons = [
        {"code": 109, "field": "ext.kv_memory_layout", "ours": "HND", "theirs": "NHD",
         "meaning": "block bytes are ordered differently in memory"},
        {"code": 113, "field": "ext.model_revision", "ours": "5f2b1c0",
         "theirs": {"absent": True}, "meaning": "only one side declares the weights revision"},
    ]
    r_ext = {"t": "refuse", "v": 1, "code": 109, "msg": "refused", "reasons": ext_reasons,
             "node": "node-b", "rc": V2_RC, "fp": V2_FP,
             "geo": {"bpb": 589824, "seg": [49152] * 12},
             "khash": {"algo": "xxh3-128", "seed": 0},
             "ext": {"kv_memory_layout": "HND", "model_revision": "5f2b1c0"}}
    add("refuse_hnd_refuses_nhd_equal_fingerprints", r_ext, expected(r_ext))
    lk = {"t": "lookup", "v": 1, "req": 7, "keys": [b"\x01" * 20, b"\xff" * 64]}
    add("lookup", lk, expected(lk))
    lk2 = {"t": "lookup", "v": 1, "req": 8, "keys": [b"k"], "priority": "high"}
    add("lookup_unknown_field_ignored", lk2, expected(lk2) | {"fields": jsonable(
        {"req": 8, "keys": [b"k"]})})
    hi = {"t": "hits", "v": 1, "req": 7, "hits": [True, False]}
    add("hits", hi, expected(hi))
    hi0 = {"t": "hits", "v": 1, "req": 2**64 - 1, "hits": []}
    add("hits_empty_max_req", hi0, expected(hi0))
    # pending-v1 (section 19): the third key is being computed, held in about 1.5 s.
    hid = {"t": "hits", "v": 1, "req": 7, "hits": [True, False, False],
           "due": [0, 0, 1500]}
    add("hits_pending_due", hid, expected(hid))
    hin = {"t": "hits", "v": 1, "req": 7, "hits": [False], "due": None}
    add("hits_due_nil_is_absent", hin, expected(hin))
    fe = {"t": "fetch", "v": 1, "req": 9, "keys": [b"a", b"b", b"c"], "window": 16}
    add("fetch", fe, expected(fe))
    cr = {"t": "credit", "v": 1, "req": 9, "n": 3}
    add("credit", cr, expected(cr))
    payload = [b"\x00" * 8, b"\x01" * 4, b"\x02" * 8, b"\x03" * 4]
    bl = {"t": "block", "v": 1, "req": 9, "idx": [0, 2], "sums": [1, 2**64 - 1]}
    add("block_two_blocks_two_segments", bl,
        expected(bl, payload=[{"bin": p.hex()} for p in payload]), payload, [8, 4])
    bl2 = {"t": "block", "v": 1, "req": 9, "idx": [1], "sums": [None]}
    add("block_no_checksum_unknown_segments", bl2,
        expected(bl2, payload=[{"bin": "aa"}]), [b"\xaa"], None)
    dn = {"t": "done", "v": 1, "req": 9, "outcomes": [0, 1, 2]}
    add("done", dn, expected(dn))
    for tag in ("abort", "abort_ack"):
        m = {"t": tag, "v": 1, "req": 9}
        add(tag, m, expected(m))
    for tag in ("ping", "pong"):
        m = {"t": tag, "v": 1, "nonce": 12345678901234567890}
        add(tag, m, expected(m))
    by = {"t": "bye", "v": 1, "code": 300, "msg": ""}
    add("bye", by, expected(by))
    er = {"t": "error", "v": 1, "req": None, "code": 204, "msg": "unknown message type"}
    add("error_no_request", er, expected(er))
    er2 = {"t": "error", "v": 1, "req": 5, "code": 210, "msg": "too many"}
    add("error_for_request", er2, expected(er2))
    return out


def error_vectors() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, frames: list[bytes], code: int,
            segments: list[int] | None = None) -> None:
        out.append({"name": name, "frames": [f.hex() for f in frames],
                    "segments": segments, "code": code})

    def m(**kw: Any) -> bytes:
        return pack(kw)

    lookup = {"t": "lookup", "v": 1, "req": 1, "keys": [b"k"]}
    add("no_frames", [], FRAME_COUNT)
    add("empty_frame", [b""], MALFORMED)
    add("not_msgpack", [b"\xc1"], MALFORMED)
    add("truncated", [pack(lookup)[:-1]], MALFORMED)
    add("trailing_bytes", [pack(lookup) + b"\x00"], MALFORMED)
    add("not_a_map", [pack([1, 2, 3])], MALFORMED)
    add("int_map_key", [b"\x81\x01\x02"], MALFORMED)
    add("ext_type", [pack({"t": "ping", "v": 1, "nonce": msgpack.ExtType(1, b"x")})],
        MALFORMED)
    add("missing_t", [m(v=1, req=1)], MISSING_FIELD)
    add("t_is_bin", [m(t=b"ping", v=1, nonce=1)], WRONG_TYPE)
    add("missing_v", [m(t="ping", nonce=1)], MISSING_FIELD)
    add("v_is_bool", [m(t="ping", v=True, nonce=1)], WRONG_TYPE)
    add("other_major_lookup", [m(t="lookup", v=2, req=1, keys=[b"k"])], MAJOR_MISMATCH)
    add("other_major_unreadable_hello", [m(t="hello", v=2, node=1)], MAJOR_MISMATCH)
    add("unknown_type", [m(t="teleport", v=1)], UNKNOWN_TYPE)
    add("missing_req", [m(t="lookup", v=1, keys=[b"k"])], MISSING_FIELD)
    add("req_negative", [m(t="abort", v=1, req=-1)], OUT_OF_BOUNDS)
    add("req_bool", [m(t="abort", v=1, req=True)], WRONG_TYPE)
    add("req_float", [m(t="abort", v=1, req=1.0)], WRONG_TYPE)
    add("key_is_str", [m(t="lookup", v=1, req=1, keys=["k"])], WRONG_TYPE)
    add("key_empty", [m(t="lookup", v=1, req=1, keys=[b""])], OUT_OF_BOUNDS)
    add("key_too_long", [m(t="lookup", v=1, req=1, keys=[b"x" * 65])], OUT_OF_BOUNDS)
    add("no_keys", [m(t="lookup", v=1, req=1, keys=[])], OUT_OF_BOUNDS)
    add("too_many_keys", [m(t="lookup", v=1, req=1, keys=[b"k"] * 16385)], MALFORMED)
    add("keys_not_array", [m(t="fetch", v=1, req=1, keys=b"k", window=1)], WRONG_TYPE)
    add("hit_is_int", [m(t="hits", v=1, req=1, hits=[1])], WRONG_TYPE)
    # pending-v1 (section 19): due has one u32 per key, 0 for every hit.
    add("due_shorter_than_hits", [m(t="hits", v=1, req=1, hits=[False, False],
                                    due=[5])], OUT_OF_BOUNDS)
    add("due_entry_is_float", [m(t="hits", v=1, req=1, hits=[False], due=[1.5])],
        WRONG_TYPE)
    add("due_entry_above_u32", [m(t="hits", v=1, req=1, hits=[False], due=[2**32])],
        OUT_OF_BOUNDS)
    add("due_for_a_hit", [m(t="hits", v=1, req=1, hits=[True], due=[10])], OUT_OF_BOUNDS)
    add("due_not_an_array", [m(t="hits", v=1, req=1, hits=[False], due=10)], WRONG_TYPE)
    add("window_zero", [m(t="fetch", v=1, req=1, keys=[b"k"], window=0)], OUT_OF_BOUNDS)
    add("credit_zero", [m(t="credit", v=1, req=1, n=0)], OUT_OF_BOUNDS)
    add("done_outcome_3", [m(t="done", v=1, req=1, outcomes=[3])], OUT_OF_BOUNDS)
    add("block_sums_length", [m(t="block", v=1, req=1, idx=[0, 1], sums=[1]), b"a", b"b"],
        OUT_OF_BOUNDS)
    add("block_no_idx", [m(t="block", v=1, req=1, idx=[], sums=[])], OUT_OF_BOUNDS)
    add("block_sum_is_str", [m(t="block", v=1, req=1, idx=[0], sums=["x"]), b"a"], WRONG_TYPE)
    add("block_without_payload", [m(t="block", v=1, req=1, idx=[0], sums=[None])], FRAME_COUNT)
    add("block_frame_count_vs_segments",
        [m(t="block", v=1, req=1, idx=[0], sums=[None]), b"a" * 8], FRAME_COUNT, [8, 4])
    add("block_frame_size_vs_segments",
        [m(t="block", v=1, req=1, idx=[0], sums=[None]), b"a" * 8, b"b" * 5], FRAME_COUNT,
        [8, 4])
    add("payload_on_ping", [m(t="ping", v=1, nonce=1), b"x"], FRAME_COUNT)
    hello = greeting("hello", "n", V1_RC, V1_FP, [4096])
    add("hello_fp_uppercase", [pack({**hello, "fp": V1_FP.upper()})], OUT_OF_BOUNDS)
    add("hello_fp_short", [pack({**hello, "fp": V1_FP[:15]})], OUT_OF_BOUNDS)
    add("hello_seg_sum", [pack({**hello, "geo": {"bpb": 4096, "seg": [4095]}})], OUT_OF_BOUNDS)
    add("hello_seg_empty", [pack({**hello, "geo": {"bpb": 4096, "seg": []}})], OUT_OF_BOUNDS)
    add("hello_node_too_long", [pack({**hello, "node": "n" * 129})], OUT_OF_BOUNDS)
    add("hello_node_empty", [pack({**hello, "node": ""})], OUT_OF_BOUNDS)
    add("hello_rc_not_map", [pack({**hello, "rc": [1]})], WRONG_TYPE)
    add("hello_rc_bin_value", [pack({**hello, "rc": {**V1_RC, "dtype": b"f16"}})], WRONG_TYPE)
    deep: Any = 1
    for _ in range(8):
        deep = [deep]
    add("hello_rc_too_deep", [pack({**hello, "rc": {**V1_RC, "x": deep}})], OUT_OF_BOUNDS)
    add("hello_rc_nan", [pack({**hello, "rc": {**V1_RC, "blocks_per_file": float("nan")}})],
        OUT_OF_BOUNDS)
    add("hello_rc_infinity", [pack({**hello, "rc": {**V1_RC, "x": [float("-inf")]}})],
        OUT_OF_BOUNDS)
    add("hello_missing_khash", [pack({k: v for k, v in hello.items() if k != "khash"})],
        MISSING_FIELD)
    add("hello_seed_negative", [pack({**hello, "khash": {"algo": "x", "seed": -1}})],
        OUT_OF_BOUNDS)
    add("hello_cap_is_int", [pack({**hello, "caps": [1]})], WRONG_TYPE)
    add("hello_limits_zero", [pack({**hello, "limits": {"max_keys": 0}})], OUT_OF_BOUNDS)
    add("refuse_reason_missing_theirs",
        [m(t="refuse", v=1, code=100, msg="", reasons=[
            {"code": 100, "field": "f", "ours": 1, "meaning": ""}])], MISSING_FIELD)
    hello11 = greeting("hello", "n", V1_RC, V1_FP, [4096], minor=1)
    add("hello_ext_not_a_map", [pack({**hello11, "ext": ["NHD"]})], WRONG_TYPE)
    add("hello_ext_field_int", [pack({**hello11, "ext": {"model_revision": 5}})], WRONG_TYPE)
    add("hello_ext_field_nil", [pack({**hello11, "ext": {"engine": None}})], WRONG_TYPE)
    add("hello_ext_empty_revision", [pack({**hello11, "ext": {"model_revision": ""}})],
        OUT_OF_BOUNDS)
    add("hello_ext_overrides_not_hex16",
        [pack({**hello11, "ext": {"model_overrides": "ABCDEF0123456789"}})], OUT_OF_BOUNDS)
    add("hello_ext_key_hash_without_algorithm",
        [pack({**hello11, "ext": {"key_hash": "0123456789abcdef"}})], OUT_OF_BOUNDS)
    for name, text in (("trailing_space", "5f2b1c0 "), ("leading_space", " 5f2b1c0"),
                       ("tab", "5f2b\t1c0"), ("no_break_space", "5f2b\u00a01c0"),
                       ("zero_width_space", "5f2b\u200b1c0"), ("unassigned", "5f2b\u03781c0")):
        add(f"hello_ext_revision_{name}",
            [pack({**hello11, "ext": {"model_revision": text}})], OUT_OF_BOUNDS)
    add("hello_ext_revision_257_chars",
        [pack({**hello11, "ext": {"model_revision": "é" * 257}})], OUT_OF_BOUNDS)
    add("hello_ext_layout_with_blank",
        [pack({**hello11, "ext": {"kv_memory_layout": "N HD"}})], OUT_OF_BOUNDS)
    add("refuse_ext_field_int",
        [m(t="refuse", v=1, code=109, msg="", ext={"kv_memory_layout": 1})], WRONG_TYPE)
    add("bye_code_bool", [m(t="bye", v=1, code=False, msg="")], WRONG_TYPE)
    add("bye_msg_bin", [m(t="bye", v=1, code=300, msg=b"x")], WRONG_TYPE)
    return out


IDENTITY_DEFAULTS = {
    "tokens_per_hash": 16, "blocks_per_file": 1, "tp_size": 1, "pp_size": 1, "pcp_size": 1,
    "dcp_size": 1, "dtype": "float16", "kv_cache_groups": [], "inference_engine": "vllm",
}
GROUPS = [{"tokens_per_block": 16, "layer_names": ["model.layers.0.attn", "model.layers.1.attn"]},
          {"tokens_per_block": 32, "layer_names": ["model.layers.2.attn"]}]


def identity_vectors() -> list[dict[str, Any]]:
    """Each case: how to build it, and the run-config dict written out by the rules."""
    cases: list[dict[str, Any]] = []

    def add(name: str, rule: str, build: dict[str, Any], fields: dict[str, Any],
            root: str = "/cache") -> None:
        rc = {"model_name": build["args"]["model_name"], **IDENTITY_DEFAULTS, **fields}
        rc = {k: v for k, v in rc.items() if v is not None}
        text = json.dumps(rc, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        safe = rc["model_name"].replace("/", "_")
        cases.append({
            "name": name, "rule": rule, **build, "run_config": rc, "canonical": text,
            "digest": digest, "fingerprint": digest[:16], "root": root,
            "namespace": f"{root}/{safe}_{digest[:12]}",
        })

    def ctor(**args: Any) -> dict[str, Any]:
        return {"via": "constructor", "args": args}

    def resolve(**args: Any) -> dict[str, Any]:
        return {"via": "resolve", "args": args}

    add("brief_worked_example", "defaults; rule 2 (not agnostic adds the key)",
        ctor(model_name="m"), {"parallel_agnostic": False})
    add("agnostic_defaults", "rule 2: agnostic leaves the key out",
        ctor(model_name="m", parallel_agnostic=True), {})
    add("agnostic_collapses_parallel_sizes", "rule 1: sizes forced to 1, rank to 0",
        ctor(model_name="m", parallel_agnostic=True, tp_size=4, pp_size=2, pcp_size=2,
             dcp_size=2, rank=3), {})
    add("not_agnostic_keeps_parallel_sizes", "rule 2",
        ctor(model_name="m", tp_size=4, pp_size=2, pcp_size=3, dcp_size=5, rank=1),
        {"tp_size": 4, "pp_size": 2, "pcp_size": 3, "dcp_size": 5, "parallel_agnostic": False})
    add("rank_never_hashed", "rule 6: same fingerprint as not_agnostic_keeps_parallel_sizes",
        ctor(model_name="m", tp_size=4, pp_size=2, pcp_size=3, dcp_size=5, rank=7),
        {"tp_size": 4, "pp_size": 2, "pcp_size": 3, "dcp_size": 5, "parallel_agnostic": False})
    for tp in (2, 4):
        add(f"replicated_opt_in_tp{tp}", "rules 3-4: replicated with opt-in collapses sizes",
            resolve(model_name="deepseek/mla", parallel_agnostic=True,
                    is_parallelism_agnostic=False, replicated_layout=True, tp_size=tp,
                    rank=tp - 1),
            {"replicated_layout": True})
    add("replicated_without_opt_in", "rule 4: no opt-in changes nothing",
        resolve(model_name="deepseek/mla", parallel_agnostic=False,
                is_parallelism_agnostic=False, replicated_layout=True, tp_size=2),
        {"tp_size": 2, "parallel_agnostic": False})
    add("plain_agnostic_via_resolve", "rule 1 via resolve; differs from replicated",
        resolve(model_name="deepseek/mla", parallel_agnostic=True,
                is_parallelism_agnostic=True, replicated_layout=False, tp_size=2), {})
    add("agnostic_layout_without_opt_in", "rule 4: layout agnostic but no opt-in",
        resolve(model_name="m", parallel_agnostic=False, is_parallelism_agnostic=True,
                replicated_layout=False, tp_size=2),
        {"tp_size": 2, "parallel_agnostic": False})
    add("canonical_format", "rule 5", ctor(model_name="m", canonical_format="nhd-v1"),
        {"canonical_format": "nhd-v1", "parallel_agnostic": False})
    add("storage_format", "rule 5",
        ctor(model_name="m", parallel_agnostic=True, storage_format="safetensors"),
        {"storage_format": "safetensors"})
    add("kv_cache_groups", "groups in order, keys sorted in the canonical JSON",
        ctor(model_name="m", kv_cache_groups=GROUPS),
        {"kv_cache_groups": GROUPS, "parallel_agnostic": False})
    add("model_name_with_slash", "namespace replaces / with _",
        ctor(model_name="meta-llama/Llama-3.1-8B", parallel_agnostic=True), {},
        root="/mnt/kv")
    add("non_default_scalars", "dtype, tokens_per_hash, blocks_per_file, inference_engine",
        ctor(model_name="m", dtype="bfloat16", tokens_per_hash=32, blocks_per_file=8,
             inference_engine="sglang"),
        {"dtype": "bfloat16", "tokens_per_hash": 32, "blocks_per_file": 8,
         "inference_engine": "sglang", "parallel_agnostic": False})
    add("non_ascii_model_name", "canonical JSON escapes non-ASCII as \\uXXXX",
        ctor(model_name="modèle/ü", parallel_agnostic=True), {})
    return cases


ROOT_LABEL = b"p2pkv/block-key/root/v1"


def extra_bytes(extras: list[dict[str, Any]]) -> bytes:
    """SPEC §15.2: u32 count, then each extra key tagged (1 int, 2 str, 3 bytes)."""
    out = struct.pack("<I", len(extras))
    for extra in extras:
        (kind, value), = extra.items()
        if kind == "int":
            out += b"\x01" + struct.pack("<q", value)
        elif kind == "str":
            data = value.encode("utf-8")
            out += b"\x02" + struct.pack("<I", len(data)) + data
        else:
            data = bytes.fromhex(value)
            out += b"\x03" + struct.pack("<I", len(data)) + data
    return out


def key_vectors() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(name: str, seed: int, tph: int, tokens: list[int], *, group: int = 0,
            extras: list[dict[str, Any]] | None = None, parent: str | None = None) -> None:
        root = xxhash.xxh3_128(ROOT_LABEL, seed=seed).digest()
        chain = bytes.fromhex(parent) if parent is not None else root
        tail = extra_bytes(extras or [])
        messages, hashes, keys = [], [], []
        for start in range(0, len(tokens) - tph + 1, tph):
            block = tokens[start:start + tph]
            message = chain + struct.pack(f"<I{tph}I", tph, *block) + tail
            chain = xxhash.xxh3_128(message, seed=seed).digest()
            messages.append(message.hex())
            hashes.append(chain.hex())
            keys.append((chain + struct.pack(">I", group)).hex())
        cases.append({"name": name, "seed": seed, "tokens_per_hash": tph, "token_ids": tokens,
                      "extra_keys": extras or [], "group": group, "parent_hash": parent,
                      "root": root.hex(), "messages": messages, "content_hashes": hashes,
                      "keys": keys})

    add("three_blocks_and_a_tail", 0, 16, list(range(53)))
    add("max_seed_large_token_ids", 2**64 - 1, 4,
        [0, 1, 2**32 - 1, 2**31, 151643, 7, 7, 7])
    add("extra_keys_and_group", 1234, 16, list(range(1000, 1032)), group=5,
        extras=[{"int": -7}, {"str": "lóra"}, {"bytes": "00ff"}])
    add("empty_extra_values", 1, 2, [5, 6], extras=[{"int": 0}, {"str": ""}, {"bytes": ""}])
    first = cases[0]
    add("parent_hash_continues_a_chain", 0, 16, list(range(16, 53)),
        parent=first["content_hashes"][0])
    add("equal_blocks_at_different_positions", 9, 2, [3, 3, 3, 3, 3, 3])
    add("tail_only_has_no_key", 0, 16, list(range(15)))
    add("largest_group", 0, 1, [42], group=2**32 - 1)
    return cases


def splitmix_bytes(key: bytes, nbytes: int) -> bytes:
    """Appendix A, word by word with Python integers."""
    mask = 2**64 - 1
    s = xxhash.xxh3_64_intdigest(key, seed=0)
    out = bytearray()
    j = 0
    while len(out) < nbytes:
        z = (s + (j + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out += z.to_bytes(8, "little")
        j += 1
    return bytes(out[:nbytes])


def fill_vectors() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(name: str, seed: int, tph: int, count: int, bpb: int, full: bool) -> None:
        tokens = list(range(count * tph))
        keys = [bytes.fromhex(k) for k in _keys_of(seed, tph, tokens)]
        blocks = []
        for key in keys:
            data = splitmix_bytes(key, bpb)
            entry: dict[str, Any] = {"key": key.hex(), "first_bytes": data[:32].hex(),
                                     "xxh3_64": xxhash.xxh3_64_intdigest(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}
            if full:
                entry["bytes"] = data.hex()
            blocks.append(entry)
        cases.append({"name": name, "seed": seed, "tokens_per_hash": tph, "count": count,
                      "bytes_per_block": bpb, "blocks": blocks})

    add("tiny_blocks_in_full", 0, 16, 3, 40, True)
    add("not_a_multiple_of_8", 7, 4, 2, 13, True)
    add("seed_geometry_589824_bytes", 0, 16, 4, 589824, False)
    return cases


def _keys_of(seed: int, tph: int, tokens: list[int]) -> list[str]:
    chain = xxhash.xxh3_128(ROOT_LABEL, seed=seed).digest()
    out = []
    for start in range(0, len(tokens) - tph + 1, tph):
        message = chain + struct.pack(f"<I{tph}I", tph, *tokens[start:start + tph])
        message += struct.pack("<I", 0)
        chain = xxhash.xxh3_128(message, seed=seed).digest()
        out.append((chain + b"\x00\x00\x00\x00").hex())
    return out


def extension_vectors() -> dict[str, Any]:
    """SPEC 1.4: model_overrides canonical form, key_hash, extension digest, layout names.

    Every canonical text is written out by hand, never computed by p2pkv.
    """
    overrides = []

    def over(name: str, given: dict[str, Any], canonical: str) -> None:
        overrides.append({"name": name, "overrides": given, "canonical": canonical,
                          "digest": sha16(canonical)})

    over("llama3_rope_fp8_kv", {"rope_theta": 500000.0, "kv_cache_dtype": "fp8_e4m3",
                                "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
         OVERRIDES_CANONICAL)
    over("same_with_ints_nulls_and_order",
         {"kv_cache_dtype": "fp8_e4m3", "hf_overrides": None, "rope_theta": 500000,
          "rope_scaling": {"factor": 8, "low_freq_factor": None, "rope_type": "llama3"}},
         OVERRIDES_CANONICAL)
    over("no_overrides", {}, "{}")
    over("fractional_and_huge_floats",
         {"kv_scales": {"k_scale": 0.0123, "v_scale": 1e-05}, "rope_theta": 1e16},
         '{"kv_scales":{"k_scale":0.0123,"v_scale":1e-05},"rope_theta":1e+16}')
    over("lists_bools_non_ascii",
         {"hf_overrides": {"name": "é", "layers": [1, 2.5, True, None]}},
         '{"hf_overrides":{"layers":[1,2.5,true,null],"name":"\\u00e9"}}')
    key_hashes = [
        {"algo": "sha256", "seed_utf8": "vllm-none-hash",
         "key_hash": "sha256:" + sha16("vllm-none-hash")},
        {"algo": "xxhash", "seed_utf8": "0", "key_hash": "xxhash:" + sha16("0")},
        {"algo": "xxhash", "seed_utf8": "1", "key_hash": "xxhash:" + sha16("1")},
    ]
    extensions = []

    def ext(name: str, given: dict[str, str], canonical: str) -> None:
        extensions.append({"name": name, "ext": given, "canonical": canonical,
                           "digest": sha16(canonical)})

    ext("nothing_declared", {}, "{}")
    ext("layout_only", {"kv_memory_layout": "NHD"}, '{"kv_memory_layout":"NHD"}')
    ext("engine_is_not_hashed", {"kv_memory_layout": "NHD", "engine": "vllm 0.32.0"},
        '{"kv_memory_layout":"NHD"}')
    ext("every_field",
        {"model_revision": "5f2b1c0", "kv_memory_layout": "HND",
         "key_hash": key_hashes[0]["key_hash"], "model_overrides": OVERRIDES_DIGEST,
         "engine": "vllm 0.32.0"},
        '{"key_hash":"' + key_hashes[0]["key_hash"] + '","kv_memory_layout":"HND",'
        '"model_overrides":"' + OVERRIDES_DIGEST + '","model_revision":"5f2b1c0"}')
    # 1.2: the weights manifest and the model config, canonical texts written by hand.
    sha_a, sha_b = "a" * 64, "0123456789abcdef" * 4
    weights = [
        {"name": "one_file",
         "files": [{"name": "model.safetensors", "size": 538090408, "sha256": sha_a}],
         "canonical": '{"files":[{"name":"model.safetensors","sha256":"' + sha_a
                      + '","size":538090408}]}'},
        {"name": "shards_sorted_by_name",
         "files": [{"name": "model-00002-of-00002.safetensors", "size": 7, "sha256": sha_b},
                   {"name": "model-00001-of-00002.safetensors", "size": 5, "sha256": sha_a}],
         "canonical": '{"files":[{"name":"model-00001-of-00002.safetensors","sha256":"'
                      + sha_a + '","size":5},{"name":"model-00002-of-00002.safetensors",'
                      '"sha256":"' + sha_b + '","size":7}]}'},
    ]
    for case in weights:
        case["model_weights"] = sha16(case["canonical"])
    configs = [
        {"name": "metadata_keys_dropped",
         "config": {"_name_or_path": "/tmp/x", "transformers_version": "5.19.0",
                    "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
                    "model_type": "llama", "num_key_value_heads": 3,
                    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}},
         "canonical": '{"model_type":"llama","num_key_value_heads":3,'
                      '"rope_parameters":{"rope_theta":100000,"rope_type":"default"}}'},
        {"name": "rope_theta_changed",
         "config": {"model_type": "llama", "num_key_value_heads": 3,
                    "rope_parameters": {"rope_theta": 25000.0, "rope_type": "default"}},
         "canonical": '{"model_type":"llama","num_key_value_heads":3,'
                      '"rope_parameters":{"rope_theta":25000,"rope_type":"default"}}'},
    ]
    for case in configs:
        case["model_config"] = sha16(case["canonical"])
    ext("with_weights_and_config",
        {"model_weights": weights[0]["model_weights"], "model_config": configs[0]["model_config"],
         "engine": "vllm 0.32.0"},
        '{"model_config":"' + configs[0]["model_config"] + '","model_weights":"'
        + weights[0]["model_weights"] + '"}')
    layouts = [
        {"declared": "NHD", "canonical": "NHD"},
        {"declared": "lbnhc", "canonical": "NHD"},
        {"declared": "LBHNC", "canonical": "HND"},
        {"declared": "hnd_k_then_v", "canonical": "HND_K_THEN_V"},
        {"declared": "bhlnc", "canonical": "BHLNC"},
        {"declared": "my-engine.v3", "canonical": "my-engine.v3"},
    ]
    return {"about": "identity extension: model_overrides canonical form and digest, "
                     "key_hash, extension digest, kv_memory_layout names, model_weights "
                     "manifests and model_config (SPEC 1.4)",
            "model_overrides": overrides, "key_hash": key_hashes, "extension": extensions,
            "kv_memory_layout": layouts, "model_weights": weights, "model_config": configs}


class Collected:
    """One capability file's messages and errors, as its generator adds them."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []

    def add(self, name: str, wire: dict[str, Any], exp: dict[str, Any]) -> None:
        self.messages.append({"name": name, "frames": [pack(wire).hex()], "segments": None,
                              "message": exp})

    def bad(self, name: str, wire: dict[str, Any], code: int) -> None:
        self.errors.append({"name": name, "frames": [pack(wire).hex()], "segments": None,
                            "code": code})


def shm_vectors() -> dict[str, Any]:
    """Capability shm-v1 (SPEC 16): its messages, their errors, and a segment header."""
    found = Collected()
    messages, errors, add, bad = found.messages, found.errors, found.add, found.bad

    offer = {"name": "p2pkv-4242-123456-0011223344556677", "size": 9441280}
    w = greeting("welcome", "node-b", V2_RC, V2_FP, [49152] * 12, minor=1,
                 caps=[CHECKSUM, "shm-v1"], shm=offer)
    add("welcome_offers_segment", w, expected(w, limits=None, v=1))
    fe = {"t": "fetch", "v": 1, "req": 9, "keys": [b"a", b"b"], "window": 16, "shm": True}
    add("fetch_shared", fe, expected(fe))
    fe_nil = {**fe, "shm": None}  # nil, like absent: served with block messages
    add("fetch_shm_nil_is_plain", fe_nil, expected(fe_nil, shm=False))
    nonce = bytes(range(16))
    at = {"t": "attach", "v": 1, "nonce": nonce}
    add("attach", at, expected(at))
    for ok, text in ((True, ""), (False, "nonce does not match")):
        ad = {"t": "attached", "v": 1, "ok": ok, "msg": text}
        add(f"attached_{'accepted' if ok else 'refused'}", ad, expected(ad))
    lo = {"t": "located", "v": 1, "req": 9, "idx": [0, 1], "slots": [17, 0],
          "sums": [1, 2**64 - 1]}
    add("located", lo, expected(lo))
    lo2 = {"t": "located", "v": 1, "req": 9, "idx": [3], "slots": [2**64 - 1], "sums": [None]}
    add("located_no_checksum_max_slot", lo2, expected(lo2))
    rl = {"t": "release", "v": 1, "req": 9, "idx": [0, 1, 3]}
    add("release", rl, expected(rl))

    hello = greeting("hello", "n", V1_RC, V1_FP, [4096])
    bad("welcome_shm_name_with_slash", {**w, "shm": {**offer, "name": "../etc/x"}},
        OUT_OF_BOUNDS)
    bad("welcome_shm_name_leading_dot", {**w, "shm": {**offer, "name": ".hidden"}},
        OUT_OF_BOUNDS)
    bad("welcome_shm_not_a_map", {**w, "shm": "p2pkv-1"}, WRONG_TYPE)
    bad("welcome_shm_size_zero", {**w, "shm": {**offer, "size": 0}}, OUT_OF_BOUNDS)
    bad("hello_shm_without_name", {**hello, "shm": {"size": 1}}, MISSING_FIELD)
    bad("fetch_shm_not_bool", {**fe, "shm": 1}, WRONG_TYPE)
    bad("attach_nonce_short", {**at, "nonce": nonce[:15]}, OUT_OF_BOUNDS)
    bad("attach_nonce_str", {**at, "nonce": "0" * 16}, WRONG_TYPE)
    bad("attached_ok_int", {"t": "attached", "v": 1, "ok": 1, "msg": ""}, WRONG_TYPE)
    bad("located_slots_length", {**lo, "slots": [1]}, OUT_OF_BOUNDS)
    bad("located_without_slots", {k: v for k, v in lo.items() if k != "slots"},
        MISSING_FIELD)
    bad("located_negative_slot", {**lo, "slots": [1, -1]}, OUT_OF_BOUNDS)
    bad("release_no_indices", {**rl, "idx": []}, OUT_OF_BOUNDS)
    bad("release_index_too_large", {**rl, "idx": [16384]}, OUT_OF_BOUNDS)

    # A segment header (SPEC 16.2), written out field by field.
    boot = bytes.fromhex("6a1e5d1c2b3a49f8a7c6d5e4f3a2b1c0")
    regions = [(8192 + i * 65536, 49152) for i in range(2)]
    fixed = struct.pack("<8sII16s16sQQQQIIQ", b"P2PKVSHM", 1, 4096, nonce, boot,
                        4026531840, 4242, 8192 + 2 * 65536, 1, 2, 1, 4026531836)
    table = b"".join(struct.pack("<QQ", off, seg) for off, seg in regions)
    header = {"name": "header_two_regions_one_slot", "nonce": nonce.hex(),
              "boot_id": boot.hex(), "netns": 4026531840, "owner_pid": 4242,
              "total": 8192 + 2 * 65536, "slots": 1, "ready": 1, "pidns": 4026531836,
              "regions": [{"offset": o, "segment": g} for o, g in regions],
              "header_bytes": 4096, "bytes": (fixed + table).hex()}
    return {"about": "capability shm-v1 (protocol/SPEC.md section 16): messages as in "
                     "messages.json, errors as in errors.json, and a segment header",
            "messages": messages, "errors": errors, "headers": [header]}


def nixl_vectors() -> dict[str, Any]:
    """Capability nixl-v1 (SPEC 20): the welcome's offer, the attach that proves it, and
    their errors."""
    found = Collected()
    messages, errors, add, bad = found.messages, found.errors, found.add, found.bad

    seg = [49152] * 2
    slots = 64
    base = 0x7F3A_0000_0000
    regions = [[base, slots * 49152], [base + 0x0100_0000, slots * 49152]]
    offer = {"agent": "p2pkv-0011223344556677", "meta": bytes(range(200)),
             "regions": regions, "slots": slots, "nonce": base + 0x0200_0000}
    caps = [CHECKSUM, "nixl-v1", "shm-v1"]
    w = greeting("welcome", "node-b", V2_RC, V2_FP, seg, minor=2, caps=caps, nixl=offer)
    add("welcome_offers_nixl_pool", w, expected(w, limits=None, v=1))
    top = [[2**64 - slots * 49152, slots * 49152], regions[1]]  # ends at 2**64 exactly
    w_top = {**w, "nixl": {**offer, "regions": top}}
    add("welcome_nixl_region_at_the_top", w_top, expected(w_top, limits=None, v=1))
    nonce = bytes(range(16))
    at = {"t": "attach", "v": 1, "nonce": nonce, "via": "nixl-v1"}
    add("attach_via_nixl", at, expected(at))
    at_shm = {"t": "attach", "v": 1, "nonce": nonce, "via": "shm-v1"}
    add("attach_via_shm_named", at_shm, expected(at_shm))
    at_nil = {"t": "attach", "v": 1, "nonce": nonce, "via": None}
    add("attach_via_nil_is_shm", at_nil, expected(at_nil, via="shm-v1"))

    def offer_with(**kw: Any) -> dict[str, Any]:
        return {**w, "nixl": {**offer, **kw}}

    bad("welcome_nixl_one_region_for_two_segments", offer_with(regions=regions[:1]),
        OUT_OF_BOUNDS)
    bad("welcome_nixl_region_too_small", offer_with(regions=[[base, slots * 49152 - 1],
                                                            regions[1]]), OUT_OF_BOUNDS)
    bad("welcome_nixl_region_wraps", offer_with(regions=[[2**64 - 4096, slots * 49152],
                                                         regions[1]]), OUT_OF_BOUNDS)
    bad("welcome_nixl_region_not_a_pair", offer_with(regions=[[base], regions[1]]),
        OUT_OF_BOUNDS)
    bad("welcome_nixl_meta_str", offer_with(meta="x"), WRONG_TYPE)
    bad("welcome_nixl_meta_empty", offer_with(meta=b""), OUT_OF_BOUNDS)
    bad("welcome_nixl_agent_empty", offer_with(agent=""), OUT_OF_BOUNDS)
    bad("welcome_nixl_zero_slots", offer_with(slots=0), OUT_OF_BOUNDS)
    bad("welcome_nixl_without_nonce", {**w, "nixl": {k: v for k, v in offer.items()
                                                     if k != "nonce"}}, MISSING_FIELD)
    bad("welcome_nixl_not_a_map", {**w, "nixl": "agent"}, WRONG_TYPE)
    bad("attach_via_unknown", {**at, "via": "rdma-v9"}, OUT_OF_BOUNDS)
    bad("attach_via_int", {**at, "via": 1}, WRONG_TYPE)
    return {"about": "capability nixl-v1 (protocol/SPEC.md section 20): messages as in "
                     "messages.json, errors as in errors.json",
            "messages": messages, "errors": errors}


def packed_vectors() -> dict[str, Any]:
    """Capability packed-v1 (SPEC 17): packed block messages and their errors."""
    messages: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seg = [8, 4]

    def frames(wire: dict[str, Any], payload: list[bytes]) -> list[str]:
        return [pack(wire).hex(), *(p.hex() for p in payload)]

    def add(name: str, wire: dict[str, Any], payload: list[bytes],
            segments: list[int] | None = seg) -> None:
        fields = {k: v for k, v in wire.items() if k not in ("t", "v", "pk")}
        if wire.get("pk") is True:  # listed only when true (section 14.8)
            fields["pk"] = True
        fields["payload"] = [{"bin": p.hex()} for p in payload]
        messages.append({"name": name, "frames": frames(wire, payload), "segments": segments,
                         "message": {"type": "block", "fields": jsonable(fields)}})

    def bad(name: str, wire: dict[str, Any], payload: list[bytes], code: int,
            segments: list[int] | None = seg) -> None:
        errors.append({"name": name, "frames": frames(wire, payload), "segments": segments,
                       "code": code})

    # Three blocks of 12 bytes (segments 8 + 4), back to back in idx order.
    blocks = [bytes([0x10 + i]) * 8 + bytes([0x20 + i]) * 4 for i in range(3)]
    sums = [xxhash.xxh3_64_intdigest(b) for b in blocks]
    one = {"t": "block", "v": 1, "req": 9, "idx": [4], "sums": [sums[0]], "pk": True}
    add("packed_one_block", one, [blocks[0]])
    three = {"t": "block", "v": 1, "req": 9, "idx": [2, 0, 7], "sums": sums, "pk": True}
    add("packed_three_blocks", three, [b"".join(blocks)])
    nosum = {"t": "block", "v": 1, "req": 3, "idx": [1, 0], "sums": [None, None], "pk": True}
    add("packed_no_checksum_unknown_segments", nosum, [b"".join(blocks[:2])], None)
    for value, name in ((False, "false"), (None, "nil")):
        plain = {"t": "block", "v": 1, "req": 9, "idx": [0], "sums": [sums[0]], "pk": value}
        add(f"block_pk_{name}_is_unpacked", plain, [blocks[0][:8], blocks[0][8:]])

    whole = b"".join(blocks)
    bad("packed_frame_short", three, [whole[:-1]], FRAME_COUNT)
    bad("packed_frame_long", three, [whole + b"\0"], FRAME_COUNT)
    bad("packed_no_frame", three, [], FRAME_COUNT)
    bad("packed_two_frames", three, [whole[:12], whole[12:]], FRAME_COUNT)
    bad("packed_frame_per_segment", one, [blocks[0][:8], blocks[0][8:]], FRAME_COUNT)
    # Before the segments are known a packed block still has exactly one frame.
    bad("packed_unknown_segments_two_frames", nosum, [blocks[0], blocks[1]], FRAME_COUNT,
        None)
    bad("packed_unknown_segments_no_frame", nosum, [], FRAME_COUNT, None)
    big = {"t": "block", "v": 1, "req": 9, "idx": [0, 1, 2], "sums": [None] * 3, "pk": True}
    bad("packed_above_max_packed_bytes", big, [b"\0"], OUT_OF_BOUNDS, [1 << 20])
    bad("packed_pk_int", {**one, "pk": 1}, [blocks[0]], WRONG_TYPE)
    bad("packed_pk_str", {**one, "pk": "yes"}, [blocks[0]], WRONG_TYPE)
    return {"about": "capability packed-v1 (protocol/SPEC.md section 17): messages as in "
                     "messages.json, errors as in errors.json",
            "messages": messages, "errors": errors}


def datachannel_vectors() -> dict[str, Any]:
    """Capability tcp-data-v1 (SPEC 18): the offer, its errors, and stream bytes."""
    found = Collected()
    messages, errors, add, bad = found.messages, found.errors, found.add, found.bad

    token = SEAL_TOKEN
    offer = {"port": 40123, "token": token, "cport": 5555}
    w = greeting("welcome", "node-b", V2_RC, V2_FP, [49152] * 12, minor=2,
                 caps=[CHECKSUM, "packed-v1", "tcp-data-v1"], data=offer)
    add("welcome_offers_data_stream", w, expected(w, limits=None, v=1))
    hello = greeting("hello", "n", V1_RC, V1_FP, [4096], minor=2,
                     caps=[CHECKSUM, "tcp-data-v1"])
    add("hello_offers_tcp_data_v1", hello, expected(hello, limits=None, v=1))
    # A hello MUST NOT carry data, but one that does decodes by the same rules (and its
    # receiver then ignores it, SPEC 18.1).
    add("hello_carries_data_decoded_then_ignored", {**hello, "data": offer},
        expected({**hello, "data": offer}, limits=None, v=1))
    bad("welcome_data_token_short", {**w, "data": {**offer, "token": token[:15]}},
        OUT_OF_BOUNDS)
    bad("welcome_data_token_str", {**w, "data": {**offer, "token": "a" * 16}}, WRONG_TYPE)
    bad("welcome_data_port_zero", {**w, "data": {**offer, "port": 0}}, OUT_OF_BOUNDS)
    bad("welcome_data_port_above_65535", {**w, "data": {**offer, "port": 65536}},
        OUT_OF_BOUNDS)
    bad("welcome_data_without_cport", {**w, "data": {"port": 1, "token": token}},
        MISSING_FIELD)
    bad("welcome_data_not_a_map", {**w, "data": [40123]}, WRONG_TYPE)
    bad("hello_data_without_token", {**hello, "data": {"port": 1, "cport": 2}},
        MISSING_FIELD)

    # tcp-streams-v1 (SPEC 18.6): further streams' tokens, and a fetch naming its stream.
    more = [bytes([0xB0 + k]) * 16 for k in range(3)]
    ws = greeting("welcome", "node-b", V2_RC, V2_FP, [49152] * 12, minor=2,
                  caps=[CHECKSUM, "packed-v1", "tcp-data-v1", "tcp-streams-v1"],
                  data={**offer, "more": more})
    add("welcome_offers_four_streams", ws, expected(ws, limits=None, v=1))
    fs = {"t": "fetch", "v": 1, "req": 9, "keys": [bytes(16)], "window": 4, "stream": 3}
    add("fetch_on_stream_3", fs, expected(fs))
    bad("welcome_data_more_not_an_array", {**ws, "data": {**offer, "more": more[0]}},
        WRONG_TYPE)
    bad("welcome_data_more_token_short", {**ws, "data": {**offer, "more": [more[0][:15]]}},
        OUT_OF_BOUNDS)
    bad("welcome_data_more_eight_tokens", {**ws, "data": {**offer, "more": more * 3}},
        OUT_OF_BOUNDS)
    # tcp-data-tls-v1 (SPEC 18.7): the certificate pin.
    pin = bytes(range(0xC0, 0xE0))
    wt = greeting("welcome", "node-b", V2_RC, V2_FP, [49152] * 12, minor=2,
                  caps=[CHECKSUM, "packed-v1", "tcp-data-tls-v1"], data={**offer, "cert": pin})
    add("welcome_offers_tls_stream", wt, expected(wt, limits=None, v=1))
    bad("welcome_data_cert_short", {**wt, "data": {**offer, "cert": pin[:31]}}, OUT_OF_BOUNDS)
    bad("welcome_data_cert_str", {**wt, "data": {**offer, "cert": "a" * 32}}, WRONG_TYPE)
    # tcp-data-aead-v1 (SPEC 18.8): the session's stream secret, beside the pin (a node
    # that seals offers TLS too). sealed.json derives its keys from this token and key.
    wa = greeting("welcome", "node-b", V2_RC, V2_FP, [49152] * 12, minor=2,
                  caps=[CHECKSUM, "packed-v1", "tcp-data-aead-v1", "tcp-data-tls-v1"],
                  data={**offer, "cert": pin, "key": SEAL_SECRET})
    add("welcome_offers_sealed_stream", wa, expected(wa, limits=None, v=1))
    # Decoded where the capability was not negotiated too (the session ignores it).
    wk = {**wt, "data": {**offer, "cert": pin, "key": SEAL_SECRET}}
    add("welcome_tls_only_carries_key_decoded_then_ignored", wk,
        expected(wk, limits=None, v=1))
    bad("welcome_data_key_short", {**wa, "data": {**offer, "key": SEAL_SECRET[:31]}},
        OUT_OF_BOUNDS)
    bad("welcome_data_key_long", {**wa, "data": {**offer, "key": SEAL_SECRET + b"\0"}},
        OUT_OF_BOUNDS)
    bad("welcome_data_key_str", {**wa, "data": {**offer, "key": "a" * 32}}, WRONG_TYPE)
    bad("fetch_stream_8", {**fs, "stream": 8}, OUT_OF_BOUNDS)
    bad("fetch_stream_negative", {**fs, "stream": -1}, OUT_OF_BOUNDS)
    # 18.6 rule 4: an explicit 0 is the absent field (the first stream), also where the
    # capability is not in effect; nil is not a uint.
    f0 = {**fs, "stream": 0}
    add("fetch_stream_0_written_is_absent", f0, expected(f0))
    bad("fetch_stream_nil", {**fs, "stream": None}, WRONG_TYPE)
    # 18.6 rule 2 and section 3 (nil): an empty `more` is the absent one (one stream),
    # a nil `more` is not an array; a nil `cert` or `key` is the absent field.
    w0 = {**ws, "data": {**offer, "more": []}}
    add("welcome_data_more_empty_is_one_stream", w0, expected(w0, limits=None, v=1))
    bad("welcome_data_more_nil", {**ws, "data": {**offer, "more": None}}, WRONG_TYPE)
    wc = {**wt, "data": {**offer, "cert": None}}
    add("welcome_data_cert_nil_is_absent", wc, expected(wc, limits=None, v=1))
    wn = {**wa, "data": {**offer, "cert": pin, "key": None}}
    add("welcome_data_key_nil_is_absent", wn, expected(wn, limits=None, v=1))

    # Stream bytes (SPEC 18.2, 18.3), written out by hand.
    magic = b"P2PKVDC1"
    seg = [8, 4]
    blocks = [bytes([0x30 + i]) * 8 + bytes([0x40 + i]) * 4 for i in range(2)]
    head = pack({"t": "block", "v": 1, "req": 7, "idx": [1, 0],
                 "sums": [xxhash.xxh3_64_intdigest(b) for b in blocks]})
    head_pk = pack({"t": "block", "v": 1, "req": 7, "idx": [1, 0],
                    "sums": [xxhash.xxh3_64_intdigest(b) for b in blocks], "pk": True})
    done = pack({"t": "done", "v": 1, "req": 7, "outcomes": [0, 0, 1]})
    stream = [
        {"name": "preface", "direction": "client to server", "token": token.hex(),
         "bytes": (magic + token).hex()},
        {"name": "accepted", "direction": "server to client", "bytes": magic.hex()},
        {"name": "block_two_blocks_then_done", "direction": "server to client",
         "segments": seg,
         "messages": [{"frame0": head.hex(), "payload": (blocks[0] + blocks[1]).hex()},
                      {"frame0": done.hex(), "payload": ""}],
         "bytes": (struct.pack("<I", len(head)) + head + blocks[0] + blocks[1]
                   + struct.pack("<I", len(done)) + done).hex()},
        # pk true on the stream: the bytes are the same (SPEC 18.3).
        {"name": "packed_block_then_done", "direction": "server to client",
         "segments": seg,
         "messages": [{"frame0": head_pk.hex(), "payload": (blocks[0] + blocks[1]).hex()},
                      {"frame0": done.hex(), "payload": ""}],
         "bytes": (struct.pack("<I", len(head_pk)) + head_pk + blocks[0] + blocks[1]
                   + struct.pack("<I", len(done)) + done).hex()},
    ]
    return {"about": "capability tcp-data-v1 (protocol/SPEC.md section 18): messages as "
                     "in messages.json, errors as in errors.json, and the bytes of a "
                     "stream: its preface, the server's answer, and framed messages",
            "messages": messages, "errors": errors, "stream": stream}


# ---------------------------------------------------------------- tcp-data-aead-v1
# Written from the text of SPEC 18.8 with the primitives themselves (HMAC-SHA256, the
# `cryptography` package's HKDF and AES-GCM), never with p2pkv.protocol.seal.

SEAL_LABEL = b"p2pkv tcp-data-aead-v1 "
SEALED_MAGIC = b"P2PKVDA1"
RECORDS_PER_KEY = 1 << 16
MAX_RECORD = 1 << 20


def seal_prk(secret: bytes, token: bytes) -> bytes:
    """HKDF-Extract: salt the token, input keying material the secret."""
    return hmac.new(token, secret, hashlib.sha256).digest()


def seal_info(writer: str, epoch: int) -> bytes:
    return SEAL_LABEL + writer.encode("ascii") + struct.pack(">I", epoch)


def seal_key(secret: bytes, token: bytes, writer: str, epoch: int) -> bytes:
    """HKDF-SHA256 (RFC 5869), 32 bytes: by hand, checked against `cryptography`'s."""
    info = seal_info(writer, epoch)
    by_hand = hmac.new(seal_prk(secret, token), info + b"\x01", hashlib.sha256).digest()
    library = HKDF(algorithm=hashes.SHA256(), length=32, salt=token, info=info).derive(secret)
    assert by_hand == library
    return by_hand


def seal_nonce(number: int) -> bytes:
    return bytes(4) + struct.pack(">Q", number)


def seal(secret: bytes, token: bytes, writer: str, number: int, plaintext: bytes) -> bytes:
    """Record ``number`` of ``writer`` on the wire: u32le n, ciphertext, tag (the head is
    the associated data)."""
    head = struct.pack("<I", len(plaintext))
    key = seal_key(secret, token, writer, number // RECORDS_PER_KEY)
    return head + AESGCM(key).encrypt(seal_nonce(number), plaintext, head)


def sealed_vectors() -> dict[str, Any]:
    """Capability tcp-data-aead-v1 (SPEC 18.8): keys, preface, answer, records."""
    secret, token = SEAL_SECRET, SEAL_TOKEN
    keys = [{"writer": w, "epoch": e, "info": seal_info(w, e).hex(),
             "key": seal_key(secret, token, w, e).hex()}
            for w, e in (("client", 0), ("server", 0), ("server", 1))]
    ad = SEALED_MAGIC + token
    tag = AESGCM(seal_key(secret, token, "client", 0)).encrypt(seal_nonce(0), b"", ad)
    preface = ad + tag
    # Record 1: the first bytes of the stream after the answer, a framed `done` (18.3).
    done = pack({"t": "done", "v": 1, "req": 7, "outcomes": [0, 0, 1]})
    framed = struct.pack("<I", len(done)) + done
    records: list[dict[str, Any]] = []

    def record(name: str, number: int, plaintext: bytes, writer: str = "server") -> bytes:
        wire = seal(secret, token, writer, number, plaintext)
        records.append({"name": name, "writer": writer, "number": number,
                        "nonce": seal_nonce(number).hex(), "plaintext": plaintext.hex(),
                        "bytes": wire.hex()})
        return wire

    answer = record("answer", 0, b"P2PKVDC1")
    first = record("record_1_framed_done", 1, framed)
    record("record_65535_last_of_epoch_0", 65535, b"last record under key 0")
    record("record_65536_first_of_epoch_1", 65536, b"first record under key 1")

    invalid: list[dict[str, Any]] = []

    def bad(name: str, kind: str, wire: bytes, number: int = 0, writer: str = "server",
            at_head: bool = False, **inputs: bytes) -> None:
        case: dict[str, Any] = {"name": name, "kind": kind, "bytes": wire.hex()}
        if kind == "record":
            case.update(writer=writer, number=number, rejected_at_head=at_head)
        case.update({k: v.hex() for k, v in inputs.items()})
        invalid.append(case)

    def flip(data: bytes, at: int) -> bytes:
        return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]

    bad("preface_tag_bit_flipped", "preface", flip(preface, len(preface) - 1))
    bad("preface_token_changed", "preface", flip(preface, len(SEALED_MAGIC)))
    other = bytes(range(0x20, 0x40))  # a stranger who saw the token, not the secret
    other_tag = AESGCM(seal_key(other, token, "client", 0)).encrypt(seal_nonce(0), b"", ad)
    bad("preface_under_another_secret", "preface", ad + other_tag)
    bad("preface_server_keys", "preface", ad + AESGCM(seal_key(secret, token, "server", 0))
        .encrypt(seal_nonce(0), b"", ad))
    bad("record_1_opened_as_record_2", "record", first, 2)
    bad("answer_replayed_as_record_1", "record", answer, 1)
    bad("record_1_opened_with_client_keys", "record", first, 1, "client")
    bad("record_1_on_another_stream", "record", first, 1, token=bytes(range(0xB0, 0xC0)))
    bad("answer_by_a_server_without_the_secret", "record",
        seal(other, token, "server", 0, b"P2PKVDC1"), 0)
    bad("record_1_ciphertext_bit_flipped", "record", flip(first, 4), 1)
    bad("record_1_tag_bit_flipped", "record", flip(first, len(first) - 1), 1)
    bad("record_1_cut_short", "record", first[:-1], 1)
    # An empty record, its tag right: still no record (n = 0 ends the stream).
    empty = struct.pack("<I", 0)
    empty += AESGCM(seal_key(secret, token, "server", 0)).encrypt(seal_nonce(1), b"", empty)
    bad("record_head_zero", "record", empty, 1, at_head=True)
    bad("record_head_above_max_record", "record", struct.pack("<I", MAX_RECORD + 1), 1,
        at_head=True)
    # Which form a session's streams take (18.8 rule 3), by negotiation and welcome.
    forms = [
        {"caps": ["tcp-data-aead-v1", "tcp-data-tls-v1"], "data": ["cert", "key"],
         "form": "sealed"},
        {"caps": ["tcp-data-aead-v1"], "data": ["key"], "form": "sealed"},
        {"caps": ["tcp-data-aead-v1", "tcp-data-tls-v1"], "data": ["cert"], "form": "tls"},
        {"caps": ["tcp-data-tls-v1"], "data": ["cert", "key"], "form": "tls"},
        {"caps": ["tcp-data-aead-v1"], "data": ["cert"], "form": None},
        {"caps": ["tcp-data-aead-v1", "tcp-data-tls-v1"], "data": [], "form": None},
        {"caps": ["tcp-data-v1"], "data": ["key"], "form": "plain"},
    ]
    return {"about": "capability tcp-data-aead-v1 (protocol/SPEC.md section 18.8): for "
                     "the secret and token given, the PRK, traffic keys, the client's "
                     "preface and the server's records on the wire (all hex); invalid "
                     "prefaces and records a reader must reject; the form of a "
                     "session's streams by negotiated caps and the keys its data holds",
            "secret": secret.hex(), "token": token.hex(), "prk": seal_prk(secret, token).hex(),
            "keys": keys,
            "preface": {"bytes": preface.hex(), "tag": tag.hex()},
            "records": records, "invalid": invalid, "forms": forms}


def main() -> None:
    (HERE / "messages.json").write_text(json.dumps(
        {"about": "frames (hex) -> decoded message; see protocol/SPEC.md section 14",
         "vectors": message_vectors()}, indent=1) + "\n")
    (HERE / "errors.json").write_text(json.dumps(
        {"about": "frames (hex) -> protocol error code; see protocol/SPEC.md",
         "vectors": error_vectors()}, indent=1) + "\n")
    (HERE / "identity.json").write_text(json.dumps(
        {"about": "run-config inputs -> canonical JSON, SHA-256, fingerprint, namespace",
         "vectors": identity_vectors()}, indent=1, ensure_ascii=False) + "\n")
    (HERE / "keys.json").write_text(json.dumps(
        {"about": "token ids -> block keys; see protocol/SPEC.md section 15",
         "vectors": key_vectors()}, indent=1, ensure_ascii=False) + "\n")
    (HERE / "fill.json").write_text(json.dumps(
        {"about": "fill rule: keys and block bytes; see protocol/SPEC.md appendix A",
         "vectors": fill_vectors()}, indent=1) + "\n")
    (HERE / "extension.json").write_text(json.dumps(
        extension_vectors(), indent=1, ensure_ascii=False) + "\n")
    (HERE / "shm.json").write_text(json.dumps(shm_vectors(), indent=1) + "\n")
    (HERE / "nixl.json").write_text(json.dumps(nixl_vectors(), indent=1) + "\n")
    (HERE / "packed.json").write_text(json.dumps(packed_vectors(), indent=1) + "\n")
    (HERE / "datachannel.json").write_text(
        json.dumps(datachannel_vectors(), indent=1) + "\n")
    (HERE / "sealed.json").write_text(json.dumps(sealed_vectors(), indent=1) + "\n")


if __name__ == "__main__":
    main()

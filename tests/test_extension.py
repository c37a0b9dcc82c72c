"""The identity extension (protocol 1.1): canonical forms against hand-written vectors,
validation, and the handshake decision under both identity policies. Pure: no sockets."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv import IdentityExtension as ReExported
from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.identity import (
    ABSENT,
    EXTENSION_FIELDS,
    EXTENSION_REFUSAL_FIELDS,
    KV_MEMORY_LAYOUT_ALIASES,
    KV_MEMORY_LAYOUTS,
    IdentityExtension,
    RunConfig,
    canonical_model_overrides,
    extension_diff,
    key_hash_identity,
    kv_memory_layout_meaning,
    model_overrides_digest,
)
from p2pkv.protocol import (
    CAP_CHECKSUM_XXH3_64,
    EXTENSION_CODES,
    PROTOCOL_MINOR,
    Code,
    Geometry,
    HandshakeAccepted,
    HandshakeRefused,
    Hello,
    KeyHash,
    Refuse,
    Role,
    Session,
    Welcome,
    decide,
    decode,
    encode,
    encode_head,
    restate,
)

VECTORS = json.loads((Path(__file__).resolve().parent.parent / "protocol" / "vectors"
                      / "extension.json").read_text(encoding="utf-8"))
GEO = Geometry.of([49152] * 12)
KHASH = KeyHash("xxh3-128", 0)
CONFIG = RunConfig("org/model")
OVERRIDES = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
# One value per refusal-relevant field, and a second, different one.
VALUES: dict[str, tuple[str, str]] = {
    "kv_memory_layout": ("NHD", "HND"),
    "model_revision": ("5f2b1c0", "e1d4a77"),
    "model_overrides": (model_overrides_digest(OVERRIDES),
                        model_overrides_digest({**OVERRIDES, "rope_theta": 10000.0})),
    "key_hash": (key_hash_identity("xxhash", "0"), key_hash_identity("xxhash", "1")),
    # Protocol 1.2: derived from the checkpoint (p2pkv.identity.checkpoint).
    "model_weights": ("3f2a9c0d11e4b6a7", "9b1c5e2f07a8d4c3"),
    "model_config": ("0a1b2c3d4e5f6071", "8192a3b4c5d6e7f8"),
}


def greeting(ext: IdentityExtension | None, *, node: str = "a", minor: int = PROTOCOL_MINOR,
             config: RunConfig = CONFIG) -> Hello:
    g = Hello.for_config(node, config, GEO, KHASH, ext=ext)
    return dataclasses.replace(g, minor=minor)


# ---------------------------------------------------------------------------- vectors


@pytest.mark.parametrize("case", VECTORS["model_overrides"],
                         ids=[c["name"] for c in VECTORS["model_overrides"]])
def test_model_overrides_vectors(case: dict[str, Any]) -> None:
    assert canonical_model_overrides(case["overrides"]) == case["canonical"]
    assert model_overrides_digest(case["overrides"]) == case["digest"]


def test_equivalent_overrides_share_a_digest_and_a_real_change_does_not() -> None:
    digests = {c["name"]: c["digest"] for c in VECTORS["model_overrides"]}
    assert digests["llama3_rope_fp8_kv"] == digests["same_with_ints_nulls_and_order"]
    assert VALUES["model_overrides"][0] != VALUES["model_overrides"][1]
    assert model_overrides_digest({"kv_cache_dtype": "fp8_e4m3"}) != model_overrides_digest(
        {"kv_cache_dtype": "fp8_e5m2"})


@pytest.mark.parametrize("case", VECTORS["key_hash"], ids=lambda c: c["key_hash"])
def test_key_hash_vectors(case: dict[str, Any]) -> None:
    assert key_hash_identity(case["algo"], case["seed_utf8"]) == case["key_hash"]
    assert key_hash_identity(case["algo"], case["seed_utf8"].encode()) == case["key_hash"]


@pytest.mark.parametrize("case", VECTORS["extension"], ids=[c["name"] for c in
                                                            VECTORS["extension"]])
def test_extension_digest_vectors(case: dict[str, Any]) -> None:
    ext = IdentityExtension(**case["ext"])
    assert ext.digest == case["digest"]
    assert json.dumps(ext.refusal_fields(), sort_keys=True, separators=(",", ":")) == \
        case["canonical"]
    assert ext.to_wire() == case["ext"]


@pytest.mark.parametrize("case", VECTORS["kv_memory_layout"], ids=lambda c: c["declared"])
def test_layout_names_fold_to_the_registry(case: dict[str, str]) -> None:
    assert IdentityExtension(kv_memory_layout=case["declared"]).kv_memory_layout == \
        case["canonical"]


def test_registry_names_the_known_layouts() -> None:
    assert IdentityExtension is ReExported
    for name in ("NHD", "HND", "HND_K_THEN_V", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "MLA_LATENT"):
        assert name in KV_MEMORY_LAYOUTS
    # vLLM's offload kv_cache_layout strings are registry names, folded to NHD/HND.
    assert KV_MEMORY_LAYOUT_ALIASES == {"LBNHC": "NHD", "LBHNC": "HND"}
    assert {"LBNHC", "LBHNC"} <= set(KV_MEMORY_LAYOUTS)
    assert IdentityExtension(kv_memory_layout="LBNHC").kv_memory_layout == "NHD"
    assert "CPU" in KV_MEMORY_LAYOUTS["HND_K_THEN_V"]
    assert kv_memory_layout_meaning("lbhnc") == KV_MEMORY_LAYOUTS["HND"]
    assert "unknown" in kv_memory_layout_meaning("MyLayout")


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("field", "value", "match"), [
    ("kv_memory_layout", "", "kv_memory_layout must not be empty"),
    ("kv_memory_layout", "N H D", "kv_memory_layout must be 1..64 characters"),
    ("kv_memory_layout", 3, "kv_memory_layout must be a str"),
    ("model_revision", " main", "model_revision must be printable, without surrounding"),
    ("model_revision", "a\nb", "model_revision must be printable"),
    ("model_revision", "r" * 257, "model_revision is longer than 256"),
    ("model_overrides", '{"rope_theta": 1e6}', "model_overrides must be 16 lowercase hex"),
    ("model_overrides", "ABCDEF0123456789", "model_overrides must be 16 lowercase hex"),
    ("key_hash", "0123456789abcdef", "key_hash must be '<algorithm>:<16 lowercase hex>'"),
    ("key_hash", "sha256:xyz", "key_hash must be"),
    ("engine", b"vllm", "engine must be a str"),
])
def test_bad_values_name_the_field(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        IdentityExtension(**{field: value})


@pytest.mark.parametrize(("overrides", "match"), [
    ({"rope_theta": math.nan}, "not a finite number"),
    ({"rope_theta": math.inf}, "not a finite number"),
    ({"rope_scaling": {1: 2}}, "key 1 that is not a string"),
    ({"scales": {1.5}}, "overrides.scales has type set"),
    ({"big": 2**64}, "signed 64-bit"),
    ([("rope_theta", 1)], "must be a mapping"),
])
def test_bad_overrides_are_refused_with_the_path(overrides: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        model_overrides_digest(overrides)


def test_key_hash_identity_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        key_hash_identity("sha 256", b"x")
    with pytest.raises(ValueError, match="seed material must be bytes or str"):
        key_hash_identity("sha256", 42)  # type: ignore[arg-type]
    assert key_hash_identity("sha256", memoryview(b"x")) == key_hash_identity("sha256", "x")


def test_wire_form_and_digest() -> None:
    ext = IdentityExtension(kv_memory_layout="nhd", engine="vllm 0.32.0")
    assert ext.to_wire() == {"kv_memory_layout": "NHD", "engine": "vllm 0.32.0"}
    assert IdentityExtension.from_wire({**ext.to_wire(), "x-future": 1}) == ext
    assert ext.digest == IdentityExtension(kv_memory_layout="NHD").digest  # engine not hashed
    assert IdentityExtension().is_empty and not ext.is_empty
    assert IdentityExtension().describe() == "(nothing declared)"
    with pytest.raises(ValueError, match="must be a mapping"):
        IdentityExtension.from_wire(["NHD"])  # type: ignore[arg-type]


def test_extension_diff_reports_both_and_one_sided() -> None:
    a = IdentityExtension(kv_memory_layout="NHD", model_revision="r1", engine="vllm 1")
    b = IdentityExtension(kv_memory_layout="HND", engine="vllm 2")
    d = extension_diff(a, b)
    assert [(x.field, x.local, x.remote) for x in d] == [
        ("kv_memory_layout", "NHD", "HND"), ("model_revision", "r1", ABSENT)]
    assert "token-major" in d[0].meaning and "head-major" in d[0].meaning
    assert extension_diff(a, b, include_engine=True)[-1].field == "engine"
    assert extension_diff(a, a, include_engine=True) == []


# ---------------------------------------------------------------------------- decision


@pytest.mark.parametrize("field", EXTENSION_REFUSAL_FIELDS)
def test_each_field_refuses_alone_with_equal_fingerprints(field: str) -> None:
    ours, theirs = VALUES[field]
    local = greeting(IdentityExtension(**{field: ours}))
    remote = greeting(IdentityExtension(**{field: theirs}), node="b")
    assert local.fp == remote.fp and local.rc == remote.rc
    for policy in ("strict", "lenient"):
        d = decide(local, remote, identity_policy=policy)
        assert not d.accepted
        assert [(r.field, r.code, r.ours, r.theirs) for r in d.reasons] == [
            (f"ext.{field}", EXTENSION_CODES[field], ours, theirs)]
    # The peer, deciding from its side, refuses for the same field with its own view.
    back = decide(remote, local)
    assert [(r.field, r.ours, r.theirs) for r in back.reasons] == [
        (f"ext.{field}", theirs, ours)]


def test_meanings_say_what_to_change() -> None:
    def meaning(field: str) -> str:
        ours, theirs = VALUES[field]
        return decide(greeting(IdentityExtension(**{field: ours})),
                      greeting(IdentityExtension(**{field: theirs}))).reasons[0].meaning

    assert "VLLM_KV_CACHE_LAYOUT" in meaning("kv_memory_layout")
    assert "same model revision" in meaning("model_revision")
    assert "RoPE" in meaning("model_overrides")
    assert "PYTHONHASHSEED" in meaning("key_hash")
    algo = decide(greeting(IdentityExtension(key_hash=key_hash_identity("sha256", "s"))),
                  greeting(IdentityExtension(key_hash=key_hash_identity("xxhash", "s"))))
    assert "different functions (sha256 vs xxhash)" in algo.reasons[0].meaning


def test_one_sided_declaration_strict_refuses_lenient_warns() -> None:
    declared = greeting(IdentityExtension(kv_memory_layout="NHD", model_revision="r1"))
    bare = greeting(None, node="b")
    strict = decide(declared, bare)
    assert not strict.accepted
    assert [(r.field, r.code, r.ours, r.theirs) for r in strict.reasons] == [
        ("ext.kv_memory_layout", Code.EXTENSION_UNDECLARED, "NHD", ABSENT),
        ("ext.model_revision", Code.EXTENSION_UNDECLARED, "r1", ABSENT)]
    assert "identity_policy = \"lenient\"" in strict.reasons[0].meaning
    lenient = decide(declared, bare, identity_policy="lenient")
    assert lenient.accepted and lenient.reasons == ()
    assert [r.field for r in lenient.warnings] == ["ext.kv_memory_layout",
                                                   "ext.model_revision"]
    # The undeclared side sees the same from its view.
    assert [r.theirs for r in decide(bare, declared).reasons] == ["NHD", "r1"]


def test_nothing_declared_anywhere_and_engine_never_refuse() -> None:
    assert decide(greeting(None), greeting(None, node="b")).accepted
    d = decide(greeting(IdentityExtension(engine="vllm 0.32.0")),
               greeting(IdentityExtension(engine="sglang 0.5"), node="b"))
    assert d.accepted and d.warnings == ()


def test_a_1_0_peer_is_refused_by_strict_and_accepted_by_lenient() -> None:
    ours = greeting(IdentityExtension(kv_memory_layout="HND"))
    old = greeting(None, node="old", minor=0)
    d = decide(ours, old)
    assert [(r.field, r.code) for r in d.reasons] == [
        ("ext.kv_memory_layout", Code.EXTENSION_UNDECLARED)]
    assert "speaks protocol 1.0" in d.reasons[0].meaning
    assert decide(ours, old, identity_policy="lenient").accepted


def test_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="identity_policy must be one of strict, lenient"):
        decide(greeting(None), greeting(None), identity_policy="loose")
    with pytest.raises(ConfigError, match="identity_policy"):
        Session(Role.SERVER, greeting(None), now=0.0, identity_policy="loose")


# ---------------------------------------------------------------------------- wire


def test_extension_survives_the_wire_in_greetings_and_refusals() -> None:
    ext = IdentityExtension(**{f: v[0] for f, v in VALUES.items()}, engine="vllm 0.32.0")
    hello = greeting(ext)
    assert decode(encode(hello)) == hello
    other = greeting(IdentityExtension(kv_memory_layout="HND"), node="b")
    refusal = decide(hello, other).refusal(hello)
    back = decode(encode(refusal))
    assert back == refusal and isinstance(back, Refuse) and back.ext == ext


def test_declaring_nothing_sends_exactly_a_1_0_greeting_but_minor() -> None:
    now = greeting(IdentityExtension())
    assert now.ext is None
    old = dataclasses.replace(now, minor=0)
    minor = bytes([0xa5]) + b"minor" + bytes([PROTOCOL_MINOR])
    assert encode_head(now).replace(minor, b"\xa5minor\x00") == encode_head(old)
    assert b"ext" not in encode_head(now)


def test_restate_reads_a_peer_refusal_from_our_side() -> None:
    ours = greeting(IdentityExtension(kv_memory_layout="NHD"))
    theirs = greeting(IdentityExtension(kv_memory_layout="HND"), node="b")
    refusal = decide(theirs, ours, required=["x-needed"]).refusal(theirs)
    mine = restate(ours, refusal)
    by_field = {r.field: r for r in mine}
    assert (by_field["ext.kv_memory_layout"].ours,
            by_field["ext.kv_memory_layout"].theirs) == ("NHD", "HND")
    assert by_field["ext.kv_memory_layout"].meaning.startswith(
        "block bytes are ordered differently in memory: NHD")
    # The capability the peer requires cannot be re-derived here: kept as it was sent.
    assert by_field["capabilities"].theirs == "x-needed"
    # A refusal that does not say who refused is only swapped.
    anonymous = dataclasses.replace(refusal, rc=None)
    assert restate(ours, anonymous) == tuple(r.swapped() for r in refusal.reasons)


def _handshake(client_ext: IdentityExtension | None, server_ext: IdentityExtension | None,
               policy: str) -> tuple[list[Any], list[Any]]:
    client = Session(Role.CLIENT, greeting(client_ext, node="c"), now=0.0,
                     identity_policy=policy)
    server = Session(Role.SERVER, greeting(server_ext, node="s"), now=0.0,
                     identity_policy=policy)
    (hello,) = client.start(0.0)
    server.start(0.0)
    out_s = server.receive(decode(encode(hello)), 0.0)
    events_c: list[Any] = []
    for reply in out_s.replies:
        events_c += client.receive(decode(encode(reply)), 0.0).events
    return list(out_s.events), events_c


def test_sessions_report_lenient_warnings_on_both_sides() -> None:
    server_events, client_events = _handshake(IdentityExtension(model_revision="r1"), None,
                                              "lenient")
    (accepted_s,) = server_events
    (accepted_c,) = client_events
    assert isinstance(accepted_s, HandshakeAccepted) and isinstance(accepted_c,
                                                                    HandshakeAccepted)
    assert [(r.field, r.ours, r.theirs) for r in accepted_s.warnings] == [
        ("ext.model_revision", ABSENT, "r1")]
    assert [(r.field, r.ours, r.theirs) for r in accepted_c.warnings] == [
        ("ext.model_revision", "r1", ABSENT)]
    assert CAP_CHECKSUM_XXH3_64 in accepted_c.capabilities


def test_sessions_refuse_under_strict_and_the_client_hears_why() -> None:
    server_events, client_events = _handshake(IdentityExtension(model_revision="r1"), None,
                                              "strict")
    assert isinstance(server_events[0], HandshakeRefused)
    refused = [e for e in client_events if isinstance(e, HandshakeRefused)]
    assert refused and refused[0].by_remote
    assert [r.field for r in refused[0].reasons] == ["ext.model_revision"]
    assert isinstance(refused[0].remote, Refuse) and refused[0].remote.ext is None


def test_welcome_carries_the_server_extension() -> None:
    ext = IdentityExtension(kv_memory_layout="HND", engine="vllm 0.32.0")
    _, client_events = _handshake(ext, ext, "strict")
    (accepted,) = client_events
    assert isinstance(accepted, HandshakeAccepted)
    assert isinstance(accepted.remote, Welcome) and accepted.remote.ext == ext


_EXT_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 2**64 - 1), st.binary(max_size=8),
    st.text(max_size=300), st.sampled_from(["NHD", "lbhnc", "0123456789abcdef",
                                            "xxhash:0123456789abcdef", " x", ""]),
    st.lists(st.text(max_size=3), max_size=2))


@settings(max_examples=300, deadline=None)
@given(ext=st.one_of(_EXT_VALUES, st.dictionaries(
    st.sampled_from([*EXTENSION_FIELDS, "x-future"]), _EXT_VALUES, max_size=6)))
def test_any_ext_map_decodes_or_is_a_protocol_error(ext: Any) -> None:
    wire = {"t": "hello", "v": 1, "node": "n", "minor": 1, "rc": CONFIG.get_run_config(),
            "fp": CONFIG.fingerprint, "geo": {"bpb": GEO.bpb, "seg": list(GEO.seg)},
            "khash": {"algo": "xxh3-128", "seed": 0}, "caps": [], "ext": ext}
    try:
        msg = decode([msgpack.packb(wire, use_bin_type=True)])
    except ProtocolError as exc:
        assert exc.code in (Code.WRONG_TYPE, Code.OUT_OF_BOUNDS), exc
        return
    assert isinstance(msg, Hello)
    assert msg.ext is None or not msg.ext.is_empty
    if msg.ext is not None:
        assert decode(encode(msg)) == msg

"""The identity extension between real nodes on 127.0.0.1: one refusal per field with equal
FileMapper digests, the lenient policy, and peers that speak protocol 1.0."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from nodeproc import content, keys_for
from rawpeer import FakeServer, RawPeer, wait_until

from p2pkv import IdentityExtension, KeyOutcome, PeerIncompatible
from p2pkv import protocol as proto
from p2pkv.identity import ABSENT, key_hash_identity, model_overrides_digest

pytestmark = pytest.mark.timeout(120)

SPEC: dict[str, Any] = {"layout": "v2", "geometry": "small", "blocks": 4}
OVERRIDES = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}

# Per field: two values, the refusal code's name in stats, and words its meaning must have.
FIELDS: dict[str, tuple[str, str, str, str]] = {
    "kv_memory_layout": ("NHD", "HND", "kv_memory_layout_mismatch", "VLLM_KV_CACHE_LAYOUT"),
    "model_revision": ("5f2b1c0", "e1d4a77", "model_revision_mismatch",
                       "serve the same model revision"),
    "model_overrides": (model_overrides_digest(OVERRIDES),
                        model_overrides_digest({**OVERRIDES, "rope_theta": 10000}),
                        "model_overrides_mismatch", "RoPE"),
    # Two vLLM engines with xxhash block hashes and PYTHONHASHSEED=0 vs =1.
    "key_hash": (key_hash_identity("xxhash", "0"), key_hash_identity("xxhash", "1"),
                 "engine_key_hash_mismatch", "set PYTHONHASHSEED to the same value"),
}


@pytest.mark.parametrize("field", list(FIELDS))
def test_field_alone_refuses_equal_digests_on_both_sides(nodes: Any, field: str) -> None:
    ours, theirs, code_name, words = FIELDS[field]
    a = nodes({**SPEC, "ext": {field: ours}})
    b = nodes({**SPEC, "ext": {field: theirs}})
    # Same FileMapper identity: same fingerprint, same storage namespace.
    assert a.run_config == b.run_config and a.fingerprint == b.fingerprint
    assert a.run_config.namespace("/kv") == b.run_config.namespace("/kv")
    b.put(keys_for(1)[0], content(keys_for(1)[0], b.layout.bytes_per_block))

    with pytest.raises(PeerIncompatible) as seen_by_a:
        a.connect(b.address)
    (reason,) = seen_by_a.value.reasons  # refused by the extension only
    assert reason.field == f"ext.{field}"
    assert (reason.ours, reason.theirs) == (ours, theirs)
    assert words in reason.meaning
    assert b.stats().handshakes_refused == {code_name: 1}
    assert seen_by_a.value.remote["ext"] == {field: theirs}

    with pytest.raises(PeerIncompatible) as seen_by_b:
        b.connect(a.address)
    (reason,) = seen_by_b.value.reasons
    assert (reason.field, reason.ours, reason.theirs) == (f"ext.{field}", theirs, ours)
    assert words in reason.meaning
    assert a.stats().handshakes_refused == {code_name: 1}

    assert a.peers() == [] and b.peers() == []
    assert a.store.stats().used == 0 and b.stats().blocks_sent == 0


def test_nhd_vs_hnd_refused_between_processes(spawn: Any) -> None:
    server = spawn("serve", {**SPEC, "ext": {"kv_memory_layout": "HND"}})
    ready = server.event()
    assert ready["event"] == "ready"
    client = spawn("fetch", {**SPEC, "ext": {"kv_memory_layout": "NHD"}}, ready["address"])
    ev = client.event(timeout=60)
    assert ev["event"] == "refused", ev
    assert [(r["field"], r["ours"], r["theirs"]) for r in ev["reasons"]] == [
        ("ext.kv_memory_layout", "NHD", "HND")]
    assert "token-major" in ev["reasons"][0]["meaning"]
    assert ev["used"] == 0 and client.wait() == 0
    stats = server.stop()
    assert stats is not None and stats["bytes_sent"] == 0
    assert stats["refused"] == {"kv_memory_layout_mismatch": 1}


def test_equal_declarations_share_and_show_the_peer_extension(nodes: Any) -> None:
    ext = {"kv_memory_layout": "LBHNC", "model_revision": "5f2b1c0",
           "key_hash": key_hash_identity("sha256", "vllm-none-hash")}
    server = nodes({**SPEC, "ext": {**ext, "engine": "vllm 0.32.0"}})
    client = nodes({**SPEC, "ext": {**ext, "kv_memory_layout": "HND", "engine": "vllm 0.33"}})
    keys = keys_for(4)
    for key in keys:
        server.put(key, content(key, server.layout.bytes_per_block))
    peer = client.connect(server.address)  # LBHNC is vLLM's name for HND; engines may differ
    assert peer.remote_extension.kv_memory_layout == "HND"
    assert peer.remote_extension.engine == "vllm 0.32.0"
    assert peer.fetch(keys).outcomes == (KeyOutcome.STORED,) * 4
    assert client.stats().identity_undeclared == {} == server.stats().identity_undeclared


def test_nothing_declared_on_either_side_shares_as_before(nodes: Any) -> None:
    a = nodes(SPEC)
    b = nodes(SPEC)
    peer = a.connect(b.address)
    assert peer.remote_extension == IdentityExtension()
    assert b.stats().handshakes_refused == {} and a.stats().identity_undeclared == {}


def test_one_sided_declaration_strict_refuses_lenient_warns_and_counts(
        nodes: Any, caplog: pytest.LogCaptureFixture) -> None:
    declared = {**SPEC, "ext": {"kv_memory_layout": "NHD"}}
    strict_bare = nodes(SPEC)
    a = nodes(declared)
    with pytest.raises(PeerIncompatible) as info:
        a.connect(strict_bare.address)
    (reason,) = info.value.reasons
    assert (reason.field, reason.ours, reason.theirs) == ("ext.kv_memory_layout", "NHD", ABSENT)
    assert int(reason.code) == proto.Code.EXTENSION_UNDECLARED
    assert "identity_policy = \"lenient\"" in reason.meaning
    assert strict_bare.stats().handshakes_refused == {"extension_undeclared": 1}

    lenient = {"identity_policy": "lenient"}
    server = nodes(SPEC, **lenient)
    client = nodes(declared, **lenient)
    key = keys_for(1)[0]
    server.put(key, content(key, server.layout.bytes_per_block))
    with caplog.at_level(logging.WARNING, logger="p2pkv.node"):
        peer = client.connect(server.address)
        assert peer.fetch([key]).stored == [key]
    assert server.stats().identity_undeclared == {"kv_memory_layout": 1}
    assert client.stats().identity_undeclared == {"kv_memory_layout": 1}
    assert server.stats().handshakes_refused == {}
    warned = [r.getMessage() for r in caplog.records if "identity_policy=lenient" in
              r.getMessage()]
    assert len(warned) == 2 and all("ext.kv_memory_layout" in w for w in warned)


def test_lenient_does_not_excuse_a_difference(nodes: Any) -> None:
    a = nodes({**SPEC, "ext": {"model_revision": "r1"}}, identity_policy="lenient")
    b = nodes({**SPEC, "ext": {"model_revision": "r2"}}, identity_policy="lenient")
    with pytest.raises(PeerIncompatible) as info:
        a.connect(b.address)
    assert [r.field for r in info.value.reasons] == ["ext.model_revision"]


def _hello_1_0(node: Any) -> dict[str, Any]:
    """A hello as a protocol 1.0 node writes it: minor 0 and no ext map."""
    h = node.hello
    return {"t": "hello", "v": 1, "node": "old-node", "minor": 0, "rc": h.rc, "fp": h.fp,
            "geo": {"bpb": h.geo.bpb, "seg": list(h.geo.seg)},
            "khash": {"algo": h.khash.algo, "seed": h.khash.seed}, "caps": list(h.caps)}


@pytest.mark.parametrize("policy", ["strict", "lenient"])
def test_a_1_0_client(nodes: Any, policy: str) -> None:
    server = nodes({**SPEC, "ext": {"kv_memory_layout": "HND"}}, identity_policy=policy)
    raw = RawPeer(server.address)
    try:
        raw.send_map(_hello_1_0(server))
        if policy == "lenient":
            welcome = raw.expect(proto.Welcome)
            assert welcome.minor == proto.PROTOCOL_MINOR
            assert welcome.ext == IdentityExtension(kv_memory_layout="HND")
            raw.segments = tuple(welcome.geo.seg)
            assert raw.alive()
            assert server.stats().identity_undeclared == {"kv_memory_layout": 1}
        else:
            refuse = raw.expect(proto.Refuse)
            assert [(r.field, r.code, r.ours, r.theirs) for r in refuse.reasons] == [
                ("ext.kv_memory_layout", proto.Code.EXTENSION_UNDECLARED, "HND", ABSENT)]
            assert "speaks protocol 1.0" in refuse.reasons[0].meaning
            assert server.stats().handshakes_refused == {"extension_undeclared": 1}
    finally:
        raw.close()


@pytest.mark.parametrize("policy", ["strict", "lenient"])
def test_a_1_0_server(nodes: Any, policy: str) -> None:
    client = nodes({**SPEC, "ext": {"model_revision": "5f2b1c0"}}, identity_policy=policy)
    old = FakeServer(dataclasses.replace(client.hello, minor=0, ext=None))
    try:
        if policy == "lenient":
            peer = client.connect(old.address)
            assert peer.remote_extension.is_empty
            assert client.stats().identity_undeclared == {"model_revision": 1}
        else:
            with pytest.raises(PeerIncompatible) as info:
                client.connect(old.address)
            (reason,) = info.value.reasons
            assert (reason.field, reason.theirs) == ("ext.model_revision", ABSENT)
            assert "speaks protocol 1.0" in reason.meaning
            # The 1.0 server is told why, too.
            assert wait_until(lambda: any(type(m) is proto.Refuse for m in old.received), 5)
        assert old.errors == []
    finally:
        old.close()

"""What protocol/SPEC.md says a node does, checked against a live node.

Sessions end as §2 "Ending a session" says (a refused connection stays open and takes a
new ``hello``), keys of another derivation travel under their own ``khash.algo`` (§15.2),
the heartbeat default of ``p2pkv-node`` is the one §8 gives, and the appendix A example
is the one in ``vectors/fill.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from nodeproc import content, keys_for, make_node
from rawpeer import RawPeer, raw_hello

from p2pkv import protocol as proto
from p2pkv.cli import node_config
from p2pkv.errors import ConfigError, PeerIncompatible
from p2pkv.node import Node
from p2pkv.protocol import Code
from p2pkv.settings import load_settings

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"layout": "v2", "geometry": "small", "blocks": 4}


@pytest.fixture
def server() -> Iterator[Node]:
    node = make_node(SMALL)
    for key in keys_for(4):
        node.put(key, content(key, node.layout.bytes_per_block))
    yield node
    node.close(timeout=1.0)


def test_a_refused_connection_takes_a_new_hello(server: Node) -> None:
    raw = RawPeer(server.address)
    try:
        wrong = dataclasses.replace(raw_hello(server), khash=proto.KeyHash("xxh3-128", 99))
        raw.send_msg(wrong)
        refuse = raw.expect(proto.Refuse)
        assert refuse.code == Code.KEY_HASH_SEED_MISMATCH
        # Same DEALER, same TCP connection: the server discarded the refused session,
        # and a new hello starts a new handshake.
        raw.handshake(server)
        raw.send_msg(proto.Lookup(1, tuple(keys_for(2))))
        hits = raw.expect(proto.Hits)
        assert hits.req == 1 and hits.hits == (True, True)
    finally:
        raw.close()


def test_after_a_bye_the_next_message_meets_a_fresh_session(server: Node) -> None:
    raw = RawPeer(server.address)
    try:
        raw.handshake(server)
        raw.send_msg(proto.Bye(Code.NORMAL_CLOSE, "done"))
        # Anything but a hello is refused as UNEXPECTED by the new session; this also
        # proves the bye was processed (the reply comes in order on this connection).
        raw.send_msg(proto.Lookup(1, tuple(keys_for(1))))
        refuse = raw.expect(proto.Refuse)
        assert refuse.code == Code.UNEXPECTED and "lookup" in refuse.msg
        raw.handshake(server)
        assert raw.alive()
    finally:
        raw.close()


def test_keys_of_another_derivation_use_their_own_algo_name() -> None:
    engine = make_node(SMALL, key_hash_algo="vllm-sha256_cbor")
    plain = make_node(SMALL)
    try:
        assert engine.hello.khash.algo == "vllm-sha256_cbor"
        with pytest.raises(PeerIncompatible) as info:
            plain.connect(engine.address)
        assert [r.field for r in info.value.reasons] == ["key_hash.algo"]
        # Keys are opaque: an engine's own 32-byte hashes are served as they are.
        other = make_node(SMALL, key_hash_algo="vllm-sha256_cbor")
        try:
            key = bytes(range(32))
            engine.put(key, content(key, engine.layout.bytes_per_block))
            assert other.connect(engine.address).lookup([key]) == [True]
        finally:
            other.close(timeout=1.0)
    finally:
        engine.close(timeout=1.0)
        plain.close(timeout=1.0)


@pytest.mark.parametrize("algo", ["", "x" * 65, 5])
def test_bad_key_hash_algo_is_a_configuration_error(algo: object) -> None:
    from p2pkv.node import NodeConfig

    with pytest.raises(ConfigError, match="key_hash_algo"):
        NodeConfig(key_hash_algo=algo)  # type: ignore[arg-type]


def test_cli_heartbeat_interval_follows_section_8() -> None:
    assert node_config(load_settings({}, environ={})).heartbeat_interval == 1.0
    short = load_settings({"heartbeat_timeout": "2"}, environ={})
    assert node_config(short).heartbeat_interval == 0.5
    spec = (ROOT / "protocol" / "SPEC.md").read_text(encoding="utf-8")
    assert "| heartbeat interval | 1 s (`p2pkv-node`: the smaller of 1 s and a quarter" in spec


def test_appendix_a_example_is_the_vector() -> None:
    spec = (ROOT / "protocol" / "SPEC.md").read_text(encoding="utf-8")
    appendix = spec.split("## Appendix A.", 1)[1]
    vector = next(v for v in json.loads((ROOT / "protocol/vectors/fill.json").read_text())
                  ["vectors"] if v["name"] == "seed_geometry_589824_bytes")
    block0 = vector["blocks"][0]
    assert f"`{block0['key']}`" in appendix
    assert f"`{block0['first_bytes'][:32]}`" in appendix

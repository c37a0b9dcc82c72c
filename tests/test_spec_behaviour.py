"""What protocol/SPEC.md says a node does, checked against a live node.

Sessions end as §2 "Ending a session" says (a refused connection stays open and takes a
new ``hello``), keys of another derivation travel under their own ``khash.algo`` (§15.2),
the heartbeat default of ``p2pkv-node`` is the one §8 gives, and the appendix A example
is the one in ``vectors/fill.json``. The clarifications of protocol 1.1 are held here
too: a silent peer past its heartbeat timeout (§8), ``shm`` in a ``hello`` (§4.1), the
``shm-v1`` messages without the capability (§16.5), the order of ``welcome.caps`` (§6),
a strict node that declares nothing (§5), the page and boot id of a segment (§16.2).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from nodeproc import content, keys_for, make_node
from rawpeer import RawPeer, raw_hello

from p2pkv import protocol as proto
from p2pkv.cli import node_config
from p2pkv.errors import ConfigError, PeerIncompatible, ProtocolError
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


# ------------------------------------------------------------- protocol 1.1 clarifications


def test_a_peer_past_its_heartbeat_timeout_gets_bye_303_or_the_cut() -> None:
    """§8: a peer that reads (it gets every ping) but never answers is sent bye 303 and
    its connection is cut at once; whether the bye arrives first is a race."""
    from zmq.utils.monitor import recv_monitor_message

    node = make_node(SMALL, heartbeat_interval=0.2, heartbeat_timeout=1.0)
    raw = RawPeer(node.address, monitor=True)
    try:
        raw.handshake(node)
        assert raw.monitor is not None
        start = time.monotonic()
        pings, others, cut_after = 0, [], None
        while cut_after is None and time.monotonic() - start < 5.0:
            frames = raw.recv(0.02)
            if frames is not None:
                msg = proto.decode(frames, raw.segments)
                if type(msg) is proto.Ping:
                    pings += 1
                else:
                    others.append(msg)
            while raw.monitor.poll(0):
                if recv_monitor_message(raw.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                    cut_after = time.monotonic() - start
        assert cut_after is not None, "the node never closed the silent peer's connection"
        assert 0.9 <= cut_after < 3.0, cut_after
        assert pings >= 2  # it did read: the node pinged it before giving up
        assert all(type(m) is proto.Bye and m.code == Code.PEER_TIMEOUT for m in others), others
        assert len(others) <= 1
    finally:
        raw.close()
        node.close(timeout=1.0)


def test_shm_in_a_hello_is_decoded_then_ignored(server: Node) -> None:
    """§4.1: a well-formed ``shm`` in a hello is ignored, a malformed one is a decoding
    error (vector ``hello_shm_without_name``: MISSING_FIELD 201, answered with refuse)."""
    offer = proto.ShmOffer("p2pkv-1-2-0011223344556677", 4096)
    raw = RawPeer(server.address)
    try:
        raw.send_msg(dataclasses.replace(raw_hello(server), shm=offer))
        welcome = raw.expect(proto.Welcome)
        assert welcome.shm is None and "shm-v1" not in welcome.caps
    finally:
        raw.close()
    raw = RawPeer(server.address)
    try:
        head = msgpack.unpackb(proto.encode_head(raw_hello(server)), raw=False)
        raw.send_map({**head, "shm": {"size": 1}})
        refuse = raw.expect(proto.Refuse)
        assert refuse.code == Code.MISSING_FIELD and "name" in refuse.msg
    finally:
        raw.close()


def test_a_hello_that_carries_data_is_read_and_its_data_ignored(server: Node) -> None:
    """§18.1: a hello MUST NOT carry ``data``; one that carries a well-formed one is
    decoded by the same rules (the vector ``hello_carries_data_decoded_then_ignored``)
    and the server ignores it: the welcome offers the server's own stream, whose token
    is not the client's, and the session is served as any other."""
    raw = RawPeer(server.address)
    try:
        forged = proto.DataOffer(1, bytes(16), 2)
        raw.send_msg(dataclasses.replace(raw_hello(server), data=forged))
        welcome = raw.expect(proto.Welcome)
        raw.segments = tuple(welcome.geo.seg)
        assert welcome.data is not None and welcome.data.token != forged.token
        assert welcome.data.port == server.stats().data_port
        raw.send_msg(proto.Lookup(1, tuple(keys_for(4))))
        assert raw.expect(proto.Hits).hits == (True,) * 4
        assert server.stats().protocol_violations == 0
    finally:
        raw.close()


def test_an_error_naming_a_running_fetch_ends_it_and_nothing_else(server: Node) -> None:
    """§4.15: an ``error`` for a request ends that request. A client that says so of a
    fetch being served gets no more of its blocks, and its session goes on: the node
    answers the next ping and lookup, counts no violation, and pins nothing for it."""
    raw = RawPeer(server.address)
    try:
        raw.handshake(server)
        keys = tuple(keys_for(4))
        raw.send_msg(proto.Fetch(1, keys, 1))  # a window of one block: the rest waits
        assert raw.expect(proto.Block).req == 1
        raw.send_msg(proto.Error(1, Code.UNAVAILABLE, "the client gave up on it"))
        raw.send_msg(proto.Credit(1, 3))  # late: the request is over, not a violation
        raw.send_msg(proto.Ping(7))
        assert raw.expect(proto.Pong).nonce == 7
        raw.send_msg(proto.Lookup(2, keys))
        assert raw.expect(proto.Hits).hits == (True,) * 4
        assert server.stats().protocol_violations == 0
        assert server.store.stats().pinned == 0
    finally:
        raw.close()


def test_shm_v1_messages_without_the_capability(server: Node) -> None:
    """§16.5: release naming a never-opened request is UNKNOWN_REQUEST 208 (not 205), a
    fetch with shm true is served with blocks, a release for it is ignored, an attach
    is UNEXPECTED 205."""
    raw = RawPeer(server.address)
    try:
        welcome = raw.handshake(server)
        assert "shm-v1" not in welcome.caps
        raw.send_map({"t": "release", "v": 1, "req": 77, "idx": [0]})
        bye = raw.expect(proto.Bye)
        assert bye.code == Code.UNKNOWN_REQUEST
    finally:
        raw.close()
    raw = RawPeer(server.address)
    try:
        raw.handshake(server)
        raw.send_msg(proto.Fetch(1, tuple(keys_for(2)), 16, shm=True))
        got = []
        while not got or type(got[-1]) is not proto.Done:
            got.append(raw.recv_msg())
        assert {type(m) for m in got[:-1]} == {proto.Block}
        assert got[-1].outcomes == (0, 0)
        raw.send_map({"t": "release", "v": 1, "req": 1, "idx": [0, 1]})
        assert raw.alive()  # ignored: nothing was pinned
        raw.send_msg(proto.Attach(bytes(16)))
        bye = raw.expect(proto.Bye)
        assert bye.code == Code.UNEXPECTED
    finally:
        raw.close()


def test_welcome_lists_the_negotiated_capabilities_sorted(server: Node) -> None:
    """§6: the intersection of both offers, each once, sorted by code point; the
    client's order and its unknown names do not matter."""
    raw = RawPeer(server.address)
    try:
        offer = ("x-unknown", "packed-v1", "checksum-xxh3-64", "packed-v1")
        raw.send_msg(dataclasses.replace(raw_hello(server), caps=offer))
        welcome = raw.expect(proto.Welcome)
        assert welcome.caps == ("checksum-xxh3-64", "packed-v1")
    finally:
        raw.close()


EXT = {"kv_memory_layout": "HND", "key_hash": "sha256:0123456789abcdef",
       "engine": "vllm 0.32.0"}


@pytest.mark.parametrize(("plain_policy", "declaring_policy", "meet"), [
    ("strict", "strict", False), ("strict", "lenient", False),
    ("lenient", "strict", False), ("lenient", "lenient", True),
])
def test_a_strict_node_that_declares_nothing_refuses_a_declaring_peer(
        plain_policy: str, declaring_policy: str, meet: bool) -> None:
    """§5: a field only one side declares refuses every strict side, whichever side
    declares it; only lenient on both sides lets them meet."""
    plain = make_node(SMALL, identity_policy=plain_policy)
    declaring = make_node({**SMALL, "ext": EXT}, identity_policy=declaring_policy)
    try:
        for client, target in ((plain, declaring), (declaring, plain)):
            if meet:
                assert client.connect(target.address).lookup(keys_for(1)) == [False]
                continue
            with pytest.raises(PeerIncompatible) as info:
                client.connect(target.address)
            assert [(int(r.code), r.field) for r in info.value.reasons] == [
                (113, "ext.kv_memory_layout"), (113, "ext.key_hash")]
    finally:
        plain.close(timeout=1.0)
        declaring.close(timeout=1.0)


def test_segment_pages_are_4096_bytes_and_the_boot_id_is_in_text_order() -> None:
    """§16.2: regions start at multiples of 4096 bytes whatever the system page size;
    the boot id is the UUID's 16 bytes in the order its text writes them."""
    from p2pkv.shm import SHM_DIR, SharedSegment, ShmUnavailable, host_identity
    from p2pkv.shm.segment import header_bytes

    assert [header_bytes(n) for n in (1, 250, 251, 1024)] == [4096, 4096, 8192, 20480]
    vector = json.loads((ROOT / "protocol/vectors/shm.json").read_text())["headers"][0]
    assert bytes.fromhex(vector["bytes"])[32:48].hex() == vector["boot_id"]
    boot = Path("/proc/sys/kernel/random/boot_id")
    if not boot.exists() or not SHM_DIR.is_dir():
        pytest.skip("needs Linux /proc and /dev/shm")
    assert host_identity().boot_id == bytes.fromhex(boot.read_text().strip().replace("-", ""))
    try:
        segment = SharedSegment([100, 28], 3)
    except ShmUnavailable as exc:
        pytest.skip(f"no shared memory here: {exc}")
    try:
        assert segment.region_offsets == (4096, 8192) and segment.size == 12288
    finally:
        segment.close()


def test_a_packed_block_has_one_frame_before_the_segments_are_known() -> None:
    """§3.1 step 7: the count is checked without the segments, the size only with them."""
    head = proto.encode_head(proto.Block(1, (0, 1), (None, None), (), True))
    assert proto.decode([head, bytes(3)], None).pk
    for payload in ([], [bytes(3), bytes(3)]):
        with pytest.raises(ProtocolError) as info:
            proto.decode([head, *payload], None)
        assert info.value.code == Code.FRAME_COUNT

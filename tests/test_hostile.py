"""Hostile peers and a hostile network (issue 8).

A live node (in this process, so its counters can be read) is attacked through raw
ZeroMQ DEALER sockets: random frames (Hypothesis), undecodable and truncated input,
oversize frames, valid messages in the wrong state, request-id abuse and floods beyond
every configured limit. The node must never crash or hang, must answer the offender as
SPEC §3/§7/§9 say (the replies are decoded and their codes checked), and a well-behaved
peer connected at the same time must keep getting byte-exact lookups and fetches.

An intercepting proxy flips bytes in ``block`` payloads between a consumer and a
producer: with ``checksum-xxh3-64`` negotiated, every corrupted block is dropped and
reported FAILED per key, the rest is STORED byte-exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
from fuzzkit import Exerciser, examples
from hypothesis import HealthCheck, given, settings
from internals import io_thread_alive, max_message_bytes
from nodeproc import content, keys_for, make_node
from rawpeer import CorruptingProxy, GoodPeer, RawPeer, packed, raw_hello, wait_until

from p2pkv import KeyOutcome
from p2pkv import protocol as proto
from p2pkv.errors import P2PKVError, PeerGone
from p2pkv.node import Node
from p2pkv.protocol import CAP_CHECKSUM_XXH3_64, Code

pytestmark = pytest.mark.timeout(120)

SMALL = {"layout": "v2", "geometry": "small"}
SEED_V2 = {"layout": "v2", "geometry": "seed"}
NBLOCKS = 8


@dataclass
class Env:
    server: Node
    keys: list[bytes]
    good: GoodPeer

    def raw(self, handshake: bool = True, **kw: Any) -> RawPeer:
        peer = RawPeer(self.server.address, **kw)
        self._raws.append(peer)
        if handshake:
            peer.handshake(self.server)
        return peer

    def __post_init__(self) -> None:
        self._raws: list[RawPeer] = []

    def close(self) -> None:
        for peer in self._raws:
            peer.close()

    def assert_healthy(self, min_rounds: int = 1) -> None:
        """The node's IO thread lives, a fresh raw peer gets a pong, the good peer did
        only good rounds (at least ``min_rounds``) and still works after the abuse."""
        assert io_thread_alive(self.server), "the node's IO thread died"
        fresh = self.raw()
        assert fresh.alive(), "a fresh, well-behaved connection gets no pong"
        self.good.check(min_rounds)
        self.good.one_round()
        assert not self.good.errors, self.good.errors


@pytest.fixture
def hostile() -> Iterator[Any]:
    """``hostile(**server_config)``: a serving node with NBLOCKS blocks and a good peer."""
    nodes: list[Node] = []
    envs: list[Env] = []

    def build(**config: Any) -> Env:
        server = make_node({**SMALL, "blocks": NBLOCKS}, **config)
        nodes.append(server)
        keys = keys_for(NBLOCKS)
        for k in keys:
            server.put(k, content(k, server.layout.bytes_per_block))
        client = make_node({**SMALL, "blocks": 4})
        nodes.append(client)
        env = Env(server, keys, GoodPeer(client, server.address, keys))
        envs.append(env)
        return env

    yield build
    for env in envs:
        env.good.stop()
        env.close()
    for node in nodes:
        node.close(timeout=1.0)


# ---------------------------------------------------------------------- random input


def test_random_frames_never_hurt_the_node(hostile: Any) -> None:
    env = hostile()
    exerciser = Exerciser(env.server)

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(examples(env.keys))
    def run(example: Any) -> None:
        exerciser.run(example)

    try:
        run()
    finally:
        exerciser.close()
    assert exerciser.stats["example:raw"] > 20 and exerciser.stats["example:session"] > 20
    assert exerciser.stats["refuse:200"] > 0  # undecodable input was refused as MALFORMED
    assert env.server.stats().protocol_violations > 0
    env.assert_healthy(min_rounds=3)


# ---------------------------------------------------------------------- undecodable

LOOKUP = {"t": "lookup", "v": 1, "req": 1, "keys": [b"\x01" * 20]}
UNDECODABLE = [
    ("not-msgpack", [b"\xc1\x00\x17"], Code.MALFORMED),
    ("empty-frame", [b""], Code.MALFORMED),
    ("truncated-map", [packed(LOOKUP)[:-3]], Code.MALFORMED),
    ("trailing-bytes", [packed(LOOKUP) + b"\x00"], Code.MALFORMED),
    ("array", [packed([1, 2, 3])], Code.MALFORMED),
    ("int", [packed(7)], Code.MALFORMED),
    ("str", [packed("lookup")], Code.MALFORMED),
    ("missing-t", [packed({"v": 1, "req": 1})], Code.MISSING_FIELD),
    ("t-not-str", [packed({"t": 5, "v": 1})], Code.WRONG_TYPE),
    ("bool-as-int", [packed({**LOOKUP, "req": True})], Code.WRONG_TYPE),
    ("key-too-long", [packed({**LOOKUP, "keys": [b"x" * 65]})], Code.OUT_OF_BOUNDS),
    ("payload-on-lookup", [packed(LOOKUP), b"stray"], Code.FRAME_COUNT),
    ("block-without-payload",
     [packed({"t": "block", "v": 1, "req": 1, "idx": [0], "sums": [None]})],
     Code.FRAME_COUNT),
    ("major-2", [packed({**LOOKUP, "v": 2})], Code.PROTOCOL_MAJOR_MISMATCH),
]


@pytest.mark.parametrize(("frames", "code"), [(f, c) for _, f, c in UNDECODABLE],
                         ids=[n for n, _, _ in UNDECODABLE])
def test_undecodable_input_is_refused_or_byed_with_its_code(
        hostile: Any, frames: list[bytes], code: int) -> None:
    env = hostile()
    # Before the handshake: refuse with the code, the session is dropped.
    pre = env.raw(handshake=False)
    pre.send(frames)
    refuse = pre.expect(proto.Refuse)
    assert refuse.code == code, refuse
    assert refuse.fp == env.server.fingerprint  # the refuser says who it is
    # After the handshake: bye with the code, and the session is gone (a ping now meets
    # a fresh session that has not seen a hello).
    post = env.raw()
    post.send(frames)
    bye = post.expect(proto.Bye)
    assert bye.code == code, bye
    post.send_msg(proto.Ping(1))
    assert post.expect(proto.Refuse).code == Code.UNEXPECTED
    # Nothing else was sent after the refusals: the next message on each connection is
    # the answer to the next thing we send (replies on one connection come in order).
    for raw in (pre, post):
        raw.send_msg(proto.Ping(2))
        assert raw.expect(proto.Refuse).code == Code.UNEXPECTED
    env.assert_healthy()


def test_unknown_type_after_handshake_is_answered_and_not_fatal(hostile: Any) -> None:
    env = hostile()
    raw = env.raw()
    raw.send([packed({"t": "frobnicate", "v": 1, "x": [1, 2]})])
    err = raw.expect(proto.Error)
    assert err.code == Code.UNKNOWN_TYPE and err.req is None
    assert raw.alive()
    env.assert_healthy()


def test_partial_multipart_from_a_dying_sender_is_never_delivered(hostile: Any) -> None:
    """A DEALER that sent the first frame of a multipart (SNDMORE) and was closed: ZeroMQ
    delivers whole messages only, so the node sees nothing and nothing breaks."""
    env = hostile()
    violations = env.server.stats().protocol_violations
    for _ in range(20):
        raw = RawPeer(env.server.address)
        raw.handshake(env.server)
        raw.sock.send(packed(LOOKUP), zmq.SNDMORE)
        raw.close()
    # Each of those connections completed its handshake, so the node read everything
    # they delivered up to then; a fresh round trip after them shows the node still
    # answers, and no partial message was ever counted as a violation.
    env.assert_healthy()
    assert env.server.stats().protocol_violations == violations


def test_oversize_frame_makes_libzmq_drop_the_connection(hostile: Any) -> None:
    env = hostile()
    raw = env.raw(monitor=True)
    limit = max_message_bytes(env.server)  # MAXMSGSIZE of the node's sockets
    raw.send([b"\x00" * (limit + 1)])
    events = raw.monitor_events(5.0)
    assert zmq.EVENT_DISCONNECTED in events, events
    env.assert_healthy()


# ---------------------------------------------------------------------- wrong state

PRE = "before-handshake"
POST = "after-handshake"


def _wrong_state_cases() -> list[tuple[str, str]]:
    return [(PRE, "lookup"), (PRE, "welcome"), (PRE, "fetch"), (PRE, "hits"),
            (POST, "hello"), (POST, "welcome"), (POST, "block"), (POST, "hits"),
            (POST, "done"), (POST, "abort_ack")]


@pytest.mark.parametrize(("when", "tag"), _wrong_state_cases())
def test_valid_message_in_wrong_state(hostile: Any, when: str, tag: str) -> None:
    env = hostile()
    server = env.server
    key = env.keys[0]
    size = server.layout.segment_sizes
    messages: dict[str, list[bytes]] = {
        "lookup": [bytes(f) for f in proto.encode(proto.Lookup(1, (key,)))],
        "fetch": [bytes(f) for f in proto.encode(proto.Fetch(1, (key,), 4))],
        "hits": [bytes(f) for f in proto.encode(proto.Hits(1, (True,)))],
        "done": [bytes(f) for f in proto.encode(proto.Done(1, (0,)))],
        "abort_ack": [bytes(f) for f in proto.encode(proto.AbortAck(1))],
        "hello": [bytes(f) for f in proto.encode(raw_hello(server))],
        "welcome": [bytes(f) for f in proto.encode(proto.Welcome(
            *(getattr(server.hello, n) for n in
              ("node", "minor", "rc", "fp", "geo", "khash", "caps", "limits"))))],
        "block": [bytes(f) for f in proto.encode(proto.Block(
            1, (0,), (0,), tuple(b"\x00" * n for n in size)))],
    }
    raw = env.raw(handshake=(when == POST))
    raw.send(messages[tag])
    reply = raw.expect(proto.Refuse if when == PRE else proto.Bye)
    assert reply.code == Code.UNEXPECTED, reply
    assert tag in reply.msg
    env.assert_healthy()


@pytest.mark.parametrize("case", ["credit-unknown", "abort-unknown", "duplicate-req"])
def test_request_id_abuse_is_fatal_with_its_code(hostile: Any, case: str) -> None:
    env = hostile()
    raw = env.raw()
    if case == "credit-unknown":
        raw.send_msg(proto.Credit(77, 1))
        expected = Code.UNKNOWN_REQUEST
    elif case == "abort-unknown":
        raw.send_msg(proto.Abort(77))
        expected = Code.UNKNOWN_REQUEST
    else:
        raw.send_msg(proto.Fetch(5, tuple(env.keys[:3]), 1))  # stays open: window 1
        assert raw.expect(proto.Block).req == 5
        raw.send_msg(proto.Lookup(5, (env.keys[0],)))
        expected = Code.DUPLICATE_REQUEST
    bye = raw.recv_msg()
    assert type(bye) is proto.Bye and bye.code == expected, bye
    env.assert_healthy()


# ---------------------------------------------------------------------- floods/limits


@pytest.mark.slow
def test_lookup_flood_without_reading(hostile: Any) -> None:
    """Thousands of lookups sent without reading a reply: every one is answered, in
    order, correctly, and the good peer keeps working meanwhile."""
    env = hostile()
    raw = env.raw()
    absent = keys_for(1, offset=777)[0]
    n = 5000
    for req in range(1, n + 1):
        raw.send_msg(proto.Lookup(req, (env.keys[req % NBLOCKS], absent)))
    assert env.good.peer.lookup(env.keys) == [True] * NBLOCKS  # not starved meanwhile
    for req in range(1, n + 1):
        hits = raw.expect(proto.Hits, timeout=10)
        assert hits.req == req and hits.hits == (True, False), hits
    assert raw.alive()
    env.assert_healthy()


def test_more_requests_than_max_inflight(hostile: Any) -> None:
    env = hostile(max_inflight_requests=4)
    raw = env.raw(handshake=False)
    welcome = raw.handshake(env.server)
    assert welcome.limits is not None and welcome.limits.in_flight == 4
    # Fetches with window 1 over 2 blocks stay open (no credit is ever granted).
    for req in range(1, 7):
        raw.send_msg(proto.Fetch(req, tuple(env.keys[:2]), 1))
    blocks: set[int] = set()
    errors: dict[int, int] = {}
    while len(blocks) + len(errors) < 6:
        msg = raw.recv_msg()
        if type(msg) is proto.Block:
            blocks.add(msg.req)
        else:
            assert type(msg) is proto.Error and msg.req is not None, msg
            errors[msg.req] = msg.code
    assert blocks == {1, 2, 3, 4}
    assert errors == {5: Code.TOO_MANY_IN_FLIGHT, 6: Code.TOO_MANY_IN_FLIGHT}
    # Not fatal: the connection works, and finishing one request frees a slot.
    assert raw.alive()
    raw.send_msg(proto.Abort(1))
    assert raw.expect(proto.AbortAck).req == 1
    raw.send_msg(proto.Lookup(7, (env.keys[0],)))
    assert raw.expect(proto.Hits).req == 7
    env.assert_healthy()


def test_more_keys_than_max_keys_per_request(hostile: Any) -> None:
    env = hostile(max_keys_per_request=8)
    raw = env.raw(handshake=False)
    welcome = raw.handshake(env.server)
    assert welcome.limits is not None and welcome.limits.max_keys == 8
    keys = tuple(keys_for(9, offset=100))
    raw.send_msg(proto.Lookup(1, keys))
    err = raw.expect(proto.Error)
    assert err.req == 1 and err.code == Code.OUT_OF_BOUNDS, err
    raw.send_msg(proto.Fetch(2, keys, 4))
    err = raw.expect(proto.Error)
    assert err.req == 2 and err.code == Code.OUT_OF_BOUNDS, err
    raw.send_msg(proto.Lookup(3, keys[:8]))
    assert raw.expect(proto.Hits).hits == (False,) * 8
    env.assert_healthy()


def test_client_node_against_server_key_limit(hostile: Any) -> None:
    """A Node whose own limit is larger than the server's advertised max_keys: what the
    caller gets for an over-long lookup/fetch (the node does not split requests)."""
    env = hostile(max_keys_per_request=8)
    client = make_node({**SMALL, "blocks": 16})
    try:
        peer = client.connect(env.server.address)
        keys = keys_for(9, offset=100)
        with pytest.raises((ValueError, P2PKVError)) as info:
            peer.lookup(keys)
        assert "8" in str(info.value)
        with pytest.raises((ValueError, P2PKVError)):
            peer.fetch(keys)
        assert peer.lookup(keys[:8]) == [False] * 8
    finally:
        client.close(timeout=1.0)
    env.assert_healthy()


def test_more_peers_than_max_peers(hostile: Any) -> None:
    env = hostile(max_peers=3)  # the good peer holds one slot
    first = env.raw()
    env.raw()
    late = env.raw(handshake=False)
    late.send_msg(raw_hello(env.server, "late"))
    bye = late.expect(proto.Bye)
    assert bye.code == Code.UNAVAILABLE and "peer limit" in bye.msg, bye
    client = make_node({**SMALL, "blocks": 4})
    try:
        with pytest.raises(PeerGone):
            client.connect(env.server.address)
        # One peer leaves: its slot is free again.
        peers_in = env.server.stats().peers_in
        first.send_msg(proto.Bye(Code.NORMAL_CLOSE, "leaving"))
        assert wait_until(lambda: env.server.stats().peers_in < peers_in, 30)
        peer = client.connect(env.server.address)
        assert peer.lookup(env.keys[:2]) == [True, True]
    finally:
        client.close(timeout=1.0)
    env.assert_healthy()


# ---------------------------------------------------------------------- integrity


@pytest.fixture
def pair() -> Iterator[Any]:
    """``pair(spec, blocks, producer_cfg, consumer_cfg)``: producer, consumer, a proxy."""
    made: list[Any] = []

    def build(spec: dict[str, Any], blocks: int, producer_cfg: dict[str, Any],
              consumer_cfg: dict[str, Any]) -> tuple[Node, Node, CorruptingProxy, list[bytes]]:
        producer = make_node({**spec, "blocks": blocks}, **producer_cfg)
        made.append(producer)
        keys = keys_for(blocks)
        for k in keys:
            producer.put(k, content(k, producer.layout.bytes_per_block))
        consumer = make_node({**spec, "blocks": blocks}, **consumer_cfg)
        made.append(consumer)
        proxy = CorruptingProxy(producer.address, every=3, first=2)
        made.append(proxy)
        return producer, consumer, proxy, keys

    yield build
    for thing in reversed(made):
        if isinstance(thing, CorruptingProxy):
            thing.close()
        else:
            thing.close(timeout=1.0)


@pytest.mark.parametrize("spec", [SEED_V2, SMALL], ids=["seed-v2-one-block-per-msg",
                                                         "small-batched"])
def test_corrupted_blocks_fail_per_key_and_never_become_visible(
        pair: Any, spec: dict[str, Any]) -> None:
    blocks = 24
    _, consumer, proxy, keys = pair(spec, blocks, {}, {})
    peer = consumer.connect(proxy.address)
    assert CAP_CHECKSUM_XXH3_64 in peer.capabilities
    before = consumer.store.stats().checksum_failures
    result = peer.fetch(keys)
    assert not proxy.errors, proxy.errors
    bad = set(proxy.corrupted)
    assert len(bad) == blocks // 3, (len(bad), proxy.blocks_seen)
    size = consumer.layout.bytes_per_block
    for i, (key, outcome) in enumerate(zip(keys, result.outcomes, strict=True)):
        if key in bad:
            assert outcome is KeyOutcome.FAILED, (i, outcome)
            assert "checksum" in result.errors[i].lower(), result.errors[i]
            assert consumer.lookup_local([key]) == [False] and consumer.get(key) is None
        else:
            assert outcome is KeyOutcome.STORED, (i, outcome, result.errors.get(i))
            assert consumer.get(key) == content(key, size)
    assert consumer.store.stats().checksum_failures - before == len(bad)
    assert consumer.stats().checksum_failures == len(bad)
    st = consumer.store.stats()
    assert st.stored == st.used == blocks - len(bad) and st.pinned == 0
    # The connection stays open (SPEC §6): a retry through a clean path works.
    assert peer.lookup(keys) == [True] * blocks


@pytest.mark.parametrize("off", ["consumer", "producer"])
def test_without_checksums_corruption_goes_undetected(pair: Any, off: str) -> None:
    """NodeConfig(checksums=False) on either side: the capability is negotiated only when
    both offer it, so it is absent from PeerHandle.capabilities and every ``block``
    carries nil sums. Consequence: a byte flipped in transit is NOT detected — the
    corrupted block is reported STORED and becomes visible with wrong bytes; only TCP's
    own checksum (and CURVE, when used, which authenticates every frame) protects the
    data then. This test pins that consequence down."""
    cfg_off = {"checksums": False}
    _, consumer, proxy, keys = pair(SMALL, 12, cfg_off if off == "producer" else {},
                                    cfg_off if off == "consumer" else {})
    peer = consumer.connect(proxy.address)
    assert CAP_CHECKSUM_XXH3_64 not in peer.capabilities
    result = peer.fetch(keys)
    assert result.outcomes == (KeyOutcome.STORED,) * len(keys)
    bad = set(proxy.corrupted)
    assert len(bad) == 4
    size = consumer.layout.bytes_per_block
    for key in keys:
        assert (consumer.get(key) == content(key, size)) is (key not in bad)
    assert consumer.store.stats().checksum_failures == 0

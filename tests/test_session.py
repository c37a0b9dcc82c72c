"""The per-peer state machine, driven through the public API with fake time.

Two sessions are wired by a tiny in-memory loop that sends every reply through the codec
(encode → decode), as the ZeroMQ transport does.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from p2pkv.errors import P2PKVProtocolError, ProtocolError
from p2pkv.identity import RunConfig
from p2pkv.protocol import (
    CAP_CHECKSUM_XXH3_64,
    CAP_PENDING_V1,
    CAP_SHM_V1,
    IMPLEMENTED,
    TRANSITIONS,
    Abort,
    AbortAck,
    AbortAcknowledged,
    AbortRequested,
    Block,
    BlockArrived,
    BlockDiscarded,
    Bye,
    Code,
    Credit,
    CreditGranted,
    Deadlines,
    Done,
    Error,
    ErrorReceived,
    Event,
    Fetch,
    FetchFinished,
    FetchRequested,
    Geometry,
    HandshakeAccepted,
    HandshakeRefused,
    HandshakeTimedOut,
    Hello,
    Hits,
    KeyHash,
    Limits,
    LocalProtocolError,
    Lookup,
    LookupAnswered,
    LookupRequested,
    Message,
    MessageIgnored,
    Output,
    PeerClosed,
    Ping,
    Pong,
    ProtocolViolated,
    Refuse,
    RequestFailed,
    RequestTimedOut,
    Role,
    Session,
    State,
    Welcome,
    block_checksum,
    decode,
    encode,
)
from p2pkv.protocol.codec import decode_head, encode_head

V1_GEO = Geometry.of([589824])
V2_GEO = Geometry.of([49152] * 12)
KHASH = KeyHash("xxh3-128", 0)
SMALL_GEO = Geometry.of([8, 4])


def hello(
    node: str = "n",
    config: RunConfig | None = None,
    geo: Geometry = SMALL_GEO,
    khash: KeyHash = KHASH,
    caps: Iterable[str] = (CAP_CHECKSUM_XXH3_64,),
) -> Hello:
    cfg = config if config is not None else RunConfig("m", parallel_agnostic=True)
    return Hello.for_config(node, cfg, geo, khash, caps=tuple(caps))


def wire(msg: Message, segments: tuple[int, ...] | None = None) -> Message:
    """What the peer decodes when ``msg`` is sent."""
    return decode(encode(msg), segments)


class Pair:
    """A client and a server session joined by an in-memory loop through the codec."""

    def __init__(self, client_hello: Hello, server_hello: Hello, *,
                 deadlines: Deadlines | None = None, limits: Limits | None = None,
                 now: float = 0.0) -> None:
        self.now = now
        self.client = Session(Role.CLIENT, client_hello, deadlines=deadlines, limits=limits,
                              now=now)
        self.server = Session(Role.SERVER, server_hello, deadlines=deadlines, limits=limits,
                              now=now)
        self.client_events: list[Event] = []
        self.server_events: list[Event] = []

    def deliver(self, sender: Session, msgs: Iterable[Message]) -> None:
        """Send ``msgs`` from ``sender`` to its peer, and every reply back, until quiet."""
        queue: list[tuple[Session, Message]] = [(sender, m) for m in msgs]
        while queue:
            src, msg = queue.pop(0)
            dst = self.server if src is self.client else self.client
            out = dst.receive_frames(encode(msg), self.now)
            (self.server_events if dst is self.server else self.client_events).extend(out.events)
            queue.extend((dst, r) for r in out.replies)

    def handshake(self) -> None:
        self.deliver(self.client, self.client.start(self.now))

    def poll(self, session: Session) -> Output:
        out = session.poll(self.now)
        (self.server_events if session is self.server else self.client_events).extend(out.events)
        return out


def ready_pair(**kwargs: object) -> Pair:
    pair = Pair(hello("client"), hello("server"), **kwargs)  # type: ignore[arg-type]
    pair.handshake()
    assert pair.client.state is State.READY and pair.server.state is State.READY
    return pair


def of_type(events: Iterable[Event], kind: type) -> list[Event]:
    return [e for e in events if isinstance(e, kind)]


# ---------------------------------------------------------------- handshake


def test_compatible_pair_is_accepted_with_negotiated_caps() -> None:
    pair = Pair(hello("client", caps=[CAP_CHECKSUM_XXH3_64, "x-only-client"]),
                hello("server", caps=[CAP_CHECKSUM_XXH3_64, "x-only-server"]))
    pair.handshake()
    assert pair.client.state is State.READY and pair.server.state is State.READY
    (c_ok,) = of_type(pair.client_events, HandshakeAccepted)
    (s_ok,) = of_type(pair.server_events, HandshakeAccepted)
    assert isinstance(c_ok, HandshakeAccepted) and isinstance(s_ok, HandshakeAccepted)
    assert c_ok.capabilities == s_ok.capabilities == frozenset({CAP_CHECKSUM_XXH3_64})
    assert c_ok.remote.node == "server" and s_ok.remote.node == "client"
    assert pair.client.checksums and pair.server.checksums
    assert pair.client.segments == SMALL_GEO.seg


def refused_pair(client: Hello, server: Hello) -> tuple[HandshakeRefused, HandshakeRefused]:
    pair = Pair(client, server)
    pair.handshake()
    assert pair.client.state is State.REFUSED and pair.server.state is State.REFUSED
    (c,) = of_type(pair.client_events, HandshakeRefused)
    (s,) = of_type(pair.server_events, HandshakeRefused)
    assert isinstance(c, HandshakeRefused) and isinstance(s, HandshakeRefused)
    assert c.by_remote and not s.by_remote
    return c, s


def test_v1_vs_v2_refused_on_both_sides_with_diff_and_segments() -> None:
    v1 = hello("v1", RunConfig("m", parallel_agnostic=True), V1_GEO)
    v2 = hello("v2", RunConfig("m"), V2_GEO)
    assert v1.geo.bpb == v2.geo.bpb == 589824
    c, s = refused_pair(v1, v2)
    for event, ours, theirs in ((s, v2, v1), (c, v1, v2)):
        fields = {r.field: r for r in event.reasons}
        assert "fingerprint" in fields
        assert fields["fingerprint"].ours == ours.fp and fields["fingerprint"].theirs == theirs.fp
        assert "run_config.parallel_agnostic" in fields
        seg = fields["geometry.segments"]
        assert seg.code == Code.SEGMENTS_MISMATCH
        assert seg.ours == list(ours.geo.seg) and seg.theirs == list(theirs.geo.seg)
        assert "geometry.bytes_per_block" not in fields
    seg_meaning = {r.field: r for r in c.reasons}["geometry.segments"].meaning
    assert "V2 per-layer (12 × 49152-byte segments)" in seg_meaning
    assert "V1 cross-layer (one 589824-byte segment)" in seg_meaning
    # The refused client learns who refused it.
    assert isinstance(c.remote, Refuse) and c.remote.node == "v2" and c.remote.fp == v2.fp


def test_replicated_tp2_and_tp4_are_accepted() -> None:
    def replicated(tp: int) -> RunConfig:
        return RunConfig.resolve("m", parallel_agnostic=True, is_parallelism_agnostic=False,
                                 replicated_layout=True, tp_size=tp)

    pair = Pair(hello("tp2", replicated(2)), hello("tp4", replicated(4)))
    pair.handshake()
    assert pair.client.state is State.READY and pair.server.state is State.READY


def test_replicated_vs_plain_agnostic_refused() -> None:
    rep = RunConfig.resolve("m", parallel_agnostic=True, is_parallelism_agnostic=False,
                            replicated_layout=True, tp_size=2)
    plain = RunConfig("m", parallel_agnostic=True)
    c, s = refused_pair(hello("a", rep), hello("b", plain))
    assert "run_config.replicated_layout" in {r.field for r in s.reasons}
    assert "run_config.replicated_layout" in {r.field for r in c.reasons}


def test_wrong_key_hash_seed_refused() -> None:
    c, s = refused_pair(hello("a", khash=KeyHash("xxh3-128", 1)),
                        hello("b", khash=KeyHash("xxh3-128", 2)))
    (reason,) = s.reasons
    assert reason.code == Code.KEY_HASH_SEED_MISMATCH
    assert (reason.ours, reason.theirs) == (2, 1)
    assert (c.reasons[0].ours, c.reasons[0].theirs) == (1, 2)


def test_forged_fingerprint_refused() -> None:
    honest = hello("a")
    forged = dataclasses.replace(hello("b", RunConfig("other-model", parallel_agnostic=True)),
                                 fp=honest.fp)
    c, s = refused_pair(forged, honest)
    assert Code.FINGERPRINT_FORGED in {r.code for r in s.reasons}
    assert c.code == Code.FINGERPRINT_FORGED


def test_protocol_major_mismatch_refused() -> None:
    c, s = refused_pair(dataclasses.replace(hello("a"), v=2), hello("b"))
    (reason,) = s.reasons
    assert reason.code == Code.PROTOCOL_MAJOR_MISMATCH and (reason.ours, reason.theirs) == (1, 2)
    assert c.code == Code.PROTOCOL_MAJOR_MISMATCH


def test_unreadable_other_major_hello_refused_with_reason() -> None:
    server = Session(Role.SERVER, hello("b"), now=0.0)
    import msgpack

    out = server.receive_frames([msgpack.packb({"t": "hello", "v": 7, "new": "shape"})], 0.0)
    assert server.state is State.REFUSED
    (refuse,) = out.replies
    assert isinstance(refuse, Refuse) and refuse.code == Code.PROTOCOL_MAJOR_MISMATCH
    assert refuse.reasons[0].theirs == 7


def test_required_capability_missing_refused() -> None:
    client = Session(Role.CLIENT, hello("a", caps=()), now=0.0)
    server = Session(Role.SERVER, hello("b"), now=0.0, required_caps=[CAP_CHECKSUM_XXH3_64])
    (h,) = client.start(0.0)
    out = server.receive(wire(h), 0.0)
    (refuse,) = out.replies
    assert isinstance(refuse, Refuse) and refuse.code == Code.CAPABILITY_MISSING
    out = client.receive(wire(refuse), 0.0)
    assert client.state is State.REFUSED


def test_client_refuses_welcome_and_server_learns_it() -> None:
    client = Session(Role.CLIENT, hello("a", caps=()), now=0.0,
                     required_caps=[CAP_CHECKSUM_XXH3_64])
    server = Session(Role.SERVER, hello("b"), now=0.0)
    (h,) = client.start(0.0)
    (welcome,) = server.receive(wire(h), 0.0).replies
    assert isinstance(welcome, Welcome) and welcome.caps == ()
    out = client.receive(wire(welcome), 0.0)
    (refuse,) = out.replies
    assert isinstance(refuse, Refuse) and client.state is State.REFUSED
    out = server.receive(wire(refuse), 0.0)
    assert server.state is State.REFUSED
    (event,) = out.events
    assert isinstance(event, HandshakeRefused) and event.by_remote


def test_start_twice_is_a_local_error() -> None:
    client = Session(Role.CLIENT, hello(), now=0.0)
    client.start(0.0)
    with pytest.raises(LocalProtocolError):
        client.start(0.0)
    server = Session("server", hello(), now=0.0)
    assert server.start(0.0) == []


# ---------------------------------------------------------------- requests


def test_lookup_round_trip() -> None:
    pair = ready_pair()
    msg = pair.client.lookup([b"k1", b"k2", b"k3"], pair.now)
    pair.deliver(pair.client, [msg])
    (asked,) = of_type(pair.server_events, LookupRequested)
    assert isinstance(asked, LookupRequested) and asked.keys == (b"k1", b"k2", b"k3")
    pair.deliver(pair.server, [pair.server.answer_lookup(asked.req, [True, False, True])])
    (answer,) = of_type(pair.client_events, LookupAnswered)
    assert answer == LookupAnswered(msg.req, (True, False, True))
    assert not pair.client.is_pending(msg.req) and pair.server.in_flight == 0


def test_a_lookup_answer_says_when_pending_keys_will_be_held_only_under_pending_v1() -> None:
    """pending-v1 (SPEC §19): with it, ``due`` reaches the client; without it, a server
    cannot send it, and a ``hits`` that carries it anyway is a violation."""
    pair = Pair(hello("client", caps=[CAP_PENDING_V1]), hello("server", caps=[CAP_PENDING_V1]))
    pair.handshake()
    assert pair.client.pending_answers and pair.server.pending_answers
    msg = pair.client.lookup([b"k1", b"k2", b"k3"], pair.now)
    pair.deliver(pair.client, [msg])
    (asked,) = of_type(pair.server_events, LookupRequested)
    with pytest.raises(ValueError, match="0 for every hit"):
        pair.server.answer_lookup(asked.req, [True, False, False], due=[5, 0, 1200])
    pair.deliver(pair.server, [pair.server.answer_lookup(asked.req, [True, False, False],
                                                         due=[0, 0, 1200])])
    (answer,) = of_type(pair.client_events, LookupAnswered)
    assert answer == LookupAnswered(msg.req, (True, False, False), (0, 0, 1200))
    # Nothing pending: nothing is sent, as a node without the capability answers.
    msg = pair.client.lookup([b"k4"], pair.now)
    pair.deliver(pair.client, [msg])
    asked = of_type(pair.server_events, LookupRequested)[-1]
    assert pair.server.answer_lookup(asked.req, [False], due=[0]) == Hits(asked.req, (False,))

    plain = ready_pair()
    assert not plain.client.pending_answers
    msg = plain.client.lookup([b"k1"], plain.now)
    plain.deliver(plain.client, [msg])
    (asked,) = of_type(plain.server_events, LookupRequested)
    with pytest.raises(LocalProtocolError, match="pending-v1"):
        plain.server.answer_lookup(asked.req, [False], due=[30])
    out = plain.client.receive(Hits(msg.req, (False,), (30,)), plain.now)
    assert out.replies == (Bye(Code.UNEXPECTED, "lookup answer with pending keys "
                               "(pending-v1 was not negotiated)"),)


def test_fetch_with_credit_and_done() -> None:
    pair = ready_pair()
    keys = [b"a", b"b", b"c", b"d"]
    fetch = pair.client.fetch(keys, 2, pair.now)
    pair.deliver(pair.client, [fetch])
    (asked,) = of_type(pair.server_events, FetchRequested)
    assert isinstance(asked, FetchRequested) and asked.window == 2
    req = asked.req
    data = {i: [bytes([i]) * 8, bytes([i + 10]) * 4] for i in range(4)}

    def send(idx: list[int]) -> None:
        payload = [seg for i in idx for seg in data[i]]
        sums = [block_checksum(data[i]) for i in idx]
        pair.deliver(pair.server, [pair.server.block(req, idx, sums, payload)])

    send([0, 1])
    assert pair.server.window_left(req) == 0
    with pytest.raises(LocalProtocolError) as excinfo:
        pair.server.block(req, [2], [0], data[2])
    assert excinfo.value.code == Code.WINDOW_EXCEEDED
    pair.deliver(pair.client, [pair.client.credit(req, 2, pair.now)])
    assert of_type(pair.server_events, CreditGranted) == [CreditGranted(req, 2)]
    send([3])
    arrived = of_type(pair.client_events, BlockArrived)
    assert [a.idx for a in arrived] == [(0, 1), (3,)]  # type: ignore[attr-defined]
    first = arrived[0]
    assert isinstance(first, BlockArrived)
    assert [bytes(p) for p in first.payload] == data[0] + data[1]
    assert first.sums == (block_checksum(data[0]), block_checksum(data[1]))
    pair.deliver(pair.server, [pair.server.fetch_done(req, [0, 0, 1, 0])])
    assert of_type(pair.client_events, FetchFinished) == [FetchFinished(req, (0, 0, 1, 0))]
    assert pair.client.in_flight == 0 and pair.server.in_flight == 0


def test_a_fetch_naming_stream_0_is_a_plain_fetch_without_tcp_streams() -> None:
    """SPEC §18.6 rule 4: ``stream`` absent and ``stream: 0`` are the same fetch (vector
    ``fetch_stream_0_written_is_absent``), so a server that did not negotiate
    ``tcp-streams-v1`` serves an explicit 0; any other stream is UNEXPECTED 205."""
    pair = ready_pair()
    out = pair.server.receive(Fetch(1, (b"k",), 4, False, 0), pair.now)
    assert [type(e) for e in out.events] == [FetchRequested] and not out.replies
    out = pair.server.receive(Fetch(2, (b"k",), 4, False, 3), pair.now)
    assert out.replies == (Bye(Code.UNEXPECTED, "fetch naming a stream (tcp-streams-v1 "
                                                "was not negotiated)"),)


def test_fetch_done_must_match_what_was_sent() -> None:
    pair = ready_pair()
    fetch = pair.client.fetch([b"a", b"b"], 4, pair.now)
    pair.deliver(pair.client, [fetch])
    with pytest.raises(ValueError, match="outcome 0"):
        pair.server.fetch_done(fetch.req, [0, 1])
    # A lying server is caught by the client.
    out = pair.client.receive(Done(fetch.req, (0, 1)), pair.now)
    assert pair.client.state is State.ERROR
    assert isinstance(out.replies[0], Bye) and out.replies[0].code == Code.OUT_OF_BOUNDS
    # Every block reported sent, one of them never delivered: caught as well.
    pair = ready_pair()
    fetch = pair.client.fetch([b"a", b"b"], 4, pair.now)
    pair.deliver(pair.client, [fetch])
    block = [b"\1" * 8, b"\2" * 4]
    pair.deliver(pair.server, [pair.server.block(fetch.req, [1], [block_checksum(block)],
                                                 block)])
    assert pair.client.state is State.READY
    out = pair.client.receive(Done(fetch.req, (0, 0)), pair.now)
    assert pair.client.state is State.ERROR
    assert isinstance(out.replies[0], Bye) and out.replies[0].code == Code.OUT_OF_BOUNDS
    assert "block 0 never arrived" in out.replies[0].msg


def test_block_beyond_window_is_a_violation() -> None:
    pair = ready_pair()
    fetch = pair.client.fetch([b"a", b"b"], 1, pair.now)
    pair.deliver(pair.client, [fetch])
    out = pair.client.receive(Block(fetch.req, (0, 1), (1, 2)), pair.now)
    assert of_type(out.events, ProtocolViolated)[0] == ProtocolViolated(
        Code.WINDOW_EXCEEDED, f"request {fetch.req}: 2 blocks arrived, 1 granted")
    assert of_type(out.events, RequestFailed)[0].req == fetch.req  # type: ignore[attr-defined]


def test_block_sums_must_follow_negotiation() -> None:
    pair = ready_pair()
    fetch = pair.client.fetch([b"a"], 1, pair.now)
    pair.deliver(pair.client, [fetch])
    with pytest.raises(ValueError):
        pair.server.block(fetch.req, [0])  # checksums negotiated: sums required
    out = pair.client.receive(Block(fetch.req, (0,), (None,)), pair.now)
    assert out.replies == (Bye(Code.WRONG_TYPE,
                               "block without checksum (checksum-xxh3-64 was negotiated)"),)


def test_abort_flow_discards_late_blocks() -> None:
    pair = ready_pair()
    fetch = pair.client.fetch([b"a", b"b"], 2, pair.now)
    pair.deliver(pair.client, [fetch])
    block = pair.server.block(fetch.req, [0], [5], [b"x" * 8, b"y" * 4])
    abort = pair.client.abort(fetch.req, pair.now)
    pair.deliver(pair.server, [block])  # crossed the abort on the wire
    assert of_type(pair.client_events, BlockDiscarded) == [BlockDiscarded(fetch.req, (0,))]
    pair.deliver(pair.client, [abort])
    assert of_type(pair.server_events, AbortRequested) == [AbortRequested(fetch.req)]
    pair.deliver(pair.server, [pair.server.abort_ack(fetch.req)])
    assert of_type(pair.client_events, AbortAcknowledged) == [AbortAcknowledged(fetch.req)]
    assert pair.client.in_flight == 0 and pair.server.in_flight == 0
    with pytest.raises(LocalProtocolError):
        pair.server.block(fetch.req, [1], [1])


def test_abort_of_finished_request_is_acked() -> None:
    pair = ready_pair()
    lookup = pair.client.lookup([b"a"], pair.now)
    pair.deliver(pair.client, [lookup])
    hits = pair.server.answer_lookup(lookup.req, [True])
    abort = pair.client.abort(lookup.req, pair.now)
    pair.deliver(pair.server, [hits])  # dropped: the client is aborting
    pair.deliver(pair.client, [abort])  # server answers abort_ack by itself
    assert of_type(pair.client_events, AbortAcknowledged) == [AbortAcknowledged(lookup.req)]
    assert pair.client.state is State.READY


def test_server_limits_answer_with_error() -> None:
    pair = ready_pair(limits=Limits(max_keys=2, max_in_flight=1))
    # The client's own check uses the server's advertised limit only when advertised;
    # here it sends 3 keys and the server answers a non-fatal error.
    big = pair.client.lookup([b"a", b"b", b"c"], pair.now)
    pair.deliver(pair.client, [big])
    (failed,) = of_type(pair.client_events, RequestFailed)
    assert failed == RequestFailed(big.req, Code.OUT_OF_BOUNDS,
                                   "lookup: 3 keys, this node accepts at most 2")
    first = Lookup(100, (b"a",))
    second = Lookup(101, (b"a",))
    assert of_type(pair.server.receive(first, 0.0).events, LookupRequested)
    out = pair.server.receive(second, 0.0)
    assert isinstance(out.replies[0], Error) and out.replies[0].code == Code.TOO_MANY_IN_FLIGHT
    out = pair.server.receive(Lookup(100, (b"a",)), 0.0)
    assert isinstance(out.replies[0], Bye) and out.replies[0].code == Code.DUPLICATE_REQUEST


def test_client_respects_advertised_limits() -> None:
    adv = Limits(max_keys=2, max_in_flight=1).advertised(window=8)
    server_hello = dataclasses.replace(hello("server"), limits=adv)
    pair = Pair(hello("client"), server_hello)
    pair.handshake()
    with pytest.raises(ValueError, match=r"1\.\.2 keys"):
        pair.client.lookup([b"a", b"b", b"c"], pair.now)
    pair.client.lookup([b"a"], pair.now)
    with pytest.raises(LocalProtocolError) as excinfo:
        pair.client.lookup([b"a"], pair.now)
    assert excinfo.value.code == Code.TOO_MANY_IN_FLIGHT


def test_a_withdrawn_request_frees_its_place_and_is_unknown_to_the_peer() -> None:
    adv = Limits(max_in_flight=1).advertised(window=8)
    pair = Pair(hello("client"), dataclasses.replace(hello("server"), limits=adv))
    pair.handshake()
    opened = pair.client.fetch([b"a"], 1, pair.now)
    assert pair.client.in_flight == 1
    pair.client.withdraw(opened.req)  # never sent: as if never opened
    assert pair.client.in_flight == 0 and not pair.client.is_pending(opened.req)
    # The place is free again, and a reply naming the withdrawn id is a violation
    # (it was never opened on this connection), not a late reply.
    pair.client.lookup([b"a"], pair.now)
    out = pair.client.receive(Done(opened.req, (1,)), pair.now)
    assert of_type(out.events, ProtocolViolated)
    assert isinstance(out.replies[0], Bye) and out.replies[0].code == Code.UNKNOWN_REQUEST


def test_a_sent_request_cannot_be_withdrawn() -> None:
    pair = ready_pair()
    fetch = pair.client.fetch([b"a", b"b"], 1, pair.now)
    pair.client.abort(fetch.req, pair.now)
    with pytest.raises(LocalProtocolError, match="was sent"):
        pair.client.withdraw(fetch.req)
    with pytest.raises(LocalProtocolError, match="no open request"):
        pair.client.withdraw(999)


def test_every_row_of_the_table_names_a_known_capability() -> None:
    # Capabilities are data of the one table: every row of shm-v1 is there, for both
    # roles, and nothing else names a capability the table does not implement.
    rows = [(role, state, tag, rule.capability) for role, table in TRANSITIONS.items()
            for (state, tag), rule in table.items() if rule.capability is not None]
    assert {cap for *_, cap in rows} <= IMPLEMENTED
    assert {(role.value, tag) for role, state, tag, _ in rows if state is State.READY} == {
        ("client", "attached"), ("client", "located"), ("server", "attach"),
        ("server", "release")}


@pytest.mark.parametrize("bad", [[], [b""], [b"x" * 65], ["str"]])
def test_lookup_rejects_bad_keys(bad: list[object]) -> None:
    pair = ready_pair()
    with pytest.raises(ValueError):
        pair.client.lookup(bad, pair.now)  # type: ignore[arg-type]


def test_requests_before_handshake_are_violations() -> None:
    client = Session(Role.CLIENT, hello("a"), now=0.0)
    with pytest.raises(LocalProtocolError):
        client.lookup([b"k"], 0.0)
    server = Session(Role.SERVER, hello("b"), now=0.0)
    out = server.receive_frames(encode(Lookup(1, (b"k",))), 0.0)
    assert server.state is State.ERROR
    (refuse,) = out.replies
    assert isinstance(refuse, Refuse) and refuse.code == Code.UNEXPECTED
    assert refuse.node == "b"
    server = Session(Role.SERVER, hello("b"), now=0.0)
    out = server.receive(Fetch(1, (b"k",), 4), 0.0)
    assert of_type(out.events, ProtocolViolated)


def test_reply_for_unknown_request_is_a_violation() -> None:
    pair = ready_pair()
    out = pair.client.receive(Hits(99, (True,)), pair.now)
    assert out.replies == (Bye(Code.UNKNOWN_REQUEST, "hits for unknown request 99"),)
    assert pair.client.state is State.ERROR
    with pytest.raises(LocalProtocolError):
        pair.client.lookup([b"k"], pair.now)


def test_unknown_type_answered_with_error_and_session_continues() -> None:
    import msgpack

    pair = ready_pair()
    frames = [msgpack.packb({"t": "teleport", "v": 1, "where": "mars"})]
    out = pair.server.receive_frames(frames, pair.now)
    assert pair.server.state is State.READY
    (reply,) = out.replies
    assert isinstance(reply, Error) and reply.code == Code.UNKNOWN_TYPE and reply.req is None
    assert of_type(out.events, MessageIgnored)
    out = pair.client.receive(wire(reply), pair.now)
    assert out.events == (ErrorReceived(Code.UNKNOWN_TYPE, reply.msg),)


def test_malformed_frames_after_handshake_close_with_bye() -> None:
    pair = ready_pair()
    out = pair.server.receive_frames([b"\xc1"], pair.now)
    (bye,) = out.replies
    assert isinstance(bye, Bye) and bye.code == Code.MALFORMED
    assert pair.server.state is State.ERROR
    # Block payload of the wrong size is caught with the negotiated segments.
    pair = ready_pair()
    fetch = pair.client.fetch([b"a"], 1, pair.now)
    pair.deliver(pair.client, [fetch])
    frames = [encode_head(Block(fetch.req, (0,), (1,))), b"x" * 8, b"y" * 5]
    out = pair.client.receive_frames(frames, pair.now)
    assert isinstance(out.replies[0], Bye) and out.replies[0].code == Code.FRAME_COUNT


def test_ping_is_answered_and_bye_closes() -> None:
    pair = ready_pair()
    out = pair.server.receive(Ping(7), pair.now)
    assert out.replies == (Pong(7),)
    lookup = pair.client.lookup([b"k"], pair.now)
    out = pair.client.receive(Bye(Code.SHUTDOWN, "going away"), pair.now)
    assert out.events == (
        RequestFailed(lookup.req, Code.SHUTDOWN, "peer closed: going away"),
        PeerClosed(Code.SHUTDOWN, "going away", True),
    )
    assert pair.client.state is State.CLOSED and pair.client.next_deadline() is None
    # In-flight messages that cross our bye are dropped, not violations.
    assert pair.client.receive(Hits(lookup.req, (True,)), pair.now) == Output()


def test_close_fails_open_requests() -> None:
    pair = ready_pair()
    lookup = pair.client.lookup([b"k"], pair.now)
    out = pair.client.close(Code.SHUTDOWN, "bye now")
    assert out.replies == (Bye(Code.SHUTDOWN, "bye now"),)
    assert out.events == (RequestFailed(lookup.req, Code.SHUTDOWN, "bye now"),)
    assert pair.client.close() == Output()


def test_after_refused_requests_are_violations() -> None:
    pair = Pair(hello("a", khash=KeyHash("xxh3-128", 1)), hello("b"))
    pair.handshake()
    server = pair.server
    assert server.state is State.REFUSED
    assert server.receive(Bye(Code.NORMAL_CLOSE, ""), 0.0) == Output()
    out = server.receive(Lookup(1, (b"k",)), 0.0)
    assert of_type(out.events, ProtocolViolated)
    assert server.state.value == "error"


# ---------------------------------------------------------------- deadlines


def test_handshake_deadline() -> None:
    client = Session(Role.CLIENT, hello(), deadlines=Deadlines(handshake=3.0), now=10.0)
    client.start(10.0)
    assert client.next_deadline() == 13.0
    assert client.poll(12.9) == Output()
    out = client.poll(13.0)
    assert client.state is State.CLOSED
    assert out.events == (PeerClosed(Code.TIMEOUT, "no welcome within 3 s", False),)
    assert isinstance(out.replies[0], Bye)


def test_the_callers_handshake_deadline_is_the_sessions_too() -> None:
    # One clock: the caller's deadline for the handshake (the connect timeout) is kept
    # and checked by the session, before its own; the caller gave up, nothing is sent.
    client = Session(Role.CLIENT, hello(), deadlines=Deadlines(handshake=3.0), now=10.0)
    client.start(10.0, deadline=11.5)
    assert client.handshake_until == 11.5
    assert client.next_deadline() == 11.5
    assert client.poll(11.4) == Output()
    assert client.poll(11.5) == Output(events=(HandshakeTimedOut(),))
    assert client.state is State.CLOSED and client.next_deadline() is None


def test_local_and_remote_protocol_errors_are_siblings() -> None:
    # As in h11: a caller's misuse is never taken for the peer's violation, nor the
    # other way round; both are P2PKVProtocolErrors with a wire code.
    assert issubclass(LocalProtocolError, P2PKVProtocolError)
    assert issubclass(ProtocolError, P2PKVProtocolError)
    assert not issubclass(LocalProtocolError, ProtocolError)
    assert not issubclass(ProtocolError, LocalProtocolError)
    client = Session(Role.CLIENT, hello(), now=0.0)
    client.start(0.0)
    with pytest.raises(LocalProtocolError) as excinfo:
        client.start(0.0)
    assert not isinstance(excinfo.value, ProtocolError)
    assert excinfo.value.code == Code.UNEXPECTED


def test_lookup_deadline_and_late_reply_ignored() -> None:
    pair = ready_pair(deadlines=Deadlines(lookup=2.0, heartbeat_interval=10.0,
                                          heartbeat_timeout=20.0))
    lookup = pair.client.lookup([b"k"], 0.0)
    pair.deliver(pair.client, [lookup])
    assert pair.client.next_deadline() == 2.0
    assert pair.client.poll(1.99) == Output()
    out = pair.client.poll(2.0)
    assert out.events == (RequestTimedOut(lookup.req, "lookup"),)
    late = pair.server.answer_lookup(lookup.req, [True])
    assert pair.client.receive(wire(late), 2.5) == Output()
    assert pair.client.state is State.READY


def test_fetch_idle_deadline_resets_on_progress_then_aborts() -> None:
    d = Deadlines(fetch_idle=5.0, abort=1.0, heartbeat_interval=100.0, heartbeat_timeout=200.0)
    pair = ready_pair(deadlines=d)
    fetch = pair.client.fetch([b"a", b"b"], 1, 0.0)
    pair.deliver(pair.client, [fetch])
    block = pair.server.block(fetch.req, [0], [1])
    pair.now = 4.0
    pair.client.receive(block, 4.0)  # progress: deadline moves to 9.0
    assert pair.client.poll(8.9).events == ()
    out = pair.client.poll(9.0)
    assert out.events == (RequestTimedOut(fetch.req, "fetch"),)
    assert out.replies == (Abort(fetch.req),)
    # No abort_ack in time: the connection is given up.
    out = pair.client.poll(10.0)
    assert RequestTimedOut(fetch.req, "abort") in out.events
    assert pair.client.state is State.CLOSED
    assert isinstance(out.replies[-1], Bye) and out.replies[-1].code == Code.TIMEOUT


def test_heartbeat_pings_when_idle_and_declares_dead() -> None:
    d = Deadlines(heartbeat_interval=1.0, heartbeat_timeout=3.0)
    pair = ready_pair(deadlines=d)
    assert pair.client.poll(0.5) == Output()
    out = pair.client.poll(1.0)
    (ping,) = out.replies
    assert isinstance(ping, Ping)
    assert pair.client.poll(1.25) == Output()  # one ping per interval
    assert pair.server.receive(ping, 1.25).replies == (Pong(ping.nonce),)
    pair.client.receive(Pong(ping.nonce), 1.5)  # traffic: alive again
    assert pair.client.next_deadline() == 2.5
    assert pair.client.poll(4.25).events == ()
    out = pair.client.poll(4.5)
    assert pair.client.state is State.CLOSED
    assert of_type(out.events, PeerClosed) == [
        PeerClosed(Code.PEER_TIMEOUT, "no traffic from the peer for 3 s", False)]


@pytest.mark.parametrize(
    "kwargs",
    [{"handshake": 0}, {"lookup": -1.0}, {"fetch_idle": float("nan")},
     {"heartbeat_interval": 5.0, "heartbeat_timeout": 5.0}, {"abort": True}],
)
def test_bad_deadlines_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="deadlines"):
        Deadlines(**kwargs)


# ---------------------------------------------------------------- state × message type


def _sample_messages() -> list[Message]:
    h = hello("x")
    return [
        h,
        Welcome(h.node, h.minor, h.rc, h.fp, h.geo, h.khash, h.caps),
        Refuse(Code.UNEXPECTED, "no"),
        Lookup(1, (b"k",)),
        Hits(1, (True,)),
        Fetch(1, (b"k",), 1),
        Credit(1, 1),
        Block(1, (0,), (1,), (b"x" * 8, b"y" * 4)),
        Done(1, (0,)),
        Abort(1),
        AbortAck(1),
        Ping(1),
        Pong(1),
        Bye(Code.NORMAL_CLOSE, ""),
        Error(None, Code.UNAVAILABLE, "x"),
    ]


def _session_in(role: Role, state: State) -> Session:
    """A session driven into ``state`` through the public API only."""
    s = Session(role, hello("me"), now=0.0)
    s.start(0.0)
    peer = hello("peer")
    if state in (State.AWAITING_HELLO, State.AWAITING_WELCOME):
        return s
    if state is State.READY:
        greeting: Message = peer if role is Role.SERVER else Welcome(
            peer.node, peer.minor, peer.rc, peer.fp, peer.geo, peer.khash, peer.caps)
        s.receive(greeting, 0.0)
    elif state is State.REFUSED:
        s.receive(Refuse(Code.UNEXPECTED, "no") if role is Role.CLIENT else
                  dataclasses.replace(peer, khash=KeyHash("other", 0)), 0.0)
    elif state is State.CLOSED:
        s.close()
    elif state is State.ERROR:
        s.receive(Pong(1) if role is Role.SERVER else Ping(1), 0.0)
    return s


_STATES = {
    Role.CLIENT: [State.AWAITING_WELCOME, State.READY, State.REFUSED, State.CLOSED, State.ERROR],
    Role.SERVER: [State.AWAITING_HELLO, State.READY, State.REFUSED, State.CLOSED, State.ERROR],
}
_CASES = [(role, state, msg) for role, states in _STATES.items() for state in states
          for msg in _sample_messages()]


@pytest.mark.parametrize(
    ("role", "state", "msg"), _CASES,
    ids=[f"{r.value}-{s.value}-{m.TAG}" for r, s, m in _CASES],
)
def test_every_state_and_message_type(role: Role, state: State, msg: Message) -> None:
    session = _session_in(role, state)
    assert session.state is state
    out = session.receive(msg, 1.0)
    assert isinstance(out, Output)
    violations = of_type(out.events, ProtocolViolated)
    if violations:
        assert session.state is State.ERROR
        (reply,) = out.replies
        assert isinstance(reply, (Refuse, Bye)) and reply.code >= 200
        assert violations[0].code == reply.code  # type: ignore[attr-defined]
    else:
        assert session.state in set(State)
    if state in (State.CLOSED, State.ERROR):
        assert out == Output()
    # Every reply encodes and decodes.
    for reply in out.replies:
        assert decode_head(encode(reply)[0]) is not None
    # Same through the codec (payload frames included).
    session = _session_in(role, state)
    frames_out = session.receive_frames(encode(msg), 1.0)
    assert isinstance(frames_out, Output)


def test_core_imports_no_io_modules() -> None:
    # In a fresh interpreter: importing the core loads neither zmq, torch nor socket.
    code = (
        "import sys, p2pkv.protocol\n"
        "bad = [m for m in ('zmq', 'torch', 'socket', 'asyncio', 'numpy', 'selectors')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == ""
    # No core module imports threading, a clock or IO itself. (``threading`` may still be
    # in sys.modules: the stdlib ``logging`` module imports it.)
    forbidden = {"zmq", "torch", "threading", "socket", "time", "asyncio", "select",
                 "selectors", "numpy", "random"}
    core = Path(__file__).resolve().parent.parent / "p2pkv" / "protocol"
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"


# ---------------------------------------------------------------- the calls' table


def test_every_call_that_builds_a_message_is_a_row_of_the_table() -> None:
    # The local half of the one table: each public call of a session that sends
    # something, or reads a request's state for sending, is checked against CALLS.
    from p2pkv.protocol.transitions import CALLS

    calls = {call for _, call in CALLS}
    public = {name for name in vars(Session) if not name.startswith("_")}
    lifecycle = {"start", "receive", "receive_data", "receive_frames", "violated", "close",
                 "poll", "next_deadline"}
    views = {"is_pending", "shared_fetch", "fetch_credit"}
    assert public - lifecycle - views == calls
    # Each row belongs to one role: the other role is told who sends it.
    pair = ready_pair()
    for (role, call), _rule in CALLS.items():
        other = pair.server if role is Role.CLIENT else pair.client
        with pytest.raises(LocalProtocolError, match=f"only the {role.value} sends it"):
            getattr(other, call)(*{"lookup": ([b"k"], 0.0), "fetch": ([b"k"], 1, 0.0),
                                   "fetch_shared": ([b"k"], 1, 0.0),
                                   "credit": (1, 1, 0.0), "abort": (1, 0.0),
                                   "attach": (bytes(16),), "release": (1, [0]),
                                   "block": (1, [0]), "located": (1, [0], [0]),
                                   "fetch_done": (1, [0]), "fail": (1, 1, "x"),
                                   "attach_verdict": (True, ""),
                                   "answer_lookup": (1, [True])}.get(call, (1,)))


def test_a_capability_call_is_checked_against_what_was_negotiated() -> None:
    # Both sides implement shm-v1 and packed-v1, neither offered them: the calls of a
    # capability are refused, not just those of a capability this code lacks.
    pair = ready_pair()
    assert CAP_SHM_V1 not in pair.client.capabilities
    for call, args in (("attach", (bytes(16),)), ("release", (1, [0]))):
        with pytest.raises(LocalProtocolError, match="shm-v1 was not negotiated"):
            getattr(pair.client, call)(*args)
    with pytest.raises(LocalProtocolError, match="shm-v1 was not negotiated"):
        pair.server.attach_verdict(True, "")
    fetch = pair.client.fetch([b"a"], 1, pair.now)
    pair.deliver(pair.client, [fetch])
    with pytest.raises(LocalProtocolError, match="packed-v1 was not negotiated"):
        pair.server.block(fetch.req, [0], [1], packed=True)
    # The same field rule on what the peer sends: a packed block is a violation.
    out = pair.client.receive(Block(fetch.req, (0,), (1,), (), True), pair.now)
    assert out.replies == (Bye(Code.UNEXPECTED, "packed block (packed-v1 was not "
                                                "negotiated)"),)


def test_a_request_has_one_clock_the_callers_deadline_included() -> None:
    # The caller's deadline for the whole request is the session's: a lookup and a
    # fetch past it time out as "overall" (the fetch is aborted), well before their
    # progress deadlines.
    pair = ready_pair(deadlines=Deadlines(lookup=10.0, fetch_idle=10.0,
                                          heartbeat_interval=100.0, heartbeat_timeout=200.0))
    lookup = pair.client.lookup([b"a"], pair.now, deadline=1.0)
    fetch = pair.client.fetch([b"b"], 1, pair.now, deadline=2.0)
    assert pair.client.next_deadline() == 1.0
    out = pair.client.poll(1.0)
    assert out.events == (RequestTimedOut(lookup.req, "lookup", overall=True),)
    assert pair.client.next_deadline() == 2.0
    out = pair.client.poll(2.0)
    assert out.events == (RequestTimedOut(fetch.req, "fetch", overall=True),)
    assert out.replies == (Abort(fetch.req),)
    # Aborting, only the abort_ack is awaited, within the abort deadline.
    assert pair.client.next_deadline() == 2.0 + Deadlines().abort
    # Without a caller's deadline, the progress deadline is the one that passes.
    other = ready_pair(deadlines=Deadlines(fetch_idle=10.0, heartbeat_interval=100.0,
                                           heartbeat_timeout=200.0))
    idle = other.client.fetch([b"c"], 1, 0.0)
    assert other.client.next_deadline() == 10.0
    out = other.client.poll(10.0)
    assert out.events == (RequestTimedOut(idle.req, "fetch", overall=False),)

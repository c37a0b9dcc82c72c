"""The data channel (capability ``tcp-data-v1``, SPEC §18) with real nodes and sockets.

What is held: two nodes that both offer it move every layout's blocks on a plain TCP
stream, byte for byte what the ZeroMQ path moves, into the store and into caller
buffers; peers without it, CURVE nodes and peers behind a relay stay on ZeroMQ and say
why; a stream is bound only by its session's token, once, in time (a wrong, replayed,
late or orphaned token, a bad preface or a silent stream is closed unanswered, with the
pool untouched); checksums, cancel and deadlines hold on the stream; a stream that dies
or goes silent ends its session with an error, never a hang, and leaves no slot pinned
or being written on either side; a server that breaks the stream's framing is a
protocol violation. The stream's transport pieces (gather, scatter) are tested on
socket pairs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from nodeproc import content, fill, keys_for
from nodeproc import pooled_node as node
from procs import NodeProcess
from rawpeer import (
    FakeServer,
    RawPeer,
    ThrottlingProxy,
    answer_pings_until_bye,
    closed_unanswered,
    wait_until,
)

from p2pkv import protocol as proto
from p2pkv.errors import P2PKVError, PeerGone, PeerTimeout, ProtocolError
from p2pkv.node import KeyOutcome, Node, PeerHandle
from p2pkv.transport import datachannel as dc
from p2pkv.transport.datachannel import Gather

pytestmark = pytest.mark.timeout(120)

LAYOUTS = [
    {"layout": "v2", "geometry": "seed"},
    {"layout": "v1", "geometry": "seed"},
    {"layout": "replicated", "geometry": "mla-small"},
    {"layout": "v2", "geometry": "small"},
]
SEED_V2 = LAYOUTS[0]
HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}


def open_stream(port: int, token: bytes | None, *, raw: bytes | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.settimeout(5)
    sock.sendall(raw if raw is not None else proto.preface(token or b"\0" * 16))
    return sock


def read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise EOFError(f"stream closed after {len(out)} of {n} bytes")
        out += part
    return bytes(out)


def read_stream_message(sock: socket.socket, bpb: int
                        ) -> tuple[proto.Message, bytes]:
    """One message of a data stream, decoded by hand: frame 0 and a block's bytes."""
    (n,) = struct.unpack("<I", read_exact(sock, 4))
    msg = proto.decode_head(read_exact(sock, n), None, None)
    payload = read_exact(sock, len(msg.idx) * bpb) if type(msg) is proto.Block else b""
    return msg, payload


# ---------------------------------------------------------------------- negotiation


@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: f"{s['layout']}-{s['geometry']}")
def test_every_layout_moves_on_the_stream_byte_for_byte(spec: dict[str, Any],
                                                        made: list[Any]) -> None:
    producer, consumer = node(spec), node(spec)
    made += [producer, consumer]
    keys = fill(producer, 40)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data", peer.data_path_detail
    assert proto.CAP_TCP_DATA_V1 in peer.capabilities
    bpb = producer.layout.bytes_per_block
    result = consumer.fetch(peer, keys)
    assert result.outcomes == (KeyOutcome.LANDED,) * 40 and result.nbytes == 40 * bpb
    assert all(consumer.get(k) == content(k, bpb) for k in keys)
    # And into caller buffers: nothing goes to the store.
    bufs = [[bytearray(s) for s in producer.layout.segment_sizes] for _ in keys[:8]]
    into = consumer.fetch_into(peer, keys[:8], bufs)
    assert into.outcomes == (KeyOutcome.LANDED,) * 8
    assert all(b"".join(bytes(x) for x in b) == content(k, bpb)
               for k, b in zip(keys[:8], bufs, strict=True))
    cs, ps = consumer.stats(), producer.stats()
    assert cs.blocks_received_stream == 48 and ps.blocks_sent_stream == 48
    assert cs.data_peers_out == 1 and ps.data_peers_in == 1 and ps.data_port is not None
    assert consumer.store.stats().pinned == 0
    assert wait_until(lambda: producer.store.stats().pinned == 0, timeout=5)


def test_the_stream_works_over_ipv6(made: list[Any]) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    spec = {"layout": "v2", "geometry": "small"}
    producer = node(spec, listen="tcp://[::1]:0")
    consumer = node(spec, listen="tcp://[::1]:0")
    made += [producer, consumer]
    keys = fill(producer, 20)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data" and "::1" in peer.data_path_detail
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * 20
    assert all(consumer.get(k) == producer.get(k) for k in keys)


@pytest.mark.parametrize("off", ["consumer", "producer"])
def test_a_peer_without_the_capability_gets_the_zeromq_path(off: str,
                                                            made: list[Any]) -> None:
    producer = node(SEED_V2, data_channel=off != "producer")
    consumer = node(SEED_V2, data_channel=off != "consumer")
    made += [producer, consumer]
    keys = fill(producer, 12)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp" and proto.CAP_TCP_DATA_V1 not in peer.capabilities
    assert "tcp-data-v1" in peer.data_path_detail or "off" in peer.data_path_detail
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * 12
    assert all(consumer.get(k) == content(k, producer.layout.bytes_per_block) for k in keys)
    assert consumer.stats().blocks_received_stream == 0
    assert consumer.stats().blocks_received == 12
    assert (producer.stats().data_port is None) == (off == "producer")


def test_curve_nodes_never_offer_a_plaintext_stream(made: list[Any]) -> None:
    """Under CURVE a stream is never weaker than the connection: tcp-data-v1 is not
    offered; the encrypted form is (tests/test_tls_stream.py), or nothing at all when
    the data channel is off."""
    import zmq

    from p2pkv.transport import CurveKeys

    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    producer = node(SEED_V2, curve=CurveKeys(spub, ssec), data_channel=False)
    consumer = node(SEED_V2, curve=CurveKeys(cpub, csec, spub))
    made += [producer, consumer]
    assert proto.CAP_TCP_DATA_V1 not in consumer.hello.caps
    assert proto.CAP_TCP_DATA_TLS_V1 in consumer.hello.caps
    assert producer.stats().data_port is None
    keys = fill(producer, 6)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp" and proto.CAP_TCP_DATA_V1 not in peer.capabilities
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * 6
    assert consumer.stats().blocks_received_stream == 0


def test_a_peer_behind_a_relay_stays_on_zeromq(made: list[Any]) -> None:
    producer, consumer = node(SEED_V2), node(SEED_V2)
    made += [producer, consumer]
    keys = fill(producer, 6)
    proxy = ThrottlingProxy(producer.address, 200e6)
    made.append(proxy)
    peer = consumer.connect(proxy.address)
    assert proto.CAP_TCP_DATA_V1 in peer.capabilities
    assert peer.data_path == "tcp" and "relay" in peer.data_path_detail
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * 6
    assert producer.stats().data_peers_in == 0 and consumer.stats().data_fallbacks == 1


def test_an_unreachable_data_port_falls_back_to_zeromq(made: list[Any]) -> None:
    """A welcome naming a port nobody listens on: connect still succeeds, on ZeroMQ."""
    identity = node(SEED_V2)
    made.append(identity)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    fake = FakeServer(identity.hello)
    made.append(fake)
    fake.welcome = dataclasses.replace(fake.welcome, data=proto.DataOffer(
        dead_port, os.urandom(16), dc.port_of(fake.address)))
    consumer = node(SEED_V2)
    made.append(consumer)
    peer = consumer.connect(fake.address, timeout=5)
    assert peer.data_path == "tcp" and "cannot open" in peer.data_path_detail
    assert consumer.stats().data_fallbacks == 1


# ---------------------------------------------------------------------- tokens


def test_a_stream_needs_its_sessions_token_once_and_in_time(made: list[Any]) -> None:
    producer = node(SEED_V2, handshake_timeout=1.0)
    made.append(producer)
    keys = fill(producer, 4)
    port = producer.stats().data_port
    assert port is not None
    before = producer.store.stats()

    # Not a p2pkv stream, a wrong token, and silence: closed unanswered.
    assert closed_unanswered(open_stream(port, None, raw=b"GET / HTTP/1.1\r\n\r\n" + b"x" * 8))
    assert closed_unanswered(open_stream(port, os.urandom(16)))
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    assert closed_unanswered(silent)
    assert 0.5 < time.monotonic() - t0 < 8

    raw = RawPeer(producer.address)
    made.append(raw)
    welcome = raw.handshake(producer)
    assert welcome.data is not None and welcome.data.cport == dc.port_of(producer.address)
    assert welcome.data.port == port and len(welcome.data.token) == 16
    first = open_stream(port, welcome.data.token)
    assert read_exact(first, 8) == proto.ACCEPTED
    # The same token again (a replay, or a second stream): refused.
    assert closed_unanswered(open_stream(port, welcome.data.token))
    # The bound stream carries the session's fetch.
    raw.send_msg(proto.Fetch(1, tuple(keys), 16))
    bpb = producer.layout.bytes_per_block
    got = {}
    while True:
        msg, payload = read_stream_message(first, bpb)
        if type(msg) is proto.Done:
            break
        assert type(msg) is proto.Block
        for n, i in enumerate(msg.idx):
            got[i] = payload[n * bpb:(n + 1) * bpb]
    assert msg.outcomes == (0,) * 4
    assert all(got[i] == content(k, bpb) for i, k in enumerate(keys))
    first.close()

    # A token that waited past the handshake deadline, and one of a session that ended.
    late = RawPeer(producer.address)
    made.append(late)
    late_offer = late.handshake(producer).data
    gone = RawPeer(producer.address)
    made.append(gone)
    gone_offer = gone.handshake(producer).data
    assert late_offer is not None and gone_offer is not None
    gone.send_msg(proto.Bye(proto.Code.NORMAL_CLOSE, "bye"))
    time.sleep(1.3)
    assert closed_unanswered(open_stream(port, late_offer.token))
    assert closed_unanswered(open_stream(port, gone_offer.token))

    stats = producer.stats()
    assert stats.data_streams_refused == 6
    after = producer.store.stats()
    assert (after.used, after.stored, after.hits, after.misses, after.evictions) == (
        before.used, before.stored, before.hits, before.misses, before.evictions)
    assert wait_until(lambda: producer.store.stats().pinned == 0, timeout=5)


def test_streams_without_a_preface_are_bounded(made: list[Any]) -> None:
    """At most ``max_peers`` streams may wait for their preface: one more is closed at
    once, unanswered, and a slot frees when a waiting stream goes (SPEC §18.2)."""
    producer = node(SEED_V2, max_peers=3, handshake_timeout=30.0)
    made.append(producer)
    port = producer.stats().data_port
    assert port is not None

    def kept_open(sock: socket.socket) -> bool:
        """Still open 1 s after connecting (waiting for its preface), or closed."""
        sock.settimeout(1.0)
        try:
            return sock.recv(1) != b""
        except TimeoutError:
            return True
        except ConnectionResetError:
            return False

    waiting = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
    assert all(kept_open(w) for w in waiting)
    started = time.monotonic()
    assert closed_unanswered(socket.create_connection(("127.0.0.1", port), timeout=5))
    assert time.monotonic() - started < 10  # long before the 30 s preface deadline
    waiting.pop().close()
    again = None
    for _ in range(20):  # until the server noticed the closed one
        time.sleep(0.2)
        again = socket.create_connection(("127.0.0.1", port), timeout=5)
        if kept_open(again):
            break
        again.close()
        again = None
    assert again is not None, "no room came back for a stream after one closed"
    for sock in [*waiting, again]:
        sock.close()
    assert producer.stats().data_streams_refused >= 1


# ---------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("scatter", ["native", "python"])
def test_checksums_catch_a_block_changed_under_its_pin(
        made: list[Any], scatter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever scatter receives the stream (the compiled one hashes each block as it
    lands), the changed block fails and the others land."""
    if scatter == "native" and not dc.NATIVE_SCATTER:
        pytest.skip("the compiled helper was not built")
    monkeypatch.setattr(dc, "NATIVE_SCATTER", scatter == "native")
    producer, consumer = node(SEED_V2), node(SEED_V2)
    made += [producer, consumer]
    keys = fill(producer, 8)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data"
    reader = producer.store.acquire_read(keys[3])
    assert reader is not None
    _ = reader.checksum  # the checksum is taken from the stored bytes ...
    reader.views[0][0] ^= 0xFF  # ... which then change in the pool
    reader.release()
    result = consumer.fetch(peer, keys)
    assert result.outcomes[3] is KeyOutcome.FAILED and "checksum" in result.errors[3]
    assert result.outcomes.count(KeyOutcome.LANDED) == 7
    assert consumer.stats().checksum_failures == 1 and consumer.get(keys[3]) is None
    assert consumer.store.stats().pinned == 0


def test_cancel_stops_writes_and_frees_every_slot(made: list[Any]) -> None:
    producer = node({**SEED_V2, "pool": 400})
    consumer = node({**SEED_V2, "pool": 400})
    made += [producer, consumer]
    keys = fill(producer, 380)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data"
    segments = producer.layout.segment_sizes
    bufs = [[bytearray(s) for s in segments] for _ in keys]
    fut = consumer.fetch_into_async(peer, keys, bufs)
    assert wait_until(lambda: consumer.stats().blocks_received_stream > 0, timeout=20)
    assert consumer.abort(fut)
    frozen = [bytes(b[0][:64]) + bytes(b[-1][-64:]) for b in bufs]
    time.sleep(0.5)
    assert [bytes(b[0][:64]) + bytes(b[-1][-64:]) for b in bufs] == frozen
    # The store path: a cancelled fetch leaves no slot being written, and nothing
    # half-landed is visible; the keys can be fetched again, whole.
    fut = consumer.fetch_async(peer, keys)
    assert wait_until(lambda: consumer.stats().blocks_received_stream > 380, timeout=20)
    consumer.abort(fut)
    assert wait_until(lambda: consumer.store.stats().pinned == 0, timeout=5)
    bpb = producer.layout.bytes_per_block
    assert all(consumer.get(k) in (None, content(k, bpb)) for k in keys)
    again = consumer.fetch(peer, keys)
    assert again.outcomes == (KeyOutcome.LANDED,) * len(keys)
    assert all(consumer.get(k) == content(k, bpb) for k in keys)
    assert wait_until(lambda: producer.store.stats().pinned == 0, timeout=5)


def test_a_fetch_past_its_deadline_times_out_and_frees_its_slots(made: list[Any]) -> None:
    producer = node({**SEED_V2, "pool": 400})
    consumer = node({**SEED_V2, "pool": 400})
    made += [producer, consumer]
    keys = fill(producer, 380)
    peer = consumer.connect(producer.address)
    with pytest.raises(PeerTimeout):
        consumer.fetch(peer, keys, timeout=0.02)
    assert wait_until(lambda: consumer.store.stats().pinned == 0, timeout=5)
    bpb = producer.layout.bytes_per_block
    assert all(consumer.get(k) in (None, content(k, bpb)) for k in keys)
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)


def test_a_producer_killed_mid_stream_fails_the_fetch_at_once(made: list[Any]) -> None:
    spec = {**SEED_V2, "blocks": 400, "pool": 410}
    proc = NodeProcess("serve", spec)
    made.append(_Killer(proc))
    ready = proc.event(timeout=60)
    assert ready["event"] == "ready", ready
    consumer = node({**SEED_V2, "pool": 410}, **HEARTBEAT)
    made.append(consumer)
    peer = consumer.connect(ready["address"])
    assert peer.data_path == "tcp-data", peer.data_path_detail
    keys = keys_for(400)
    fut = consumer.fetch_async(peer, keys, timeout=60)
    assert wait_until(lambda: consumer.stats().blocks_received_stream > 0, timeout=20)
    t0 = time.monotonic()
    proc.proc.kill()
    with pytest.raises(PeerGone):
        fut.result(30)
    assert time.monotonic() - t0 < 5  # the stream's end, not a heartbeat deadline
    assert consumer.store.stats().pinned == 0
    bpb = consumer.layout.bytes_per_block
    assert all(consumer.get(k) in (None, content(k, bpb)) for k in keys)
    assert consumer.peers() == []


def bound_stream(producer: Node, made: list[Any]) -> tuple[RawPeer, socket.socket]:
    """A raw client's session with ``producer`` and its data stream, bound."""
    raw = RawPeer(producer.address)
    made.append(raw)
    offer = raw.handshake(producer).data
    assert offer is not None
    stream = open_stream(offer.port, offer.token)
    assert read_exact(stream, 8) == proto.ACCEPTED
    return raw, stream


def fetch_that_stays_pinned(made: list[Any], **config: Any
                            ) -> tuple[Node, RawPeer, socket.socket]:
    """A producer serving a 200-block fetch on a raw client's bound stream (a small
    receive buffer), once its first message was read and blocks are pinned for the rest."""
    producer = node({**SEED_V2, "pool": 300}, **{**HEARTBEAT, **config})
    made.append(producer)
    keys = fill(producer, 280)
    raw, stream = bound_stream(producer, made)
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    raw.send_msg(proto.Fetch(1, tuple(keys), 200))
    msg, _ = read_stream_message(stream, producer.layout.bytes_per_block)
    assert type(msg) is proto.Block
    assert wait_until(lambda: producer.store.stats().pinned > 0, timeout=5)
    return producer, raw, stream


@pytest.mark.parametrize("how", ["stream closed", "wrote on the stream", "stopped reading"])
def test_a_consumer_whose_stream_dies_leaves_no_pin(how: str, made: list[Any]) -> None:
    producer, _raw, stream = fetch_that_stays_pinned(made)
    if how == "stream closed":
        stream.close()
    elif how == "wrote on the stream":
        stream.sendall(b"\0")
    # "stopped reading": the raw peer neither reads nor answers pings: its heartbeat
    # deadline ends the session.
    assert wait_until(lambda: producer.store.stats().pinned == 0, timeout=10)
    assert wait_until(lambda: producer.stats().data_peers_in == 0, timeout=5)
    if how == "wrote on the stream":
        assert producer.stats().protocol_violations == 1
    stream.close()


def test_a_reader_that_stalls_but_answers_pings_is_cut_at_its_send_deadline(
        made: list[Any]) -> None:
    """A consumer that stops reading its stream but keeps its session alive: the stream
    takes no bytes for ``send_timeout``, the session ends with a ``bye`` that says why,
    and every block pinned for the fetch is released (SPEC §18.4)."""
    producer, raw, stream = fetch_that_stays_pinned(made, send_timeout=1.0)
    # From here on the stream is never read again; the ZeroMQ side answers every ping,
    # so the heartbeat (1 s) keeps the session alive: only the send deadline ends it.
    bye, pongs = answer_pings_until_bye(raw, timeout=20)
    assert bye is not None, "the stalled stream was never cut"
    assert bye.code == proto.Code.PEER_TIMEOUT and "took no bytes" in bye.msg, bye
    assert pongs >= 2, pongs  # the peer was alive all along
    assert wait_until(lambda: producer.store.stats().pinned == 0, timeout=5)
    stats = producer.stats()
    assert stats.data_streams_stalled == 1 and stats.data_peers_in == 0
    assert closed_unanswered_after_data(stream)


def closed_unanswered_after_data(sock: socket.socket, timeout: float = 10.0) -> bool:
    """The peer closed ``sock`` (whatever it had queued before is read and dropped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 20):
            pass
        return True
    except ConnectionResetError:
        return True
    finally:
        sock.close()


def test_a_reader_that_keeps_reading_slowly_is_never_cut(made: list[Any]) -> None:
    """The send deadline is about a stream that takes *nothing*: one that takes 256 KiB
    every 0.3 s, under its 0.5 s send deadline each time but a whole fetch lasting many
    deadlines, is served to the end, byte for byte."""
    producer = node({**SEED_V2, "pool": 64}, send_timeout=0.5, **HEARTBEAT)
    made.append(producer)
    keys = fill(producer, 8)
    raw, stream = bound_stream(producer, made)
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    raw.send_msg(proto.Fetch(1, tuple(keys), 8))
    bpb = producer.layout.bytes_per_block
    buf = bytearray()
    started = time.monotonic()
    while (got := stream_messages(buf, bpb)) is None and time.monotonic() - started < 60:
        while (frames := raw.recv(0)) is not None:
            ping = proto.decode(frames, raw.segments)
            if type(ping) is proto.Ping:
                raw.send_msg(proto.Pong(ping.nonce))
        part = stream.recv(256 << 10)
        assert part, f"the stream closed after {len(buf)} bytes"
        buf += part
        time.sleep(0.3)
    assert got is not None, f"no done after {len(buf)} bytes"
    assert got == {i: content(k, bpb) for i, k in enumerate(keys)}
    assert time.monotonic() - started > 1.0  # longer than two send deadlines
    assert producer.stats().data_streams_stalled == 0
    stream.close()


def stream_messages(buf: bytearray, bpb: int) -> dict[int, bytes] | None:
    """The blocks of a whole fetch read off a stream (u32 length, frame 0, a block's
    payload, ... up to its ``done``), or None while the ``done`` has not arrived."""
    at, blocks = 0, {}
    while at + 4 <= len(buf):
        (n,) = struct.unpack_from("<I", buf, at)
        if at + 4 + n > len(buf):
            return None
        msg = proto.decode_head(bytes(buf[at + 4:at + 4 + n]), None, None)
        at += 4 + n
        if type(msg) is proto.Done:
            return blocks
        size = len(msg.idx) * bpb
        if at + size > len(buf):
            return None
        for m, i in enumerate(msg.idx):
            blocks[i] = bytes(buf[at + m * bpb:at + (m + 1) * bpb])
        at += size
    return None


def test_the_peer_always_learns_why_its_session_ended(made: list[Any]) -> None:
    """A client that writes on its bound stream breaks the protocol: the node ends the
    session with ``bye`` PROTOCOL_VIOLATION and cuts the connection, the ``bye`` first,
    every time (10 sessions)."""
    producer = node(SEED_V2, **HEARTBEAT)
    made.append(producer)
    for attempt in range(10):
        raw, stream = bound_stream(producer, made)
        stream.sendall(b"\0")
        bye, _ = answer_pings_until_bye(raw, timeout=10)
        assert bye is not None, f"attempt {attempt}: no bye"
        assert bye.code == proto.Code.PROTOCOL_VIOLATION, bye
        assert "wrote on its data stream" in bye.msg, bye
        stream.close()
        raw.close()
    assert wait_until(lambda: producer.stats().data_peers_in == 0, timeout=5)
    assert producer.stats().protocol_violations == 10


def test_an_unexpected_error_while_sending_on_the_stream_leaks_no_pin(
        made: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pkv.runtime.paths.data_sender import BoundStream

    producer = node({**SEED_V2, "pool": 40})
    made.append(producer)
    keys = fill(producer, 30)
    real_push = BoundStream.push
    calls = {"n": 0}

    def failing_push(self: Any, head: bytes, segments: Any = None, done: Any = None) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure in the stream's send path")
        real_push(self, head, segments, done)

    monkeypatch.setattr(BoundStream, "push", failing_push)
    consumer = node(SEED_V2, fetch_idle_timeout=3.0)
    made.append(consumer)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data"
    with pytest.raises(P2PKVError):  # a bug costs the peer, never the node
        consumer.fetch(peer, keys, timeout=30)
    assert calls["n"] >= 2
    assert wait_until(lambda: producer.store.stats().pinned == 0, 5.0), producer.store.stats()
    assert consumer.store.stats().pinned == 0
    again = node(SEED_V2)
    made.append(again)
    result = again.fetch(again.connect(producer.address), keys, timeout=30)
    assert result.outcomes == (KeyOutcome.LANDED,) * 30
    assert wait_until(lambda: producer.store.stats().pinned == 0, 5.0)


# ---------------------------------------------------------------------- a hostile server


class _StreamServer:
    """A FakeServer whose welcome offers a data stream this test serves by hand."""

    def __init__(self, identity: Node, on_fetch: Any) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.token = os.urandom(16)
        self.stream: socket.socket | None = None
        self.on_fetch = on_fetch
        caps = (*identity.hello.caps,)
        self.fake = FakeServer(dataclasses.replace(identity.hello, caps=caps), self._script)
        self.fake.welcome = dataclasses.replace(self.fake.welcome, data=proto.DataOffer(
            self.listener.getsockname()[1], self.token, dc.port_of(self.fake.address)))
        self.address = self.fake.address

    @classmethod
    def connected(cls, consumer: Node, on_fetch: Any, made: list[Any]) -> PeerHandle:
        """``consumer`` connected to a new one, its data stream bound."""
        server = cls(consumer, on_fetch)
        made.append(server)
        fut = consumer.connect_async(server.address, timeout=10)
        server.accept()
        peer = fut.result(10)
        assert peer.data_path == "tcp-data"
        return peer

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(10)
        assert proto.token_of(read_exact(conn, proto.PREFACE_BYTES)) == self.token
        conn.sendall(proto.ACCEPTED)
        self.stream = conn

    def _script(self, msg: proto.Message) -> list[proto.Message]:
        if type(msg) is proto.Fetch and self.stream is not None:
            self.on_fetch(self.stream, msg)
        return []

    def close(self) -> None:
        self.fake.close()
        if self.stream is not None:
            self.stream.close()
        self.listener.close()


def _frame(head: dict[str, Any]) -> bytes:
    data = msgpack.packb(head, use_bin_type=True)
    return struct.pack("<I", len(data)) + data


@pytest.mark.parametrize("fault", ["ends mid-block", "frame of 0 bytes",
                                   "frame over 2 MiB", "index out of range"])
def test_a_server_that_breaks_the_stream_fails_the_fetch(fault: str,
                                                         made: list[Any]) -> None:
    consumer = node(SEED_V2)
    made.append(consumer)
    bpb = consumer.layout.bytes_per_block

    def on_fetch(stream: socket.socket, msg: proto.Fetch) -> None:
        ones = proto.block_checksum([b"\1" * bpb])
        block = {"t": "block", "v": 1, "req": msg.req, "idx": [0, 1], "sums": [ones, ones]}
        if fault == "ends mid-block":
            stream.sendall(_frame(block) + b"\1" * (bpb + 1000))
            stream.close()
        elif fault == "frame of 0 bytes":
            stream.sendall(struct.pack("<I", 0))
        elif fault == "frame over 2 MiB":
            stream.sendall(struct.pack("<I", proto.codes.MAX_HEAD_BYTES + 1))
        else:
            stream.sendall(_frame({**block, "idx": [0, 9999]}) + b"\1" * (2 * bpb))

    peer = _StreamServer.connected(consumer, on_fetch, made)
    keys = keys_for(4)
    with pytest.raises(P2PKVError):
        consumer.fetch(peer, keys, timeout=10)
    # A framing fault is the peer's protocol violation; a stream that ends is a peer gone.
    assert wait_until(lambda: consumer.stats().protocol_violations
                      == (0 if fault == "ends mid-block" else 1), timeout=5)
    stats = consumer.store.stats()
    assert stats.pinned == 0 and stats.used == stats.stored  # nothing half-written
    # A block whose bytes all came and verified may stay; the one cut short never does.
    assert consumer.get(keys[1]) is None
    assert stats.stored == (1 if fault == "ends mid-block" else 0)
    assert wait_until(lambda: consumer.peers() == [], timeout=5)


@pytest.mark.parametrize("packed", [True, False], ids=["packed-v1", "no packed-v1"])
def test_pk_on_the_stream_changes_nothing_but_needs_packed_v1(packed: bool,
                                                              made: list[Any]) -> None:
    """SPEC §18.3: the stream's bytes are those of a packed frame whatever ``pk`` says,
    so a ``block`` with ``pk`` true lands like one without, where ``packed-v1`` was
    negotiated; where it was not, ``pk`` true is UNEXPECTED 205, as on ZeroMQ."""
    consumer = node(SEED_V2, packed_blocks=packed)
    made.append(consumer)
    bpb = consumer.layout.bytes_per_block
    keys = keys_for(2)

    def on_fetch(stream: socket.socket, msg: proto.Fetch) -> None:
        blocks = [content(k, bpb) for k in keys]
        sums = [proto.block_checksum([b]) for b in blocks]
        stream.sendall(_frame({"t": "block", "v": 1, "req": msg.req, "idx": [0, 1],
                               "sums": sums, "pk": True}) + b"".join(blocks))
        stream.sendall(_frame({"t": "done", "v": 1, "req": msg.req, "outcomes": [0, 0]}))

    peer = _StreamServer.connected(consumer, on_fetch, made)
    assert ("packed-v1" in peer.capabilities) is packed
    if packed:
        result = consumer.fetch(peer, keys, timeout=10)
        assert result.outcomes == (KeyOutcome.LANDED, KeyOutcome.LANDED)
        assert [consumer.get(k) for k in keys] == [content(k, bpb) for k in keys]
        return
    with pytest.raises(ProtocolError) as excinfo:
        consumer.fetch(peer, keys, timeout=10)
    assert excinfo.value.code == proto.Code.UNEXPECTED and "packed" in str(excinfo.value)
    assert consumer.stats().protocol_violations == 1
    assert consumer.store.stats().stored == 0


def test_a_message_that_trickles_in_with_pauses_lands_whole(made: list[Any]) -> None:
    """The stream waits for whole chunks of the message under way (``SO_RCVLOWAT``), never
    for more than the message still owes: a sender that pauses with less than a chunk
    on the wire, and again a few bytes before the end, still gets its blocks landed."""
    consumer = node(SEED_V2)
    made.append(consumer)
    bpb = consumer.layout.bytes_per_block
    keys = keys_for(6)  # 3.4 MiB in one message: more than one chunk
    blocks = [content(k, bpb) for k in keys]
    payload = b"".join(blocks)

    def on_fetch(stream: socket.socket, msg: proto.Fetch) -> None:
        sums = [proto.block_checksum([b]) for b in blocks]
        head = _frame({"t": "block", "v": 1, "req": msg.req, "idx": list(range(6)),
                       "sums": sums})
        cuts = [0, 1, 100_000, len(payload) - 7, len(payload)]
        stream.sendall(head)
        for start, end in itertools.pairwise(cuts):
            stream.sendall(payload[start:end])
            time.sleep(0.15)
        stream.sendall(_frame({"t": "done", "v": 1, "req": msg.req, "outcomes": [0] * 6}))

    peer = _StreamServer.connected(consumer, on_fetch, made)
    result = consumer.fetch(peer, keys, timeout=10)
    assert result.outcomes == (KeyOutcome.LANDED,) * 6, result.errors
    assert [consumer.get(k) for k in keys] == blocks


# ---------------------------------------------------------------------- the table


def _session_pair(client_caps: tuple[str, ...], server_caps: tuple[str, ...],
                  offer: proto.DataOffer | None) -> tuple[proto.Session, proto.Session,
                                                          proto.Welcome]:
    from p2pkv.identity import RunConfig

    def hello(name: str, caps: tuple[str, ...]) -> proto.Hello:
        return proto.Hello.for_config(name, RunConfig("m"), proto.Geometry.of([8, 4]),
                                      proto.KeyHash("xxh3-128", 0), caps=caps)

    client = proto.Session(proto.Role.CLIENT, hello("c", client_caps), now=0.0)
    server = proto.Session(proto.Role.SERVER, hello("s", server_caps), now=0.0,
                           data_offer=offer)
    (hello_msg,) = client.start(0.0)
    server.start(0.0)
    (welcome,) = server.receive(hello_msg, 0.0).replies
    assert type(welcome) is proto.Welcome
    # Through the codec, as the client reads it.
    client.receive(proto.decode(proto.encode(welcome)), 0.0)
    return client, server, welcome


def test_the_welcome_offers_a_stream_only_when_tcp_data_v1_is_negotiated() -> None:
    offer = proto.DataOffer(40123, bytes(range(16)), 5555)
    both = (proto.CAP_CHECKSUM_XXH3_64, proto.CAP_TCP_DATA_V1)
    client, server, welcome = _session_pair(both, both, offer)
    assert welcome.data == offer and proto.CAP_TCP_DATA_V1 in welcome.caps
    assert server.data_offer == offer and client.data_offer == offer
    assert proto.usable_offer(client.capabilities, client.data_offer, 5555) == (offer, "")
    assert "relay" in proto.usable_offer(client.capabilities, client.data_offer, 6000)[1]
    plain = (proto.CAP_CHECKSUM_XXH3_64,)
    for c, s in ((plain, both), (both, plain)):
        client, server, welcome = _session_pair(c, s, offer)
        assert welcome.data is None and server.data_offer is None
        assert client.data_offer is None
        assert proto.usable_offer(client.capabilities, None, 5555)[0] is None
    # A client never keeps an offer it did not negotiate, nor sends one in its hello.
    client, _, _ = _session_pair(plain, plain, None)
    assert client.data_offer is None and client.local.data is None


# ---------------------------------------------------------------------- the transport


def test_gather_writes_in_order_and_reports_each_unit_once() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 14)
        gather = Gather(a)
        done: list[int] = []
        payloads = [os.urandom(300_000), os.urandom(5), b"", os.urandom(70_000)]
        for i, p in enumerate(payloads):
            half = len(p) // 2
            gather.push([memoryview(p)[:half], memoryview(p)[half:]],
                        lambda i=i: done.append(i))
        received = bytearray()
        b.settimeout(5)
        while not gather.flush():
            received += b.recv(1 << 20)
        while len(received) < sum(map(len, payloads)):
            received += b.recv(1 << 20)
        assert bytes(received) == b"".join(payloads)
        assert done == [0, 1, 2, 3] and not gather and gather.queued_bytes == 0
        # Dropped units are reported too (whoever pinned them unpins).
        gather.push([memoryview(os.urandom(10))], lambda: done.append(9))
        gather.drop()
        assert done[-1] == 9 and not gather


def test_gather_over_many_buffers_and_units_with_partial_writes() -> None:
    """Many units of many buffers (some empty, some a whole unit of nothing) through a
    small socket buffer: every write that stops inside a buffer resumes there, every
    byte goes out once and in order, and each unit is reported once, in order, only after
    its last byte was written."""
    rng = random.Random(11)
    units = [[os.urandom(rng.choice((0, 1, 9, 4096, 16384, 70_000)))
              for _ in range(rng.choice((0, 1, 5, 40)))] for _ in range(30)]
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 13)
        gather = Gather(a)
        done: list[tuple[int, int]] = []
        total = 0
        for i, parts in enumerate(units):
            total += sum(map(len, parts))
            gather.push([memoryview(p) for p in parts],
                        lambda i=i, end=total: done.append((i, end)))
        received = bytearray()
        b.settimeout(5)
        while not gather.flush():
            assert all(end <= gather.written_bytes for _, end in done)
            received += b.recv(rng.choice((1, 1000, 1 << 20)))
        while len(received) < total:
            received += b.recv(1 << 20)
        assert bytes(received) == b"".join(p for parts in units for p in parts)
        assert [i for i, _ in done] == list(range(len(units)))
        assert gather.queued_bytes == 0 and gather.written_bytes == total


def test_stream_frames_and_prefaces_are_checked() -> None:
    assert proto.token_of(proto.preface(b"k" * 16)) == b"k" * 16
    assert proto.token_of(b"P2PKVDC2" + b"k" * 16) is None
    assert proto.token_of(b"short") is None
    with pytest.raises(ValueError):
        proto.preface(b"short")
    assert proto.frame_length(struct.pack("<I", 77)) == 77
    with pytest.raises(ProtocolError) as zero:
        proto.frame_length(struct.pack("<I", 0))
    assert zero.value.code == proto.Code.FRAME_COUNT
    with pytest.raises(ProtocolError) as big:
        proto.frame_length(struct.pack("<I", 2 * 1024 * 1024 + 1))
    assert big.value.code == proto.Code.TOO_LARGE
    # A stream message stays within a block header's bounds.
    assert proto.stream_batch_limit(16384, 1) == 512
    assert proto.stream_batch_limit(589824, 12) == 14
    assert proto.stream_batch_limit(1024, 32) == 512
    assert proto.stream_batch_limit(1 << 30, 1) == 1


# ---------------------------------------------------------------------- the vectors

VECTORS = json.loads((Path(__file__).resolve().parent.parent / "protocol" / "vectors"
                      / "datachannel.json").read_text())


@pytest.mark.parametrize("vector", VECTORS["messages"],
                         ids=[v["name"] for v in VECTORS["messages"]])
def test_datachannel_message_vector_decodes_and_reencodes(vector: dict[str, Any]) -> None:
    from test_protocol_vectors import as_vector, frames_of

    msg = proto.decode(frames_of(vector), vector["segments"])
    assert as_vector(msg) == vector["message"]
    assert as_vector(proto.decode([bytes(f) for f in proto.encode(msg)])) == vector["message"]


@pytest.mark.parametrize("vector", VECTORS["errors"], ids=[v["name"] for v in VECTORS["errors"]])
def test_datachannel_error_vector_raises_its_code(vector: dict[str, Any]) -> None:
    from test_protocol_vectors import frames_of

    with pytest.raises(ProtocolError) as excinfo:
        proto.decode(frames_of(vector), vector["segments"])
    assert excinfo.value.code == vector["code"], excinfo.value.message


@pytest.mark.parametrize("name", ["block_two_blocks_then_done", "packed_block_then_done"])
def test_stream_vectors_read_as_the_spec_says(name: str) -> None:
    by_name = {v["name"]: v for v in VECTORS["stream"]}
    pre = by_name["preface"]
    assert proto.preface(bytes.fromhex(pre["token"])).hex() == pre["bytes"]
    assert proto.token_of(bytes.fromhex(pre["bytes"])) == bytes.fromhex(pre["token"])
    assert bytes.fromhex(by_name["accepted"]["bytes"]) == proto.ACCEPTED
    framed = by_name[name]
    # pk or not, the bytes after a block's frame 0 are the same (SPEC §18.3).
    plain = by_name["block_two_blocks_then_done"]["messages"]
    assert [m["payload"] for m in framed["messages"]] == [m["payload"] for m in plain]
    data, at, bpb = bytes.fromhex(framed["bytes"]), 0, sum(framed["segments"])
    for want in framed["messages"]:
        n = proto.frame_length(data[at:at + 4])
        head = data[at + 4:at + 4 + n]
        assert head.hex() == want["frame0"]
        assert proto.frame_prefix(head) == data[at:at + 4]
        msg = proto.decode_head(head, None, framed["segments"])
        size = len(msg.idx) * bpb if type(msg) is proto.Block else 0
        payload = data[at + 4 + n:at + 4 + n + size]
        assert payload.hex() == want["payload"]
        if type(msg) is proto.Block:
            for k, s in enumerate(msg.sums):
                assert proto.block_checksum([payload[k * bpb:(k + 1) * bpb]]) == s
        at += 4 + n + size
    assert at == len(data)


class _Killer:
    def __init__(self, proc: NodeProcess) -> None:
        self.proc = proc

    def close(self) -> None:
        with_sig = getattr(self.proc.proc, "send_signal", None)
        if with_sig is not None and self.proc.proc.poll() is None:
            with_sig(signal.SIGKILL)
        self.proc.kill()

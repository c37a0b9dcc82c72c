"""The sealed data stream (``tcp-data-aead-v1``, SPEC §18.8): records, sockets, nodes.

What is held:

- the socket: whatever the buffers' sizes on either side, the bytes that arrive are the
  bytes sent; a writer reports only whole records as written and takes the rest again;
  a reader that gets part of a record keeps the rest for the next read (and says so);
- every change to the bytes in flight ends the stream with SealError: one bit flipped,
  a record replayed, dropped, swapped with the next, moved across a key epoch, a head
  that lies, the end of the stream inside a record; the end between records is a clean
  end;
- with real CURVE nodes: blocks move sealed by default, byte for byte, into the store
  and into caller buffers, on one stream and on several; a TLS-only peer still gets
  TLS; a man in the middle of the data port that changes, replays, drops, reorders or
  cuts records makes the fetch fail and lands nothing wrong, and the node goes on; a
  stranger who saw the token in the clear can neither bind with it nor spend it.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

import pytest
import zmq
from internals import inbound_connections, plaintext_bytes, staging_bytes, stream_socket
from nodeproc import content, fill, moves_both_ways
from nodeproc import pooled_node as node
from rawpeer import Acceptor, ThrottlingProxy, closed_unanswered, ipv6_loopback, wait_until

from p2pkv import protocol as proto
from p2pkv.errors import P2PKVError, PeerGone
from p2pkv.node import KeyOutcome, Node
from p2pkv.protocol.seal import (
    ANSWER_RECORD_BYTES,
    MAX_RECORD,
    RECORD_HEAD,
    RECORDS_PER_KEY,
    TAG_LEN,
    RecordKeys,
    SealError,
    open_record,
    seal_record,
)
from p2pkv.transport import CurveKeys
from p2pkv.transport.sealed import SealedSocket

pytestmark = pytest.mark.timeout(120)

SECRET = bytes(range(32))
TOKEN = bytes(range(100, 116))


# -- the socket ------------------------------------------------------------------------------


def _pair(first: int = 0) -> tuple[SealedSocket, SealedSocket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    return (SealedSocket(a, sealer=RecordKeys(SECRET, TOKEN, "server", first)),
            SealedSocket(b, opener=RecordKeys(SECRET, TOKEN, "server", first)))


def _cut(data: bytes, sizes: list[int]) -> list[memoryview]:
    """``data`` as consecutive views of the given sizes (cycled)."""
    view, out, i = memoryview(data), [], 0
    while view.nbytes:
        n = sizes[i % len(sizes)]
        out.append(view[:n])
        view = view[n:]
        i += 1
    return out


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views``."""
    while n:
        head = views[0]
        if n >= head.nbytes:
            n -= head.nbytes
            views.pop(0)
        else:
            views[0] = head[n:]
            n = 0


def _move(tx: SealedSocket, rx: SealedSocket, send: list[memoryview],
          recv: list[memoryview]) -> None:
    """Everything of ``send`` through the pair into ``recv``, both non-blocking, in
    turns; a writer presents again what it was not told was written."""
    queue = list(send)
    want = list(recv)
    spins = 0
    while want:
        spins += 1
        assert spins < 200_000
        if queue:
            try:
                n = tx.send_records(queue[:64])
            except BlockingIOError:
                n = 0
            _consume(queue, n)
        try:
            got = rx.recv_records(want[:64])
        except BlockingIOError:
            continue
        assert got, "end of the stream before the end of the data"
        _consume(want, got)


@pytest.mark.parametrize(("send_sizes", "recv_sizes"), [
    ([100, 48 << 10, 48 << 10, 48 << 10], [100, 48 << 10, 48 << 10, 48 << 10]),
    ([12, 589_824], [12, 589_824]),
    ([3 << 20], [7, 1000, 300_000, 1 << 20]),
    ([1, 2, 3, 70_000, 5], [1 << 20]),
    ([16 << 10], [4096, 100, 16 << 10]),
])
def test_the_bytes_that_arrive_are_the_bytes_sent(send_sizes: list[int],
                                                  recv_sizes: list[int]) -> None:
    tx, rx = _pair()
    data = os.urandom(5 << 20)
    out = bytearray(len(data))
    try:
        _move(tx, rx, _cut(data, send_sizes), _cut(out, recv_sizes))  # type: ignore[arg-type]
        assert out == data
        assert rx.pending() == 0
        # Records are at most MAX_RECORD bytes, and large buffers are not gathered.
        assert tx.sealer is not None and tx.sealer.next >= len(data) // MAX_RECORD
    finally:
        tx.close()
        rx.close()


def test_buffers_grow_only_as_far_as_the_records_they_hold() -> None:
    tx, rx = _pair()
    try:
        # Large segments, each sealed and opened in place, behind a small header.
        data = os.urandom(200 + (3 << 20))
        out = bytearray(len(data))
        _move(tx, rx, _cut(data, [200, 1 << 20]), _cut(out, [200, 1 << 20]))
        assert out == data
        assert staging_bytes(tx) == plaintext_bytes(rx) == 64 << 10
        # Small buffers gathered into 1 MiB records: the staging grows to hold one.
        small = os.urandom(2 << 20)
        out = bytearray(len(small))
        _move(tx, rx, _cut(small, [16 << 10]), [memoryview(out)[:100], memoryview(out)[100:]])
        assert out == small
        assert staging_bytes(tx) == MAX_RECORD
        assert plaintext_bytes(rx) == MAX_RECORD  # the first record did not fit 100 bytes
    finally:
        tx.close()
        rx.close()


def test_a_writer_reports_whole_records_only_and_takes_the_rest_again() -> None:
    tx, rx = _pair()  # socket buffers far below one 1 MiB record
    data = memoryview(os.urandom(4 << 20))
    try:
        # Part of record 0 went to the kernel, but none of it is reported written ...
        with pytest.raises(BlockingIOError):
            tx.send_records([data])
        with pytest.raises(BlockingIOError):  # ... nor can the reader open any of it yet
            rx.recv_records([memoryview(bytearray(16))])
        with pytest.raises(BlockingIOError):
            tx.send_records([data])
        # The same bytes presented again finish it: nothing lost, nothing twice.
        out = bytearray(data.nbytes)
        _move(tx, rx, [data], [memoryview(out)])
        assert out == data
        assert tx.sealer is not None and tx.sealer.next == 4
    finally:
        tx.close()
        rx.close()


def test_part_of_a_record_waits_for_the_next_read() -> None:
    tx, rx = _pair()
    try:
        tx.sendall(b"x" * 100)
        small = bytearray(10)
        assert wait_until(lambda: _try_read(rx, small) == 10, timeout=5)
        assert rx.pending() == 90
        assert rx.promised(500) == 410  # 90 are here already
        rest = bytearray(90)
        assert rx.recv_into(rest) == 90 and bytes(small + rest) == b"x" * 100
        with pytest.raises(BlockingIOError):
            rx.recv_into(bytearray(1))
    finally:
        tx.close()
        rx.close()


def _try_read(rx: SealedSocket, buf: bytearray) -> int:
    try:
        return rx.recv_into(buf)
    except BlockingIOError:
        return 0


def test_records_cross_a_key_epoch() -> None:
    tx, rx = _pair(first=RECORDS_PER_KEY - 2)
    data = os.urandom(4 * 70_000)
    out = bytearray(len(data))
    try:
        _move(tx, rx, _cut(data, [70_000]), [memoryview(out)])
        assert out == data
        assert rx.opener is not None and rx.opener.next == RECORDS_PER_KEY + 2
    finally:
        tx.close()
        rx.close()


def _records(n: int, first: int = 0) -> list[bytes]:
    keys = RecordKeys(SECRET, TOKEN, "server", first)
    return [seal_record(keys, bytes([i]) * (1000 + i)) for i in range(n)]


def _flip(record: bytes, at: int) -> bytes:
    b = bytearray(record)
    b[at] ^= 0x01
    return bytes(b)


r = _records(4)
TAMPERED: dict[str, tuple[bytes, str]] = {
    "a bit flipped in the ciphertext": (r[0] + _flip(r[1], 20) + r[2], "record 1"),
    "a bit flipped in the tag": (r[0] + _flip(r[1], len(r[1]) - 1), "record 1"),
    "a bit flipped in the head": (r[0] + _flip(r[1], 0), "record 1"),
    "a record replayed": (r[0] + r[0] + r[1], "record 1"),
    "a record dropped": (r[0] + r[2], "record 1"),
    "two records swapped": (r[1] + r[0], "record 0"),
    "a record of another epoch": (_records(1, RECORDS_PER_KEY)[0], "record 0"),
    "a record of another direction": (
        seal_record(RecordKeys(SECRET, TOKEN, "client"), b"x" * 100), "record 0"),
    "a record of another stream": (
        seal_record(RecordKeys(SECRET, bytes(16), "server"), b"x" * 100), "record 0"),
    "a head of 0 bytes": (RECORD_HEAD.pack(0) + bytes(TAG_LEN), "of 0 bytes"),
    "a head above the record bound": (RECORD_HEAD.pack(MAX_RECORD + 1), "bytes (1 to"),
    "the end inside a record": (r[0] + r[1][:500], "ended inside a record"),
    "the end inside a head": (r[0] + r[1][:2], "ended inside a record"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_every_change_in_flight_ends_the_stream(case: str) -> None:
    wire, said = TAMPERED[case]
    a, b = socket.socketpair()
    rx = SealedSocket(b, opener=RecordKeys(SECRET, TOKEN, "server"))
    try:
        a.sendall(wire)
        a.shutdown(socket.SHUT_WR)
        buf = bytearray(1 << 20)
        with pytest.raises(SealError, match=re.escape(said)):
            for _ in range(100):
                try:
                    if rx.recv_into(buf) == 0:
                        break
                except BlockingIOError:
                    threading.Event().wait(0.01)
    finally:
        a.close()
        rx.close()


def test_the_end_between_records_is_a_clean_end() -> None:
    a, b = socket.socketpair()
    rx = SealedSocket(b, opener=RecordKeys(SECRET, TOKEN, "server"))
    try:
        a.sendall(b"".join(_records(2)))
        a.shutdown(socket.SHUT_WR)
        buf = bytearray(4000)
        assert wait_until(lambda: _try_read(rx, buf) == 2001, timeout=5)  # both records
        assert buf[:2001] == b"\x00" * 1000 + b"\x01" * 1001
        assert rx.recv_into(buf) == 0
        assert rx.recv_into(buf) == 0
    finally:
        a.close()
        rx.close()


def test_an_answer_opens_only_under_its_streams_keys() -> None:
    answer = seal_record(RecordKeys(SECRET, TOKEN, "server"), proto.ACCEPTED)
    assert len(answer) == ANSWER_RECORD_BYTES
    assert open_record(RecordKeys(SECRET, TOKEN, "server"), answer) == proto.ACCEPTED
    with pytest.raises(SealError):
        open_record(RecordKeys(bytes(32), TOKEN, "server"), answer)
    with pytest.raises(SealError):
        open_record(RecordKeys(SECRET, TOKEN, "server", 1), answer)


# -- nodes -----------------------------------------------------------------------------------

curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
SEED_V1 = {"layout": "v1", "geometry": "seed"}


def curve_pair(made: list[Any], producer_config: dict[str, Any] | None = None,
               **config: Any) -> tuple[Node, Node]:
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    producer = node({**SEED_V1, "pool": 80}, curve=CurveKeys(spub, ssec),
                    **{**config, **(producer_config or {})})
    consumer = node({**SEED_V1, "pool": 80}, curve=CurveKeys(cpub, csec, spub), **config)
    made += [producer, consumer]
    return producer, consumer


def _inbound_socks(producer: Node) -> list[socket.socket]:
    (inbound,) = inbound_connections(producer)
    return [stream_socket(s) for s in inbound.streams.values()]


@curve
def test_curve_nodes_move_blocks_on_a_sealed_stream(made: list[Any]) -> None:
    producer, consumer = curve_pair(made)
    caps = producer.hello.caps
    assert proto.CAP_TCP_DATA_AEAD_V1 in caps and proto.CAP_TCP_DATA_TLS_V1 in caps
    assert proto.CAP_TCP_DATA_V1 not in caps  # never a plaintext stream
    keys = fill(producer, 24)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data", peer.data_path_detail
    assert "sealed (AES-256-GCM" in peer.data_path_detail
    assert all(isinstance(s, SealedSocket) for s in _inbound_socks(producer))
    moves_both_ways(producer, consumer, peer, keys)


@curve
def test_several_sealed_streams(made: list[Any]) -> None:
    producer, consumer = curve_pair(made, data_streams=3)
    keys = fill(producer, 30)
    peer = consumer.connect(producer.address)
    assert peer.data_path_detail.startswith("3 data streams"), peer.data_path_detail
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)
    socks = _inbound_socks(producer)
    assert len(socks) == 3 and all(isinstance(s, SealedSocket) for s in socks)
    bpb = consumer.layout.bytes_per_block
    assert all(consumer.get(k) == content(k, bpb) for k in keys)


@curve
@pytest.mark.parametrize("tls_side", ["producer", "consumer"])
def test_a_tls_only_peer_still_gets_tls(made: list[Any], tls_side: str) -> None:
    tls = {"data_encryption": "tls"}
    producer, consumer = (curve_pair(made, producer_config=tls) if tls_side == "producer"
                          else curve_pair(made, **tls, producer_config={
                              "data_encryption": "sealed"}))
    keys = fill(producer, 6)
    peer = consumer.connect(producer.address)
    assert "TLS 1.3, its certificate pinned" in peer.data_path_detail
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)


class RecordRelay(Acceptor):
    """A man in the middle of the data port that reads the server's records as they
    pass (it cannot open them) and, from the ``at``-th record after the answer on, does
    ``what`` to them. It records the client's preface."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], what: str,
                 at: int = 2,
                 on_preface: Callable[[bytes], None] | None = None) -> None:
        super().__init__(listen)
        self.upstream = upstream
        self.what = what
        self.at = at
        self.on_preface = on_preface
        self.prefaces: list[bytes] = []
        self.done = threading.Event()
        self.start()

    def serve(self, client: socket.socket) -> None:
        client.settimeout(10)
        try:
            server = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    @staticmethod
    def _exactly(sock: socket.socket, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return bytes(out)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        try:
            preface = self._exactly(client, proto.SEALED_PREFACE_BYTES)
            self.prefaces.append(preface)
            if self.on_preface is not None:
                self.on_preface(preface)
            server.sendall(preface)
            client.sendall(self._exactly(server, ANSWER_RECORD_BYTES))
            held: bytes | None = None
            n = 0
            while True:
                head = self._exactly(server, RECORD_HEAD.size)
                (size,) = RECORD_HEAD.unpack(head)
                record = head + self._exactly(server, size + TAG_LEN)
                n += 1
                if n < self.at:
                    client.sendall(record)
                    continue
                if n == self.at:
                    if self.what == "flip":
                        record = _flip(record, RECORD_HEAD.size + size // 2)
                    elif self.what == "replay":
                        record = record + record
                    elif self.what == "drop":
                        continue
                    elif self.what == "swap":
                        held = record
                        continue
                    elif self.what == "cut":
                        # The client sees its stream end inside a record first; the
                        # server's side closes a little later.
                        client.sendall(record[:size // 2])
                        client.close()
                        threading.Event().wait(0.5)
                        break
                if held is not None:
                    record, held = record + held, None
                client.sendall(record)
        except OSError:
            pass
        finally:
            self.done.set()
            for s in (client, server):
                s.close()


def _through_relay(made: list[Any], what: str, **relay: Any
                   ) -> tuple[Node, Node, RecordRelay, str]:
    producer, consumer = curve_pair(made)
    zport = int(producer.address.rsplit(":", 1)[1])
    dport = producer.stats().data_port
    assert dport is not None
    # ZeroMQ goes through a plain relay (CurveZMQ is end to end); the data port through
    # the man in the middle, at the same port numbers on ::1.
    made.append(ThrottlingProxy(f"tcp://127.0.0.1:{zport}", 1e9, listen=("::1", zport)))
    mitm = RecordRelay(("::1", dport), ("127.0.0.1", dport), what, **relay)
    made.append(mitm)
    return producer, consumer, mitm, f"tcp://[::1]:{zport}"


@curve
@pytest.mark.skipif(not ipv6_loopback(), reason="needs ::1")
@pytest.mark.parametrize("what", ["flip", "replay", "drop", "swap", "cut"])
def test_a_man_in_the_middle_who_changes_records_lands_nothing_wrong(
        made: list[Any], what: str) -> None:
    producer, consumer, mitm, address = _through_relay(made, what)
    keys = fill(producer, 40)  # 40 × 576 KiB: records 1.. carry them
    peer = consumer.connect(address)
    assert peer.data_path == "tcp-data", peer.data_path_detail
    with pytest.raises(P2PKVError) as failed:
        result = consumer.fetch(peer, keys)
        assert result.outcomes != (KeyOutcome.LANDED,) * len(keys)
        raise AssertionError(f"the fetch did not fail: {result.outcomes}")
    said = str(failed.value)
    # What the caller is told (SPEC 18.8 rule 5): the peer is gone, and why.
    assert isinstance(failed.value, PeerGone), repr(failed.value)
    assert "the sealed data stream failed" in said
    assert ("failed authentication" in said or "ended inside a record" in said), said
    assert consumer.stats().data_records_refused == 1
    assert mitm.done.wait(10)
    bpb = consumer.layout.bytes_per_block
    landed = [k for k in keys if consumer.get(k) is not None]
    assert all(consumer.get(k) == content(k, bpb) for k in landed)  # nothing wrong
    assert len(landed) < len(keys)
    assert wait_until(lambda: producer.store.stats().pinned == 0, timeout=10)
    # The node goes on: a new connection, straight to the port, moves every block.
    again = consumer.connect(producer.address)
    assert again.data_path == "tcp-data"
    assert consumer.fetch(again, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)
    assert all(consumer.get(k) == content(k, bpb) for k in keys)


@curve
@pytest.mark.skipif(not ipv6_loopback(), reason="needs ::1")
def test_a_stranger_who_saw_the_token_can_neither_bind_nor_spend_it(
        made: list[Any]) -> None:
    verdicts: list[bool] = []
    dport: list[int] = []

    def race(preface: bytes) -> None:
        # Before the client's preface goes on, a stranger presents its token: with a
        # tag of its own (it lacks the key), in a plaintext preface, in a sealed preface
        # cut short (SPEC 18.8 rule 7), and in a plain preface inside TLS, whose
        # handshake the server completes before it reads the preface.
        token = proto.sealed_token_of(preface)
        assert token is not None
        forged = preface[:-TAG_LEN] + bytes(TAG_LEN)
        for attempt in (forged, proto.preface(token)):
            s = socket.create_connection(("127.0.0.1", dport[0]), timeout=5)
            s.sendall(attempt)
            verdicts.append(closed_unanswered(s))
        s = socket.create_connection(("127.0.0.1", dport[0]), timeout=5)
        s.sendall(preface[:30])
        s.shutdown(socket.SHUT_WR)
        verdicts.append(closed_unanswered(s))
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
        tls.minimum_version = ssl.TLSVersion.TLSv1_3
        raw = socket.create_connection(("127.0.0.1", dport[0]), timeout=5)
        wrapped = tls.wrap_socket(raw)  # the handshake completes
        wrapped.sendall(proto.preface(token))
        verdicts.append(closed_unanswered(wrapped))

    producer, consumer, mitm, address = _through_relay(made, "none", on_preface=race)
    dport.append(producer.stats().data_port or 0)
    keys = fill(producer, 6)
    peer = consumer.connect(address)
    assert verdicts == [True, True, True, True]
    assert peer.data_path == "tcp-data", peer.data_path_detail  # the token still binds
    assert consumer.fetch(peer, keys).outcomes == (KeyOutcome.LANDED,) * len(keys)
    assert producer.stats().data_streams_refused == 4
    # A preface replayed once the stream is bound: the token is used up.
    s = socket.create_connection(("127.0.0.1", dport[0]), timeout=5)
    s.sendall(mitm.prefaces[0])
    assert closed_unanswered(s)
    assert producer.store.stats().pinned == 0

"""A connection's data path: one object per side, chosen once, the same shape for all.

What is held, with real nodes and sockets: each of the four paths (ZeroMQ frames, packed
frames, shared memory, the data stream) is the one a pair of nodes ends up on for what
they both offer, moves the same bytes, and counts what it moved in ``stats().paths``
under its own kind only, in one shape for every path; and on every path that pins
blocks for a reader, a reader that stalls while it keeps its session alive is cut at
the send deadline, its pins released, counted under the path that stalled.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from nodeproc import content, fill
from nodeproc import pooled_node as node
from rawpeer import RawPeer, answer_pings_until_bye, wait_until

from p2pkv import protocol as proto
from p2pkv.node import KeyOutcome, Node, PeerHandle
from p2pkv.runtime.paths.frames import KINDS
from p2pkv.runtime.public import PathStats
from p2pkv.shm import MappedSegment

pytestmark = pytest.mark.timeout(120)

SEED_V1 = {"layout": "v1", "geometry": "seed"}  # 1 x 576 KiB: frames go without a copy
SEED_V2 = {"layout": "v2", "geometry": "seed"}  # 12 x 48 KiB: packed when both take it
HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}

# What each pair offers -> the path both sides must be on.
PAIRS = {
    "zmq": (SEED_V1, {"data_channel": False}),
    "packed": (SEED_V2, {"data_channel": False}),
    "shm": (SEED_V2, {"shm": True}),
    "stream": (SEED_V2, {}),
}
HANDLE = {"zmq": "tcp", "packed": "tcp", "shm": "shm", "stream": "tcp-data"}


def _pair_on(kind: str, blocks: int, made: list[Any]
             ) -> tuple[Node, Node, PeerHandle, list[bytes]]:
    """A producer holding ``blocks`` blocks and a consumer connected to it, on path
    ``kind``: (producer, consumer, the consumer's peer handle, the keys)."""
    spec, config = PAIRS[kind]
    producer = node(spec, **config)
    consumer = node(spec, **config)
    made += [producer, consumer]
    keys = fill(producer, blocks)
    peer = consumer.connect(producer.address)
    assert peer.data_path == HANDLE[kind], peer.data_path_detail
    return producer, consumer, peer, keys


@pytest.mark.parametrize("kind", list(PAIRS))
def test_each_path_moves_the_same_bytes_and_counts_them_under_its_kind(
        kind: str, made: list[Any]) -> None:
    producer, consumer, peer, keys = _pair_on(kind, 12, made)
    result = consumer.fetch(peer, keys)
    assert result.outcomes == (KeyOutcome.LANDED,) * len(keys)
    bpb = consumer.layout.bytes_per_block
    assert all(consumer.get(k) == content(k, bpb) for k in keys)

    sent, received = producer.stats().paths, consumer.stats().paths
    assert set(sent) == set(received) == set(KINDS)  # every kind, always present
    assert all(isinstance(s, PathStats) for s in (*sent.values(), *received.values()))
    n = len(keys)
    assert sent[kind] == PathStats(blocks_sent=n, bytes_sent=n * bpb)
    assert received[kind] == PathStats(blocks_received=n, bytes_received=n * bpb)
    for other in set(KINDS) - {kind}:
        assert sent[other] == received[other] == PathStats(), other
    # The totals count every path.
    assert producer.stats().blocks_sent == consumer.stats().blocks_received == n


@pytest.mark.parametrize("kind", list(PAIRS))
def test_a_key_repeated_in_a_fetch_lands_every_time_and_moves_once(
        kind: str, made: list[Any]) -> None:
    """A fetch into the store that names a key more than once (a caller's list of
    blocks, not deduplicated) gets that key as landed at every position, on every path,
    and its block moves once (one slot holds it)."""
    producer, consumer, peer, keys = _pair_on(kind, 4, made)
    asked = [keys[0], keys[1], keys[0], keys[2], keys[1], keys[0]]
    result = consumer.fetch(peer, asked)
    assert result.outcomes == (KeyOutcome.LANDED,) * len(asked), result.errors
    assert result.errors == {}
    bpb = consumer.layout.bytes_per_block
    assert result.blocks == 3 and result.nbytes == 3 * bpb
    assert all(consumer.get(k) == content(k, bpb) for k in keys[:3])
    assert producer.stats().blocks_sent == 3


def test_a_frames_reader_that_stalls_but_pings_is_cut_at_its_send_deadline(
        made: list[Any]) -> None:
    """A consumer that stops reading its DEALER but keeps sending pings: its session
    stays alive (the node hears from it), its frames stay pinned in libzmq's queue, and
    the ledger sees none let go for ``send_timeout``: the node cuts it and unpins."""
    producer = node({**SEED_V1, "pool": 300}, data_channel=False, send_timeout=1.0,
                    **HEARTBEAT)
    made.append(producer)
    keys = fill(producer, 280)
    raw = RawPeer(producer.address, rcvhwm=2, rcvbuf=1 << 16, monitor=True)
    made.append(raw)
    raw.handshake(producer)
    raw.send_msg(proto.Fetch(1, tuple(keys), 250))
    assert wait_until(lambda: producer.store.stats().pinned > 0, timeout=5)
    # Never read again; a ping every 0.2 s keeps the heartbeat (1 s) satisfied.
    deadline = time.monotonic() + 20
    while producer.store.stats().pinned and time.monotonic() < deadline:
        raw.send_msg(proto.Ping(1))
        time.sleep(0.2)
    assert producer.store.stats().pinned == 0, "the stalled reader's frames stayed pinned"
    stats = producer.stats()
    assert stats.paths["zmq"].readers_stalled == 1
    assert stats.paths["zmq"].blocks_sent < len(keys)  # it never took the whole fetch
    assert stats.peers_in == 0


def attached(producer: Node, made: list[Any]) -> RawPeer:
    """A raw client of ``producer`` that proved it maps the producer's pool."""
    raw = RawPeer(producer.address)
    made.append(raw)
    welcome = raw.handshake(producer)
    assert welcome.shm is not None
    mapping = MappedSegment(welcome.shm.name, welcome.shm.size, welcome.geo.seg)
    raw.send_msg(proto.Attach(mapping.nonce))
    mapping.close()
    assert raw.expect(proto.Attached).ok
    return raw


def test_a_shared_memory_reader_that_never_releases_is_cut_at_its_send_deadline(
        made: list[Any]) -> None:
    """A same-host consumer that maps the pool and answers pings but never releases a
    located block: the node ends its session at ``send_timeout``, the ``bye`` says why,
    and every pin is released."""
    producer = node({**SEED_V2, "pool": 64}, shm=True, send_timeout=1.0, **HEARTBEAT)
    made.append(producer)
    keys = fill(producer, 16)
    raw = attached(producer, made)
    raw.send_msg(proto.Fetch(1, tuple(keys), 16, shm=True))
    bye, _ = answer_pings_until_bye(raw, timeout=20)
    assert bye is not None, "the reader that never released was never cut"
    assert bye.code == proto.Code.PEER_TIMEOUT and "released none" in bye.msg, bye
    assert wait_until(lambda: producer.store.stats().pinned == 0, timeout=5)
    assert producer.stats().shm_pinned == 0
    assert producer.stats().paths["shm"].readers_stalled == 1


def test_a_shared_memory_reader_that_releases_is_never_cut(made: list[Any]) -> None:
    """Releasing is progress: a consumer that holds each located block for a while but
    releases it, over a fetch much longer than the send deadline, is served to the end."""
    producer: Node = node({**SEED_V2, "pool": 64}, shm=True, send_timeout=0.5, **HEARTBEAT)
    made.append(producer)
    keys = fill(producer, 12)
    raw = attached(producer, made)
    raw.send_msg(proto.Fetch(1, tuple(keys), 2, shm=True))
    started = time.monotonic()
    done = None
    while done is None and time.monotonic() - started < 30:
        msg = raw.recv_msg(10)
        if type(msg) is proto.Ping:
            raw.send_msg(proto.Pong(msg.nonce))
        elif type(msg) is proto.Located:
            time.sleep(0.3)  # under the deadline each time
            raw.send_msg(proto.Release(1, msg.idx))
            raw.send_msg(proto.Credit(1, len(msg.idx)))
        elif type(msg) is proto.Done:
            done = msg
        else:
            assert type(msg) is proto.Pong, msg
    assert done is not None and done.outcomes == (0,) * len(keys)
    assert time.monotonic() - started > 1.0  # longer than two send deadlines
    assert producer.stats().paths["shm"].readers_stalled == 0


class _FakeTracker:
    def __init__(self) -> None:
        self.done = False


class _FakeSocket:
    """Records what :func:`send_payload` sends; a tracked send returns a fake tracker."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bool, bool]] = []
        self.trackers: list[_FakeTracker] = []

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        self.sent.append((memoryview(data).nbytes, flags, copy, track))
        if not track:
            return None
        self.trackers.append(_FakeTracker())
        return self.trackers[-1]


class _FakeStore:
    def __init__(self) -> None:
        self.released: list[Any] = []

    def release_many(self, readers: Any) -> None:
        self.released.extend(readers)


def test_the_ledger_unpins_a_message_only_once_every_zero_copy_frame_is_let_go() -> None:
    import zmq

    from p2pkv.runtime.paths.sender import SendLedger, send_payload
    from p2pkv.runtime.tuning import ZERO_COPY_MIN

    big, small = memoryview(bytearray(ZERO_COPY_MIN)), memoryview(bytearray(16))
    sock = _FakeSocket()
    trackers = send_payload(sock, [big, small, big, big])  # type: ignore[arg-type]
    # Every zero-copy frame is tracked, the small one copied, the last ends the message.
    assert sock.sent == [(ZERO_COPY_MIN, zmq.SNDMORE, False, True), (16, zmq.SNDMORE, True, False),
                         (ZERO_COPY_MIN, zmq.SNDMORE, False, True), (ZERO_COPY_MIN, 0, False, True)]
    assert trackers == sock.trackers and len(trackers) == 3
    store = _FakeStore()
    ledger = SendLedger(store)  # type: ignore[arg-type]
    ledger.hold(b"peer", trackers, ["reader-1", "reader-2"])  # type: ignore[list-item]
    # libzmq lets go of the last frame first: the earlier ones still point into the pool.
    sock.trackers[2].done = True
    ledger.reap()
    assert store.released == [] and ledger
    sock.trackers[0].done = True
    ledger.reap()
    assert store.released == [] and ledger
    sock.trackers[1].done = True
    ledger.reap()
    assert store.released == ["reader-1", "reader-2"] and not ledger

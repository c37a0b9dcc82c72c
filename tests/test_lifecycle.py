"""Lifecycle guarantees an engine can build on (issue 11, section 2).

An engine calls the node from scheduler and worker threads, preempts requests and reuses
buffers. Each test here fails without the guarantee it names:

* cancel: ``Future.cancel()`` on a fetch (and ``Node.abort``) stops it; the peer is
  told, not one more byte lands in the caller's buffers once cancel returned, no slot
  stays taken, and the keys can be fetched again;
* an unexpected exception in the receive or the send path leaks no writer slot and no
  send pin;
* every future completes when the node closes, including those queued while closing;
* ``stats()`` is safe while connections churn;
* local limits raise :class:`LocalLimitExceeded`, never a ``ProtocolError``, and
  ``timeout=0`` means zero.

Mid-transfer states go through a :class:`ThrottlingProxy`, so "the fetch is still
running" is a fact, not a race.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from typing import Any

import pytest
from nodeproc import content, keys_for
from rawpeer import FakeServer, ThrottlingProxy, wait_until

from p2pkv import KeyOutcome
from p2pkv.errors import (
    ConfigError,
    LocalLimitExceeded,
    P2PKVError,
    PeerGone,
    PeerTimeout,
    ProtocolError,
)
from p2pkv.runtime.paths.data_sender import BoundStream
from p2pkv.runtime.paths.packing import PackedSender
from p2pkv.runtime.paths.sender import Sender
from p2pkv.settings import load_settings
from p2pkv.store import BlockWriter
from p2pkv.store.slots import SlotBatches

pytestmark = pytest.mark.timeout(120)

SEED_V2 = {"layout": "v2", "geometry": "seed"}
SEED_V1 = {"layout": "v1", "geometry": "seed"}
SMALL = {"layout": "v2", "geometry": "small"}
SLACK = 5.0
SENTINEL = 0xA5


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads far more often than every 5 ms, so that races show up."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def producer_with(nodes: Any, spec: dict[str, Any], **config: Any) -> tuple[Any, list[bytes]]:
    node = nodes(spec, **config)
    keys = keys_for(spec["blocks"])
    for k in keys:
        node.put(k, content(k, node.layout.bytes_per_block))
    return node, keys


def buffers(node: Any, n: int) -> list[list[bytearray]]:
    return [[bytearray([SENTINEL]) * size for size in node.layout.segment_sizes]
            for _ in range(n)]


def touched(dests: list[list[bytearray]]) -> int:
    """How many keys' buffers hold anything but the sentinel."""
    return sum(1 for bufs in dests if any(b[0] != SENTINEL or b[-1] != SENTINEL for b in bufs))


# ---------------------------------------------------------------------- cancel


def test_cancel_fetch_into_stops_writing_into_caller_buffers(nodes: Any) -> None:
    blocks = 64  # 36 MiB through a 4 MB/s proxy: about 9 s, cancelled after the first
    producer, keys = producer_with(nodes, {**SEED_V2, "blocks": blocks})
    proxy = ThrottlingProxy(producer.address, 4e6)
    try:
        # The abort_ack queues behind up to a window of blocks: at 4 MB/s, 4 MiB take 1 s.
        consumer = nodes({**SEED_V2, "blocks": 4}, window_bytes=4 << 20, abort_timeout=20.0)
        peer = consumer.connect(proxy.address)
        dests = buffers(consumer, blocks)
        fut = consumer.fetch_into_async(peer, keys, [[memoryview(b) for b in bufs]
                                                     for bufs in dests], timeout=60)
        assert wait_until(lambda: touched(dests) >= 1, 30.0), "no block landed"
        assert fut.cancel(), "a running fetch must be cancellable"
        assert fut.cancelled()
        frozen = [[bytes(b) for b in bufs] for bufs in dests]
        relayed = proxy.relayed
        # Block bytes keep arriving for a while (queued before the abort): they must go
        # nowhere. The proxy shows that they did arrive.
        assert wait_until(lambda: proxy.relayed > relayed + 1_000_000, 30.0)
        time.sleep(0.5)
        assert [[bytes(b) for b in bufs] for bufs in dests] == frozen, \
            "caller buffers written after cancel() returned"
        # The peer was told: it stops short of the whole fetch, and the connection lives.
        assert wait_until(lambda: _steady(producer), 20.0)
        assert producer.stats().blocks_sent < blocks
        assert peer.lookup(keys[:2]) == [True, True]
        # The same keys can be fetched again (into fresh buffers), byte-exact.
        again = buffers(consumer, 2)
        result = consumer.fetch_into(peer, keys[:2], [[memoryview(b) for b in bufs]
                                                      for bufs in again], timeout=30)
        assert result.outcomes == (KeyOutcome.STORED, KeyOutcome.STORED)
        size = consumer.layout.bytes_per_block
        assert [b"".join(bufs) for bufs in again] == [content(k, size) for k in keys[:2]]
        assert consumer.store.stats().pinned == 0
    finally:
        proxy.close()


def test_cancel_holds_while_the_io_thread_is_mid_read(nodes: Any) -> None:
    """cancel() returns while the IO thread is in the middle of reading the connection
    (here: running a lookup future's callback between two messages), with block
    messages of the fetch queued right behind: none of them may land after cancel()."""
    blocks = 48
    producer, keys = producer_with(nodes, {**SEED_V2, "blocks": blocks})
    proxy = ThrottlingProxy(producer.address, 8e6)
    try:
        consumer = nodes({**SEED_V2, "blocks": 4}, window_bytes=4 << 20, abort_timeout=20.0)
        peer = consumer.connect(proxy.address)
        dests = buffers(consumer, blocks)
        fut = consumer.fetch_into_async(peer, keys, [[memoryview(b) for b in bufs]
                                                     for bufs in dests], timeout=60)
        assert wait_until(lambda: touched(dests) >= 1, 30.0), "no block landed"
        in_callback, resume = threading.Event(), threading.Event()

        def hold_io_thread(_: Future[list[bool]]) -> None:
            in_callback.set()
            resume.wait(10)  # the IO thread, inside its read loop of this connection

        lookup = consumer.lookup_async(peer, keys[:1], timeout=30)
        lookup.add_done_callback(hold_io_thread)
        assert in_callback.wait(30)
        time.sleep(0.5)  # more block messages queue up behind the lookup answer
        assert fut.cancel()
        frozen = [[bytes(b) for b in bufs] for bufs in dests]
        resume.set()
        # The producer stops; a lookup round trip on the same connection then shows
        # that every block message queued before its answer was read (and dropped).
        assert wait_until(lambda: _steady(producer), 20.0)
        assert peer.lookup(keys[:1], timeout=30) == [True]
        assert [[bytes(b) for b in bufs] for bufs in dests] == frozen, \
            "caller buffers written after cancel() returned"
        assert lookup.result(0) == [True]
    finally:
        proxy.close()


def test_cancel_over_shared_memory_copies_nothing_more(nodes: Any) -> None:
    """The same guarantee over shm-v1, where the consumer copies located blocks out of
    the producer's pool itself: once cancel() returned, nothing more is copied.

    The fetch and a lookup are submitted from the IO thread itself, in that order; the
    lookup's answer comes back first and its callback holds the IO thread while the
    fetch's located blocks queue up behind it, and the test cancels."""
    blocks = 64  # 8 KiB blocks, two of credit at a time
    producer, keys = producer_with(nodes, {**SMALL, "blocks": blocks}, shm=True)
    consumer = nodes({**SMALL, "blocks": 4}, shm=True, window_bytes=1)
    peer = consumer.connect(producer.address)
    if peer.data_path != "shm":
        pytest.skip(f"no shared memory between two nodes here: {peer.data_path_detail}")
    dests = buffers(consumer, blocks)
    views = [[memoryview(b) for b in bufs] for bufs in dests]
    started: list[Future[Any]] = []
    held, resume = threading.Event(), threading.Event()

    def hold_io_thread(_: Future[list[bool]]) -> None:
        held.set()
        resume.wait(10)

    def start_from_the_io_thread(_: Future[list[bool]]) -> None:
        started.append(consumer.fetch_into_async(peer, keys, views, timeout=60))
        consumer.lookup_async(peer, keys[:1], timeout=30).add_done_callback(hold_io_thread)

    consumer.lookup_async(peer, keys[:1], timeout=30).add_done_callback(
        start_from_the_io_thread)
    try:
        assert held.wait(30)
        fut = started[0]
        # The producer answered the lookup at once and located the fetch's first window
        # right after: those located blocks wait behind the held IO thread.
        assert wait_until(lambda: producer.stats().blocks_sent_shm >= 1, 20.0)
        assert not fut.done()
        assert fut.cancel()
        frozen = [[bytes(b) for b in bufs] for bufs in dests]
    finally:
        resume.set()
    assert wait_until(lambda: _steady(producer), 20.0)
    assert peer.lookup(keys[:1], timeout=30) == [True]
    assert [[bytes(b) for b in bufs] for bufs in dests] == frozen, \
        "caller buffers written after cancel() returned"
    assert touched(dests) < blocks
    assert wait_until(lambda: producer.stats().shm_pinned == 0, 20.0), \
        "the producer still pins blocks of the cancelled fetch"


def _steady(node: Any) -> bool:
    """The producer stopped sending (nothing new within a short pause)."""
    def sent() -> tuple[int, int]:
        stats = node.stats()
        return stats.blocks_sent, stats.blocks_sent_shm

    before = sent()
    time.sleep(0.3)
    return sent() == before


def test_abort_confirms_and_frees_the_pool(nodes: Any) -> None:
    blocks = 48
    producer, keys = producer_with(nodes, {**SEED_V2, "blocks": blocks})
    proxy = ThrottlingProxy(producer.address, 4e6)
    try:
        consumer = nodes({**SEED_V2, "blocks": blocks, "pool": blocks}, window_bytes=4 << 20,
                         abort_timeout=20.0)
        peer = consumer.connect(proxy.address)
        fut = consumer.fetch_async(peer, keys, timeout=60)
        assert wait_until(lambda: consumer.store.stats().stored >= 1, 30.0)
        assert consumer.abort(fut) is True  # waits for the peer's abort_ack
        assert fut.cancelled()
        stored = consumer.store.stats().stored
        assert stored < blocks
        # Nothing more lands in the pool, no slot is left "being written".
        time.sleep(0.5)
        st = consumer.store.stats()
        assert (st.stored, st.used, st.pinned) == (stored, stored, 0)
        # Every key can be fetched again, and all of them land this time.
        result = consumer.fetch(peer, keys, timeout=60)
        assert result.outcomes == (KeyOutcome.STORED,) * blocks
        size = consumer.layout.bytes_per_block
        assert all(consumer.get(k) == content(k, size) for k in keys)
        # abort of a finished fetch: nothing to stop.
        done = consumer.fetch_async(peer, keys[:1])
        done.result(30)
        assert consumer.abort(done) is False
    finally:
        proxy.close()


# ---------------------------------------------------------------------- leaks


@pytest.mark.parametrize("path", ["plain", "packed", "stream"])
def test_unexpected_error_while_receiving_leaks_no_writer_slot(
        nodes: Any, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Plain block messages commit block by block, packed ones (packed-v1) and those of a
    data stream (tcp-data-v1, as arrays of slots) in one call per batch: a failure in any
    leaves no slot "being written"."""
    packed = path != "plain"
    producer, keys = producer_with(nodes, {**SMALL, "blocks": 4}, packed_blocks=packed)
    consumer = nodes({**SMALL, "blocks": 4}, data_channel=path == "stream")
    peer = consumer.connect(producer.address)
    calls = {"n": 0}
    if packed:
        # Packed messages commit through commit_many, the stream's slots through
        # store.slots.commit; the first is the second's wrapper.
        real_many = SlotBatches.commit

        def failing_many(self: SlotBatches, keys: Any, slots: Any, sums: Any,
                         actual: Any = None) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure in the receive path")
            return real_many(self, keys, slots, sums, actual)

        monkeypatch.setattr(SlotBatches, "commit", failing_many)
    else:
        real_commit = BlockWriter.commit

        def failing_commit(self: BlockWriter, expected_checksum: int | None = None) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure in the receive path")
            real_commit(self, expected_checksum)

        monkeypatch.setattr(BlockWriter, "commit", failing_commit)
    with pytest.raises(P2PKVError):  # a bug costs the connection, never the node
        consumer.fetch(peer, keys, timeout=30)
    assert calls["n"] >= 1
    assert wait_until(lambda: consumer.store.stats().pinned == 0, 5.0), \
        consumer.store.stats()
    # The key whose write failed is not stuck "being written": it lands now.
    peer = consumer.connect(producer.address)
    result = consumer.fetch(peer, keys, timeout=30)
    assert result.outcomes == (KeyOutcome.STORED,) * 4, result.errors
    size = consumer.layout.bytes_per_block
    assert all(consumer.get(k) == content(k, size) for k in keys)


@pytest.mark.parametrize("packed", [False, True])
def test_unexpected_error_while_sending_leaks_no_pin(
        nodes: Any, monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    producer, keys = producer_with(nodes, {**SEED_V2, "blocks": 8}, packed_blocks=packed)
    owner: Any = PackedSender if packed else Sender
    name = "send" if packed else "_send_message"
    real_send = getattr(owner, name)
    calls = {"n": 0}

    def failing_send(self: Any, rid: bytes, head: bytes, readers: Any) -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure in the send path")
        return bool(real_send(self, rid, head, readers))

    monkeypatch.setattr(owner, name, failing_send)
    consumer = nodes({**SEED_V2, "blocks": 8}, fetch_idle_timeout=3.0, data_channel=False)
    peer = consumer.connect(producer.address)
    with pytest.raises(P2PKVError):
        consumer.fetch(peer, keys, timeout=30)
    assert calls["n"] >= 1
    released_and_serving(nodes, producer, keys)


def released_and_serving(nodes: Any, producer: Any, keys: list[bytes]) -> None:
    """The pinned blocks of a failed send were released, and the node still serves."""
    assert wait_until(lambda: producer.store.stats().pinned == 0, 5.0), \
        producer.store.stats()
    other = nodes({**SEED_V2, "blocks": 8})
    result = other.connect(producer.address).fetch(keys, timeout=30)
    assert result.outcomes == (KeyOutcome.STORED,) * 8
    assert wait_until(lambda: producer.store.stats().pinned == 0, 5.0)


def test_unexpected_error_while_queueing_on_a_stream_leaks_no_pin(
        nodes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data stream's sender pins a batch as store slots (no reader objects): a
    failure while queueing it releases every pin, and the node still serves."""
    producer, keys = producer_with(nodes, {**SEED_V2, "blocks": 8})
    real_push = BoundStream.push
    calls = {"n": 0}

    def failing_push(self: Any, head: bytes, segments: Any = None, done: Any = None) -> None:
        if segments:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure in the stream's send path")
        real_push(self, head, segments, done)

    monkeypatch.setattr(BoundStream, "push", failing_push)
    consumer = nodes({**SEED_V2, "blocks": 8}, fetch_idle_timeout=3.0)
    peer = consumer.connect(producer.address)
    assert peer.data_path == "tcp-data", peer.data_path_detail
    with pytest.raises(P2PKVError):
        consumer.fetch(peer, keys, timeout=30)
    assert calls["n"] == 1
    released_and_serving(nodes, producer, keys)


# ---------------------------------------------------------------------- close


def test_every_future_completes_on_close(nodes: Any, fast_switching: None) -> None:
    """Eight threads submit lookups and fetches as fast as they can while the node
    closes (several rounds, so that submits land in every phase of the close): each
    call either raises PeerGone or returns a future, and every such future completes."""
    producer, keys = producer_with(nodes, {**SMALL, "blocks": 16})
    for _ in range(6):
        consumer = nodes({**SMALL, "blocks": 16}, max_inflight_requests=4096)
        _submit_while_closing(consumer, consumer.connect(producer.address), keys)


def _submit_while_closing(consumer: Any, peer: Any, keys: list[bytes]) -> None:
    futures: list[Future[Any]] = []
    lock = threading.Lock()
    refused = {"n": 0}

    def submit(i: int) -> None:
        while True:
            try:
                fut: Future[Any] = (consumer.lookup_async(peer, keys[:4]) if i % 2
                                    else consumer.fetch_async(peer, keys[i % 16:i % 16 + 1]))
            except PeerGone:
                with lock:
                    refused["n"] += 1
                return
            except LocalLimitExceeded:
                continue
            with lock:
                futures.append(fut)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(futures) >= 100, 30.0)
    consumer.close(timeout=1.0)
    for t in threads:
        t.join(10)
    assert refused["n"] == 8, "every submit after close must raise PeerGone"
    done, pending = wait(futures, timeout=10)
    assert not pending, f"{len(pending)} of {len(futures)} futures never completed"
    for fut in done:
        exc = fut.exception(0)
        assert exc is None or isinstance(exc, P2PKVError), repr(exc)


# ---------------------------------------------------------------------- stats


def test_stats_is_safe_while_connections_churn(nodes: Any, fast_switching: None) -> None:
    producer, keys = producer_with(nodes, {**SMALL, "blocks": 2})
    clients = [nodes({**SMALL, "blocks": 2}) for _ in range(3)]
    errors: list[BaseException] = []
    stop = threading.Event()
    reads = {"n": 0}

    def hammer() -> None:
        while not stop.is_set():
            try:
                producer.stats()
                clients[0].stats()
                reads["n"] += 1
            except BaseException as exc:  # any exception at all is the failure
                errors.append(exc)
                return

    # Many inbound peers make each stats() walk long; churn adds and removes more.
    for client in clients[1:]:
        for _ in range(40):
            client.connect(producer.address)
    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not errors:
            peer = clients[0].connect(producer.address)
            peer.lookup(keys)
            peer.close()
    finally:
        stop.set()
        thread.join(10)
    assert not errors, repr(errors[0])
    assert reads["n"] > 0
    assert producer.stats().peers_in >= 80


# ---------------------------------------------------------------------- limits


def test_local_limits_raise_local_limit_exceeded(nodes: Any) -> None:
    client = nodes(SMALL, max_inflight_requests=2, max_keys_per_request=8, max_peers=1)
    mute = FakeServer(client.hello)  # handshakes, then answers nothing
    try:
        peer = client.connect(mute.address)
        keys = keys_for(9)
        with pytest.raises(LocalLimitExceeded) as info:
            client.lookup_async(peer, keys)
        assert info.value.limit == "max_keys_per_request" and info.value.allowed == 8
        pending = [client.lookup_async(peer, keys[:1], timeout=30),
                   client.fetch_async(peer, keys[:2], timeout=30)]
        for call in (lambda: client.lookup(peer, keys[:1], timeout=30),
                     lambda: client.fetch(peer, keys[:1], timeout=30)):
            with pytest.raises(LocalLimitExceeded) as info:
                call()
            assert not isinstance(info.value, ProtocolError)
            assert info.value.limit == "max_inflight_requests" and info.value.allowed == 2
        # Not a peer fault: the connection is still up, the requests still pending.
        assert client.peers() == [peer]
        assert not any(f.done() for f in pending)
        with pytest.raises(LocalLimitExceeded) as info:
            client.connect(mute.address)
        assert info.value.limit == "max_peers"
    finally:
        mute.close()


def test_peer_advertised_key_limit_is_a_local_limit(nodes: Any) -> None:
    producer, _ = producer_with(nodes, {**SMALL, "blocks": 2}, max_keys_per_request=8)
    client = nodes(SMALL)
    peer = client.connect(producer.address)
    with pytest.raises(LocalLimitExceeded) as info:
        peer.lookup(keys_for(9))
    assert info.value.limit == "max_keys" and info.value.allowed == 8
    assert peer.lookup(keys_for(8)) == [True, True] + [False] * 6
    assert producer.stats().protocol_violations == 0


def test_timeout_zero_means_zero(nodes: Any) -> None:
    producer, keys = producer_with(nodes, {**SMALL, "blocks": 4})
    consumer = nodes({**SMALL, "blocks": 4}, handshake_timeout=30.0, lookup_timeout=30.0,
                     fetch_timeout=30.0)
    with pytest.raises(PeerTimeout):
        consumer.connect(producer.address, timeout=0)
    assert producer.stats().handshakes_accepted == 0
    peer = consumer.connect(producer.address)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout):
        peer.lookup(keys, timeout=0)
    with pytest.raises(PeerTimeout):
        peer.fetch(keys, timeout=0)
    with pytest.raises(PeerTimeout):
        consumer.fetch_into(peer, keys[:1], buffers(consumer, 1), timeout=0)
    assert time.monotonic() - t0 < SLACK
    # Nothing was sent: the producer served no lookup and sent no block.
    assert peer.lookup(keys[:1]) == [True]
    assert producer.stats().lookups_served == 1 and producer.stats().blocks_sent == 0
    # What needs no peer still answers with timeout=0.
    assert peer.fetch(keys[:2]).stored == keys[:2]
    assert peer.fetch(keys[:2], timeout=0).stored == keys[:2]
    with pytest.raises(ValueError, match="timeout"):
        peer.lookup(keys, timeout=-1)
    consumer.close(timeout=0)


# ---------------------------------------------------------------------- serve options


def test_serve_has_every_deadline_option() -> None:
    from p2pkv.cli import node_config

    settings = load_settings({"fetch_idle_timeout": "7", "abort_timeout": "1.5",
                              "close_timeout": "3", "heartbeat_interval": "0.25",
                              "heartbeat_timeout": "2"}, environ={})
    config = node_config(settings)
    assert (config.fetch_idle_timeout, config.abort_timeout, config.close_timeout,
            config.heartbeat_interval, config.heartbeat_timeout) == (7.0, 1.5, 3.0, 0.25, 2.0)
    env = load_settings({}, environ={"P2PKV_FETCH_IDLE_TIMEOUT": "9",
                                     "P2PKV_ABORT_TIMEOUT": "4"})
    assert (node_config(env).fetch_idle_timeout, node_config(env).abort_timeout) == (9.0, 4.0)
    with pytest.raises(ConfigError, match=r"^--heartbeat-interval: must be shorter"):
        node_config(load_settings({"heartbeat_interval": "5", "heartbeat_timeout": "5"},
                                  environ={}))
    with pytest.raises(ConfigError, match=r"^--abort-timeout: "):
        load_settings({"abort_timeout": "0"}, environ={})


# ---------------------------------------------------------------------- frozen consumer


@pytest.mark.slow
def test_frozen_consumer_does_not_pin_the_producer_forever(spawn: Any, nodes: Any) -> None:
    """SIGSTOP a consumer mid-fetch: its kernel keeps the TCP connection open with a zero
    window, so ZeroMQ can never send what it queued for it, and those blocks stay pinned.
    After the heartbeat deadline the producer cuts that connection and releases them;
    meanwhile and afterwards it serves another consumer and stores new blocks."""
    blocks = 96  # 54 MiB through a 20 MB/s proxy: still running when frozen
    heartbeat_timeout = 2.0
    # V1: one 576 KiB segment per block, sent zero-copy (so pinned until ZeroMQ is done).
    producer, keys = producer_with(nodes, {**SEED_V1, "blocks": blocks, "pool": blocks + 8},
                                   heartbeat_interval=0.3, heartbeat_timeout=heartbeat_timeout)
    proxy = ThrottlingProxy(producer.address, 20e6, upstream_rcvbuf=256 << 10)
    frozen = spawn("watch", {**SEED_V1, "blocks": blocks, "flowing": 4,
                             # A window larger than the socket buffers on the way: part
                             # of what it allows stays queued in ZeroMQ.
                             "config": {"heartbeat_timeout": 30.0, "fetch_idle_timeout": 30.0,
                                        "window_bytes": 32 << 20}},
                   proxy.address)
    pid = frozen.proc.pid
    try:
        assert frozen.event(60)["event"] == "flowing"
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        # Blocks sent towards it cannot leave: they are pinned now.
        assert wait_until(lambda: producer.store.stats().pinned > 0, 1.0), \
            producer.store.stats()
        # Another consumer is served byte-exact while the first one is frozen.
        other = nodes({**SEED_V1, "blocks": blocks})
        result = other.connect(producer.address).fetch(keys, timeout=60)
        assert result.outcomes == (KeyOutcome.STORED,) * blocks
        size = producer.layout.bytes_per_block
        assert all(other.get(k) == content(k, size) for k in keys)
        # After the heartbeat deadline every pin is released.
        assert wait_until(lambda: producer.store.stats().pinned == 0,
                          heartbeat_timeout + 2 * SLACK), producer.store.stats()
        assert time.monotonic() - t_stop >= heartbeat_timeout * 0.5
        assert producer.stats().peers_in == 1  # only the other consumer
        # New blocks fill the whole pool (evicting old ones): no slot is held back.
        fresh = keys_for(blocks + 8, offset=blocks)
        for k in fresh:
            assert producer.put(k, content(k, size)) is True
        assert producer.lookup_local(fresh) == [True] * len(fresh)
        assert producer.store.stats().pinned == 0
        # Thawed, the consumer finds its connection gone, and nothing wrong was stored.
        os.kill(pid, signal.SIGCONT)
        final = frozen.event(60)
        assert final["event"] in ("failed", "finished"), final
        assert final["corrupt"] == 0, final
    finally:
        os.kill(pid, signal.SIGCONT)
        frozen.kill()
        proxy.close()

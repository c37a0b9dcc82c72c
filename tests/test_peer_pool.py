"""PeerPool (p2pkv.cluster.peers), the one way Cluster and the vLLM tier's static peers
keep connections: real nodes on 127.0.0.1.

After a failed attempt an address is not tried again before its back-off ends (a refusal:
``refusal_backoff``; unreachable or dropped: ``retry_interval``), and until then its
future fails at once with the failure that started it; ``eager`` waives the second
back-off for an address never reached; the listener hears each attempt's end once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from nodeproc import make_node

from p2pkv.bench.ports import free_port
from p2pkv.cluster.peers import PeerPool
from p2pkv.errors import PeerGone, PeerIncompatible, PeerTimeout
from p2pkv.node import Node, PeerHandle

WAIT = 10.0


class Heard:
    """What a pool's listener heard, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, PeerHandle | None, BaseException | None]] = []

    def __call__(self, address: str, handle: PeerHandle | None,
                 exc: BaseException | None) -> None:
        with self.lock:
            self.events.append((address, handle, exc))

    def count(self) -> int:
        with self.lock:
            return len(self.events)


@pytest.fixture
def asker() -> Iterator[Node]:
    node = make_node({"layout": "v2"}, handshake_timeout=0.5)
    yield node
    node.close()


@pytest.fixture
def holder() -> Iterator[Node]:
    node = make_node({"layout": "v2"})
    yield node
    node.close()


def test_an_unreachable_address_waits_its_interval_unless_eager(asker: Node) -> None:
    heard = Heard()
    pool = PeerPool(asker, retry_interval=30.0, listener=heard)
    nobody = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises((PeerGone, PeerTimeout)):
        pool.handle_async(nobody).result(WAIT)
    assert heard.count() == 1 and heard.events[0][1] is None
    first = heard.events[0][2]
    # Within the interval: failed at once with the same failure, no new attempt.
    started = time.monotonic()
    again = pool.handle_async(nobody)
    assert again.done() and again.exception() is first
    assert time.monotonic() - started < 0.1
    assert heard.count() == 1
    state = pool.state(nobody)
    assert state.failure is first and not state.seen and state.refused is None
    # Engines starting together: a peer never reached is tried again now.
    with pytest.raises((PeerGone, PeerTimeout)):
        pool.handle_async(nobody, eager=True).result(WAIT)
    assert heard.count() == 2 and heard.events[1][2] is not first


def test_a_refusal_is_kept_for_its_backoff_even_when_eager(asker: Node) -> None:
    other = make_node({"layout": "v1"})  # another layout: another fingerprint
    try:
        heard = Heard()
        pool = PeerPool(asker, refusal_backoff=30.0, listener=heard)
        with pytest.raises(PeerIncompatible) as refused:
            pool.handle_async(other.address).result(WAIT)
        again = pool.handle_async(other.address, eager=True)
        assert again.done() and again.exception() is refused.value
        assert heard.count() == 1
        assert set(pool.refused()) == {other.address}
        assert pool.state(other.address).refused is refused.value
        assert pool.by_address() == {}
    finally:
        other.close()


def test_a_dropped_connection_is_made_again_after_the_interval(asker: Node,
                                                               holder: Node) -> None:
    heard = Heard()
    pool = PeerPool(asker, retry_interval=0.3, listener=heard)
    handle = pool.handle_async(holder.address).result(WAIT)
    assert pool.handle_async(holder.address).result(WAIT) is handle  # shared, not remade
    assert pool.by_address() == {holder.address: handle}
    assert heard.events == [(holder.address, handle, None)]
    assert pool.state(holder.address).seen
    # A late report about another connection drops nothing.
    pool.drop(holder.address, object(), why=PeerGone("an old connection"))
    assert pool.by_address() == {holder.address: handle}
    why = PeerGone("the fetch found it closed")
    pool.drop(holder.address, handle, why=why)
    assert pool.by_address() == {}
    refused_now = pool.handle_async(holder.address)
    assert refused_now.done() and refused_now.exception() is why
    assert str(pool.state(holder.address).failure) == "the fetch found it closed"
    time.sleep(0.35)
    again = pool.handle_async(holder.address).result(WAIT)
    assert again is not handle and pool.by_address() == {holder.address: again}
    assert heard.count() == 2 and pool.state(holder.address).failure is None


def test_a_connection_whose_peer_left_is_not_listed_as_live(asker: Node) -> None:
    leaving = make_node({"layout": "v2"}, heartbeat_timeout=1.0,
                        heartbeat_interval=0.25)
    pool = PeerPool(asker)
    handle = pool.handle_async(leaving.address).result(WAIT)
    leaving.close()
    deadline = time.monotonic() + WAIT
    while pool.by_address() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.by_address() == {}
    assert pool.by_address(every=True) == {leaving.address: handle}

"""The chunks a vLLM tier's engine computes (``pending-v1``, SPEC §19), announced from
the engine's first request: a request scheduled before the tier's node runs is kept, and
what it still computes is announced when the node starts.

:class:`~p2pkv.integrations.vllm.computing.Computing` needs no vLLM; its node is a real
:class:`~p2pkv.node.Node` that starts in the middle of the test, and a real peer asks
it over a real connection, as another engine's tier does. Every wait is bounded.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator

import pytest
from nodeproc import make_node
from test_cluster import SMALL

from p2pkv.integrations.vllm.computing import (
    ANNOUNCED,
    DROPPED,
    FINISH_GRACE_S,
    MAX_KEPT_KEYS,
    MAX_KEPT_REQUESTS,
    Computing,
)
from p2pkv.keys import block_keys
from p2pkv.node import Node

pytestmark = pytest.mark.timeout(60)

#: Seconds a peer's lookup may take here.
LOOKUP_S = 5.0


class Engine:
    """A tier's announcing side, as :class:`~p2pkv.integrations.vllm.P2PKVTier` wires
    it: a :class:`Computing` under the tier's lock whose node is None until
    :meth:`start` starts a real one (the tier's ``on_start`` then calls
    :meth:`Computing.started`), and the counts it reports."""

    def __init__(self) -> None:
        self.node: Node | None = None
        self.counts: collections.Counter[str] = collections.Counter()
        self.computing = Computing(lambda: self.node, threading.Lock(),
                                   coming=lambda: True, count=self._count)

    def _count(self, event: str, n: int) -> None:
        self.counts[event] += n

    def start(self) -> Node:
        self.node = make_node({**SMALL, "pool": 64})
        self.computing.started()
        return self.node

    def close(self) -> None:
        self.computing.close()
        if self.node is not None:
            self.node.close(timeout=1.0)


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def peer() -> Iterator[Node]:
    node = make_node({**SMALL, "pool": 64})
    try:
        yield node
    finally:
        node.close(timeout=1.0)


def keys_of(tag: int, n: int) -> list[bytes]:
    """``n`` chunk keys of a prompt of its own (shared keys), with engine keys beside."""
    return block_keys(list(range(tag * 1000, tag * 1000 + 16 * n)), tokens_per_block=16,
                      seed=0)


def engine_keys(keys: list[bytes]) -> list[bytes]:
    return [b"engine:" + k for k in keys]


def dues(peer: Node, producer: Node, keys: list[bytes]) -> list[float]:
    """What another engine is told of ``keys`` when it asks ``producer``: per key the
    seconds until it is due, 0.0 for a key not pending."""
    handle = peer.connect(producer.address, timeout=LOOKUP_S)
    try:
        answer = peer.lookup_pending_async(handle, keys, timeout=LOOKUP_S).result(
            timeout=2 * LOOKUP_S)
    finally:
        peer.disconnect(handle)
    assert not any(answer.hits), answer
    return list(answer.due)


def test_a_request_scheduled_before_the_node_started_is_announced_when_it_starts(
        engine: Engine, peer: Node) -> None:
    computing = engine.computing
    # Before the start: a request that runs (one of its chunks stored already), one
    # preempted, one finished whose chunks were all stored, one finished whose grace
    # ended before the start, one finished whose grace still runs at the start.
    running, preempted, stored, lapsed, finishing = (keys_of(t, 3) for t in range(1, 6))
    computing.announce("lapsed", engine_keys(lapsed), lapsed, 0.5)
    computing.finished("lapsed")
    began = time.monotonic()
    computing.announce("running", engine_keys(running), running, 8.0)
    announced = time.monotonic()
    computing.stored("running", engine_keys(running[:1]))
    computing.announce("preempted", engine_keys(preempted), preempted, 4.0)
    computing.withdraw("preempted")
    computing.announce("stored", engine_keys(stored), stored, 4.0)
    computing.stored("stored", engine_keys(stored))
    computing.finished("stored")
    deadline = time.monotonic() + FINISH_GRACE_S + 5.0
    while computing.describe()["kept"] > 1:  # the renewing thread withdraws "lapsed"
        assert time.monotonic() < deadline, computing.describe()
        time.sleep(0.05)
    computing.announce("finishing", engine_keys(finishing), finishing, 6.0)
    finishing_at = time.monotonic()
    computing.finished("finishing")
    finished_at = time.monotonic()
    assert engine.counts == {}  # nothing announced while the node is down
    assert computing.describe()["kept"] == 2  # "running" and "finishing"
    producer = engine.start()
    every = running + preempted + stored + lapsed + finishing
    asking = time.monotonic()
    due = dict(zip(every, dues(peer, producer, every), strict=True))
    asked = time.monotonic()
    # What still comes is announced, due when it was, measured from the start (the
    # peer's answer comes between ``asking`` and ``asked``, rounded up to whole
    # milliseconds); what was stored, withdrawn or lapsed before the start is not.
    for key in running[1:]:
        assert 8.0 - (asked - began) <= due[key] <= 8.0 - (asking - announced) + 0.001, due
    for key in finishing:
        assert FINISH_GRACE_S - (asked - finishing_at) <= due[key] <= \
            FINISH_GRACE_S - (asking - finished_at) + 0.001, due
    for key in [running[0], *preempted, *stored, *lapsed]:
        assert due[key] == 0.0, due
    assert engine.counts == {ANNOUNCED: 2 + 3}
    assert computing.describe()["kept"] == 0
    # After the start, a request is announced as it is scheduled, and its withdrawal
    # reaches the peer.
    later = keys_of(6, 2)
    computing.announce("later", engine_keys(later), later, 3.0)
    assert all(0 < d <= 3.0 for d in dues(peer, producer, later))
    computing.withdraw("running")
    assert dues(peer, producer, running) == [0.0] * 3
    assert engine.counts == {ANNOUNCED: 2 + 3 + 2}


def test_requests_kept_for_the_start_are_bounded_the_oldest_dropped_and_counted(
        engine: Engine, peer: Node) -> None:
    computing = engine.computing
    one_key = [keys_of(10_000 + i, 1) for i in range(MAX_KEPT_REQUESTS + 1)]
    for i, keys in enumerate(one_key):
        computing.announce(f"r{i}", engine_keys(keys), keys, 5.0)
    # One request more than the bound: the oldest goes.
    assert engine.counts == {DROPPED: 1}
    assert computing.describe()["kept"] == MAX_KEPT_REQUESTS
    # A prompt of as many chunks as the bound: the older requests make room for it.
    big = [i.to_bytes(4, "big") * 5 for i in range(MAX_KEPT_KEYS)]
    computing.announce("big", engine_keys(big), big, 5.0)
    assert engine.counts == {DROPPED: 1 + MAX_KEPT_REQUESTS}
    assert computing.describe()["kept"] == 1
    # One chunk more than the bound: the big prompt, the oldest now, goes.
    last = keys_of(9_999, 1)
    computing.announce("last", engine_keys(last), last, 5.0)
    assert engine.counts == {DROPPED: 1 + MAX_KEPT_REQUESTS + MAX_KEPT_KEYS}
    assert computing.describe() == {"requests": 1, "chunks": 1, "kept": 1}
    producer = engine.start()
    asked = [*one_key[0], *one_key[-1], *big[:2], *last]
    assert [d > 0 for d in dues(peer, producer, asked)] == [False, False, False, False, True]
    assert engine.counts[ANNOUNCED] == 1


def test_nothing_is_kept_when_the_node_will_not_start() -> None:
    counts: collections.Counter[str] = collections.Counter()

    def count(event: str, n: int) -> None:
        counts[event] += n

    computing = Computing(lambda: None, threading.Lock(), coming=lambda: False, count=count)
    try:
        keys = keys_of(7, 2)
        computing.announce("r", engine_keys(keys), keys, 1.0)
        assert computing.describe() == {"requests": 0, "chunks": 0, "kept": 0}
        computing.started()
        assert counts == {}
    finally:
        computing.close()

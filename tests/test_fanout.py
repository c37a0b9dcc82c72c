"""The one fan-out (p2pkv.cluster.fanout) that Cluster and the vLLM tier's static peers
ask their peers through: real nodes on 127.0.0.1.

Every peer is asked once it is connected, under one deadline; what answered is merged
per key in the order the peers were given (holders, and the soonest due of a key being
computed); what did not is reported with why: a peer still connecting at the deadline, a
failed connection, a closed one (which the caller is told to forget)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from nodeproc import content, keys_for, make_node

from p2pkv.cluster.fanout import ask_peers, merged
from p2pkv.errors import PeerGone, PeerTimeout
from p2pkv.node import Node, PeerHandle

SPEC = {"layout": "v2"}


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node, Node]]:
    made = [make_node(SPEC) for _ in range(3)]
    yield made[0], made[1], made[2]
    for n in made:
        n.close()


def done(value: PeerHandle | BaseException) -> Future[PeerHandle]:
    fut: Future[PeerHandle] = Future()
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
    return fut


def test_answers_merge_in_order_and_every_silence_says_why(
        nodes: tuple[Node, Node, Node]) -> None:
    asker, holder, computer = nodes
    keys = keys_for(4)
    size = holder.layout.bytes_per_block
    for k in keys[:2]:
        holder.put(k, content(k, size))
        computer.put(k, content(k, size))
    computer.announce_pending(keys[2:3], [3.0])
    holder.announce_pending(keys[2:3], [7.0])
    to_holder = asker.connect(holder.address)
    to_computer = asker.connect(computer.address)
    never: Future[PeerHandle] = Future()  # a peer that never finishes connecting
    started = time.monotonic()
    asked = ask_peers(asker, {done(to_computer): "computer", done(to_holder): "holder",
                              never: "slow", done(PeerGone("refused")): "gone"},
                      keys, started + 1.0)
    assert time.monotonic() - started < 3.0
    assert [a.address for a in asked.answers] == ["computer", "holder"]
    why = {address: type(exc) for address, _, exc in asked.failed}
    assert why == {"slow": PeerTimeout, "gone": PeerGone}
    assert asked.lost() == []  # no connection of these ended: nothing to forget
    per_key, due = merged(asked.answers, len(keys))
    assert [[a.address for a in h] for h in per_key] == [["computer", "holder"]] * 2 + [[], []]
    assert due[:2] == [0.0, 0.0] and due[3] == 0.0
    assert 2.0 < due[2] <= 3.0  # the soonest of the two computing it


def test_a_closed_connection_is_reported_lost(nodes: tuple[Node, Node, Node]) -> None:
    asker, holder, _ = nodes
    handle = asker.connect(holder.address)
    holder.close()
    time.sleep(0.2)
    asked = ask_peers(asker, {done(handle): "holder"}, keys_for(2), time.monotonic() + 2.0)
    assert asked.answers == []
    assert [(a, h) for a, h, _ in asked.lost()] == [("holder", handle)]
    assert ask_peers(asker, {done(handle): "holder"}, [], time.monotonic() + 1).failed == []

"""One lookup asked of several peers at once, and their answers merged: the fan-out that
both :class:`~p2pkv.cluster.Cluster` (without a directory, or when it fails) and the
vLLM tier's static peers use.

Each peer comes as a future of its connection (done for a connected peer, pending for
one still shaking hands); each is asked as soon as it is connected, and every ask has the
one deadline. A peer that does not answer by then, fails to connect, or fails its ask is
reported with why, never raised. The merge (:func:`merged`) gives, per key, the peers
that hold it in the order they were given, and for a key none holds the soonest a peer
computing it expects to hold it (``pending-v1``; 0.0: nobody is).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from p2pkv.errors import P2PKVError, PeerGone, PeerTimeout, ProtocolError
from p2pkv.node import LookupAnswer, Node, PeerHandle

__all__ = ["Answered", "FanOut", "ask_peers", "merged"]


@dataclass(frozen=True)
class Answered:
    """One peer's answer: its address, its connection and what it said."""

    address: str
    handle: PeerHandle
    answer: LookupAnswer


@dataclass
class FanOut:
    """Every peer's answer, in the order the peers were given, and why the others gave
    none (``handle`` None: no connection to it)."""

    answers: list[Answered] = field(default_factory=list)
    failed: list[tuple[str, PeerHandle | None, BaseException]] = field(default_factory=list)

    def lost(self) -> list[tuple[str, PeerHandle, BaseException]]:
        """The failures that end a connection (it closed, or its peer broke the
        protocol): the caller forgets it and reconnects later."""
        return [(a, h, e) for a, h, e in self.failed
                if h is not None and isinstance(e, (PeerGone, ProtocolError))]


def ask_peers(node: Node, peers: Mapping[Future[PeerHandle], str], keys: Sequence[bytes],
              deadline: float) -> FanOut:
    """Ask every peer (a future of its connection, and its address) about ``keys`` by
    ``deadline`` (``time.monotonic()``); see the module doc."""
    out = FanOut()
    order = {address: i for i, address in enumerate(peers.values())}
    if not keys:
        return out
    connecting = dict(peers)
    asking: dict[Future[LookupAnswer], tuple[str, PeerHandle]] = {}
    while connecting or asking:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waiting: list[Future[Any]] = [*connecting, *asking]
        done, _ = concurrent.futures.wait(
            waiting, timeout=remaining,
            return_when=concurrent.futures.FIRST_COMPLETED)
        for connected in [f for f in connecting if f in done]:
            address = connecting.pop(connected)
            failure = connected.exception()
            if failure is not None:
                out.failed.append((address, None, failure))
                continue
            handle = connected.result()
            try:
                asking[node.lookup_pending_async(
                    handle, keys, timeout=max(0.001, deadline - time.monotonic()))
                ] = (address, handle)
            except P2PKVError as start:
                out.failed.append((address, handle, start))
        for asked in [f for f in asking if f in done]:
            address, handle = asking.pop(asked)
            failure = asked.exception()
            if failure is not None:
                out.failed.append((address, handle, failure))
            else:
                out.answers.append(Answered(address, handle, asked.result()))
    late = PeerTimeout("no answer before the lookup deadline")
    out.failed += [(a, None, late) for a in connecting.values()]
    out.failed += [(a, h, late) for a, h in asking.values()]
    out.answers.sort(key=lambda a: order[a.address])
    return out


def merged(answers: Sequence[Answered], n: int) -> tuple[list[list[Answered]], list[float]]:
    """For each of ``n`` keys: the answers that hold it (in order), and, for a key none
    holds, the soonest ``due`` (seconds) among those computing it, else 0.0."""
    holders: list[list[Answered]] = [[] for _ in range(n)]
    due = [0.0] * n
    for a in answers:
        for i, hit in enumerate(a.answer.hits):
            if hit:
                holders[i].append(a)
            elif a.answer.due[i] and (not due[i] or a.answer.due[i] < due[i]):
                due[i] = a.answer.due[i]
    return holders, [0.0 if found else d for found, d in zip(holders, due, strict=True)]

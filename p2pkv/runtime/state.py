"""Per-request records of the IO thread (touched by no other thread, except
:class:`FetchTicket`, which a fetch's caller shares with it), and what waits on one
outbound connection (:class:`Waiting`).

The protocol counts (credit granted, blocks arrived, window left) are not here: the
connection's :class:`~p2pkv.protocol.Session` holds them, and
:mod:`p2pkv.protocol.flow` decides on them. These records hold what the node adds: the
caller's future, where blocks land, per-key outcomes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from p2pkv.runtime.pending import LookupAnswer
from p2pkv.runtime.public import FetchResult, KeyOutcome

__all__ = ["FetchTicket", "Receiving", "Waiting", "writable"]


class FetchTicket:
    """What a fetch's caller and the IO thread share to stop it.

    The IO thread lands each block message into the fetch's buffers holding
    :attr:`lock` and only while :attr:`cancelled` is False; :meth:`cancel` (from the
    thread that cancelled the future) takes the same lock, so once it returns nothing
    more is written. :attr:`stopped` is set once the peer confirmed the abort, or the
    connection or the node ended (nothing more can arrive at all).
    """

    __slots__ = ("cancelled", "lock", "peer_id", "reqs", "stopped")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cancelled = False
        self.stopped = threading.Event()
        #: Set by the IO thread once the fetch went out (its connection, and the request
        #: ids it went out as: one per lane, see p2pkv.runtime.paths.lanes).
        self.peer_id = 0
        self.reqs: tuple[int, ...] = ()

    def cancel(self) -> None:
        """Waits for a landing in progress to finish; none starts after it returns."""
        with self.lock:
            self.cancelled = True


@dataclass(eq=False)
class Receiving:
    """A fetch this node issued: where each block lands, and what happened to it."""

    req: int
    keys: tuple[bytes, ...]
    future: Future[FetchResult]
    destinations: Sequence[Sequence[memoryview]] | None
    started: float
    outcomes: list[KeyOutcome | None]
    index_map: list[int]  # wire index (position in the fetch message) -> key index
    errors: dict[int, str] = field(default_factory=dict)
    blocks: int = 0
    nbytes: int = 0
    ticket: FetchTicket | None = None
    #: Every protocol fetch of the same caller's fetch, when it was striped over
    #: several lanes (they share ``future``, ``outcomes`` and ``errors``).
    group: list[Receiving] | None = None
    #: Whether the peer reported this part done (a striped fetch's parts).
    done: bool = False
    #: Keys repeated in the caller's fetch (into the store): ``(index, index of its first
    #: occurrence)``; asked for once, each repeat takes the first one's outcome at the end.
    repeats: list[tuple[int, int]] = field(default_factory=list)


class writable:  # lower case: it reads as a call, ``with writable(...) as ok``
    """Whether the buffers of fetch ``recv`` may be written now, holding its ticket's
    lock for as long as they are (every data path lands through this).

    False when there is no fetch, when ``current`` (the connection's running fetch of
    that request id, looked up now) is no longer ``recv`` (it finished, timed out or was
    aborted), or when its caller cancelled it: from the moment :meth:`FetchTicket.cancel`
    returns, no byte more reaches its buffers, since a landing in progress holds the
    lock that cancel waits for. (A class, not a generator: it runs for every message.)
    """

    __slots__ = ("_ok", "_ticket")

    def __init__(self, recv: Receiving | None, current: Receiving | None) -> None:
        self._ok = recv is not None and current is recv
        self._ticket = recv.ticket if self._ok and recv is not None else None

    def __enter__(self) -> bool:
        ticket = self._ticket
        if ticket is None:
            return self._ok
        ticket.lock.acquire()
        return not ticket.cancelled

    def __exit__(self, *exc: object) -> None:
        if self._ticket is not None:
            self._ticket.lock.release()


class Waiting:
    """What waits on one outbound connection: its lookups' futures, its running fetches,
    and the tickets of fetches aborted by their callers until the peer confirms."""

    __slots__ = ("aborting", "answers", "fetches", "lookups")

    def __init__(self) -> None:
        #: Lookups whose callers want the hits only, and those that want the whole
        #: answer (with the keys pending on the peer, ``pending-v1``).
        self.lookups: dict[int, Future[list[bool]]] = {}
        self.answers: dict[int, Future[LookupAnswer]] = {}
        self.fetches: dict[int, Receiving] = {}
        self.aborting: dict[int, FetchTicket] = {}

    def __bool__(self) -> bool:
        """Whether a lookup or a fetch is waiting."""
        return bool(self.lookups or self.answers or self.fetches)

    def answered(self, req: int, hits: Sequence[bool],
                 due: Sequence[int] | None = None) -> None:
        fut = self.lookups.pop(req, None)
        if fut is not None and not fut.done():
            with contextlib.suppress(InvalidStateError):
                fut.set_result(list(hits))
        whole = self.answers.pop(req, None)
        if whole is not None and not whole.done():
            with contextlib.suppress(InvalidStateError):
                whole.set_result(LookupAnswer.of(hits, due))

    def confirmed(self, req: int) -> None:
        """The peer acknowledged the abort of ``req``: its caller stops waiting once
        every request its fetch went out as is confirmed."""
        ticket = self.aborting.pop(req, None)
        if ticket is not None and not any(t is ticket for t in self.aborting.values()):
            ticket.stopped.set()

    def fail(self, req: int, exc: BaseException) -> Receiving | None:
        """Request ``req`` failed: its caller gets ``exc``; the fetch, if it was one."""
        for waiting in (self.lookups, self.answers):
            fut = waiting.pop(req, None)
            if fut is not None:
                _fail(fut, exc)
        recv = self.fetches.pop(req, None)
        if recv is not None:
            _fail(recv.future, exc)
        self.confirmed(req)  # an abort that failed: nothing more can come of it
        return recv

    def fail_all(self, exc: BaseException) -> None:
        """The connection ended: everyone waiting gets ``exc``, nothing more arrives."""
        for waiting in (self.lookups, self.answers):
            for fut in waiting.values():
                _fail(fut, exc)
        for recv in self.fetches.values():
            _fail(recv.future, exc)
            if recv.ticket is not None:
                recv.ticket.stopped.set()
        for ticket in self.aborting.values():
            ticket.stopped.set()
        self.lookups.clear()
        self.answers.clear()
        self.fetches.clear()
        self.aborting.clear()


def _fail(fut: Future[Any], exc: BaseException) -> None:
    """Fail ``fut`` unless it is done (a fetch's caller may cancel it at any moment)."""
    if not fut.done():
        with contextlib.suppress(InvalidStateError):
            fut.set_exception(exc)

"""Per-request records of the IO thread (touched by no other thread, except
:class:`FetchTicket`, which a fetch's caller shares with it).

The protocol counts (credit granted, blocks arrived, window left) are not here: the
connection's :class:`~p2pkv.protocol.Session` holds them, and
:mod:`p2pkv.protocol.flow` decides on them. These records hold what the node adds: the
caller's future, where blocks land, per-key outcomes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from p2pkv.runtime.public import FetchResult, KeyOutcome

__all__ = ["FetchTicket", "Receiving", "Sending"]


class FetchTicket:
    """What a fetch's caller and the IO thread share to stop it.

    The IO thread lands each block message into the fetch's buffers holding
    :attr:`lock` and only while :attr:`cancelled` is False; :meth:`cancel` (from the
    thread that cancelled the future) takes the same lock, so once it returns nothing
    more is written. :attr:`stopped` is set once the peer confirmed the abort, or the
    connection or the node ended (nothing more can arrive at all).
    """

    __slots__ = ("cancelled", "lock", "peer_id", "req", "stopped")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cancelled = False
        self.stopped = threading.Event()
        #: Set by the IO thread once the fetch went out (its connection and request id).
        self.peer_id = 0
        self.req: int | None = None

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
    deadline: float
    outcomes: list[KeyOutcome | None]
    index_map: list[int]  # wire index (position in the fetch message) -> key index
    errors: dict[int, str] = field(default_factory=dict)
    blocks: int = 0
    nbytes: int = 0
    ticket: FetchTicket | None = None


@dataclass(eq=False)
class Sending:
    """A fetch this node serves: which keys are left and what became of each."""

    req: int
    keys: tuple[bytes, ...]
    outcomes: list[int]
    next_index: int = 0
    #: Served on the peer's data stream (tcp-data-v1): bound when the fetch arrived, so
    #: that every block of the fetch and its done take the same way.
    on_stream: bool = False

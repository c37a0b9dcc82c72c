"""Per-connection and per-request records of the IO thread (touched by no other thread,
except :class:`FetchTicket`, which a fetch's caller shares with it).

The protocol counts (credit granted, blocks arrived, window left) are not here: the
connection's :class:`~p2pkv.protocol.Session` holds them, and
:mod:`p2pkv.protocol.flow` decides on them. These records hold what the node adds: the
caller's future, where blocks land, per-key outcomes, sockets.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from p2pkv import protocol as proto
from p2pkv.runtime.public import FetchResult, KeyOutcome, PeerHandle
from p2pkv.shm import MappedSegment

__all__ = ["FetchTicket", "Inbound", "Outbound", "Receiving", "Sending"]


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
class Outbound:
    """A connection this node opened (a DEALER): its session and what waits on it."""

    peer_id: int
    address: str
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    session: proto.SharingSession
    connect_future: Future[PeerHandle]
    handshake_deadline: float
    handle: PeerHandle | None = None
    lookups: dict[int, tuple[Future[list[bool]], float]] = field(default_factory=dict)
    fetches: dict[int, Receiving] = field(default_factory=dict)
    #: Fetches aborted by their callers, by request id, until the peer confirms.
    aborting: dict[int, FetchTicket] = field(default_factory=dict)
    received_blocks: int = 0
    closed: bool = False
    #: The peer's pool, mapped read-only once its shared-memory proof was sent (shm-v1).
    shm: MappedSegment | None = None
    #: How blocks move on this connection and why (the segment used, or the reason
    #: it stays on TCP).
    shm_detail: str = ""

    def credit_state(self) -> list[proto.FetchCredit]:
        """The session's credit counts of this connection's running fetches."""
        out = []
        for req in self.fetches:
            state = self.session.fetch_credit(req)
            if state is not None:
                out.append(state)
        return out


@dataclass(eq=False)
class Sending:
    """A fetch this node serves: which keys are left and what became of each."""

    req: int
    keys: tuple[bytes, ...]
    outcomes: list[int]
    next_index: int = 0


@dataclass(eq=False)
class Inbound:
    """A peer connected to this node's ROUTER (identified by its routing id)."""

    rid: bytes
    session: proto.SharingSession
    jobs: collections.OrderedDict[int, Sending] = field(default_factory=collections.OrderedDict)
    closed: bool = False
    #: libzmq's descriptor of the peer's TCP connection and its remote address, to cut
    #: that one connection (``transport.cut_connection``); -1/None when unknown.
    fd: int = -1
    address: tuple[str, int] | None = None

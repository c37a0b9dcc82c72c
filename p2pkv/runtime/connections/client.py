"""The fetching side: the registry of connections this node opened, as the IO loop sees it.

Each connection is an :class:`~p2pkv.runtime.connections.outbound.OutboundConnection` that owns its
socket, session, requests and deadlines. :class:`Client` runs the API's commands
(connect, lookup, fetch, abort, disconnect) on the IO thread by finding the connection
they name, and plugs the connections into the reactor's participant hooks.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from p2pkv.errors import LocalLimitExceeded, PeerGone, PeerTimeout
from p2pkv.runtime.connections.outbound import OutboundConnection, OutboundParts
from p2pkv.runtime.pending import LookupAnswer
from p2pkv.runtime.public import FetchResult, PeerHandle
from p2pkv.runtime.state import FetchTicket

__all__ = ["Client"]


class Client:
    """Outbound connections by peer id (IO thread, except :meth:`handles`)."""

    def __init__(self, parts: OutboundParts, *, max_peers: int) -> None:
        self._parts = parts
        self._max_peers = max_peers
        self._peer_ids = itertools.count(1)
        self._outbound: dict[int, OutboundConnection] = {}
        self._lock = threading.Lock()  # guards _outbound for the API threads' reads

    # -- API threads -------------------------------------------------------------------

    def handles(self) -> list[PeerHandle]:
        """The live, handshaken connections."""
        with self._lock:
            conns = list(self._outbound.values())
        return [c.handle for c in conns if c.handle and not c.closed]

    # -- commands ------------------------------------------------------------------------

    def connect(self, address: str, fut: Future[PeerHandle], deadline: float) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if time.monotonic() >= deadline:  # timeout=0: nothing is attempted
            fut.set_exception(PeerTimeout(f"connect to {address}: the timeout expired "
                                          "before the handshake could start"))
            return
        live = sum(1 for c in self._outbound.values() if not c.closed)
        if live >= self._max_peers:
            fut.set_exception(LocalLimitExceeded(
                f"peer limit reached (max_peers={self._max_peers})", limit="max_peers",
                allowed=self._max_peers, requested=live + 1))
            return
        now = time.monotonic()
        conn = OutboundConnection(self._parts, next(self._peer_ids), address, fut, now,
                                  self._forget)
        with self._lock:
            self._outbound[conn.peer_id] = conn
        conn.open(now, deadline)

    def lookup(self, peer_id: int, keys: tuple[bytes, ...],
               fut: Future[list[bool]] | Future[LookupAnswer], deadline: float, *,
               whole: bool = False) -> None:
        if fut.set_running_or_notify_cancel():
            self._ready(peer_id).lookup(keys, fut, deadline, whole=whole)

    def fetch(self, peer_id: int, keys: tuple[bytes, ...],
              destinations: Sequence[Sequence[memoryview]] | None,
              fut: Future[FetchResult], deadline: float, ticket: FetchTicket) -> None:
        # The future is never marked running: its caller may cancel it at any time
        # (see FetchTicket), and every result is set only if it is still pending.
        if not fut.done():
            self._ready(peer_id).fetch(keys, destinations, fut, deadline, ticket)

    def abort_fetch(self, ticket: FetchTicket) -> None:
        """The caller cancelled a fetch (see :meth:`OutboundConnection.abort_fetch`)."""
        conn = self._outbound.get(ticket.peer_id)
        if conn is None:
            ticket.stopped.set()  # never sent, or the connection is gone
        else:
            conn.abort_fetch(ticket)

    def disconnect(self, peer_id: int, fut: Future[None]) -> None:
        conn = self._outbound.get(peer_id)
        if conn is not None:
            conn.disconnect()
        fut.set_result(None)

    def _ready(self, peer_id: int) -> OutboundConnection:
        conn = self._outbound.get(peer_id)
        if conn is None:
            raise PeerGone(f"peer {peer_id} is not connected (closed, dead or never connected)")
        conn.require_ready()
        return conn

    def _forget(self, conn: OutboundConnection) -> None:
        with self._lock:
            self._outbound.pop(conn.peer_id, None)

    # -- the reactor's participant hooks -------------------------------------------------

    def after_io(self, now: float) -> None:
        pass

    def busy_wait_ms(self) -> int | None:
        return None

    def next_deadline(self) -> float | None:
        deadlines = []
        for conn in self._outbound.values():
            deadline = conn.next_deadline()
            if deadline is not None:
                deadlines.append(deadline)
        return min(deadlines, default=None)

    def idle(self) -> bool:
        return not any(c.busy for c in self._outbound.values() if not c.closed)

    def check_deadlines(self, now: float) -> None:
        for conn in list(self._outbound.values()):
            conn.check_deadlines(now)

    def shutdown(self) -> None:
        gone = PeerGone("node closed")
        for conn in list(self._outbound.values()):
            conn.shut_down(gone)

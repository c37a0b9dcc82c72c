"""The serving side: the ROUTER, and the registry of peers connected to it.

Each peer that writes to the ROUTER becomes an
:class:`~p2pkv.runtime.connections.inbound.InboundConnection` keyed by its routing id, which owns
its session and its fetch jobs. :class:`Server` reads the ROUTER and hands each message
to the peer it came from (admitting a new peer while ``max_peers`` allows), serves the
peers' jobs round robin, and plugs them into the reactor's participant hooks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import zmq

from p2pkv import protocol as proto
from p2pkv.runtime.connections.inbound import InboundConnection, InboundParts, route
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.tuning import DRAIN_FLUSH_MS, DRAIN_SETTLE_S, READ_BUDGET
from p2pkv.transport import peer_of

__all__ = ["Server"]

log = logging.getLogger("p2pkv.node")


class Server:
    """Inbound connections on the node's ROUTER (IO thread, except :meth:`ready_peers`).

    ``new_session`` makes the server session of a new peer at the given time.
    """

    def __init__(self, reactor: Reactor, parts: InboundParts, *,
                 new_session: Callable[[float], proto.Session], max_peers: int) -> None:
        self._parts = parts
        self._router = parts.router
        self._new_session = new_session
        self._max_peers = max_peers
        self._inbound: dict[bytes, InboundConnection] = {}
        # The IO thread changes _inbound under this lock; stats() reads it under it.
        self._lock = threading.Lock()
        # wait_sent: set by the IO thread, at the end of an IO round, once nothing is
        # being sent while a caller waits for that.
        self._all_sent = threading.Event()
        self._sent_waiters = 0
        reactor.register(self._router, self._read)

    def ready_peers(self) -> int:
        """How many peers completed the handshake (read from any thread, for stats)."""
        with self._lock:
            peers = list(self._inbound.values())
        return sum(1 for i in peers if i.session.state is proto.State.READY)

    def stream_peers(self) -> int:
        """How many peers have a bound data stream (any thread, for stats)."""
        with self._lock:
            peers = list(self._inbound.values())
        return sum(1 for i in peers if i.streams)

    # -- reading -------------------------------------------------------------------------

    def _read(self, now: float) -> None:
        sock = self._router
        for _ in range(READ_BUDGET):
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            rid = frame.bytes
            if not sock.getsockopt(zmq.RCVMORE):
                continue  # an empty message carries nothing to answer
            head = sock.recv(zmq.NOBLOCK)
            # Peers send the server no payload frames; count and drop any one by one
            # rather than hold them all (libzmq bounds each frame, not their number).
            extra = 0
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv(zmq.NOBLOCK, copy=False)
                extra += 1
            peer = self._inbound.get(rid) or self._admit(rid, frame, now)
            if peer is None:
                continue
            try:
                peer.receive(head, extra, now)
            except Exception:
                # A bug must cost one peer, never the node.
                log.exception("internal error serving peer %s; dropping it", rid.hex())
                peer.drop(cut=True)

    def _admit(self, rid: bytes, frame: zmq.Frame, now: float) -> InboundConnection | None:
        """A new peer's connection, or None when the peer limit turned it away."""
        if len(self._inbound) >= self._max_peers:
            log.warning("peer limit reached (max_peers=%d); turning %s away",
                        self._max_peers, rid.hex())
            route(self._router, rid, [proto.Bye(proto.Code.UNAVAILABLE,
                                                f"peer limit reached ({self._max_peers})")])
            return None
        session = self._new_session(now)
        session.start(now)
        fd, address = -1, None
        with contextlib.suppress(zmq.ZMQError):
            fd = int(frame.get(zmq.SRCFD))
            address = peer_of(fd)
        peer = InboundConnection(self._parts, rid, session, self._forget, fd=fd,
                                 address=address)
        with self._lock:
            self._inbound[rid] = peer
        return peer

    def _forget(self, peer: InboundConnection) -> None:
        with self._lock:
            if self._inbound.get(peer.rid) is peer:
                del self._inbound[peer.rid]

    # -- the reactor's participant hooks -------------------------------------------------

    def after_io(self, now: float) -> None:
        # Round robin by peer: each sends what its jobs' credit allows.
        for peer in list(self._inbound.values()):
            peer.serve()
        self._parts.sender.ledger.reap()
        if self._sent_waiters and not self.sending():
            self._all_sent.set()

    def busy_wait_ms(self) -> int | None:
        if any(peer.can_send() for peer in self._inbound.values()):
            return 0
        return self._parts.sender.busy_wait_ms()

    def next_deadline(self) -> float | None:
        deadlines = []
        now = time.monotonic()
        for peer in self._inbound.values():
            deadline = peer.next_deadline(now)
            if deadline is not None:
                deadlines.append(deadline)
        data = self._parts.data
        if data is not None:
            deadline = data.next_deadline()
            if deadline is not None:
                deadlines.append(deadline)
        cut = self._parts.next_cut()
        if cut is not None:
            deadlines.append(cut)
        return min(deadlines, default=None)

    def sending(self) -> bool:
        """Any thread: whether a fetch of some peer is still being served."""
        with self._lock:
            peers = list(self._inbound.values())
        return any(p.busy for p in peers if not p.closed)

    def wait_sent(self, deadline: float) -> None:
        """Any thread (a draining node's caller): wait until every fetch is sent (the IO
        thread says so at the end of the round that sent the last block), then a short
        settle (both bounded by ``deadline``). Closing the moment the last block is
        handed to ZeroMQ can cost the consumer that block: a connection torn down right
        behind its data may drop it before the consumer reads it, and ZeroMQ says
        nothing of when the peer has read it. Meant for one caller at a time (the
        drain): a second caller meanwhile may find the event set by an earlier round."""
        with self._lock:
            self._sent_waiters += 1
            if self._sent_waiters == 1:
                self._all_sent.clear()
        try:
            # Counted as a waiter before this check: a round that finishes the last
            # fetch after it sets the event.
            if self.sending():
                self._all_sent.wait(max(0.0, deadline - time.monotonic()))
        finally:
            with self._lock:
                self._sent_waiters -= 1
        time.sleep(max(0.0, min(DRAIN_SETTLE_S, deadline - time.monotonic())))

    def idle(self) -> bool:
        return not any(p.busy for p in self._inbound.values() if not p.closed) and \
            not self._parts.sender.ledger

    def check_deadlines(self, now: float) -> None:
        for peer in list(self._inbound.values()):
            peer.poll(now)
        self._parts.cut_due(now)
        if self._parts.data is not None:
            self._parts.data.check_deadlines(now)

    def shutdown(self) -> None:
        for peer in list(self._inbound.values()):
            peer.shut_down()
        # Whatever ZeroMQ still holds is dropped with LINGER 0; unpin it. A draining node
        # lets ZeroMQ flush the tails of the fetches it finished (and its byes) first,
        # for a bounded while: the pool outlives the context's termination.
        self._parts.sender.ledger.release_all()
        self._parts.shm.release_all()
        if self._parts.data is not None:
            self._parts.data.close()
        self._router.close(DRAIN_FLUSH_MS if self._parts.draining.is_set() else 0)

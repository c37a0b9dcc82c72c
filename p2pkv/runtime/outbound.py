"""One connection this node opened: its DEALER, its session, and everything waiting on it.

An :class:`OutboundConnection` owns its socket (and the socket's monitor), its client
:class:`~p2pkv.protocol.Session`, the lookups and fetches it carries with their
futures and deadlines, and its shared-memory link. What the peer sends enters the
session through one door (:meth:`~p2pkv.protocol.Session.receive_data`), which also has
the blocks land (through the :class:`~p2pkv.runtime.receiver.Receiver`, or copied from
the peer's pool); the session's events then become results and typed errors on the
callers' futures, and credit goes back to the peer as the per-peer
:class:`~p2pkv.protocol.CreditBudget` decides. A closed or silent connection fails
everything waiting on it.

IO thread only, except :attr:`OutboundConnection.handle` and
:attr:`OutboundConnection.closed`, which API threads may read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import (
    LocalLimitExceeded,
    P2PKVError,
    PeerGone,
    PeerTimeout,
    ProtocolError,
    TransferFailed,
    TransportHandshakeFailed,
)
from p2pkv.identity import IdentityExtension
from p2pkv.protocol.codes import CodeFamily, code_family
from p2pkv.reports import incompatible
from p2pkv.runtime.public import FetchResult, KeyOutcome, PeerHandle, PeerOwner
from p2pkv.runtime.reactor import Reactor, fail, resolve
from p2pkv.runtime.receiver import Receiver, drain
from p2pkv.runtime.shm_client import SharedReceiver
from p2pkv.runtime.state import FetchTicket, Receiving
from p2pkv.runtime.stats import Count, Counters
from p2pkv.runtime.tuning import MONITOR_GRACE_MS, READ_BUDGET, READ_BURST_BYTES
from p2pkv.store import BlockStore
from p2pkv.transport import handshake_failure, monitor_messages

M = TypeVar("M", proto.Lookup, proto.Fetch)

__all__ = [
    "OutboundConnection",
    "OutboundParts",
    "monitor_failure",
    "refusal_error",
    "request_error",
]

log = logging.getLogger("p2pkv.node")

_TIMEOUTS: Final = frozenset({proto.Code.PEER_TIMEOUT, proto.Code.TIMEOUT})
_DECLINED: Final = frozenset({proto.Code.OUT_OF_BOUNDS, proto.Code.TOO_MANY_IN_FLIGHT,
                              proto.Code.UNAVAILABLE})
"""Codes of a request the peer turned down; the connection stays up."""


def request_error(address: str, ev: proto.RequestFailed) -> P2PKVError:
    """The typed error for a request the session failed, chosen by its code."""
    text = f"{address}: request {ev.req} failed: {ev.msg} [{proto.code_name(ev.code)}]"
    if ev.code in _TIMEOUTS:
        return PeerTimeout(text)
    if code_family(ev.code) in (CodeFamily.REFUSAL, CodeFamily.CLOSE):
        # The connection ended: refused (PeerIncompatible is raised only by the
        # handshake itself, with its reasons) or closed.
        return PeerGone(text)
    if ev.code in _DECLINED:
        return TransferFailed(text)
    return ProtocolError(ev.code, text)


def refusal_error(address: str, hello: proto.Hello, ev: proto.HandshakeRefused) -> P2PKVError:
    """A refused handshake's error: PeerIncompatible with its reasons, or, refused for a
    protocol violation (a malformed or unexpected greeting), a ProtocolError."""
    if ev.reasons:
        return incompatible(address, hello, ev)
    who = "refused by" if ev.by_remote else "refused"
    return ProtocolError(ev.code, f"handshake {who} {address}: {ev.msg} "
                         f"[{proto.code_name(ev.code)}]")


def monitor_failure(address: str, messages: list[tuple[int, int]], *, curve: bool,
                    handshaken: bool) -> P2PKVError | None:
    """What a connection's socket monitor events mean: a failed security handshake, a
    lost connection, or nothing."""
    for event, value in messages:
        failure = handshake_failure(event, value, curve=curve, address=address)
        if failure is not None:
            kind, text = failure
            return TransportHandshakeFailed(
                f"{address}: ZeroMQ security handshake failed: {text}", kind, text)
    if any(event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) for event, _ in messages):
        if not handshaken:
            return PeerGone(f"could not connect to {address} (refused, or closed during "
                            "the handshake)")
        return PeerGone(f"connection to {address} was lost")
    return None


@dataclass(frozen=True, eq=False)
class OutboundParts:
    """What every outbound connection of a node shares (built once, by the node)."""

    reactor: Reactor
    #: A new DEALER connecting to an address, and its socket monitor.
    dial: Callable[[str], tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]
    #: A new client session, started at the given time.
    new_session: Callable[[float], proto.Session]
    hello: proto.Hello
    owner: PeerOwner
    store: BlockStore
    receiver: Receiver
    shm: SharedReceiver
    budget: proto.CreditBudget
    counters: Counters
    #: Whether connections use CurveZMQ (what a failed security handshake means).
    curve: bool
    bytes_per_block: int


class _Frames:
    """The payload frames of the message being read, still in the DEALER
    (a :class:`~p2pkv.protocol.Payload`: the session decides what becomes of them)."""

    count = None

    def __init__(self, sock: zmq.Socket[bytes], land: Callable[[proto.DataArrived], None]
                 ) -> None:
        self._sock = sock
        self.land = land

    def follows(self) -> bool:
        return bool(self._sock.getsockopt(zmq.RCVMORE))

    def discard(self) -> None:
        drain(self._sock)


class OutboundConnection:
    """A connection this node opened, with the requests on it. ``on_closed`` is called
    once, when it ends."""

    def __init__(self, parts: OutboundParts, peer_id: int, address: str,
                 connected: Future[PeerHandle], handshake_deadline: float, now: float,
                 on_closed: Callable[[OutboundConnection], None]) -> None:
        self.peer_id = peer_id
        self.address = address
        #: Set once the handshake (and the shared-memory proof, if any) is over.
        self.handle: PeerHandle | None = None
        self.closed = False
        self.session = parts.new_session(now)
        self._parts = parts
        self._connected = connected
        self._handshake_deadline = handshake_deadline
        self._on_closed = on_closed
        self._lookups: dict[int, tuple[Future[list[bool]], float]] = {}
        self._fetches: dict[int, Receiving] = {}
        #: Fetches aborted by their callers, by request id, until the peer confirms.
        self._aborting: dict[int, FetchTicket] = {}
        self._received_blocks = 0
        self._shm = parts.shm.link(address)
        self._sock, self._monitor = parts.dial(address)
        self._frames = _Frames(self._sock, self._land)

    def open(self, now: float) -> None:
        """Watch the socket and its monitor, and say hello."""
        self._parts.reactor.register(self._sock, self._on_readable)
        self._parts.reactor.register(self._monitor, self._on_monitor)
        self._send(self.session.start(now))

    # -- requests ------------------------------------------------------------------------

    def require_ready(self) -> None:
        """Raise PeerGone unless requests may go out on this connection."""
        if self.closed:
            raise PeerGone(f"peer {self.peer_id} is not connected (closed, dead or never "
                           "connected)")
        if self.session.state is not proto.State.READY:
            raise PeerGone(f"peer {self.address} is not ready (state "
                           f"{self.session.state.name})")

    def lookup(self, keys: tuple[bytes, ...], fut: Future[list[bool]], deadline: float) -> None:
        self._admit(len(keys), "lookup")
        msg = self._opened(lambda: self.session.lookup(keys, time.monotonic()), "lookup",
                           deadline)
        self._lookups[msg.req] = (fut, deadline)
        self._send([msg])

    def fetch(self, keys: tuple[bytes, ...], destinations: Sequence[Sequence[memoryview]] | None,
              fut: Future[FetchResult], deadline: float, ticket: FetchTicket) -> None:
        """Fetch the blocks of ``keys`` not held locally (into the store), or all of them
        (into ``destinations``)."""
        now = time.monotonic()
        outcomes: list[KeyOutcome | None] = [None] * len(keys)
        wanted: list[int] = []
        if destinations is None:
            for i, present in enumerate(self._parts.store.lookup(list(keys))):
                if present:
                    outcomes[i] = KeyOutcome.LANDED
                else:
                    wanted.append(i)
        else:
            wanted = list(range(len(keys)))
        if not wanted:
            resolve(fut, FetchResult(keys, tuple(o or KeyOutcome.LANDED for o in outcomes),
                                     {}, 0, 0, 0.0))
            return
        self._admit(len(wanted), "fetch")
        # One credit budget per peer, shared by all its fetches: it bounds the data
        # queued towards this node, and so how long a lookup answer can wait behind it.
        window = self._parts.budget.opening_window(self._credit_state(), len(wanted))
        session = self.session
        open_fetch = session.fetch_shared if session.shared_memory else session.fetch
        msg = self._opened(lambda: open_fetch(tuple(keys[i] for i in wanted), window, now),
                           "fetch", deadline)
        self._fetches[msg.req] = Receiving(msg.req, keys, fut, destinations, now, deadline,
                                           outcomes, wanted, ticket=ticket)
        ticket.peer_id, ticket.req = self.peer_id, msg.req
        self._send([msg])

    def abort_fetch(self, ticket: FetchTicket) -> None:
        """The caller cancelled a fetch: tell the peer, give its credit to the others.
        ``ticket.stopped`` is set once the peer confirmed (or nothing can arrive)."""
        recv = None if ticket.req is None else self._fetches.pop(ticket.req, None)
        if self.closed or recv is None:
            ticket.stopped.set()  # never sent, or already over
            return
        now = time.monotonic()
        self._aborting[recv.req] = ticket
        self._send([self.session.abort(recv.req, now)])
        if not self.closed:
            self._refill_credit(now)

    def disconnect(self) -> None:
        if not self.closed:
            self._send(self.session.close(proto.Code.NORMAL_CLOSE, "disconnect").replies)
            self.close(PeerGone(f"disconnected from {self.address}"))

    def shut_down(self, gone: P2PKVError) -> None:
        """The node closes: tell the peer, fail everything waiting."""
        if not self.closed:
            self._send(self.session.close(proto.Code.SHUTDOWN, "node closing").replies)
        self.close(gone)

    def _admit(self, nkeys: int, what: str) -> None:
        """The peer's key limit, checked before a request is opened, so that the caller
        gets a typed LocalLimitExceeded."""
        limit = self.session.key_limit
        if nkeys > limit:
            raise LocalLimitExceeded(
                f"{what} of {nkeys} keys: {self.address} accepts at most {limit} keys per "
                "request; split the request", limit="max_keys", allowed=limit,
                requested=nkeys)

    def _opened(self, open_request: Callable[[], M], what: str, deadline: float) -> M:
        """Open a request in the session (which holds the in-flight limit), unless the
        caller's deadline passed already: then nothing is sent (``timeout=0``)."""
        try:
            msg = open_request()
        except proto.LocalProtocolError as exc:
            if exc.code != proto.Code.TOO_MANY_IN_FLIGHT:
                raise
            in_flight, allowed = self.session.in_flight, self.session.request_limit
            raise LocalLimitExceeded(
                f"{what}: {in_flight} requests already in flight to {self.address} "
                f"(limit {allowed}); wait for one to finish",
                limit="max_inflight_requests", allowed=allowed,
                requested=in_flight + 1) from None
        if time.monotonic() >= deadline:
            self.session.withdraw(msg.req)
            raise PeerTimeout(f"{what} on {self.address}: the timeout expired before the "
                              "request could be sent")
        return msg

    # -- deadlines -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a lookup or a fetch is waiting on this connection."""
        return bool(self._lookups or self._fetches)

    def next_deadline(self) -> float | None:
        deadlines = [recv.deadline for recv in self._fetches.values()]
        session = self.session.next_deadline()
        if session is not None:
            deadlines.append(session)
        return min(deadlines, default=None)

    def check_deadlines(self, now: float) -> None:
        if self.closed:
            return
        if self.handle is None and now >= self._handshake_deadline:
            self.close(PeerTimeout(f"no handshake answer from {self.address} within the "
                                   "deadline"))
            return
        for req, recv in list(self._fetches.items()):
            if now >= recv.deadline:
                self._fetches.pop(req, None)
                with contextlib.suppress(ProtocolError):
                    self._send([self.session.abort(req, now)])
                fail(recv.future, PeerTimeout(
                    f"fetch of {len(recv.keys)} blocks from {self.address} did not finish "
                    "within its deadline"))
        for req, (fut, deadline) in list(self._lookups.items()):
            if now >= deadline:
                self._lookups.pop(req, None)
                if not fut.done():
                    fut.set_exception(PeerTimeout(
                        f"lookup on {self.address} not answered within its deadline"))
        if not self.closed:
            self._handle(self.session.poll(now), now)

    # -- the socket ----------------------------------------------------------------------

    def _send(self, messages: Iterable[proto.Message]) -> None:
        for msg in messages:
            try:
                self._sock.send_multipart(proto.encode(msg), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                # Before the p2pkv handshake a send fails when ZeroMQ's own (CURVE/NULL)
                # handshake already failed and tore the pipe down; the monitor says
                # which, so give it a moment to report.
                if (self.handle is None and not self.closed
                        and self._monitor.poll(MONITOR_GRACE_MS)):
                    self._on_monitor(time.monotonic())
                self.close(PeerGone(f"cannot send to {self.address}: {exc}"))
                return

    def _on_monitor(self, now: float) -> None:
        if self.closed:
            return
        failure = monitor_failure(self.address, monitor_messages(self._monitor),
                                  curve=self._parts.curve, handshaken=self.handle is not None)
        if failure is None:
            return
        # What the peer sent before it went away may still wait in ZeroMQ's queue (the
        # tail of a fetch, its done, a bye from a node that drained): read it first, so
        # a peer that closed cleanly is not taken for one that vanished.
        while self.handle is not None and not self.closed and self._sock.poll(0, zmq.POLLIN):
            self._on_readable(now)
        if not self.closed:
            self.close(failure)

    def _on_readable(self, now: float) -> None:
        if self.closed:
            return
        try:
            self._read(now)
        except Exception as exc:
            # A bug must cost one connection, never the node.
            log.exception("internal error on connection to %s", self.address)
            self.close(P2PKVError(f"internal error: {exc!r}"))

    def _read(self, now: float) -> None:
        start = self._received_blocks
        bpb = self._parts.bytes_per_block
        for _ in range(READ_BUDGET):
            # Leave a burst of bulk data after a few MiB so that queued commands (a
            # lookup issued meanwhile) and other peers get their turn.
            if self.closed or (self._received_blocks - start) * bpb >= READ_BURST_BYTES:
                return
            try:
                head = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.close(PeerGone(f"receive from {self.address} failed: {exc}"))
                return
            self._handle(self.session.receive_data(head, now, self._frames), now)

    def _land(self, arrived: proto.DataArrived) -> None:
        """Land the blocks of an accepted message (the session calls this back).

        A cancelled fetch's data is read and dropped: not one more byte goes into its
        buffers once cancel() returned (FetchTicket).
        """
        if isinstance(arrived, proto.BlocksLocated):
            located = arrived
            self._unless_cancelled(located.req, lambda recv: self._shm.land(recv, located))
        else:
            assert isinstance(arrived, proto.BlockArrived)
            block = arrived
            receiver, sock = self._parts.receiver, self._sock
            self._unless_cancelled(block.req, lambda recv: receiver.land(sock, recv, block))

    def _unless_cancelled(self, req: int, land: Callable[[Receiving | None], None]) -> None:
        """Land data for fetch ``req`` holding its ticket's lock, or for nobody (the data
        is consumed and dropped) once the fetch was cancelled or is gone."""
        recv = self._fetches.get(req)
        ticket = recv.ticket if recv is not None else None
        if ticket is None:
            land(recv)
            return
        with ticket.lock:
            land(None if ticket.cancelled else recv)

    def _credit_state(self) -> list[proto.FetchCredit]:
        """The session's credit counts of this connection's running fetches."""
        out = []
        for req in self._fetches:
            state = self.session.fetch_credit(req)
            if state is not None:
                out.append(state)
        return out

    def _refill_credit(self, now: float) -> None:
        """Grant the credit the peer's budget allows now (see ``CreditBudget.grants``)."""
        for req, n in self._parts.budget.grants(self._credit_state()):
            try:
                credit = self.session.credit(req, n, now)
            except (ProtocolError, ValueError):
                continue  # the fetch is aborting; it needs no more credit
            self._send([credit])
            if self.closed:
                return

    # -- session events ------------------------------------------------------------------

    def _handle(self, out: proto.Output, now: float) -> None:
        self._send(out.replies)
        for ev in out.events:
            if self.closed:
                return
            on_event = _ON_EVENT.get(type(ev))
            if on_event is not None:
                on_event(self, ev, now)

    def _on_block(self, ev: proto.BlockArrived, now: float) -> None:
        self._received_blocks += len(ev.idx)
        self._refill_credit(now)

    def _on_located(self, ev: proto.BlocksLocated, now: float) -> None:
        """The located blocks were copied (or dropped): release them, grant credit."""
        self._send([self.session.release(ev.req, ev.idx)])
        self._received_blocks += len(ev.idx)
        if not self.closed:
            self._refill_credit(now)

    def _on_accepted(self, ev: proto.HandshakeAccepted, now: float) -> None:
        self._parts.counters.undeclared(self.address, ev.warnings)
        log.info("connected to %s (%s), capabilities %s", self.address, ev.remote.node,
                 sorted(ev.capabilities))
        # A same-host peer first gets our shared-memory proof; the connection is ready
        # once it answered (within the handshake deadline).
        attach = self._shm.begin(self.session)
        if attach is not None:
            self._send([attach])
        else:
            self._ready()

    def _on_attach_answered(self, ev: proto.AttachAnswered, now: float) -> None:
        self._shm.answered(ev)
        self._ready()

    def _ready(self) -> None:
        """The handshake (and the shared-memory proof, if any) is over: hand out the peer."""
        remote = self.session.remote
        if remote is None or self.closed:
            return
        session = self.session
        self.handle = PeerHandle(self.peer_id, self.address, remote.node, dict(remote.rc),
                                 remote.fp, frozenset(session.capabilities),
                                 self._parts.owner, remote.ext or IdentityExtension(),
                                 "shm" if session.shared_memory else "tcp", self._shm.detail)
        resolve(self._connected, self.handle)

    def _on_refused(self, ev: proto.HandshakeRefused, now: float) -> None:
        exc = refusal_error(self.address, self._parts.hello, ev)
        log.warning("%s", exc)
        self.close(exc)

    def _on_lookup_answered(self, ev: proto.LookupAnswered, now: float) -> None:
        pending = self._lookups.pop(ev.req, None)
        if pending is not None and not pending[0].done():
            pending[0].set_result(list(ev.hits))

    def _on_fetch_finished(self, ev: proto.FetchFinished, now: float) -> None:
        recv = self._fetches.pop(ev.req, None)
        if recv is not None:
            resolve(recv.future, self._parts.receiver.finish(recv, ev.outcomes, now))
            self._refill_credit(now)  # its budget goes to the others

    def _on_abort_acknowledged(self, ev: proto.AbortAcknowledged, now: float) -> None:
        ticket = self._aborting.pop(ev.req, None)
        if ticket is not None:
            ticket.stopped.set()

    def _on_request_failed(self, ev: proto.RequestFailed, now: float) -> None:
        self._fail_request(ev.req, request_error(self.address, ev))

    def _on_request_timed_out(self, ev: proto.RequestTimedOut, now: float) -> None:
        self._fail_request(ev.req, PeerTimeout(
            f"{self.address} made no progress on request {ev.req} ({ev.kind}) within its "
            "deadline"))

    def _on_peer_closed(self, ev: proto.PeerClosed, now: float) -> None:
        if ev.code == proto.Code.TIMEOUT:
            self.close(PeerTimeout(f"{self.address}: {ev.msg}"))
        else:
            self.close(PeerGone(f"{self.address} closed the connection: {ev.msg} "
                                f"[{proto.code_name(ev.code)}]"))

    def _on_violation(self, ev: proto.ProtocolViolated, now: float) -> None:
        self._parts.counters.add(Count.PROTOCOL_VIOLATIONS)
        log.warning("protocol violation by %s: %s", self.address, ev.msg)
        self.close(ProtocolError(ev.code, ev.msg))

    def _fail_request(self, req: int, exc: P2PKVError) -> None:
        pending = self._lookups.pop(req, None)
        if pending is not None and not pending[0].done():
            pending[0].set_exception(exc)
        recv = self._fetches.pop(req, None)
        if recv is not None:
            fail(recv.future, exc)
        ticket = self._aborting.pop(req, None)
        if ticket is not None:
            ticket.stopped.set()

    # -- the end -------------------------------------------------------------------------

    def close(self, exc: P2PKVError) -> None:
        """End the connection: fail everything waiting on it with ``exc``, release its
        sockets and its mapping of the peer's pool. Idempotent."""
        if self.closed:
            return
        self.closed = True
        log.info("connection to %s closed: %s", self.address, exc)
        fail(self._connected, exc)
        for fut, _ in self._lookups.values():
            if not fut.done():
                fut.set_exception(exc)
        for recv in self._fetches.values():
            fail(recv.future, exc)
            if recv.ticket is not None:
                recv.ticket.stopped.set()
        for ticket in self._aborting.values():
            ticket.stopped.set()
        self._lookups.clear()
        self._fetches.clear()
        self._aborting.clear()
        reactor = self._parts.reactor
        reactor.unregister(self._sock)
        reactor.unregister(self._monitor)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._shm.close()
        self._on_closed(self)


_ON_EVENT: Final[dict[type[proto.Event], Callable[[OutboundConnection, Any, float], None]]] = {
    proto.BlockArrived: OutboundConnection._on_block,
    proto.BlocksLocated: OutboundConnection._on_located,
    proto.HandshakeAccepted: OutboundConnection._on_accepted,
    proto.AttachAnswered: OutboundConnection._on_attach_answered,
    proto.HandshakeRefused: OutboundConnection._on_refused,
    proto.LookupAnswered: OutboundConnection._on_lookup_answered,
    proto.FetchFinished: OutboundConnection._on_fetch_finished,
    proto.AbortAcknowledged: OutboundConnection._on_abort_acknowledged,
    proto.RequestFailed: OutboundConnection._on_request_failed,
    proto.RequestTimedOut: OutboundConnection._on_request_timed_out,
    proto.PeerClosed: OutboundConnection._on_peer_closed,
    proto.ProtocolViolated: OutboundConnection._on_violation,
}
"""What each session event does to an outbound connection (the rest need nothing)."""

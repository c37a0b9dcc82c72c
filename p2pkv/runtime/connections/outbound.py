"""One connection this node opened: its DEALER, its session, and everything waiting on it.

An :class:`OutboundConnection` owns its socket (and its monitor), its client
:class:`~p2pkv.protocol.Session`, the lookups and fetches it carries with their futures,
and its data path (:mod:`p2pkv.runtime.paths`), chosen after the handshake
(:class:`~p2pkv.runtime.paths.choice.PathChoice`). What the peer sends, on the DEALER or
the data stream, enters the session through one door
(:meth:`~p2pkv.protocol.Session.receive_data`), which has the path land the blocks; the
session's events then become results and typed errors on the callers' futures, and
credit goes back to the peer as the path's :class:`~p2pkv.protocol.CreditBudget` decides.
Every deadline of a request is the session's (one clock per request); a closed or silent
connection fails everything waiting on it.

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
from typing import Any, Final, TypeVar, cast

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import (
    LocalLimitExceeded,
    LocalProtocolError,
    P2PKVError,
    P2PKVProtocolError,
    PeerGone,
    PeerTimeout,
    ProtocolError,
)
from p2pkv.identity import IdentityExtension
from p2pkv.reports import refusal_error, request_error, timeout_error
from p2pkv.runtime.paths.choice import PathChoice
from p2pkv.runtime.paths.data_client import DataReceiver, StreamOwner
from p2pkv.runtime.paths.frames import HANDLE_PATHS, FramesIn
from p2pkv.runtime.paths.lanes import open_lanes, take_others
from p2pkv.runtime.paths.nixl_client import NixlReceiver
from p2pkv.runtime.paths.receiver import Receiver, drain
from p2pkv.runtime.paths.shm_client import SharedReceiver
from p2pkv.runtime.pending import LookupAnswer
from p2pkv.runtime.public import FetchResult, KeyOutcome, PeerHandle, PeerOwner
from p2pkv.runtime.reactor import Reactor, fail, resolve
from p2pkv.runtime.state import FetchTicket, Receiving, Waiting
from p2pkv.runtime.stats import Count, Counters
from p2pkv.runtime.tuning import MONITOR_GRACE_MS, READ_BUDGET, READ_BURST_BYTES
from p2pkv.store import BlockStore
from p2pkv.transport import monitor_failure, monitor_messages

M = TypeVar("M", proto.Lookup, proto.Fetch)

__all__ = [
    "OutboundConnection",
    "OutboundParts",
    "opened",
    "wanted_keys",
]

log = logging.getLogger("p2pkv.node")


def opened(session: proto.Session, address: str, open_request: Callable[[], M], what: str,
           deadline: float) -> M:
    """Open a request in the session (which holds the peer's key limit and the in-flight
    limit: either becomes a typed LocalLimitExceeded), unless the caller's deadline
    passed already: then nothing is sent (``timeout=0``)."""
    try:
        msg = open_request()
    except proto.KeyLimitExceeded as exc:
        raise LocalLimitExceeded(
            f"{what} of {exc.requested} keys: {address} accepts at most {exc.allowed} "
            "keys per request; split the request", limit="max_keys", allowed=exc.allowed,
            requested=exc.requested) from None
    except LocalProtocolError as exc:
        if exc.code != proto.Code.TOO_MANY_IN_FLIGHT:
            raise  # this node's misuse of its session: a LocalProtocolError, never the peer's
        in_flight, allowed = session.in_flight, session.request_limit
        raise LocalLimitExceeded(
            f"{what}: {in_flight} requests already in flight to {address} "
            f"(limit {allowed}); wait for one to finish",
            limit="max_inflight_requests", allowed=allowed,
            requested=in_flight + 1) from None
    if time.monotonic() >= deadline:
        session.withdraw(msg.req)
        raise PeerTimeout(f"{what} on {address}: the timeout expired before the "
                          "request could be sent")
    return msg


def wanted_keys(store: BlockStore, keys: Sequence[bytes], into_store: bool
                ) -> tuple[list[KeyOutcome | None], list[int], list[tuple[int, int]]]:
    """A new fetch's outcomes so far, the indices of the keys to ask for, and its
    repeated keys. Into caller buffers: every key is asked for (each has a buffer of its
    own). Into the store: the keys not held locally, each once; a key repeated in the
    fetch is ``(index, index of its first occurrence)``, and takes that one's outcome
    when the fetch ends (one block, one slot: asking twice would only find the second
    copy's slot taken by the first)."""
    outcomes: list[KeyOutcome | None] = [None] * len(keys)
    if not into_store:
        return outcomes, list(range(len(keys))), []
    held = store.lookup(list(keys))
    if not any(held) and len(set(keys)) == len(keys):
        return outcomes, list(range(len(keys))), []  # the common case, with no step per key
    wanted: list[int] = []
    first: dict[bytes, int] = {}
    repeats: list[tuple[int, int]] = []
    for i, present in enumerate(held):
        if present:
            outcomes[i] = KeyOutcome.LANDED
            continue
        seen = first.setdefault(keys[i], i)
        if seen == i:
            wanted.append(i)
        else:
            repeats.append((i, seen))
    return outcomes, wanted, repeats


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
    data: DataReceiver
    nixl: NixlReceiver
    #: The credit budget of a connection whose blocks come in ZeroMQ frames.
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
                 connected: Future[PeerHandle], now: float,
                 on_closed: Callable[[OutboundConnection], None]) -> None:
        self.peer_id = peer_id
        self.address = address
        #: Set once the handshake (and the shared-memory proof, if any) is over.
        self.handle: PeerHandle | None = None
        self.closed = False
        self.session = parts.new_session(now)
        self._parts = parts
        self._connected = connected
        self._on_closed = on_closed
        self._waiting = Waiting()
        self._fetches = self._waiting.fetches
        self._received_blocks = 0
        self._sock, self._monitor = parts.dial(address)
        self._dealer_payload = _Frames(self._sock, self._land)
        frames = FramesIn(parts.receiver, self._sock, self._fetches.get, parts.budget,
                          parts.counters, parts.bytes_per_block)
        self._paths = PathChoice(frames, parts.shm, parts.data, parts.reactor, parts.counters,
                                 address, self._fetches.get, StreamOwner(
                                     fetch_of=self._fetches.get, deliver=self._deliver,
                                     lost=self._stream_lost), self._ready, parts.nixl)

    def open(self, now: float, deadline: float) -> None:
        """Watch the socket and its monitor, and say hello; ``deadline`` is the caller's
        for the handshake, which the session keeps (with the proof, if any)."""
        self._parts.reactor.register(self._sock, self._on_readable)
        self._parts.reactor.register(self._monitor, self._on_monitor)
        self._send(self.session.start(now, deadline=deadline))

    # -- requests ------------------------------------------------------------------------

    def require_ready(self) -> None:
        """Raise PeerGone unless requests may go out on this connection."""
        if self.closed:
            raise PeerGone(f"peer {self.peer_id} is not connected (closed, dead or never "
                           "connected)")
        if self.session.state is not proto.State.READY:
            raise PeerGone(f"peer {self.address} is not ready (state "
                           f"{self.session.state.name})")

    def lookup(self, keys: tuple[bytes, ...], fut: Future[list[bool]] | Future[LookupAnswer],
               deadline: float, *, whole: bool = False) -> None:
        """Ask the peer about ``keys``; ``fut`` gets the hits, or with ``whole`` the
        whole answer (:class:`LookupAnswer`, with the keys pending on the peer)."""
        session = self.session
        msg = opened(session, self.address,
                     lambda: session.lookup(keys, time.monotonic(), deadline=deadline),
                     "lookup", deadline)
        if whole:
            self._waiting.answers[msg.req] = cast("Future[LookupAnswer]", fut)
        else:
            self._waiting.lookups[msg.req] = cast("Future[list[bool]]", fut)
        self._send([msg])

    def fetch(self, keys: tuple[bytes, ...], destinations: Sequence[Sequence[memoryview]] | None,
              fut: Future[FetchResult], deadline: float, ticket: FetchTicket) -> None:
        """Fetch the blocks of ``keys`` not held locally (into the store), or all of them
        (into ``destinations``)."""
        now = time.monotonic()
        outcomes, wanted, repeats = wanted_keys(self._parts.store, keys, destinations is None)
        if not wanted:
            resolve(fut, FetchResult(keys, tuple(o or KeyOutcome.LANDED for o in outcomes),
                                     {}, 0, 0, 0.0))
            return
        session = self.session
        lanes = open_lanes(session, self._paths.path, keys, wanted, self._credit_state(), now,
                           deadline, lambda one: opened(session, self.address, one, "fetch",
                                                        deadline))
        group: list[Receiving] | None = [] if len(lanes) > 1 else None
        errors: dict[int, str] = {}  # one for every part
        for msg, part in lanes:
            recv = Receiving(msg.req, keys, fut, destinations, now, outcomes, part, errors,
                             ticket=ticket, group=group, repeats=repeats)
            self._fetches[msg.req] = recv
            if group is not None:
                group.append(recv)
        ticket.peer_id, ticket.reqs = self.peer_id, tuple(msg.req for msg, _ in lanes)
        self._send([msg for msg, _ in lanes])

    def abort_fetch(self, ticket: FetchTicket) -> None:
        """The caller cancelled a fetch: tell the peer, give its credit to the others.
        ``ticket.stopped`` is set once the peer confirmed (or nothing can arrive)."""
        running = [r for r in (self._fetches.pop(req, None) for req in ticket.reqs)
                   if r is not None]
        if self.closed or not running:
            ticket.stopped.set()  # never sent, or already over
            return
        now = time.monotonic()
        for recv in running:
            self._paths.path.cancel(recv.req)
            self._waiting.aborting[recv.req] = ticket
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

    # -- deadlines -----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a lookup or a fetch is waiting on this connection."""
        return bool(self._waiting)

    def next_deadline(self) -> float | None:
        # The session holds every deadline of the connection (the handshake's, the
        # caller's for it included, and every request's); a data stream still being
        # bound gives up at the caller's, which it was given.
        session = self.session.next_deadline()
        binding = self._paths.next_deadline() if self.handle is None else None
        if binding is None or session is None:
            return session if binding is None else binding
        return min(session, binding)

    def check_deadlines(self, now: float) -> None:
        if self.closed:
            return
        if self.handle is None:
            self._paths.check(now)  # a data port that does not answer: stay on ZeroMQ
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
        # What the peer sent before it went away may still wait on the stream or in
        # ZeroMQ's queue (a fetch's tail, its done, a drained node's bye): read it
        # first, so a peer that closed cleanly is not taken for one that vanished.
        self._paths.path.read_pending(now)
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
            self._handle(self.session.receive_data(head, now, self._dealer_payload), now)

    def _land(self, arrived: proto.DataArrived) -> None:
        """The DEALER's payload lands through the path its message belongs to."""
        assert isinstance(arrived, (proto.BlockArrived, proto.BlocksLocated))
        self._paths.of(arrived).land(arrived)

    # -- the data stream (StreamOwner) ---------------------------------------------------

    def _stream_lost(self, exc: P2PKVError) -> None:
        """The stream ended, or carried a violation: the peer's goes through the session's
        one door (told, counted, reported); this node's own only closes with its code."""
        if isinstance(exc, ProtocolError) and not self.closed:
            self._handle(self.session.violated(exc, now := time.monotonic()), now)
        elif isinstance(exc, P2PKVProtocolError) and not self.closed:
            self._send(self.session.close(exc.code, exc.message).replies)
        if not self.closed:
            self.close(exc)

    def _deliver(self, head: bytes, payload: proto.Payload, now: float) -> proto.Output:
        """A frame 0 read on the data stream, through the same door as the DEALER's."""
        self._handle(out := self.session.receive_data(head, now, payload), now)
        return out

    # -- credit --------------------------------------------------------------------------

    def _credit_state(self) -> list[proto.FetchCredit]:
        """The session's credit counts of this connection's running fetches."""
        states = (self.session.fetch_credit(req) for req in self._fetches)
        return [state for state in states if state is not None]

    def _refill_credit(self, now: float) -> None:
        """Grant the credit the path's budget allows now (see ``CreditBudget.grants``)."""
        for req, n in self._paths.path.budget.grants(self._credit_state()):
            try:
                credit = self.session.credit(req, n, now)
            except (LocalProtocolError, ValueError):
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

    def _on_landed(self, ev: proto.BlockArrived | proto.BlocksLocated, now: float) -> None:
        """Blocks were landed (or dropped): what their way back needs (a shared-memory
        release; nothing for bytes that came on ZeroMQ or the stream), then credit."""
        self._send(self._paths.of(ev).settled(self.session, ev))
        self._received_blocks += len(ev.idx)
        if not self.closed:
            self._refill_credit(now)

    def _on_accepted(self, ev: proto.HandshakeAccepted, now: float) -> None:
        self._parts.counters.undeclared(self.address, ev.warnings)
        log.info("connected to %s (%s), capabilities %s", self.address, ev.remote.node,
                 sorted(ev.capabilities))
        # A same-host peer first gets our shared-memory proof, others a data stream if
        # both sides take one; the connection is ready once that is over (within the
        # handshake deadline).
        self._send(self._paths.begin(self.session, self.session.handshake_until))

    def _on_attach_answered(self, ev: proto.AttachAnswered, now: float) -> None:
        self._paths.answered(self.session, ev, self.session.handshake_until)

    def _on_handshake_timed_out(self, ev: proto.HandshakeTimedOut, now: float) -> None:
        self.close(PeerTimeout(f"no handshake answer from {self.address} within the "
                               "deadline"))

    def _ready(self) -> None:
        """The handshake (and the shm proof or the data stream) is over: choose the data
        path, once, and hand the connection out."""
        remote = self.session.remote
        if remote is None or self.closed or self.handle is not None:
            return
        session = self.session
        detail = self._paths.choose(session)
        self.handle = PeerHandle(self.peer_id, self.address, remote.node, dict(remote.rc),
                                 remote.fp, frozenset(session.capabilities),
                                 self._parts.owner, remote.ext or IdentityExtension(),
                                 HANDLE_PATHS[self._paths.path.kind], detail)
        resolve(self._connected, self.handle)

    def _on_refused(self, ev: proto.HandshakeRefused, now: float) -> None:
        exc = refusal_error(self.address, self._parts.hello, ev)
        log.warning("%s", exc)
        self.close(exc)

    def _on_lookup_answered(self, ev: proto.LookupAnswered, now: float) -> None:
        self._waiting.answered(ev.req, ev.hits, ev.due)

    def _on_fetch_finished(self, ev: proto.FetchFinished, now: float) -> None:
        recv = self._fetches.pop(ev.req, None)
        if recv is not None:
            result = self._parts.receiver.finish(recv, ev.outcomes, now)
            if result is not None:  # a striped fetch is over once its every part is
                resolve(recv.future, result)
            self._refill_credit(now)  # its budget goes to the others

    def _on_abort_acknowledged(self, ev: proto.AbortAcknowledged, now: float) -> None:
        self._waiting.confirmed(ev.req)

    def _on_request_failed(self, ev: proto.RequestFailed, now: float) -> None:
        self._fail_request(ev.req, request_error(self.address, ev))

    def _on_request_timed_out(self, ev: proto.RequestTimedOut, now: float) -> None:
        recv = self._fetches.get(ev.req)
        self._fail_request(ev.req, timeout_error(self.address, ev,
                                                 None if recv is None else len(recv.keys)))

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
        recv = self._waiting.fail(req, exc)
        if recv is not None:
            self._paths.path.cancel(req)  # nothing more of it lands
            # A striped fetch fails as a whole: its other parts are aborted.
            for other in take_others(recv, self._fetches):
                self._paths.path.cancel(other.req)
                with contextlib.suppress(LocalProtocolError):
                    self._send([self.session.abort(other.req, time.monotonic())])
            self._refill_credit(time.monotonic())  # its budget goes to the others

    # -- the end -------------------------------------------------------------------------

    def close(self, exc: P2PKVError) -> None:
        """End the connection: fail everything waiting on it with ``exc``, release its
        sockets, its stream and its mapping of the peer's pool. Idempotent."""
        if self.closed:
            return
        self.closed = True
        log.info("connection to %s closed: %s", self.address, exc)
        fail(self._connected, exc)
        self._waiting.fail_all(exc)
        reactor = self._parts.reactor
        reactor.unregister(self._sock)
        reactor.unregister(self._monitor)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._paths.close()
        self._on_closed(self)


_ON_EVENT: Final[dict[type[proto.Event], Callable[[OutboundConnection, Any, float], None]]] = {
    proto.BlockArrived: OutboundConnection._on_landed,
    proto.BlocksLocated: OutboundConnection._on_landed,
    proto.HandshakeAccepted: OutboundConnection._on_accepted,
    proto.AttachAnswered: OutboundConnection._on_attach_answered,
    proto.HandshakeRefused: OutboundConnection._on_refused,
    proto.HandshakeTimedOut: OutboundConnection._on_handshake_timed_out,
    proto.LookupAnswered: OutboundConnection._on_lookup_answered,
    proto.FetchFinished: OutboundConnection._on_fetch_finished,
    proto.AbortAcknowledged: OutboundConnection._on_abort_acknowledged,
    proto.RequestFailed: OutboundConnection._on_request_failed,
    proto.RequestTimedOut: OutboundConnection._on_request_timed_out,
    proto.PeerClosed: OutboundConnection._on_peer_closed,
    proto.ProtocolViolated: OutboundConnection._on_violation,
}
"""What each session event does to an outbound connection (the rest need nothing)."""

"""The fetching side: connections this node opens, its requests, and their futures.

One DEALER per peer (and its socket monitor), each with a client
:class:`~p2pkv.protocol.Session`. Commands from the API (connect, lookup, fetch,
disconnect) run here on the IO thread; session events become results and typed errors
on the callers' futures. Blocks land through the :class:`~p2pkv.runtime.receiver.Receiver`;
credit goes back to the peer as the per-peer :class:`~p2pkv.protocol.CreditBudget`
decides. A closed or silent connection fails everything waiting on it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

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
from p2pkv.reports import incompatible
from p2pkv.runtime.public import FetchResult, KeyOutcome, NodeConfig, PeerHandle, PeerOwner
from p2pkv.runtime.reactor import Reactor, fail, resolve
from p2pkv.runtime.receiver import Receiver, drain
from p2pkv.runtime.shm_client import SharedReceiver
from p2pkv.runtime.state import FetchTicket, Outbound, Receiving
from p2pkv.runtime.stats import Counters
from p2pkv.runtime.tuning import MONITOR_GRACE_MS, READ_BUDGET, READ_BURST_BYTES
from p2pkv.store import BlockStore
from p2pkv.transport import CurveKeys, handshake_failure, make_dealer, monitor_messages

__all__ = ["Client", "admit", "refusal_error", "request_error"]

log = logging.getLogger("p2pkv.node")


def request_error(address: str, ev: proto.RequestFailed) -> P2PKVError:
    """The typed error for a request the session failed, chosen by its code."""
    text = f"{address}: request {ev.req} failed: {ev.msg} [{proto.code_name(ev.code)}]"
    code = int(ev.code)
    if code in (proto.Code.PEER_TIMEOUT, proto.Code.TIMEOUT):
        return PeerTimeout(text)
    if 100 <= code < 200 or 300 <= code < 400:
        # 1xx: the handshake was refused, which ends the connection. PeerIncompatible
        # is raised only by the handshake itself, with its reasons.
        return PeerGone(text)
    if code in (proto.Code.OUT_OF_BOUNDS, proto.Code.TOO_MANY_IN_FLIGHT, proto.Code.UNAVAILABLE):
        # The peer turned this request down; the connection stays up.
        return TransferFailed(text)
    return ProtocolError(code, text)


def admit(conn: Outbound, nkeys: int, what: str, deadline: float) -> None:
    """Local limits and the caller's deadline, checked before a request is sent."""
    session = conn.session
    if nkeys > session.key_limit:
        raise LocalLimitExceeded(
            f"{what} of {nkeys} keys: {conn.address} accepts at most {session.key_limit} "
            "keys per request; split the request", limit="max_keys",
            allowed=session.key_limit, requested=nkeys)
    if session.in_flight >= session.request_limit:
        raise LocalLimitExceeded(
            f"{what}: {session.in_flight} requests already in flight to {conn.address} "
            f"(limit {session.request_limit}); wait for one to finish",
            limit="max_inflight_requests", allowed=session.request_limit,
            requested=session.in_flight + 1)
    if time.monotonic() >= deadline:  # timeout=0: nothing is sent
        raise PeerTimeout(f"{what} on {conn.address}: the timeout expired before the "
                          "request could be sent")


def refusal_error(address: str, hello: proto.Hello, ev: proto.HandshakeRefused) -> P2PKVError:
    """A refused handshake's error: PeerIncompatible with its reasons, or, refused for a
    protocol violation (a malformed or unexpected greeting), a ProtocolError."""
    if ev.reasons:
        return incompatible(address, hello, ev)
    who = "refused by" if ev.by_remote else "refused"
    return ProtocolError(ev.code, f"handshake {who} {address}: {ev.msg} "
                         f"[{proto.code_name(ev.code)}]")


class Client:
    """Outbound connections and the requests on them (IO thread, except as noted)."""

    def __init__(self, *, reactor: Reactor, ctx: zmq.Context[zmq.Socket[bytes]],
                 owner: PeerOwner, hello: proto.Hello, deadlines: proto.Deadlines,
                 limits: proto.Limits, config: NodeConfig, store: BlockStore,
                 receiver: Receiver, budget: proto.CreditBudget, counters: Counters,
                 max_message: int, shm: SharedReceiver) -> None:
        self._reactor = reactor
        self._ctx = ctx
        self._owner = owner
        self._hello = hello
        self._deadlines = deadlines
        self._limits = limits
        self._config = config
        self._store = store
        self._receiver = receiver
        self._budget = budget
        self._counters = counters
        self._max_message = max_message
        self._shm = shm
        self._segments = tuple(hello.geo.seg)
        self._bpb = hello.geo.bpb
        self._curve: CurveKeys | None = config.curve
        self._peer_ids = itertools.count(1)
        self._outbound: dict[int, Outbound] = {}
        self._lock = threading.Lock()  # guards _outbound for the API threads' reads

    # -- API threads -------------------------------------------------------------------

    def handles(self) -> list[PeerHandle]:
        """The live, handshaken connections."""
        with self._lock:
            return [c.handle for c in self._outbound.values() if c.handle and not c.closed]

    # -- commands ------------------------------------------------------------------------

    def connect(self, address: str, fut: Future[PeerHandle], deadline: float) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if time.monotonic() >= deadline:  # timeout=0: nothing is attempted
            fut.set_exception(PeerTimeout(f"connect to {address}: the timeout expired "
                                          "before the handshake could start"))
            return
        max_peers = self._config.max_peers
        live = sum(1 for c in self._outbound.values() if not c.closed)
        if live >= max_peers:
            fut.set_exception(LocalLimitExceeded(
                f"peer limit reached (max_peers={max_peers})", limit="max_peers",
                allowed=max_peers, requested=live + 1))
            return
        sock, monitor = make_dealer(self._ctx, address, max_message_bytes=self._max_message,
                                    curve=self._curve)
        now = time.monotonic()
        session = proto.SharingSession(proto.Role.CLIENT, self._hello,
                                       deadlines=self._deadlines, limits=self._limits, now=now,
                                       identity_policy=self._config.identity_policy)
        conn = Outbound(next(self._peer_ids), address, sock, monitor, session, fut, deadline)
        with self._lock:
            self._outbound[conn.peer_id] = conn
        self._reactor.register(sock, lambda now: self._on_readable(conn, now))
        self._reactor.register(monitor, lambda now: self._on_monitor(conn, now))
        self._send(conn, session.start(now))

    def lookup(self, peer_id: int, keys: tuple[bytes, ...], fut: Future[list[bool]],
               deadline: float) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        conn = self._ready_conn(peer_id)
        admit(conn, len(keys), "lookup", deadline)
        msg = conn.session.lookup(keys, time.monotonic())
        conn.lookups[msg.req] = (fut, deadline)
        self._send(conn, [msg])

    def fetch(self, peer_id: int, keys: tuple[bytes, ...],
              destinations: Sequence[Sequence[memoryview]] | None,
              fut: Future[FetchResult], deadline: float, ticket: FetchTicket) -> None:
        # The future is never marked running: its caller may cancel it at any time
        # (see FetchTicket), and every result is set only if it is still pending.
        if fut.done():
            return
        conn = self._ready_conn(peer_id)
        now = time.monotonic()
        outcomes: list[KeyOutcome | None] = [None] * len(keys)
        wanted: list[int] = []
        if destinations is None:
            for i, present in enumerate(self._store.lookup(list(keys))):
                if present:
                    outcomes[i] = KeyOutcome.STORED
                else:
                    wanted.append(i)
        else:
            wanted = list(range(len(keys)))
        if not wanted:
            resolve(fut, FetchResult(keys, tuple(o or KeyOutcome.STORED for o in outcomes),
                                     {}, 0, 0, 0.0))
            return
        admit(conn, len(wanted), "fetch", deadline)
        # One credit budget per peer, shared by all its fetches: it bounds the data
        # queued towards this node, and so how long a lookup answer can wait behind it.
        window = self._budget.opening_window(conn.credit_state(), len(wanted))
        fetch = conn.session.fetch_shared if conn.session.shared_memory else conn.session.fetch
        msg = fetch(tuple(keys[i] for i in wanted), window, now)
        conn.fetches[msg.req] = Receiving(msg.req, keys, fut, destinations, now, deadline,
                                          outcomes, wanted, ticket=ticket)
        ticket.peer_id, ticket.req = conn.peer_id, msg.req
        self._send(conn, [msg])

    def abort_fetch(self, ticket: FetchTicket) -> None:
        """The caller cancelled a fetch: tell the peer, give its credit to the others.
        ``ticket.stopped`` is set once the peer confirmed (or nothing can arrive)."""
        conn = self._outbound.get(ticket.peer_id)
        recv = None if conn is None or ticket.req is None else conn.fetches.pop(ticket.req, None)
        if conn is None or conn.closed or recv is None:
            ticket.stopped.set()  # never sent, already over, or the connection is gone
            return
        now = time.monotonic()
        conn.aborting[recv.req] = ticket
        self._send(conn, [conn.session.abort(recv.req, now)])
        if not conn.closed:
            self._refill_credit(conn, now)

    def disconnect(self, peer_id: int, fut: Future[None]) -> None:
        conn = self._outbound.get(peer_id)
        if conn is not None and not conn.closed:
            self._send(conn, conn.session.close(proto.Code.NORMAL_CLOSE, "disconnect").replies)
            self._drop(conn, PeerGone(f"disconnected from {conn.address}"))
        fut.set_result(None)

    def _ready_conn(self, peer_id: int) -> Outbound:
        conn = self._outbound.get(peer_id)
        if conn is None or conn.closed:
            raise PeerGone(f"peer {peer_id} is not connected (closed, dead or never connected)")
        if conn.session.state is not proto.State.READY:
            raise PeerGone(f"peer {conn.address} is not ready (state {conn.session.state.name})")
        return conn

    # -- sockets -------------------------------------------------------------------------

    def _send(self, conn: Outbound, messages: Iterable[proto.Message]) -> None:
        for msg in messages:
            try:
                conn.sock.send_multipart(proto.encode(msg), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                # Before the p2pkv handshake a send fails when ZeroMQ's own (CURVE/NULL)
                # handshake already failed and tore the pipe down; the monitor says
                # which, so give it a moment to report.
                if (conn.handle is None and not conn.closed
                        and conn.monitor.poll(MONITOR_GRACE_MS)):
                    self._on_monitor(conn, time.monotonic())
                self._drop(conn, PeerGone(f"cannot send to {conn.address}: {exc}"))
                return

    def _on_monitor(self, conn: Outbound, now: float) -> None:
        if conn.closed:
            return
        failure = _monitor_failure(conn, monitor_messages(conn.monitor),
                                   curve=self._curve is not None)
        if failure is not None:
            self._drop(conn, failure)

    def _on_readable(self, conn: Outbound, now: float) -> None:
        if conn.closed:
            return
        try:
            self._read(conn, now)
        except Exception as exc:
            # A bug must cost one connection, never the node.
            log.exception("internal error on connection to %s", conn.address)
            self._drop(conn, P2PKVError(f"internal error: {exc!r}"))

    def _read(self, conn: Outbound, now: float) -> None:
        sock = conn.sock
        start = conn.received_blocks
        for _ in range(READ_BUDGET):
            if conn.closed:
                return
            # Leave a burst of bulk data after a few MiB so that queued commands (a
            # lookup issued meanwhile) and other peers get their turn.
            if (conn.received_blocks - start) * self._bpb >= READ_BURST_BYTES:
                return
            try:
                head = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._drop(conn, PeerGone(f"receive from {conn.address} failed: {exc}"))
                return
            try:
                msg = proto.decode_head(head, segments=self._segments)
            except ProtocolError as exc:
                drain(sock)
                self._handle(conn, conn.session.receive_malformed(exc, now), now)
                continue
            if type(msg) is proto.Block:
                out = conn.session.receive(msg, now)
                if any(type(e) is proto.BlockArrived for e in out.events):
                    self._land(conn, msg, now)
                else:
                    drain(sock)  # discarded (aborted fetch) or a violation
                self._handle(conn, out, now)
                continue
            if sock.getsockopt(zmq.RCVMORE):
                drain(sock)
                bad = ProtocolError(proto.Code.FRAME_COUNT,
                                    f"{msg.TAG} must not carry payload frames")
                self._handle(conn, conn.session.receive_malformed(bad, now), now)
                continue
            self._handle(conn, conn.session.receive(msg, now), now)

    def _land(self, conn: Outbound, msg: proto.Block, now: float) -> None:
        # A cancelled fetch's frames are read and dropped: not one more byte goes into
        # its buffers once cancel() returned (FetchTicket).
        bad = _unless_cancelled(conn.fetches.get(msg.req),
                                lambda recv: self._receiver.land(conn.sock, recv, msg))
        if bad is not None:
            self._handle(conn, conn.session.receive_malformed(bad, now), now)
            return
        conn.received_blocks += len(msg.idx)
        self._refill_credit(conn, now)

    def _refill_credit(self, conn: Outbound, now: float) -> None:
        """Grant the credit the peer's budget allows now (see ``CreditBudget.grants``)."""
        for req, n in self._budget.grants(conn.credit_state()):
            try:
                credit = conn.session.credit(req, n, now)
            except (ProtocolError, ValueError):
                continue  # the fetch is aborting; it needs no more credit
            self._send(conn, [credit])
            if conn.closed:
                return

    # -- session events ------------------------------------------------------------------

    def _handle(self, conn: Outbound, out: proto.Output, now: float) -> None:
        self._send(conn, out.replies)
        for ev in out.events:
            kind = type(ev)
            if kind is proto.BlockArrived or kind is proto.BlockDiscarded:
                continue
            if isinstance(ev, proto.BlocksLocated):
                self._land_located(conn, ev, now)
            elif isinstance(ev, proto.HandshakeAccepted):
                self._counters.undeclared(conn.address, ev.warnings)
                log.info("connected to %s (%s), capabilities %s", conn.address,
                         ev.remote.node, sorted(ev.capabilities))
                # A same-host peer first gets our shared-memory proof; the connection is
                # ready once it answered (within the handshake deadline).
                attach = self._shm.begin(conn)
                if attach is not None:
                    self._send(conn, [attach])
                else:
                    self._ready(conn)
            elif isinstance(ev, proto.AttachAnswered):
                self._shm.answered(conn, ev)
                self._ready(conn)
            elif isinstance(ev, proto.HandshakeRefused):
                exc = refusal_error(conn.address, self._hello, ev)
                log.warning("%s", exc)
                self._drop(conn, exc)
                return
            elif isinstance(ev, proto.LookupAnswered):
                pending = conn.lookups.pop(ev.req, None)
                if pending is not None and not pending[0].done():
                    pending[0].set_result(list(ev.hits))
            elif isinstance(ev, proto.FetchFinished):
                recv = conn.fetches.pop(ev.req, None)
                if recv is not None:
                    resolve(recv.future, self._receiver.finish(recv, ev.outcomes, now))
                    self._refill_credit(conn, now)  # its budget goes to the others
            elif isinstance(ev, proto.AbortAcknowledged):
                ticket = conn.aborting.pop(ev.req, None)
                if ticket is not None:
                    ticket.stopped.set()
            elif isinstance(ev, proto.RequestFailed):
                self._fail_request(conn, ev.req, request_error(conn.address, ev))
            elif isinstance(ev, proto.RequestTimedOut):
                self._fail_request(conn, ev.req, PeerTimeout(
                    f"{conn.address} made no progress on request {ev.req} ({ev.kind}) "
                    "within its deadline"))
            elif isinstance(ev, proto.PeerClosed):
                self._drop(conn, PeerGone(
                    f"{conn.address} closed the connection: {ev.msg} "
                    f"[{proto.code_name(ev.code)}]") if ev.code != proto.Code.TIMEOUT
                    else PeerTimeout(f"{conn.address}: {ev.msg}"))
                return
            elif isinstance(ev, proto.ProtocolViolated):
                self._counters.add("protocol_violations")
                log.warning("protocol violation by %s: %s", conn.address, ev.msg)
                self._drop(conn, ProtocolError(ev.code, ev.msg))
                return

    def _ready(self, conn: Outbound) -> None:
        """The handshake (and the shared-memory proof, if any) is over: hand out the peer."""
        if conn.session.remote is not None and not conn.closed:
            conn.handle = _peer_handle(conn, self._owner)
            if not conn.connect_future.done():
                conn.connect_future.set_result(conn.handle)

    def _land_located(self, conn: Outbound, ev: proto.BlocksLocated, now: float) -> None:
        """Copy located blocks from the peer's pool, release them, grant credit."""
        # As over TCP: nothing is copied into a cancelled fetch's buffers (FetchTicket).
        bad = _unless_cancelled(conn.fetches.get(ev.req),
                                lambda recv: self._shm.land(conn, recv, ev))
        if bad is not None:
            self._handle(conn, conn.session.receive_malformed(bad, now), now)
            return
        self._send(conn, [conn.session.release(ev.req, ev.idx)])
        conn.received_blocks += len(ev.idx)
        if not conn.closed:
            self._refill_credit(conn, now)

    def _fail_request(self, conn: Outbound, req: int, exc: P2PKVError) -> None:
        pending = conn.lookups.pop(req, None)
        if pending is not None and not pending[0].done():
            pending[0].set_exception(exc)
        recv = conn.fetches.pop(req, None)
        if recv is not None:
            fail(recv.future, exc)
        ticket = conn.aborting.pop(req, None)
        if ticket is not None:
            ticket.stopped.set()

    def _drop(self, conn: Outbound, exc: P2PKVError) -> None:
        if conn.closed:
            return
        conn.closed = True
        log.info("connection to %s closed: %s", conn.address, exc)
        if not conn.connect_future.done():
            conn.connect_future.set_exception(exc)
        for fut, _ in conn.lookups.values():
            if not fut.done():
                fut.set_exception(exc)
        for recv in conn.fetches.values():
            fail(recv.future, exc)
            if recv.ticket is not None:
                recv.ticket.stopped.set()
        for ticket in conn.aborting.values():
            ticket.stopped.set()
        conn.lookups.clear()
        conn.fetches.clear()
        conn.aborting.clear()
        self._reactor.unregister(conn.sock)
        self._reactor.unregister(conn.monitor)
        with contextlib.suppress(zmq.ZMQError):
            conn.sock.disable_monitor()
        conn.monitor.close(0)
        conn.sock.close(0)
        self._shm.forget(conn)
        with self._lock:
            self._outbound.pop(conn.peer_id, None)

    # -- the reactor's participant hooks -------------------------------------------------

    def after_io(self, now: float) -> None:
        pass

    def busy_wait_ms(self) -> int | None:
        return None

    def next_deadline(self) -> float | None:
        deadlines = [d for c in self._outbound.values()
                     for d in (c.session.next_deadline(), *(r.deadline for r in c.fetches.values()))
                     if d is not None]
        return min(deadlines, default=None)

    def idle(self) -> bool:
        return not any(c.lookups or c.fetches for c in self._outbound.values() if not c.closed)

    def check_deadlines(self, now: float) -> None:
        for conn in list(self._outbound.values()):
            if conn.closed:
                continue
            if conn.handle is None and now >= conn.handshake_deadline:
                self._drop(conn, PeerTimeout(
                    f"no handshake answer from {conn.address} within the deadline"))
                continue
            for req, recv in list(conn.fetches.items()):
                if now >= recv.deadline:
                    conn.fetches.pop(req, None)
                    with contextlib.suppress(ProtocolError):
                        self._send(conn, [conn.session.abort(req, now)])
                    fail(recv.future, PeerTimeout(
                        f"fetch of {len(recv.keys)} blocks from {conn.address} did not "
                        "finish within its deadline"))
            for req, (fut, deadline) in list(conn.lookups.items()):
                if now >= deadline:
                    conn.lookups.pop(req, None)
                    if not fut.done():
                        fut.set_exception(PeerTimeout(
                            f"lookup on {conn.address} not answered within its deadline"))
            if not conn.closed:
                self._handle(conn, conn.session.poll(now), now)

    def shutdown(self) -> None:
        gone = PeerGone("node closed")
        for conn in list(self._outbound.values()):
            if not conn.closed:
                self._send(conn, conn.session.close(proto.Code.SHUTDOWN, "node closing").replies)
            self._drop(conn, gone)


def _monitor_failure(conn: Outbound, messages: list[tuple[int, int]], *,
                     curve: bool) -> P2PKVError | None:
    """What the socket monitor's events mean for a connection: a failed security
    handshake, a lost connection, or nothing."""
    for event, value in messages:
        failure = handshake_failure(event, value, curve=curve, address=conn.address)
        if failure is not None:
            kind, text = failure
            return TransportHandshakeFailed(
                f"{conn.address}: ZeroMQ security handshake failed: {text}", kind, text)
    if any(event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) for event, _ in messages):
        if conn.handle is None:
            return PeerGone(f"could not connect to {conn.address} (refused, or closed during "
                            "the handshake)")
        return PeerGone(f"connection to {conn.address} was lost")
    return None


def _unless_cancelled(recv: Receiving | None,
                      land: Callable[[Receiving | None], ProtocolError | None]
                      ) -> ProtocolError | None:
    """Land a message for ``recv`` holding its ticket's lock, or for nobody (the data is
    consumed and dropped) once the fetch was cancelled."""
    ticket = recv.ticket if recv is not None else None
    if ticket is None:
        return land(recv)
    with ticket.lock:
        return land(None if ticket.cancelled else recv)


def _peer_handle(conn: Outbound, owner: PeerOwner) -> PeerHandle:
    """The handle of a connection whose handshake (and shared-memory proof) is over."""
    remote = conn.session.remote
    assert remote is not None
    return PeerHandle(conn.peer_id, conn.address, remote.node, dict(remote.rc), remote.fp,
                      frozenset(conn.session.capabilities), owner,
                      remote.ext or IdentityExtension(),
                      "shm" if conn.session.shared_memory else "tcp", conn.shm_detail)

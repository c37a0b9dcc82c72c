"""One peer connected to this node's ROUTER: its session, its fetch jobs, its TCP link.

An :class:`InboundConnection` owns its server :class:`~p2pkv.protocol.Session`
(the session enforces the handshake: a refused peer is told why, then forgotten), the
fetch jobs the peer opened, its data path (:mod:`p2pkv.runtime.paths`: ZeroMQ frames,
packed frames or its data stream, and shared memory for the fetches that ask for it),
and what identifies its TCP connection. It answers lookups from the store and has each
job's path send its blocks as their credit allows. A peer that misbehaves or becomes
unreachable costs only itself: one that stops reading (a frozen process, a zero TCP
window) is declared dead after its heartbeat deadline, and one that keeps answering
pings but takes nothing of what its path holds for it is cut at the send deadline
(``send_timeout``); either way its TCP connection is cut, so that libzmq drops what it
still queued for it and the blocks pinned for those sends are released.

All on the IO thread; the ROUTER itself is read by
:class:`~p2pkv.runtime.connections.server.Server`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import OUTCOME_FAILED
from p2pkv.reports import reason_name
from p2pkv.runtime.paths.data_sender import BoundStream, DataSender, StreamOut
from p2pkv.runtime.paths.data_server import DataListener
from p2pkv.runtime.paths.frames import FramesOut, serving_frames
from p2pkv.runtime.paths.interfaces import Sending, ServePath
from p2pkv.runtime.paths.sender import Sender
from p2pkv.runtime.paths.shm_server import SharedOut, SharedSender
from p2pkv.runtime.pending import PendingKeys
from p2pkv.runtime.stats import Count, Counters
from p2pkv.runtime.tuning import BYE_FLUSH_S
from p2pkv.store import BlockStore
from p2pkv.transport import cut_connection

__all__ = ["InboundConnection", "InboundParts", "route"]

log = logging.getLogger("p2pkv.node")

_DONE_STATES: Final = frozenset({proto.State.CLOSED, proto.State.ERROR, proto.State.REFUSED})


def route(router: zmq.Socket[bytes], rid: bytes, messages: Iterable[proto.Message]) -> bool:
    """Send ``messages`` to the peer ``rid``; False when it is unreachable."""
    for msg in messages:
        try:
            router.send_multipart([rid, *proto.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # ROUTER_MANDATORY: the peer is gone (EHOSTUNREACH) or not reading (EAGAIN).
            log.info("peer %s unreachable (%s); dropping its state", rid.hex(), exc)
            return False
    return True


@dataclass(frozen=True, eq=False)
class InboundParts:
    """What every inbound connection of a node shares (built once, by the node)."""

    router: zmq.Socket[bytes]
    store: BlockStore
    sender: Sender
    shm: SharedSender
    counters: Counters
    #: Seconds a peer may take nothing of what waits for it on its path (the send
    #: deadline, see ``ServePath.stalled_for``).
    send_timeout: float
    #: The data port (``tcp-data-v1``) and what sends on its streams; None when this
    #: node offers no data channel.
    data: DataListener | None = None
    data_sender: DataSender | None = None
    #: Set by :meth:`Node.drain`: new fetches are declined, lookups answer misses.
    draining: threading.Event = field(default_factory=threading.Event)
    #: Keys this node is computing (``pending-v1``): lookups say when they are due.
    pending: PendingKeys = field(default_factory=PendingKeys)
    #: Connections to cut once their ``bye`` had time to leave (time, fd, address):
    #: run by :meth:`cut_due`.
    cuts: list[tuple[float, int, tuple[str, int]]] = field(default_factory=list)

    def cut_due(self, now: float) -> None:
        """Cut the connections whose ``bye`` had :data:`BYE_FLUSH_S` to leave."""
        due = [c for c in self.cuts if c[0] <= now]
        if due:
            self.cuts[:] = [c for c in self.cuts if c[0] > now]
        for _, fd, address in due:
            if cut_connection(fd, address):
                log.info("cut the connection of %s:%d after its bye", *address)

    def next_cut(self) -> float | None:
        return min((c[0] for c in self.cuts), default=None)


class _Counted:
    """Payload frames the server already read and dropped, counted (a
    :class:`~p2pkv.protocol.Payload`: peers send the server no blocks)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def follows(self) -> bool:
        return self.count > 0

    def land(self, arrived: proto.DataArrived) -> None:  # pragma: no cover - never called
        raise AssertionError("a server lands no blocks")

    def discard(self) -> None:
        pass


class InboundConnection:
    """One peer on the ROUTER, by routing id. ``on_closed`` is called when it is dropped.

    ``fd`` and ``address`` are libzmq's descriptor of the peer's TCP connection and its
    remote address, to cut that one connection (``transport.cut_connection``); -1/None
    when unknown.
    """

    def __init__(self, parts: InboundParts, rid: bytes, session: proto.Session,
                 on_closed: Callable[[InboundConnection], None], *, fd: int = -1,
                 address: tuple[str, int] | None = None) -> None:
        self.rid = rid
        self.session = session
        self.closed = False
        self.fd = fd
        self.address = address
        self._parts = parts
        self._on_closed = on_closed
        self._jobs: collections.OrderedDict[int, Sending] = collections.OrderedDict()
        #: The peer's data path: ZeroMQ frames until the handshake says packed, or its
        #: data stream binds (tcp-data-v1); and shared memory once its proof was
        #: accepted, for the fetches that ask for it.
        self.path: ServePath = FramesOut(parts.sender, rid, self.send)
        self._shared: SharedOut | None = None
        #: Its bound data streams by index (several with tcp-streams-v1); the first one
        #: bound is the connection's path.
        self.streams: dict[int, StreamOut] = {}
        self._offer = session.data_offer  # tokens are minted with the session
        if parts.data is not None and self._offer is not None:
            parts.data.own(self._offer, self)

    # -- what the peer sends -------------------------------------------------------------

    def receive(self, head: bytes, extra_frames: int, now: float) -> None:
        """One message from the peer: its frame 0 and how many frames followed it."""
        self._handle(self.session.receive_data(head, now, _Counted(extra_frames)))

    def poll(self, now: float) -> None:
        """Check the session's deadlines and its paths' send deadline; forget the peer
        once its session ended."""
        out = self.session.poll(now)
        if out.events or out.replies:
            self._handle(out)
        if self.session.state in _DONE_STATES:
            self.drop()
            return
        timeout = self._parts.send_timeout
        for path in self._serving_paths():
            if (stalled := path.stalled_for(now)) >= timeout:
                self._parts.counters.stalled(path.kind)
                self.stream_lost(proto.Code.PEER_TIMEOUT,
                                 f"{_STALLS[path.kind]} for {stalled:.1f} s (send timeout "
                                 f"{timeout:g} s) while blocks waited for it: its fetches "
                                 "fail and their blocks are released")
                return

    def next_deadline(self, now: float) -> float | None:
        """When :meth:`poll` next has something to do: the session's next deadline, or
        sooner a path's send deadline (a path holding nothing is ``send_timeout`` away:
        asked again every loop turn, that never comes due)."""
        soonest = self.session.next_deadline()
        if soonest is None:
            return None
        timeout = self._parts.send_timeout
        for path in self._serving_paths():
            soonest = min(soonest, now + timeout - path.stalled_for(now))
        return soonest

    def _serving_paths(self) -> Iterable[ServePath]:
        """Every path that serves this peer, each once."""
        return {id(p): p for p in (self.path, self._shared, *self.streams.values())
                if p is not None}.values()

    def _handle(self, out: proto.Output) -> None:
        # Handshake verdicts are counted before the answer goes out, so that a peer that
        # has its answer can already see it in this node's stats.
        for ev in out.events:
            on_event = _BEFORE_REPLIES.get(type(ev))
            if on_event is not None:
                on_event(self, ev)
        if out.replies and not self.send(out.replies):
            return
        for ev in out.events:
            if self.closed:
                return
            on_event = _AFTER_REPLIES.get(type(ev))
            if on_event is not None:
                on_event(self, ev)

    def _count_accepted(self, ev: proto.HandshakeAccepted) -> None:
        self.path = serving_frames(self._parts.sender, self.rid, self.session, self.send)
        counters = self._parts.counters
        counters.add(Count.HANDSHAKES_ACCEPTED)
        log.info("accepted peer %s (%s)", ev.remote.node, self.rid.hex())
        counters.undeclared(f"peer {self.rid.hex()}", ev.warnings)

    def _count_refused(self, ev: proto.HandshakeRefused) -> None:
        # One count per reason kind per refused handshake (every differing run-config
        # field carries the fingerprint code).
        codes = {int(reason.code) for reason in ev.reasons} or {ev.code}
        self._parts.counters.refused(reason_name(code) for code in codes)
        log.warning("refused peer %s: %s", self.rid.hex(),
                    "; ".join(r.describe() for r in ev.reasons))

    def _unpin_abandoned(self, ev: proto.LocatedAbandoned) -> None:
        # An abort that crossed its done: unpin before the abort_ack goes out, so a peer
        # holding the ack never sees the blocks pinned.
        if self._shared is not None:
            self._shared.abort(ev.req)

    def _on_refused(self, ev: proto.HandshakeRefused) -> None:
        self.drop()

    def _on_lookup(self, ev: proto.LookupRequested) -> None:
        # A draining node promises nothing: its blocks are about to go away.
        draining = self._parts.draining.is_set()
        keys = list(ev.keys)
        hits = [False] * len(keys) if draining else self._parts.store.lookup(keys)
        due = (self._parts.pending.due_ms(keys, hits)
               if self.session.pending_answers and not draining else None)
        counters = self._parts.counters
        counters.add(Count.LOOKUPS_SERVED)
        counters.add(Count.LOOKUP_KEYS_SERVED, len(ev.keys))
        counters.add(Count.LOOKUP_HITS_SERVED, sum(hits))
        self.send([self.session.answer_lookup(ev.req, hits, due)])

    def _on_fetch(self, ev: proto.FetchRequested) -> None:
        if self._parts.draining.is_set():
            # Declined at once (not fatal): the consumer asks another holder instead of
            # waiting for a node that is going away.
            self._parts.counters.add(Count.FETCHES_DECLINED_DRAINING)
            self.send([self.session.fail(ev.req, proto.Code.UNAVAILABLE,
                                         "node draining: ask another holder")])
            return
        # The fetch's path is bound now: every block of it and its done take it (the
        # stream it names, tcp-streams-v1, when that one is bound).
        shared = self._shared if self.session.shared_fetch(ev.req) else None
        path = shared or self.streams.get(ev.stream) or self.path
        self._jobs[ev.req] = Sending(ev.req, tuple(ev.keys), [OUTCOME_FAILED] * len(ev.keys),
                                     path=path)

    def _on_request_failed(self, ev: proto.RequestFailed) -> None:
        """The session ended one of the peer's requests (its ``error`` naming it): a job
        of it goes, and what its path still pins for it is released."""
        job = self._jobs.pop(ev.req, None)
        if job is not None and job.path is not None:
            job.path.abort(ev.req)

    def _on_abort(self, ev: proto.AbortRequested) -> None:
        job = self._jobs.pop(ev.req, None)
        if job is not None and job.path is not None:
            job.path.abort(ev.req)
        self.send([self.session.abort_ack(ev.req)])

    def _on_attach(self, ev: proto.AttachRequested) -> None:
        verdict = self._parts.shm.verify(self.rid, self.session, ev)
        if verdict.ok:
            self._shared = SharedOut(self._parts.shm, self.rid, self.send)
        self.send([verdict])

    def _on_released(self, ev: proto.BlocksReleased) -> None:
        if self._shared is not None:  # else nothing of it is pinned
            self._shared.release(ev.req, ev.idx)

    # -- the data stream (StreamOwner) ---------------------------------------------------

    def wants_stream(self, index: int) -> bool:
        """Whether stream ``index`` may bind now: the welcome offered it (tcp-data-v1
        was negotiated; tcp-streams-v1 for more than one), the session is ready, and
        that stream is not bound yet."""
        offer = self.session.data_offer
        return (not self.closed and index not in self.streams
                and self.session.state is proto.State.READY
                and offer is not None and index <= len(offer.more))

    def stream_form(self) -> str | None:
        """How this session's streams are protected (plain, tls or sealed)."""
        return proto.stream_form(self.session.capabilities, self.session.data_offer)

    def bind_stream(self, stream: BoundStream, index: int) -> None:
        """The peer's stream ``index`` arrived with its token: fetches go out on it from
        now (the first one bound, and any that names it)."""
        sender = self._parts.data_sender
        assert sender is not None  # a stream binds only where the node offers them
        out = self.streams[index] = StreamOut(sender, stream)
        if self.path.kind != "stream":
            self.path = out
        log.info("peer %s bound its data stream %d", self.rid.hex(), index)

    def stream_lost(self, code: int, why: str) -> None:
        """The bound stream ended or failed: the session ends with it (blocks counted
        as sent there never reach the peer, so no ``done`` could be honest)."""
        if self.closed:
            return
        if code == proto.Code.PROTOCOL_VIOLATION:  # the peer's: through the one door
            self._handle(self.session.violated(ProtocolError(code, why), time.monotonic()))
            if not self.closed:  # a session that had ended already says nothing
                self.drop()
            return
        log.info("peer %s: %s; dropping it", self.rid.hex(), why)
        told = self.session.state is proto.State.READY and \
            self.send(self.session.close(code, why).replies)
        # The bye first, then the connection: cut at once, libzmq would drop the bye
        # with everything else it queued, and the peer would never learn why.
        self.drop(cut=not told, cut_after=BYE_FLUSH_S if told else None)

    def _on_peer_closed(self, ev: proto.PeerClosed) -> None:
        log.info("peer %s closed: %s", self.rid.hex(), ev.msg)
        # A peer silent past its heartbeat deadline may have stopped reading: cut its
        # connection so libzmq lets go of what it queued for it.
        self.drop(cut=not ev.by_remote and ev.code == proto.Code.PEER_TIMEOUT)

    def _on_violation(self, ev: proto.ProtocolViolated) -> None:
        self._parts.counters.add(Count.PROTOCOL_VIOLATIONS)
        log.warning("protocol violation by peer %s, closed: %s [%s]", self.rid.hex(), ev.msg,
                    proto.code_name(ev.code))
        self.drop()

    # -- what this node sends ------------------------------------------------------------

    def send(self, messages: Iterable[proto.Message]) -> bool:
        """Send to the peer; an unreachable peer is dropped (False)."""
        if route(self._parts.router, self.rid, messages):
            return True
        if not self.closed:
            self.drop(cut=True)
        return False

    @property
    def busy(self) -> bool:
        """Whether a fetch of this peer is still being served (or its path still has
        bytes queued)."""
        return bool(self._jobs) or any(s.busy for s in self.streams.values())

    def can_send(self) -> bool:
        """Whether a job has blocks left that its credit and its path's room (the pin
        limit, the data stream's queue) let go now."""
        session = self.session
        for j in self._jobs.values():
            if j.next_index >= len(j.keys) or session.window_left(j.req) <= 0:
                continue
            if j.path is not None and j.path.can_send(session, j):
                return True
        return False

    def serve(self) -> None:
        """Send blocks for every job of this peer that has credit."""
        for job in list(self._jobs.values()):
            if self.closed:
                break
            try:
                self._serve(job)
            except (ProtocolError, zmq.ZMQError) as exc:
                # One peer's trouble must never stop the node serving the others. This
                # node's own (a LocalProtocolError, a ValueError) is a bug, said as one.
                log.warning("dropping peer %s while serving request %d: %s",
                            self.rid.hex(), job.req, exc)
                self.drop(cut=True)
            except Exception:
                # A bug must cost one peer, never the node (or its IO thread).
                log.exception("internal error serving request %d of peer %s; dropping it",
                              job.req, self.rid.hex())
                self.drop(cut=True)

    def _serve(self, job: Sending) -> None:
        path = job.path
        assert path is not None  # bound when the fetch arrived
        if not path.send(self.session, job):
            self.drop(cut=True)
            return
        if not self.closed and job.next_index >= len(job.keys):
            self._jobs.pop(job.req, None)
            path.finish(self.session, job)  # its done, after its blocks, on its path

    def shut_down(self) -> None:
        """The node closes: tell a ready peer, then forget it."""
        if self.session.state is proto.State.READY:
            self.send(self.session.close(proto.Code.SHUTDOWN, "node closing").replies)
        self.drop()

    def drop(self, *, cut: bool = False, cut_after: float | None = None) -> None:
        """Forget the peer; ``cut``: also close its TCP connection (see the module doc),
        ``cut_after``: that many seconds from now (what was sent last leaves first)."""
        self.closed = True
        self._jobs.clear()
        self._on_closed(self)
        self.path.close()  # unpins what it still holds (a stream's queue)
        for stream in self.streams.values():
            stream.close()
        if self._shared is not None:
            self._shared.close()  # unpins everything located for the peer
        if self._parts.data is not None:
            self._parts.data.revoke(self._offer)
        if cut_after is not None and self.address is not None:
            self._parts.cuts.append((time.monotonic() + cut_after, self.fd, self.address))
            self.address = None
        if cut and self.address is not None and cut_connection(self.fd, self.address):
            log.info("cut the connection of peer %s (%s:%d)", self.rid.hex(), *self.address)
            self.address = None


_STALLS: Final = {
    "zmq": "the peer took none of its block frames",
    "packed": "the peer took none of its block frames",
    "shm": "the peer released none of its located blocks",
    "stream": "the data stream took no bytes",
}
"""What a peer that stalls on a path of each kind stopped doing (its ``bye`` says so)."""

_Handler = Callable[[InboundConnection, Any], None]
_BEFORE_REPLIES: Final[dict[type[proto.Event], _Handler]] = {
    proto.HandshakeAccepted: InboundConnection._count_accepted,
    proto.HandshakeRefused: InboundConnection._count_refused,
    proto.LocatedAbandoned: InboundConnection._unpin_abandoned,
}
"""What an event does before the session's replies go out."""
_AFTER_REPLIES: Final[dict[type[proto.Event], _Handler]] = {
    proto.HandshakeRefused: InboundConnection._on_refused,
    proto.LookupRequested: InboundConnection._on_lookup,
    proto.FetchRequested: InboundConnection._on_fetch,
    proto.AbortRequested: InboundConnection._on_abort,
    proto.RequestFailed: InboundConnection._on_request_failed,
    proto.AttachRequested: InboundConnection._on_attach,
    proto.BlocksReleased: InboundConnection._on_released,
    proto.PeerClosed: InboundConnection._on_peer_closed,
    proto.ProtocolViolated: InboundConnection._on_violation,
}
"""What an event does once the replies went out (the rest need nothing)."""

"""The serving side: the ROUTER, the sessions of peers connected to it, their requests.

Each peer that writes to the ROUTER gets a server :class:`~p2pkv.protocol.Session`
keyed by its routing id. The session enforces the handshake (a refused peer is told
why, then forgotten); this module answers lookups from the store, keeps the fetch jobs
peers opened, and hands them to the :class:`~p2pkv.runtime.sender.Sender` round robin,
as their credit allows. A peer that misbehaves or becomes unreachable costs only itself:
one that stops reading (a frozen process, a zero TCP window) is declared dead after its
heartbeat deadline and its TCP connection is cut, so that libzmq drops what it still
queued for it and the blocks pinned for those sends are released.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import OUTCOME_FAILED
from p2pkv.reports import reason_name
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.sender import Sender
from p2pkv.runtime.shm_server import SharedSender
from p2pkv.runtime.state import Inbound, Sending
from p2pkv.runtime.stats import Counters
from p2pkv.runtime.tuning import READ_BUDGET
from p2pkv.store import BlockStore
from p2pkv.transport import cut_connection, peer_of

__all__ = ["Server"]

log = logging.getLogger("p2pkv.node")

_DONE_STATES = frozenset({proto.State.CLOSED, proto.State.ERROR, proto.State.REFUSED})


class Server:
    """Inbound sessions on the node's ROUTER (IO thread, except :meth:`ready_peers`)."""

    def __init__(self, *, reactor: Reactor, router: zmq.Socket[bytes], store: BlockStore,
                 hello: proto.Hello, deadlines: proto.Deadlines, limits: proto.Limits,
                 max_peers: int, sender: Sender, counters: Counters,
                 identity_policy: str = "strict", shm: SharedSender) -> None:
        self._router = router
        self._store = store
        self._hello = hello
        self._deadlines = deadlines
        self._limits = limits
        self._max_peers = max_peers
        self._identity_policy = identity_policy
        self._sender = sender
        self._shm = shm
        self._counters = counters
        self._inbound: dict[bytes, Inbound] = {}
        # The IO thread changes _inbound under this lock; stats() reads it under it.
        self._lock = threading.Lock()
        reactor.register(router, self._read)

    def ready_peers(self) -> int:
        """How many peers completed the handshake (read from any thread, for stats)."""
        with self._lock:
            peers = list(self._inbound.values())
        return sum(1 for i in peers if i.session.state is proto.State.READY)

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
            peer = self._inbound.get(rid)
            if peer is None:
                if len(self._inbound) >= self._max_peers:
                    log.warning("peer limit reached (max_peers=%d); turning %s away",
                                self._max_peers, rid.hex())
                    self._send(rid, [proto.Bye(proto.Code.UNAVAILABLE,
                                               f"peer limit reached ({self._max_peers})")])
                    continue
                session = proto.SharingSession(proto.Role.SERVER, self._hello,
                                               deadlines=self._deadlines, limits=self._limits,
                                               now=now, identity_policy=self._identity_policy,
                                               shm_offer=self._shm.offer)
                session.start(now)
                peer = Inbound(rid, session)
                with contextlib.suppress(zmq.ZMQError):
                    peer.fd = int(frame.get(zmq.SRCFD))
                    peer.address = peer_of(peer.fd)
                with self._lock:
                    self._inbound[rid] = peer
            try:
                try:
                    msg = proto.decode_head(head, extra)
                except ProtocolError as exc:
                    out = peer.session.receive_malformed(exc, now)
                else:
                    out = peer.session.receive(msg, now)
                self._handle(peer, out)
            except Exception:
                # A bug must cost one peer, never the node.
                log.exception("internal error serving peer %s; dropping it", rid.hex())
                self._drop(peer, cut=True)

    def _handle(self, peer: Inbound, out: proto.Output) -> None:
        # Handshake verdicts are counted before the answer goes out, so that a peer that
        # has its answer can already see it in this node's stats.
        for ev in out.events:
            if isinstance(ev, proto.HandshakeAccepted):
                self._counters.add("handshakes_accepted")
                log.info("accepted peer %s (%s)", ev.remote.node, peer.rid.hex())
                self._counters.undeclared(f"peer {peer.rid.hex()}", ev.warnings)
            elif isinstance(ev, proto.HandshakeRefused):
                # One count per reason kind per refused handshake (every differing
                # run-config field carries the fingerprint code).
                codes = {int(reason.code) for reason in ev.reasons} or {ev.code}
                self._counters.refused(reason_name(code) for code in codes)
                log.warning("refused peer %s: %s", peer.rid.hex(),
                            "; ".join(r.describe() for r in ev.reasons))
            elif isinstance(ev, proto.LocatedAbandoned):
                # An abort that crossed its done: unpin before the abort_ack goes out,
                # so a peer holding the ack never sees the blocks pinned.
                self._shm.abort(peer.rid, ev.req)
        if out.replies and not self._send(peer.rid, out.replies):
            return
        for ev in out.events:
            if isinstance(ev, proto.HandshakeRefused):
                self._drop(peer)
                return
            if isinstance(ev, proto.LookupRequested):
                hits = self._store.lookup(list(ev.keys))
                self._counters.add("lookups_served")
                self._counters.add("lookup_keys_served", len(ev.keys))
                self._counters.add("lookup_hits_served", sum(hits))
                self._send(peer.rid, [peer.session.answer_lookup(ev.req, hits)])
            elif isinstance(ev, proto.FetchRequested):
                peer.jobs[ev.req] = Sending(ev.req, tuple(ev.keys),
                                            [OUTCOME_FAILED] * len(ev.keys))
            elif isinstance(ev, proto.AbortRequested):
                peer.jobs.pop(ev.req, None)
                self._shm.abort(peer.rid, ev.req)
                self._send(peer.rid, [peer.session.abort_ack(ev.req)])
            elif isinstance(ev, proto.AttachRequested):
                self._send(peer.rid, [self._shm.verify(peer.rid, peer.session, ev)])
            elif isinstance(ev, proto.BlocksReleased):
                self._shm.release(peer.rid, ev.req, ev.idx)
            elif isinstance(ev, (proto.PeerClosed, proto.ProtocolViolated)):
                if isinstance(ev, proto.ProtocolViolated):
                    self._counters.add("protocol_violations")
                    log.warning("protocol violation by peer %s, closed: %s [%s]",
                                peer.rid.hex(), ev.msg, proto.code_name(ev.code))
                else:
                    log.info("peer %s closed: %s", peer.rid.hex(), ev.msg)
                # A peer silent past its heartbeat deadline may have stopped reading:
                # cut its connection so libzmq lets go of what it queued for it.
                self._drop(peer, cut=isinstance(ev, proto.PeerClosed) and not ev.by_remote
                           and ev.code == proto.Code.PEER_TIMEOUT)
                return

    def _send(self, rid: bytes, messages: Iterable[proto.Message]) -> bool:
        for msg in messages:
            try:
                self._router.send_multipart([rid, *proto.encode(msg)], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                # ROUTER_MANDATORY: the peer is gone (EHOSTUNREACH) or not reading (EAGAIN).
                log.info("peer %s unreachable (%s); dropping its state", rid.hex(), exc)
                peer = self._inbound.get(rid)
                if peer is not None:
                    self._drop(peer, cut=True)
                return False
        return True

    def _drop(self, peer: Inbound, *, cut: bool = False) -> None:
        """Forget a peer; ``cut``: also close its TCP connection (see the module doc)."""
        peer.closed = True
        peer.jobs.clear()
        with self._lock:
            self._inbound.pop(peer.rid, None)
        self._shm.forget(peer.rid)
        if cut and peer.address is not None and cut_connection(peer.fd, peer.address):
            log.info("cut the connection of peer %s (%s:%d)", peer.rid.hex(), *peer.address)
            peer.address = None

    # -- sending blocks ------------------------------------------------------------------

    def _pump(self) -> None:
        """Send blocks for every served fetch that has credit, round robin by peer."""
        for peer in list(self._inbound.values()):
            for job in list(peer.jobs.values()):
                if peer.closed:
                    break
                try:
                    shared = peer.session.shared_fetch(job.req)
                    sender = self._shm if shared else self._sender
                    if not sender.send_job(peer.rid, peer.session, job):
                        self._drop(peer, cut=True)
                        continue
                    if job.next_index >= len(job.keys):
                        peer.jobs.pop(job.req, None)
                        self._send(peer.rid, [peer.session.fetch_done(job.req, job.outcomes)])
                except (ProtocolError, ValueError, zmq.ZMQError) as exc:
                    # One peer's trouble must never stop the node serving the others.
                    log.warning("dropping peer %s while serving request %d: %s",
                                peer.rid.hex(), job.req, exc)
                    self._drop(peer, cut=True)
                except Exception:
                    # A bug must cost one peer, never the node (or its IO thread).
                    log.exception("internal error serving request %d of peer %s; dropping "
                                  "it", job.req, peer.rid.hex())
                    self._drop(peer, cut=True)

    # -- the reactor's participant hooks -------------------------------------------------

    def after_io(self, now: float) -> None:
        self._pump()
        self._sender.ledger.reap()

    def busy_wait_ms(self) -> int | None:
        if any(j.next_index < len(j.keys) and i.session.window_left(j.req) > 0
               and (not i.session.shared_fetch(j.req) or self._shm.can_send(i.rid))
               for i in self._inbound.values() for j in i.jobs.values()):
            return 0
        return self._sender.busy_wait_ms()

    def next_deadline(self) -> float | None:
        deadlines = [d for d in (i.session.next_deadline() for i in self._inbound.values())
                     if d is not None]
        return min(deadlines) if deadlines else None

    def idle(self) -> bool:
        return not any(i.jobs for i in self._inbound.values() if not i.closed) and \
            not self._sender.ledger

    def check_deadlines(self, now: float) -> None:
        for peer in list(self._inbound.values()):
            out = peer.session.poll(now)
            if out.events or out.replies:
                self._handle(peer, out)
            if peer.session.state in _DONE_STATES:
                self._drop(peer)

    def shutdown(self) -> None:
        for peer in list(self._inbound.values()):
            if peer.session.state is proto.State.READY:
                self._send(peer.rid, peer.session.close(proto.Code.SHUTDOWN,
                                                        "node closing").replies)
            self._drop(peer)
        # Whatever ZeroMQ still holds is dropped with LINGER 0; unpin it.
        self._sender.ledger.release_all()
        self._shm.release_all()
        self._router.close(0)

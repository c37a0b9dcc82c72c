"""The serving side of ``tcp-data-v1``: the data port, tokens, and the streams' sends.

A peer that negotiated ``tcp-data-v1`` gets, in its ``welcome``, this node's data port
and a fresh random token (:meth:`DataListener.offer`). The token binds the first stream
that presents it to that peer's session, within the handshake deadline, once: a stream
whose preface is not a p2pkv one, whose token is unknown, used already or expired, or
that says nothing in time, is closed unanswered and never touches the pool. A bound
stream (:class:`BoundStream`) then carries the ``block`` and ``done`` messages of the
peer's fetches that are not served through shared memory (:class:`StreamOut`, the
``stream`` kind of :mod:`p2pkv.runtime.paths`): :class:`DataSender` pins a
batch within the fetch's credit, queues its header and the slots' segments, and
``sendmsg`` gathers them straight from the pool; each block stays pinned until its last
byte went to the kernel (or the stream is dropped). The client sends nothing on the
stream after its preface: a byte from it, the end of the stream or a failed write ends
the peer's session, like the end of its ZeroMQ connection.

IO thread only.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from p2pkv import protocol as proto
from p2pkv.protocol.codes import DATA_KEY_LEN, DATA_TOKEN_LEN, OUTCOME_SENT
from p2pkv.protocol.seal import RecordKeys
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.sender import pin_next_slots
from p2pkv.runtime.state import Sending
from p2pkv.runtime.stats import SENT, Count, Counters
from p2pkv.store import BlockStore
from p2pkv.transport.datachannel import RETRY, Gather, tune
from p2pkv.transport.sealed import SealedSocket
from p2pkv.transport.tls import ServerTLS

__all__ = ["BoundStream", "DataListener", "DataSender", "StreamOut", "StreamOwner"]

log = logging.getLogger("p2pkv.node")

_QUEUE_MESSAGES: Final = 2
"""Stream messages queued ahead of the kernel per peer: enough to keep its socket
buffer full, few enough that pins are short and a new fetch's first blocks go out soon."""
_ACCEPTS_PER_TURN: Final = 64
_TLS_HANDSHAKE: Final = b"\x16"
"""The first byte of a TLS stream (a handshake record)."""


class StreamOwner(Protocol):
    """The peer a token was offered to (an inbound connection)."""

    closed: bool

    def wants_stream(self, index: int) -> bool:
        """Whether its stream ``index`` may bind now (its session negotiated the stream,
        and that one is not bound yet)."""

    def stream_form(self) -> str | None:
        """How its session's streams are protected (``"plain"``, ``"tls"``,
        ``"sealed"``: :func:`p2pkv.protocol.stream_form`), None without a stream."""

    def bind_stream(self, stream: BoundStream, index: int) -> None:
        """Its stream ``index`` arrived with the right token."""

    def stream_lost(self, code: int, why: str) -> None:
        """Its bound stream ended or failed (``code``: the close reason): the session
        ends."""


@dataclass(eq=False)
class _Offer:
    expires: float
    #: Which stream of its session the token binds (0: the first, ``tcp-streams-v1``).
    index: int = 0
    owner: StreamOwner | None = None
    #: The session's stream secret (``tcp-data-aead-v1``), when this node seals streams.
    key: bytes | None = None


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    deadline: float
    data: bytearray
    #: Whether its TLS handshake is over (always, for a plain stream).
    shaken: bool = True
    #: Whether it is TLS; None while its first byte, which says so, has not come yet
    #: (a node that serves TLS streams and others on one port).
    tls: bool | None = False


class DataListener:
    """The node's data port (one listening socket) and the tokens it honours.

    ``timeout``: how long a token waits for its stream, and a new stream for its
    preface (the handshake deadline, its TLS handshake included). At most
    ``max_pending`` streams may be waiting for their preface at once; more are closed at
    once. ``tls``: the node's TLS identity when it serves TLS streams
    (``tcp-data-tls-v1``, SPEC §18.7): every offer pins the certificate, and a stream
    whose first byte opens a TLS handshake is TLS 1.3 before its preface. ``sealed``:
    whether it serves sealed streams (``tcp-data-aead-v1``, SPEC §18.8): every offer
    carries a fresh stream secret, and a sealed preface must verify under it.
    """

    def __init__(self, reactor: Reactor, sock: socket.socket, counters: Counters, *,
                 timeout: float, max_pending: int, tls: ServerTLS | None = None,
                 sealed: bool = False) -> None:
        self._tls = tls
        self._sealed = sealed
        self._reactor = reactor
        self._sock = sock
        self._counters = counters
        self._timeout = timeout
        self._max_pending = max_pending
        self.port = int(sock.getsockname()[1])
        self._offers: dict[bytes, _Offer] = {}
        self._pending: dict[socket.socket, _Pending] = {}
        self.closed = False
        reactor.register(sock, self._accept)

    # -- tokens --------------------------------------------------------------------------

    def offer(self, cport: int, now: float, streams: int = 1) -> proto.DataOffer:
        """Fresh tokens for a new session's ``streams`` streams (``cport``: this node's
        ZeroMQ port), each good once until the deadline, and only once :meth:`own`
        named its session. Tokens beyond the first go to a peer only where
        ``tcp-streams-v1`` is negotiated (the session drops them otherwise)."""
        tokens = [secrets.token_bytes(DATA_TOKEN_LEN) for _ in range(streams)]
        key = secrets.token_bytes(DATA_KEY_LEN) if self._sealed else None
        for index, token in enumerate(tokens):
            self._offers[token] = _Offer(now + self._timeout, index, key=key)
        return proto.DataOffer(self.port, tokens[0], cport, tuple(tokens[1:]),
                               None if self._tls is None else self._tls.pin, key)

    def own(self, offer: proto.DataOffer, owner: StreamOwner) -> None:
        """The session ``offer`` was made for."""
        for token in (offer.token, *offer.more):
            entry = self._offers.get(token)
            if entry is not None:
                entry.owner = owner

    def revoke(self, offer: proto.DataOffer | None) -> None:
        """The session ended: its tokens not used yet are good for nothing."""
        if offer is not None:
            for token in (offer.token, *offer.more):
                self._offers.pop(token, None)

    def pending(self) -> int:
        """Streams accepted and waiting for their preface (for tests and stats)."""
        return len(self._pending)

    # -- streams -------------------------------------------------------------------------

    def _accept(self, now: float) -> None:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                sock, _ = self._sock.accept()
            except RETRY:
                return
            except OSError as exc:  # out of descriptors, for instance: try next turn
                log.warning("data port: accept failed: %s", exc)
                return
            if len(self._pending) >= self._max_pending:
                self._refuse(sock, "too many streams waiting for their preface")
                continue
            try:
                tune(sock)
            except OSError:
                sock.close()
                continue
            pending = _Pending(sock, now + self._timeout, bytearray(),
                               tls=None if self._tls is not None else False)
            self._pending[sock] = pending
            self._reactor.register(sock, self._preface_reader(pending))

    def _preface_reader(self, p: _Pending) -> Callable[[float], None]:
        return lambda now: self._read_preface(p, now)

    def _read_preface(self, p: _Pending, now: float) -> None:
        try:
            self._bind(p, now)
        except Exception:
            # A bug must cost that stream, never the node (or its IO thread).
            log.exception("data port: internal error reading a preface")
            if p.sock in self._pending:
                self._drop_pending(p, "internal error")

    def _handshake(self, p: _Pending) -> bool:
        """Go on with a TLS stream's handshake; True once it is over."""
        try:
            p.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            self._reactor.watch_writable(p.sock, False)
            return False
        except ssl.SSLWantWriteError:
            self._reactor.watch_writable(p.sock, True)
            return False
        except OSError as exc:  # not TLS, or not TLS 1.3: like a bad preface
            self._drop_pending(p, f"no TLS 1.3 handshake: {exc}")
            return False
        p.shaken = True
        self._reactor.watch_writable(p.sock, False)
        return True

    def _start_tls(self, p: _Pending) -> bool:
        """A port that serves TLS and other streams: the first byte says which (a TLS
        handshake record is 0x16, a preface begins with ``P``). True once decided."""
        assert self._tls is not None
        try:
            first = p.sock.recv(1, socket.MSG_PEEK)
        except RETRY:
            return False
        except OSError:
            first = b""
        if not first:
            self._drop_pending(p, "closed before its preface")
            return False
        p.tls = first == _TLS_HANDSHAKE
        if p.tls:
            del self._pending[p.sock]
            self._reactor.unregister(p.sock)
            try:
                p.sock = self._tls.context.wrap_socket(p.sock, server_side=True,
                                                       do_handshake_on_connect=False)
            except OSError as exc:
                self._refuse(p.sock, f"no TLS 1.3 handshake: {exc}")
                return False
            p.shaken = False
            self._pending[p.sock] = p
            self._reactor.register(p.sock, self._preface_reader(p))
        return True

    def _bind(self, p: _Pending, now: float) -> None:
        if p.tls is None and not self._start_tls(p):
            return
        if not p.shaken and not self._handshake(p):
            return
        while True:
            # The magic first: it says how long the preface is (a sealed one has a tag).
            magic = len(proto.STREAM_MAGIC)
            want = magic if len(p.data) < magic else (
                proto.SEALED_PREFACE_BYTES if p.data.startswith(proto.SEALED_MAGIC)
                else proto.PREFACE_BYTES)
            if len(p.data) >= want:
                break
            try:
                chunk = p.sock.recv(want - len(p.data))
            except RETRY:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._drop_pending(p, "closed before its preface")
                return
            p.data += chunk
        data = bytes(p.data)
        sealed = data.startswith(proto.SEALED_MAGIC)
        token = proto.sealed_token_of(data) if sealed else proto.token_of(data)
        if token is None:
            self._drop_pending(p, "not a p2pkv data stream")
            return
        offer = self._offers.get(token)
        owner = None if offer is None else offer.owner
        if offer is not None and offer.key is not None and owner is not None and \
                owner.stream_form() == "sealed" and not (
                    sealed and not p.tls and proto.check_sealed_preface(offer.key, data)):
            # A sealed session's token travels in the clear: only a preface that proves
            # the session's secret uses it up, so a stranger who saw it cannot spend it.
            self._drop_pending(p, "a preface that does not prove its session's key")
            return
        self._offers.pop(token, None)  # used up, whatever follows
        why = self._refusal(p, offer, sealed, now)
        if why is not None:
            self._drop_pending(p, why)
            return
        assert offer is not None and offer.owner is not None
        owner = offer.owner
        self._pending.pop(p.sock, None)
        self._reactor.unregister(p.sock)
        sock = p.sock
        if sealed:
            assert token is not None and offer.key is not None
            sock = SealedSocket(sock, sealer=RecordKeys(offer.key, token, "server"))
        # Bound before the answer goes: a fetch the client sends once it read the answer
        # finds its stream here (the IO thread queues nothing on it before this returns).
        stream = BoundStream(self._reactor, sock, owner)
        owner.bind_stream(stream, offer.index)
        try:
            sock.sendall(proto.ACCEPTED)  # 8 bytes (sealed: 28) into an empty socket buffer
        except OSError as exc:
            stream.close()
            owner.stream_lost(proto.Code.NORMAL_CLOSE,
                              f"the data stream failed as it was bound: {exc}")
            return
        self._counters.add(Count.DATA_STREAMS_BOUND)

    @staticmethod
    def _refusal(p: _Pending, offer: _Offer | None, sealed: bool, now: float) -> str | None:
        """Why the stream of a well-formed preface may not bind (None: it binds)."""
        owner = None if offer is None else offer.owner
        if offer is None or owner is None or now >= offer.expires or \
                not owner.wants_stream(offer.index):
            return "an unknown, used or expired token"
        if p.tls and sealed:
            return "a sealed preface inside TLS (TLS carries the plain one)"
        form = "tls" if p.tls else ("sealed" if sealed else "plain")
        if owner.stream_form() != form:
            return f"a {form} stream for a session whose streams are {owner.stream_form()}"
        return None

    def _drop_pending(self, p: _Pending, why: str) -> None:
        self._pending.pop(p.sock, None)
        self._reactor.unregister(p.sock)
        self._refuse(p.sock, why)

    def _refuse(self, sock: socket.socket, why: str) -> None:
        self._counters.add(Count.DATA_STREAMS_REFUSED)
        try:
            peer = sock.getpeername()
        except OSError:
            peer = "?"
        log.warning("data port: refused a stream from %s: %s", peer, why)
        sock.close()

    def check_deadlines(self, now: float) -> None:
        for p in [p for p in self._pending.values() if now >= p.deadline]:
            self._drop_pending(p, "no preface within the handshake deadline")
        for token in [t for t, o in self._offers.items()
                      if now >= o.expires or (o.owner is not None and o.owner.closed)]:
            del self._offers[token]

    def next_deadline(self) -> float | None:
        times = [p.deadline for p in self._pending.values()]
        times += [o.expires for o in self._offers.values()]
        return min(times, default=None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in list(self._pending.values()):
            self._reactor.unregister(p.sock)
            p.sock.close()
        self._pending.clear()
        self._offers.clear()
        self._reactor.unregister(self._sock)
        self._sock.close()


class BoundStream:
    """One bound stream: messages queued in order, written as the socket takes them.

    The peer never writes on it: readable means it closed or broke the protocol, and
    ``owner.stream_lost`` is told (once). :meth:`close` unpins whatever is queued.
    """

    def __init__(self, reactor: Reactor, sock: socket.socket, owner: StreamOwner) -> None:
        self._reactor = reactor
        self._sock = sock
        self._owner = owner
        self._gather = Gather(sock)
        self._messages = 0
        self._watching = False
        self.closed = False
        # The stall clock: bytes written so far, and since when that count has not moved
        # while bytes were queued (None: not waiting on the reader).
        self._seen_written = 0
        self._waiting_since: float | None = None
        reactor.register(sock, self._on_event)

    @property
    def has_room(self) -> bool:
        """Whether another message may be queued now."""
        return self._messages < _QUEUE_MESSAGES

    @property
    def busy(self) -> bool:
        """Whether bytes are still queued for the kernel."""
        return bool(self._gather)

    def stalled_for(self, now: float) -> float:
        """Seconds the reader has taken no byte while some were queued for it (0 when
        nothing waits or bytes moved since the last call). The peer's connection polls
        it against its send deadline: a consumer that stops reading its stream but keeps
        answering pings would otherwise pin its fetch's blocks for ever."""
        written = self._gather.written_bytes
        if not self._gather or written != self._seen_written:
            self._seen_written = written
            self._waiting_since = now if self._gather else None
            return 0.0
        if self._waiting_since is None:
            self._waiting_since = now
        return now - self._waiting_since

    def push(self, head: bytes, segments: list[memoryview] | None = None,
             done: Callable[[], None] | None = None) -> None:
        """Queue frame 0 ``head`` (and a block message's segments, in order; ``done``
        runs once they are written or dropped)."""
        buffers = [memoryview(proto.frame_prefix(head) + head)]
        if segments:
            buffers.extend(segments)
        self._messages += 1

        def written() -> None:
            self._messages -= 1
            if done is not None:
                done()

        self._gather.push(buffers, written)

    def flush(self) -> None:
        """Write what the socket takes; watch for room when something is left."""
        if self.closed:
            return
        try:
            empty = self._gather.flush()
        except OSError as exc:
            self._lost(proto.Code.NORMAL_CLOSE, f"writing the data stream failed: {exc}")
            return
        if empty == self._watching:
            self._watching = not empty
            self._reactor.watch_writable(self._sock, self._watching)

    def _on_event(self, now: float) -> None:
        if self.closed:
            return
        try:
            self._read_or_write()
        except Exception as exc:
            # A bug must cost one peer, never the node (or its IO thread).
            log.exception("internal error on a data stream")
            self._lost(proto.Code.NORMAL_CLOSE, f"internal error on the data stream: {exc!r}")

    def _read_or_write(self) -> None:
        try:
            data = self._sock.recv(1)
        except RETRY:
            self.flush()
            return
        except OSError as exc:
            self._lost(proto.Code.NORMAL_CLOSE, f"the data stream failed: {exc}")
            return
        if data:
            self._lost(proto.Code.PROTOCOL_VIOLATION,
                       "the peer wrote on its data stream after the preface")
        else:
            self._lost(proto.Code.NORMAL_CLOSE, "the peer closed its data stream")

    def _lost(self, code: int, why: str) -> None:
        self.close()
        self._owner.stream_lost(code, why)

    def close(self) -> None:
        """Drop the stream: everything queued is unpinned, the socket closed."""
        if self.closed:
            return
        self.closed = True
        self._reactor.unregister(self._sock)
        self._gather.drop()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class DataSender:
    """Sends served fetches' blocks on bound streams, within each fetch's credit."""

    def __init__(self, store: BlockStore, segments: tuple[int, ...], bytes_per_block: int,
                 counters: Counters) -> None:
        self._store = store
        self._bpb = bytes_per_block
        self._counters = counters
        self._batch_limit = proto.stream_batch_limit(bytes_per_block, len(segments))

    def send_job(self, session: proto.Session, job: Sending, stream: BoundStream) -> None:
        """Queue what the credit of ``job`` and the stream's queue allow, then write."""
        store = self._store
        n = len(job.keys)
        checksums = session.checksums
        credit = session.window_left(job.req)
        views = store.pool.slot_views
        while credit > 0 and job.next_index < n and stream.has_room and not stream.closed:
            idx, slots = pin_next_slots(store, job, credit, self._batch_limit)
            credit -= len(idx)
            if not idx:
                continue
            unpin = self._unpin(slots)
            try:
                sums = store.slots.checksums(slots) if checksums else None
                head = proto.encode_head(session.block(job.req, idx, sums))
                segments: list[memoryview] = []
                for slot in slots:
                    segments += views(slot)
                stream.push(head, segments, unpin)
            except BaseException:
                unpin()  # whatever went wrong, or the blocks stay pinned forever
                raise
            for i in idx:
                job.outcomes[i] = OUTCOME_SENT
            self._counters.add(Count.BLOCKS_SENT, len(idx))
            self._counters.add(Count.BYTES_SENT, len(idx) * self._bpb)
            self._counters.moved("stream", SENT, len(idx), len(idx) * self._bpb)
        stream.flush()

    def _unpin(self, slots: list[int]) -> Callable[[], None]:
        """Release the pins of ``slots`` once, however many times it is called (written,
        or dropped, or given up when queueing failed)."""
        store = self._store
        held = [slots]

        def unpin() -> None:
            if held:
                store.slots.unpin(held.pop())

        return unpin


class StreamOut:
    """The serving half of ``tcp-data-v1`` for one peer: its bound stream carries the
    blocks and the ``done`` of every fetch that arrived once it was bound."""

    kind = "stream"

    def __init__(self, sender: DataSender, stream: BoundStream) -> None:
        self._sender = sender
        self.stream = stream

    def can_send(self, session: proto.Session, job: Sending) -> bool:
        return self.stream.has_room

    def send(self, session: proto.Session, job: Sending) -> bool:
        # A failed write ends the stream, and its owner's session with it.
        self._sender.send_job(session, job, self.stream)
        return True

    def finish(self, session: proto.Session, job: Sending) -> bool:
        # The done follows the fetch's last block on the same stream (SPEC §18).
        self.stream.push(proto.encode_head(session.fetch_done(job.req, job.outcomes)))
        self.stream.flush()
        return True

    def abort(self, req: int) -> None:
        pass  # what is queued goes out; the client discards a fetch it aborted

    def stalled_for(self, now: float) -> float:
        return self.stream.stalled_for(now)

    @property
    def busy(self) -> bool:
        return self.stream.busy

    def close(self) -> None:
        self.stream.close()  # unpins what it still queued

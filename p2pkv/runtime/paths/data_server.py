"""The serving side of ``tcp-data-v1``: the data port and its tokens.

A peer that negotiated ``tcp-data-v1`` gets, in its ``welcome``, this node's data port
and a fresh random token (:meth:`DataListener.offer`). The token binds the first stream
that presents it to that peer's session, within the handshake deadline, once: a stream
whose preface is not a p2pkv one, whose token is unknown, used already or expired, or
that says nothing in time, is closed unanswered and never touches the pool. A bound
stream (:class:`~p2pkv.runtime.paths.data_sender.BoundStream`) then carries the peer's
blocks (:mod:`p2pkv.runtime.paths.data_sender`).

IO thread only.
"""
from __future__ import annotations

import logging
import secrets
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from p2pkv import protocol as proto
from p2pkv.protocol.codes import DATA_KEY_LEN, DATA_TOKEN_LEN
from p2pkv.protocol.seal import RecordKeys
from p2pkv.runtime.paths.data_sender import BoundStream, StreamOwner
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.stats import Count, Counters
from p2pkv.transport.datachannel import RETRY, tune
from p2pkv.transport.sealed import SealedSocket
from p2pkv.transport.tls import ServerTLS

__all__ = ["DataListener"]

log = logging.getLogger("p2pkv.node")

_ACCEPTS_PER_TURN: Final = 64
_TLS_HANDSHAKE: Final = b"\x16"
"""The first byte of a TLS stream (a handshake record)."""


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

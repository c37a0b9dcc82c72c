"""Opening a connection's data stream (``tcp-data-v1``): dial, present the token, bind.

Right after a handshake that negotiated ``tcp-data-v1`` (and unless the blocks move
through shared memory), the connection opens a plain TCP stream to the data port the
``welcome`` named, at the host it dialed, and sends the token first (the preface). It is
ready once the server answered ``accepted`` within the handshake deadline: the bound
socket then goes to a :class:`~p2pkv.runtime.paths.data_client.StreamIn`, the connection's
data path. Anything less — the capability not negotiated, a relay in between, a port
that does not answer, a token refused — and every block keeps moving over ZeroMQ;
:attr:`StreamDialer.detail` says why, and the fallback is counted.

IO thread only.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from collections.abc import Callable
from enum import Enum

from p2pkv import protocol as proto
from p2pkv.protocol.seal import ANSWER_RECORD_BYTES, RecordKeys, SealError, open_record
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.stats import Count, Counters
from p2pkv.transport.datachannel import RETRY, connect_error, dial, host_of, port_of
from p2pkv.transport.sealed import SealedSocket
from p2pkv.transport.tls import client_context, pin_matches

__all__ = ["StreamDialer"]

log = logging.getLogger("p2pkv.node")


class _State(Enum):
    OFF = "off"
    DIALING = "dialing"  # TCP connecting
    SHAKING = "shaking"  # the TLS handshake (tcp-data-tls-v1)
    SENDING = "sending"  # the preface
    AWAITING = "awaiting"  # the answer
    DONE = "done"


class StreamDialer:
    """Binds one outbound connection's data stream, or says why it stays on ZeroMQ.

    ``bound(sock)`` is called with the bound socket (unregistered, non-blocking),
    ``gave_up()`` when the attempt is over without one; exactly one of them, once, after
    :meth:`begin` returned True. ``index``: which of the session's streams it binds (0:
    the first, with the offer's ``token``; ``k``: ``more[k - 1]``, ``tcp-streams-v1``).
    """

    def __init__(self, reactor: Reactor, counters: Counters, address: str, *,
                 enabled: bool, bound: Callable[[socket.socket], None],
                 gave_up: Callable[[], None], index: int = 0) -> None:
        self.index = index
        self._reactor = reactor
        self._counters = counters
        self._address = address
        self._enabled = enabled
        self._bound = bound
        self._gave_up = gave_up
        self._state = _State.OFF
        self._sock: socket.socket | None = None
        self._deadline = 0.0
        self._out = b""
        self._answer = bytearray()
        #: The certificate pin when the stream is TLS (tcp-data-tls-v1), else None.
        self._pin: bytes | None = None
        #: The keys of the server's records when the stream is sealed (tcp-data-aead-v1).
        self._opener: RecordKeys | None = None
        #: The stream used, or why there is none.
        self.detail = ""
        #: Where the stream goes, and how (``HOST:PORT`` and, for TLS, the pin), once
        #: :meth:`begin` dialed it.
        self.target = ""

    @property
    def pending(self) -> bool:
        """Whether the connection still waits for the stream's verdict."""
        return self._state in (_State.DIALING, _State.SHAKING, _State.SENDING,
                               _State.AWAITING)

    def begin(self, session: proto.Session, deadline: float) -> bool:
        """Right after the handshake: True while a stream is being opened (``bound`` or
        ``gave_up`` follows), False when the connection stays on ZeroMQ."""
        if not self._enabled:
            self.detail = "the data channel is off on this node"
            return False
        offer, why = proto.usable_offer(session.capabilities, session.data_offer,
                                        port_of(self._address))
        if offer is None:
            if proto.CAP_TCP_DATA_V1 in session.capabilities:
                self._fell_back(why)  # negotiated, and still not used
            else:
                self.detail = why
            return False
        host = host_of(self._address)
        try:
            sock = dial(host, offer.port)
        except OSError as exc:
            self._fell_back(f"cannot open a data stream to {host}:{offer.port}: {exc}")
            return False
        self._sock = sock
        self._deadline = deadline
        token = offer.token if self.index == 0 else offer.more[self.index - 1]
        form = proto.stream_form(session.capabilities, offer)
        how = ""
        if form == "sealed":
            assert offer.key is not None
            self._out = proto.sealed_preface(offer.key, token)
            self._opener = RecordKeys(offer.key, token, "server")
            how = ", sealed (AES-256-GCM, keys from the CURVE session)"
        else:
            self._out = proto.preface(token)
            if form == "tls":
                self._pin = offer.cert
                how = ", TLS 1.3, its certificate pinned"
        self._state = _State.DIALING
        which = f"data stream {self.index}" if self.index else "data stream"
        self.target = f"{host}:{offer.port}{how}"
        self.detail = f"{which} to {self.target}"
        self._reactor.register(sock, self._on_event, writable=True)
        return True

    def next_deadline(self) -> float | None:
        """When :meth:`check` gives the stream up, while it is being bound."""
        return self._deadline if self.pending else None

    def check(self, now: float) -> None:
        """A stream not bound by the deadline is given up: blocks stay on ZeroMQ."""
        if self.pending and now >= self._deadline:
            self._give_up("the data port did not answer within the handshake deadline")

    def close(self) -> None:
        """The connection ended while binding: close the socket, call nobody."""
        self._close_socket()
        self._state = _State.DONE

    def _on_event(self, now: float) -> None:
        try:
            state = self._state
            if state is _State.DIALING:
                self._connected()
            elif state is _State.SHAKING:
                self._handshake()
            elif state is _State.SENDING:
                self._send_preface()
            elif state is _State.AWAITING:
                self._read_answer()
        except Exception as exc:
            # A bug must cost the stream, never the node (or its IO thread).
            log.exception("internal error binding the data stream of %s", self._address)
            if self.pending:
                self._give_up(f"internal error while binding the data stream: {exc!r}")

    def _connected(self) -> None:
        """The TCP connection is up (or failed): the TLS handshake, else the preface."""
        sock = self._sock
        assert sock is not None
        err = connect_error(sock)
        if err:
            self._give_up(f"cannot open the data stream: {errno.errorcode.get(err, err)}")
            return
        if self._pin is None:
            self._state = _State.SENDING
            self._send_preface()
            return
        self._reactor.unregister(sock)
        self._sock = client_context().wrap_socket(sock, server_side=False,
                                                  do_handshake_on_connect=False)
        self._reactor.register(self._sock, self._on_event, writable=True)
        self._state = _State.SHAKING
        self._handshake()

    def _handshake(self) -> None:
        """TLS 1.3 with the server, which must present the certificate the welcome
        pinned (else a man in the middle, or another server, answers: no stream)."""
        sock = self._sock
        assert isinstance(sock, ssl.SSLSocket) and self._pin is not None
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._reactor.watch_writable(sock, False)
            return
        except ssl.SSLWantWriteError:
            self._reactor.watch_writable(sock, True)
            return
        except OSError as exc:
            self._give_up(f"the data stream's TLS handshake failed: {exc}")
            return
        if not pin_matches(sock, self._pin):
            self._counters.add(Count.DATA_PINS_REFUSED)
            self._give_up("the data port's certificate is not the one the welcome pinned "
                          "(another server, or a man in the middle, answered)")
            return
        self._state = _State.SENDING
        self._reactor.watch_writable(sock, True)
        self._send_preface()

    def _send_preface(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            sent = sock.send(self._out)
        except RETRY:
            return
        except OSError as exc:
            self._give_up(f"cannot open the data stream: {exc}")
            return
        self._out = self._out[sent:]
        if not self._out:
            self._state = _State.AWAITING
            self._reactor.watch_writable(sock, False)

    def _read_answer(self) -> None:
        sock = self._sock
        assert sock is not None
        # Exactly the answer's bytes: what follows it is the stream's, read by StreamIn.
        size = len(proto.ACCEPTED) if self._opener is None else ANSWER_RECORD_BYTES
        want = size - len(self._answer)
        try:
            got = sock.recv(want)
        except RETRY:
            return
        except OSError as exc:
            self._give_up(f"the data stream failed before it was bound: {exc}")
            return
        if not got:
            self._give_up("the peer closed the data stream without binding it (token "
                          "refused)")
            return
        self._answer += got
        if len(self._answer) < size:
            return
        answer = bytes(self._answer)
        if self._opener is not None:
            try:
                answer = open_record(self._opener, answer)
            except SealError:
                answer = b""  # not sealed by the session's server: a stranger answered
        if answer != proto.ACCEPTED:
            self._give_up("the data port answered something else than p2pkv" +
                          ("" if self._opener is None else
                           " (an answer not sealed with the session's keys)"))
            return
        self._reactor.unregister(sock)
        self._sock = None
        if self._opener is not None:
            sock = SealedSocket(sock, opener=self._opener)
        self._state = _State.DONE
        self._counters.add(Count.DATA_STREAMS_OPENED)
        log.info("%s: blocks move over the data stream%s", self._address,
                 f" {self.index}" if self.index else "")
        self._bound(sock)

    def _give_up(self, why: str) -> None:
        self._close_socket()
        self._state = _State.DONE
        self._fell_back(why)
        self._gave_up()

    def _fell_back(self, why: str) -> None:
        self.detail = why
        self._counters.add(Count.DATA_FALLBACKS)
        log.info("%s: blocks move over ZeroMQ: %s", self._address, why)

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            self._reactor.unregister(sock)
            sock.close()

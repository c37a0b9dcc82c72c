"""ZeroMQ sockets for the node: factories, options, wake-ups and monitors.

Nothing here knows p2pkv messages; the node's runtime (``p2pkv.runtime``) wires these
sockets to the protocol core. All sockets created here are owned by the node's IO thread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket

import zmq
from zmq.utils.monitor import recv_monitor_message

from p2pkv.errors import ConfigError, P2PKVError, PeerGone, TransportHandshakeFailed
from p2pkv.transport.curve import CurveKeys

__all__ = [
    "Wakeup",
    "bound_address",
    "configure_common",
    "cut_connection",
    "handshake_failure",
    "make_dealer",
    "make_router",
    "monitor_events",
    "monitor_failure",
    "monitor_messages",
    "peer_of",
    "server_mechanism",
    "validate_address",
]

_ADDRESS = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-*]+):(\d{1,5})$")

# libzmq counts whole messages against the high-water mark. Credit-based flow control
# keeps every pipe far below this bound; it only exists so a peer that stops reading
# cannot make us queue without limit. ROUTER_MANDATORY turns "HWM reached" and
# "peer gone" into errors instead of silent drops.
_HWM_MESSAGES = 100_000


def validate_address(address: str, *, what: str = "address",
                     option: str | None = None) -> str:
    """Check a ``tcp://HOST:PORT`` address; raise :class:`ConfigError` naming it
    (``what`` in the message, ``option`` as the error's data)."""
    if not isinstance(address, str):
        raise ConfigError(f"{what} must be a string like tcp://127.0.0.1:5555, got "
                          f"{address!r}", option=option, named=False)
    match = _ADDRESS.match(address)
    if match is None:
        raise ConfigError(f"{what} must look like tcp://HOST:PORT, got {address!r}",
                          option=option, named=False)
    port = int(match.group(2))
    if port > 65535:
        raise ConfigError(f"{what} has port {port} out of range 0..65535", option=option,
                          named=False)
    return address


def configure_common(sock: zmq.Socket[bytes], address: str, *, max_message_bytes: int) -> None:
    # LINGER 0: close never blocks; the node finishes or fails in-flight work itself.
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM_MESSAGES)
    sock.setsockopt(zmq.RCVHWM, _HWM_MESSAGES)
    # Enforced by libzmq before Python sees a byte: an oversize frame drops the peer.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if "[" in address:
        sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)


def make_router(ctx: zmq.Context[zmq.Socket[bytes]], listen: str, *, max_message_bytes: int,
                curve: CurveKeys | None = None) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.ROUTER)
    try:
        configure_common(sock, listen, max_message_bytes=max_message_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        host_port = listen
        if listen.endswith(":0"):
            host_port = listen[:-2] + ":*"
        sock.bind(host_port)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise ConfigError(f"cannot listen on {listen!r}: {exc}", option="listen",
                          named=False) from exc
    return sock


def make_dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str, *, max_message_bytes: int,
                curve: CurveKeys | None = None,
                ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A DEALER connected to ``address`` and its monitor socket.

    The monitor is attached before connecting: on loopback ZeroMQ's own handshake can
    fail within microseconds, and an event emitted before a monitor exists is lost.
    """
    sock = ctx.socket(zmq.DEALER)
    configure_common(sock, address, max_message_bytes=max_message_bytes)
    # A connection is one handshake: never let libzmq silently reconnect the same
    # socket to a restarted peer that knows nothing of our session.
    sock.setsockopt(zmq.RECONNECT_IVL, -1)
    if curve is not None:
        if curve.server_key is None:
            sock.close(0)
            raise ConfigError("CURVE client needs the server's public key (server_key)")
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        raise ConfigError(f"cannot connect to {address!r}: {exc}") from exc
    return sock, monitor


def bound_address(sock: zmq.Socket[bytes]) -> str:
    """The address actually bound (ephemeral port resolved), as ``tcp://HOST:PORT``."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


class Wakeup:
    """A self-pipe that API threads write to so the IO thread's poll returns at once.

    ``os.write`` of one byte to a pipe is atomic and thread-safe, unlike sharing a
    ZeroMQ socket between threads.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def notify(self) -> None:
        # A full pipe already guarantees a wake-up.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


def monitor_events(monitor: zmq.Socket[bytes]) -> list[int]:
    """Drain a socket monitor without blocking; return the event codes seen."""
    events: list[int] = []
    while True:
        try:
            message = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
        except zmq.Again:
            return events
        except zmq.ZMQError:
            return events
        events.append(int(message["event"]))


def monitor_messages(monitor: zmq.Socket[bytes]) -> list[tuple[int, int]]:
    """Drain a socket monitor without blocking; return (event, value) pairs."""
    out: list[tuple[int, int]] = []
    while True:
        try:
            message = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again included: nothing more to read
            return out
        out.append((int(message["event"]), int(message["value"])))


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


def handshake_failure(event: int, value: int, *, curve: bool,
                      address: str) -> tuple[str, str] | None:
    """What a failed ZeroMQ security handshake with ``address`` means, from the
    connecting side's monitor event: ``(kind, text)``, or None for any other event.
    ``curve``: whether this side connected with CurveZMQ. The kinds are those of
    :class:`~p2pkv.errors.TransportHandshakeFailed`.

    A server that sees a mechanism mismatch first may hang up before this side read
    its greeting (the event is then "no detail", EPIPE): :func:`server_mechanism` then
    asks the server which mechanism it speaks (a blocking check of at most 0.25 s, on
    this failure path only), so the verdict does not depend on that race.
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        mechanism = server_mechanism(address)
        if mechanism == ("NULL" if curve else "CURVE"):
            event, value = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                            zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        # The server's ZAP handler answered with a status code (400: key not allowed).
        return ("key-rejected",
                f"the server did not accept this node's CURVE public key (ZAP status "
                f"{value}): it is not among the server's authorized client keys")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve:
                return ("curve-not-offered",
                        "security mechanism mismatch: this node connects with CurveZMQ, "
                        "the server speaks plaintext")
            return ("curve-required",
                    "security mechanism mismatch: the server requires CurveZMQ "
                    "encryption, this node connected in plaintext (give it a CURVE key "
                    "pair and the server's public key)")
        name = _protocol_error_name(value)
        return ("protocol", f"ZeroMQ handshake protocol error {name}")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        why = errno.errorcode.get(value, str(value))
        if curve:
            return ("no-answer",
                    f"the server closed the CurveZMQ handshake without an answer ({why}): "
                    "the server public key given is probably not this server's")
        return ("no-answer", f"the server closed the ZeroMQ handshake without an answer "
                             f"({why})")
    return None


def _protocol_error_name(value: int) -> str:
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return f"{name} ({value:#x})"
    return f"{value:#x}"


def peer_of(fd: int) -> tuple[str, int] | None:
    """The remote address of the TCP connection behind libzmq's descriptor ``fd``
    (ZMQ_SRCFD of a received frame), or None when it is not a connected socket."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    finally:
        sock.close()  # closes the duplicate only
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None


def cut_connection(fd: int, peer: tuple[str, int]) -> bool:
    """Shut down the TCP connection behind ``fd`` if it still leads to ``peer``.

    libzmq then closes that connection at once and drops everything it still queued
    for it (zero-copy frames included: their trackers complete). This is the only way
    to take back what a ROUTER queued for one peer that stopped reading: ZeroMQ's own
    heartbeat cannot fire while a send is stuck behind a zero TCP window. The address
    check guards against a descriptor number libzmq already reused.
    """
    if peer_of(fd) != peer:
        return False
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    finally:
        sock.close()
    return True


_ZMTP_SIGNATURE = b"\xff" + b"\0" * 8 + b"\x7f"
_GREETING_BYTES = 64
_MECHANISM = slice(12, 32)


def server_mechanism(address: str, timeout: float = 0.25) -> str | None:
    """The security mechanism (``"NULL"``, ``"CURVE"``, ...) a ZMTP 3 server at
    ``tcp://HOST:PORT`` announces in its greeting, or None when it does not say within
    ``timeout``. Sends only the signature and major version (not a mechanism of its
    own), so the server has nothing to refuse before it sent its greeting."""
    match = _ADDRESS.match(address)
    if match is None:
        return None
    host = match.group(1).strip("[]")
    try:
        with socket.create_connection((host, int(match.group(2))), timeout=timeout) as sock:
            sock.sendall(_ZMTP_SIGNATURE + b"\x03")
            data = b""
            while len(data) < _GREETING_BYTES:
                chunk = sock.recv(_GREETING_BYTES - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    if len(data) < _GREETING_BYTES or data[:1] != b"\xff" or data[9:10] != b"\x7f":
        return None
    return data[_MECHANISM].rstrip(b"\0").decode("ascii", "replace") or None

"""ZeroMQ sockets for the node: factories, options, wake-ups and monitors.

Nothing here knows p2pkv messages; the node's runtime (``p2pkv.runtime``) wires these
sockets to the protocol core. All sockets created here are owned by the node's IO thread.
"""

from __future__ import annotations

import contextlib
import os
import re

import zmq
from zmq.utils.monitor import recv_monitor_message

from p2pkv.errors import ConfigError
from p2pkv.transport.curve import CurveKeys

__all__ = [
    "Wakeup",
    "bound_address",
    "configure_common",
    "make_dealer",
    "make_router",
    "monitor_events",
    "validate_address",
]

_ADDRESS = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-*]+):(\d{1,5})$")

# libzmq counts whole messages against the high-water mark. Credit-based flow control
# keeps every pipe far below this bound; it only exists so a peer that stops reading
# cannot make us queue without limit. ROUTER_MANDATORY turns "HWM reached" and
# "peer gone" into errors instead of silent drops.
_HWM_MESSAGES = 100_000


def validate_address(address: str, *, what: str = "address") -> str:
    """Check a ``tcp://HOST:PORT`` address; raise :class:`ConfigError` naming it."""
    if not isinstance(address, str):
        raise ConfigError(f"{what} must be a string like tcp://127.0.0.1:5555, got {address!r}")
    match = _ADDRESS.match(address)
    if match is None:
        raise ConfigError(f"{what} must look like tcp://HOST:PORT, got {address!r}")
    port = int(match.group(2))
    if port > 65535:
        raise ConfigError(f"{what} has port {port} out of range 0..65535")
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
        raise ConfigError(f"cannot listen on {listen!r}: {exc}") from exc
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

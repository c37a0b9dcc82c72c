"""A TCP relay in front of one holder that can flip bytes, stall, or be a slow link.

The holder registers the relay's address (``serve --advertise``), so every consumer
reaches it through here. :attr:`FaultProxy.mode` is read for every chunk: ``"pass"``
relays unchanged, ``"flip"`` flips one random bit in each chunk the holder sends (block
bytes, frame headers, handshakes alike), ``"stall"`` holds what arrives until the mode
changes. :meth:`FaultProxy.set_rate` makes it a link of that many bytes per second each
way (all connections of one direction share it), or unlimited again. Threads: one
acceptor and, per connection, one that dials the holder and then two pumps, each waiting
at most :data:`TICK` seconds at a time; :meth:`close` stops and joins them all.
``listener`` and ``dial`` replace the listening socket and the connection to the holder
(the partition fault makes both in network namespaces, see
:mod:`p2pkv.bench.chaos.netns`); in ``"pass"`` mode the proxy is a plain relay.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["FaultProxy"]

TICK = 0.1
MODES = ("pass", "flip", "stall")


class FaultProxy:
    """Listens on 127.0.0.1:``port`` (or ``listener``) and relays to
    127.0.0.1:``upstream`` (or to what ``dial`` connects)."""

    def __init__(self, port: int, upstream: int, *, seed: int,
                 listener: socket.socket | None = None,
                 dial: Callable[[], socket.socket] | None = None,
                 rate: float | None = None) -> None:
        self.port = port
        self.upstream = upstream
        self.mode = "pass"
        self.flipped = 0
        self.rate: float | None = None
        #: Per direction (False: to the holder, True: from it), when the link is free.
        self._free_at = {False: 0.0, True: 0.0}
        self.set_rate(rate)
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._dial = dial or (lambda: socket.create_connection(("127.0.0.1", upstream),
                                                               timeout=2))
        self._listener = listener or socket.create_server(("127.0.0.1", port))
        self._listener.settimeout(TICK)
        self._spawn(self._accept, "p2pkv-chaos-accept")

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"proxy mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def set_rate(self, bytes_per_second: float | None) -> None:
        """Limit each direction to ``bytes_per_second`` (None: no limit)."""
        if bytes_per_second is not None and not bytes_per_second > 0:
            raise ValueError(f"proxy rate must be a positive number of bytes per second or "
                             f"None, got {bytes_per_second!r}")
        self.rate = bytes_per_second

    def _pace(self, n: int, from_holder: bool) -> None:
        """Hold ``n`` bytes until a link of :attr:`rate` would have carried them."""
        rate = self.rate
        if rate is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at[from_holder], now)
            self._free_at[from_holder] = start + n / rate
            until = start + n / rate
        while not self._stop.is_set() and time.monotonic() < until:
            time.sleep(max(0.0, min(TICK, until - time.monotonic())))

    def _spawn(self, target: object, name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            # Dialled on a thread of its own: a holder that does not answer (a cut link)
            # must not hold up the next connection.
            self._spawn(self._connect, "p2pkv-chaos-dial", client)

    def _connect(self, client: socket.socket) -> None:
        with self._lock:
            if self._stop.is_set():
                client.close()
                return
            self._sockets.append(client)
        try:
            server = self._dial()
        except OSError:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            return
        for s in (client, server):
            s.settimeout(TICK)
        with self._lock:
            if self._stop.is_set():  # closed while dialling: close() saw no such socket
                server.close()
                return
            self._sockets.append(server)
        self._spawn(self._pump, "p2pkv-chaos-up", client, server, False)
        self._spawn(self._pump, "p2pkv-chaos-down", server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_holder: bool) -> None:
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                while self.mode == "stall" and not self._stop.is_set():
                    time.sleep(TICK / 2)
                self._pace(len(data), from_holder)
                if from_holder and self.mode == "flip":
                    buf = bytearray(data)
                    i = self._rng.randrange(len(buf))
                    buf[i] ^= 1 << self._rng.randrange(8)
                    data = bytes(buf)
                    self.flipped += 1
                self._send_all(dst, data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _send_all(self, dst: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._stop.is_set():
            try:
                sent = dst.send(view)
            except TimeoutError:
                continue
            view = view[sent:]

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._listener.close()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads, sockets = list(self._threads), list(self._sockets)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for s in sockets:
            s.close()

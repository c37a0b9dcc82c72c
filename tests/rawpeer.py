"""Raw ZeroMQ peers for reliability and security tests: no p2pkv.Node on this side.

* :class:`RawPeer`: a DEALER that speaks (or mangles) the wire protocol by hand.
* :class:`SilentRouter`: accepts connections and reads everything, answers nothing.
* :class:`SilentTcp`: accepts TCP connections and never speaks (not even ZMTP).
* :class:`ThrottlingProxy`: a TCP relay that passes a known number of bytes per second
  towards the client, so a test can act mid-transfer without racing a full-speed fetch.
* :class:`CorruptingProxy`: ROUTER facing a client, DEALER to the real server; flips one
  byte in some ``block`` payload frames.
* :class:`GoodPeer`: a well-behaved node that keeps looking up and fetching (byte-exact)
  in a thread while something hostile happens next to it.

Every receive has a timeout; every socket has LINGER 0; every thread stops on ``close``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import select
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
from nodeproc import content

from p2pkv import protocol as proto
from p2pkv.node import Node, PeerHandle
from p2pkv.transport import bound_address

Frames = list[bytes]


def raw_hello(server: Node, name: str = "raw") -> proto.Hello:
    """A hello the server accepts: its own identity under another node id."""
    return dataclasses.replace(server.hello, node=name)


def packed(obj: Any) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


class RawPeer:
    """One DEALER connection to ``address``, driven by hand."""

    def __init__(self, address: str, *, ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 monitor: bool = False, reconnect: bool = False, rcvhwm: int = 0,
                 rcvbuf: int = -1) -> None:
        self._own_ctx = ctx is None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = ctx or zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # floods must not block on our side
        # 0: take everything (floods); small: a reader whose queue fills, so the node's
        # TCP window closes once it stops reading.
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        if not reconnect:
            self.sock.setsockopt(zmq.RECONNECT_IVL, -1)
        self.monitor: zmq.Socket[bytes] | None = None
        if monitor:
            self.monitor = self.sock.get_monitor_socket()
        self.sock.connect(address)
        self.segments: tuple[int, ...] | None = None

    # -- sending

    def send(self, frames: Sequence[bytes], timeout: float = 5.0) -> None:
        """Send one multipart message; raises zmq.Again if it cannot leave in time."""
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.sock.send_multipart(list(frames))

    def send_msg(self, msg: proto.Message) -> None:
        self.send([bytes(f) for f in proto.encode(msg)])

    def send_map(self, head: dict[str, Any], *payload: bytes) -> None:
        self.send([packed(head), *payload])

    # -- receiving

    def recv(self, timeout: float) -> Frames | None:
        """One multipart message, or None when nothing arrives within ``timeout``."""
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        return [bytes(f) for f in self.sock.recv_multipart(zmq.NOBLOCK)]

    def recv_msg(self, timeout: float = 5.0) -> proto.Message:
        """The next message, decoded (payload sizes checked once the handshake is done)."""
        frames = self.recv(timeout)
        assert frames is not None, f"no message from the node within {timeout}s"
        return proto.decode(frames, self.segments)

    def expect(self, kind: type[Any], timeout: float = 5.0) -> Any:
        msg = self.recv_msg(timeout)
        assert type(msg) is kind, f"expected {kind.__name__}, got {msg!r:.300}"
        return msg

    def nothing_within(self, timeout: float) -> bool:
        return self.recv(timeout) is None

    def handshake(self, server: Node, name: str = "raw") -> proto.Welcome:
        self.send_msg(raw_hello(server, name))
        welcome = self.expect(proto.Welcome)
        self.segments = tuple(welcome.geo.seg)
        return welcome  # type: ignore[no-any-return]

    def alive(self, nonce: int = 424242, timeout: float = 5.0) -> bool:
        """Ping the node on this connection; True when the matching pong comes back."""
        self.send_msg(proto.Ping(nonce))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            frames = self.recv(deadline - time.monotonic())
            if frames is None:
                return False
            msg = proto.decode(frames, self.segments)
            if type(msg) is proto.Pong and msg.nonce == nonce:
                return True
        return False

    def monitor_events(self, timeout: float) -> list[int]:
        """Monitor events seen within ``timeout`` (needs ``monitor=True``)."""
        from zmq.utils.monitor import recv_monitor_message

        assert self.monitor is not None
        events: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.monitor.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                break
            events.append(int(recv_monitor_message(self.monitor)["event"]))
            if zmq.EVENT_DISCONNECTED in events:
                break
        return events

    def close(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()


class _BackgroundRouter:
    """A ROUTER bound to an ephemeral loopback port, served by ``_run`` on a thread."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = bound_address(self.sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()


class SilentRouter(_BackgroundRouter):
    """A ROUTER that accepts, reads and ignores everything (a peer that never answers)."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[Frames] = []
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50, zmq.POLLIN):
                self.received.append([bytes(f) for f in self.sock.recv_multipart()])


class FakeServer(_BackgroundRouter):
    """A ROUTER that completes the handshake by hand (a welcome mirroring ``identity``),
    then answers every later message with ``script(msg)`` (default: nothing at all): a
    list of messages, each encoded, or of frame lists sent as they are."""

    def __init__(self, identity: proto.Greeting,
                 script: Callable[[proto.Message], Sequence[proto.Message | list[bytes]]]
                 | None = None) -> None:
        super().__init__()
        self.welcome = proto.Welcome(
            "fake-server", identity.minor, identity.rc, identity.fp, identity.geo,
            identity.khash, identity.caps, identity.limits)
        self.script = script or (lambda msg: [])
        self.received: list[proto.Message] = []
        self.errors: list[str] = []
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.sock.poll(50, zmq.POLLIN):
                    continue
                rid, *frames = self.sock.recv_multipart()
                msg = proto.decode(frames)
                self.received.append(msg)
                replies = [self.welcome] if type(msg) is proto.Hello else self.script(msg)
                for reply in replies:
                    out = reply if isinstance(reply, list) else proto.encode(reply)
                    self.sock.send_multipart([rid, *out])
        except Exception:
            self.errors.append(traceback.format_exc())


class Acceptor:
    """A listening socket on ``listen`` whose connections a thread hands to
    :meth:`serve` (a test's own server, relay or man in the middle); :meth:`start` it,
    :meth:`close` it."""

    def __init__(self, listen: tuple[str, int]) -> None:
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(listen)
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.serve(conn)

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def closed_unanswered(sock: socket.socket, timeout: float = 10.0) -> bool:
    """The peer closed ``sock`` without sending a byte."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


class SilentTcp(Acceptor):
    """A TCP listener that accepts connections and never sends a byte (no ZMTP)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self.start()

    def serve(self, conn: socket.socket) -> None:
        self.accepted.append(conn)

    def close(self) -> None:
        super().close()
        for conn in self.accepted:
            conn.close()


class ThrottlingProxy:
    """A TCP relay to ``upstream`` passing at most ``rate`` bytes/s towards the client.

    A long transfer through it takes a known minimum time, so "the fetch is still
    running" is a fact rather than a race. Bytes towards the server pass unthrottled.
    When either side closes or resets, the relay closes the other side at once and drops
    what it has not delivered, as a crashed or vanished peer would.

    ``upstream_rcvbuf`` fixes the receive buffer of the connection to the server (no
    autotuning), so that little of what the server sends can wait in the kernel.
    ``deliver_on_close``: when the server closes, still deliver (throttled) what it sent
    before, as a network path does, instead of dropping it.
    """

    _CHUNK = 65536

    def __init__(self, upstream: str, rate: float, upstream_rcvbuf: int | None = None, *,
                 deliver_on_close: bool = False, listen: tuple[str, int] = ("127.0.0.1", 0)
                 ) -> None:
        self._deliver_on_close = deliver_on_close
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host.strip("[]"), int(port))
        self._rate = rate
        self._rcvbuf = upstream_rcvbuf
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(listen)
        self.sock.listen(16)
        self.sock.settimeout(0.05)
        shown = f"[{listen[0]}]" if family == socket.AF_INET6 else listen[0]
        self.address = f"tcp://{shown}:{self.sock.getsockname()[1]}"
        self.relayed = 0  # bytes delivered towards clients
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            try:
                server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                if self._rcvbuf is not None:
                    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._rcvbuf)
                server.settimeout(5)
                server.connect(self._upstream)
            except OSError:
                server.close()
                client.close()
                continue
            thread = threading.Thread(target=self._relay, args=(client, server), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        client.setblocking(False)
        server.setblocking(False)
        up = b""  # towards the server
        down = b""  # towards the client
        tokens, last = 0.0, time.monotonic()
        server_done = False
        try:
            while not self._stop.is_set():
                if server_done and not down:
                    return
                now = time.monotonic()
                tokens = min(tokens + (now - last) * self._rate, float(self._CHUNK))
                last = now
                readers = [client]
                # Throttled at the read from the server, or (deliver_on_close) at the
                # write to the client, reading the server eagerly: what it sent before
                # it closed is then already here, and a reset cannot take it away.
                eager = self._deliver_on_close
                if not server_done and (eager or (not down and tokens >= 1)):
                    readers.append(server)
                writers = ([client] if down and (not eager or tokens >= 1) else []) + (
                    [server] if up and not server_done else [])
                r, w, _ = select.select(readers, writers, [], 0.005)
                if client in r:
                    data = client.recv(self._CHUNK)
                    if not data:
                        return
                    up += data
                if server in r:
                    try:
                        data = server.recv(self._CHUNK if eager else int(tokens))
                    except OSError:
                        if not eager:
                            raise
                        data = b""
                    if not data:
                        if not eager:
                            return
                        server_done = True
                    if not eager:
                        tokens -= len(data)
                    down += data
                if down and client in w:
                    n = client.send(down[:int(tokens)] if eager else down)
                    if eager:
                        tokens -= n
                    self.relayed += n
                    down = down[n:]
                if up and server in w:
                    try:
                        up = up[server.send(up):]
                    except OSError:
                        if not eager:
                            raise
                        up, server_done = b"", True
        except OSError:
            return  # a reset on either side ends the relay
        finally:
            for end in (client, server):
                with contextlib.suppress(OSError):
                    end.close()

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self.sock.close()


class CorruptingProxy:
    """Client → ROUTER (this proxy) → DEALER → real server, and back.

    Every ``every``-th block carried in a ``block`` message (counted over the proxy's
    life, starting with the ``first``-th) gets one byte flipped in one of its payload
    frames. ``corrupted`` records the keys of those blocks, found through the client's
    ``fetch`` messages (``req`` → keys) that pass through the proxy.
    """

    def __init__(self, server_address: str, *, every: int = 3, first: int = 1) -> None:
        self.server_address = server_address
        self.every = every
        self.first = first
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.front: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind("tcp://127.0.0.1:*")
        self.address = bound_address(self.front)
        self.corrupted: list[bytes] = []
        self.blocks_seen = 0
        self.errors: list[str] = []
        self._fetch_keys: dict[int, list[bytes]] = {}
        self._backs: dict[bytes, zmq.Socket[bytes]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _back(self, rid: bytes, poller: zmq.Poller) -> zmq.Socket[bytes]:
        sock = self._backs.get(rid)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.server_address)
            self._backs[rid] = sock
            poller.register(sock, zmq.POLLIN)
        return sock

    def _to_server(self, frames: Frames) -> Frames:
        with contextlib.suppress(Exception):
            head = msgpack.unpackb(frames[0], raw=False)
            if isinstance(head, dict) and head.get("t") == "fetch":
                self._fetch_keys[int(head["req"])] = list(head["keys"])
        return frames

    def _to_client(self, frames: Frames) -> Frames | None:
        try:
            head = msgpack.unpackb(frames[0], raw=False)
        except Exception:
            return frames
        if not isinstance(head, dict) or head.get("t") != "block" or len(frames) < 2:
            return frames
        idx = list(head["idx"])
        per_block = (len(frames) - 1) // len(idx)
        keys = self._fetch_keys.get(int(head["req"]), [])
        for n, i in enumerate(idx):
            self.blocks_seen += 1
            if self.blocks_seen < self.first or (self.blocks_seen - self.first) % self.every:
                continue
            if head.get("pk"):  # packed-v1: one frame, the blocks back to back
                bpb = len(frames[1]) // len(idx)
                frame = bytearray(frames[1])
                frame[n * bpb + bpb // 2] ^= 0x5A
                frames[1] = bytes(frame)
            else:
                seg = self.blocks_seen % per_block
                pos = 1 + n * per_block + seg
                frame = bytearray(frames[pos])
                frame[len(frame) // 2] ^= 0x5A
                frames[pos] = bytes(frame)
            if i < len(keys):
                self.corrupted.append(keys[i])
        return frames

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    if sock is self.front:
                        rid, *frames = [bytes(f) for f in self.front.recv_multipart()]
                        self._back(rid, poller).send_multipart(self._to_server(frames))
                        continue
                    frames = [bytes(f) for f in sock.recv_multipart()]
                    rid = next(r for r, s in self._backs.items() if s is sock)
                    out = self._to_client(frames)
                    if out is not None:  # None: a subclass holds the message back
                        self.front.send_multipart([rid, *out])
        except Exception:  # surfaced by the test through .errors
            self.errors.append(traceback.format_exc())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self._backs.values():
            sock.close(0)
        self.front.close(0)
        self.ctx.term()


class GoodPeer:
    """A well-behaved client node that keeps using ``server`` in a background thread.

    Each round: a lookup of every key (all must hit) and a fetch of them into caller
    buffers (all must be STORED and byte-exact). Anything else is recorded in
    ``errors``; :meth:`stop` returns the number of good rounds.
    """

    def __init__(self, client: Node, server_address: str, keys: Sequence[bytes],
                 pause: float = 0.01) -> None:
        self.client = client
        self.keys = list(keys)
        self.pause = pause
        self.peer: PeerHandle = client.connect(server_address)
        self.rounds = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def one_round(self) -> None:
        hits = self.peer.lookup(self.keys, timeout=10)
        if hits != [True] * len(self.keys):
            self.errors.append(f"lookup answered {hits}")
        segs = self.client.layout.segment_sizes
        buffers = [[bytearray(n) for n in segs] for _ in self.keys]
        views: list[list[memoryview]] = [[memoryview(b) for b in bufs] for bufs in buffers]
        result = self.client.fetch_into(self.peer, self.keys, views, timeout=10)
        if result.stored != self.keys:
            self.errors.append(f"fetch outcomes {result.outcomes} errors {result.errors}")
        size = sum(segs)
        for key, bufs in zip(self.keys, buffers, strict=True):
            if b"".join(bufs) != content(key, size):
                self.errors.append(f"block {key.hex()} is not byte-exact")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.one_round()
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                self.rounds += 1
            self._stop.wait(self.pause)

    def stop(self, timeout: float = 30.0) -> int:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the good peer's thread is stuck"
        return self.rounds

    def check(self, min_rounds: int = 1) -> None:
        """Stop; fail when a round went wrong or too few rounds ran."""
        rounds = self.stop()
        assert not self.errors, f"the well-behaved peer saw errors: {self.errors[:5]}"
        assert rounds >= min_rounds, f"the well-behaved peer ran only {rounds} round(s)"


def answer_pings_until_bye(raw: RawPeer, timeout: float) -> tuple[proto.Bye | None, int]:
    """Read the ZeroMQ side, answering every ping, until a ``bye`` (and how many pings
    were answered), or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    pongs = 0
    while time.monotonic() < deadline:
        frames = raw.recv(0.05)
        if frames is None:
            continue
        msg = proto.decode(frames, raw.segments)
        if type(msg) is proto.Ping:
            raw.send_msg(proto.Pong(msg.nonce))
            pongs += 1
        elif type(msg) is proto.Bye:
            return msg, pongs
    return None, pongs


def ipv6_loopback() -> bool:
    """Whether ``::1`` can be bound here."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()

"""Plain TCP streams for bulk bytes: listener, dialing, gather writes, scatter reads.

Nothing here knows p2pkv messages (the stream's format is
:mod:`p2pkv.protocol.datachannel`). Every socket is non-blocking and lives on the
node's IO thread: :class:`Gather` writes queued buffers with ``sendmsg`` straight from
where they are (pool slots, no copy in Python), :class:`Scatter` reads with
``recvmsg_into`` straight into the buffers it is given (store slots, caller buffers).
The kernel copies each byte once on each side; these classes only keep the place.

Where the compiled helper was built, :func:`scatter_for` gives a plain stream its
compiled twin (``p2pkv._fastcopy.Scatter``): the same places, but one call receives a
whole burst with the GIL released, and hashes each block piece by piece as it lands,
while it is still in cache.
"""

from __future__ import annotations

import bisect
import collections
import errno
import itertools
import logging
import operator
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias

from p2pkv.errors import ConfigError
from p2pkv.transport.sealed import SealedSocket

try:
    from p2pkv._fastcopy import Scatter as NativeScatter
except ImportError:  # no compiled helper: every stream scatters in Python
    NativeScatter = None  # type: ignore[assignment,misc]

__all__ = [
    "IOV_MAX",
    "NATIVE_SCATTER",
    "RETRY",
    "SOCKET_BUFFER",
    "AnyScatter",
    "Gather",
    "Scatter",
    "connect_error",
    "dial",
    "host_of",
    "listen",
    "pending",
    "port_of",
    "recvmsg_into",
    "scatter_for",
    "sendmsg",
    "tune",
]

log = logging.getLogger("p2pkv.node")

IOV_MAX: Final = 1000
"""Buffers per ``sendmsg``/``recvmsg_into`` call (Linux allows 1024)."""
SOCKET_BUFFER: Final = 4 << 20
"""SO_SNDBUF / SO_RCVBUF of every data stream (the kernel-ceiling benchmark's too)."""

RETRY: Final = (BlockingIOError, InterruptedError, ssl.SSLWantReadError,
                ssl.SSLWantWriteError)
"""What a non-blocking stream raises when it cannot move bytes now (TLS included)."""
NATIVE_SCATTER: bool = NativeScatter is not None
"""Whether plain streams receive with the compiled Scatter (False: the Python one)."""

_TLS_WRITE: Final = 256 << 10
"""Bytes one TLS write takes at most: a write that must be retried is retried with the
same bytes (OpenSSL's rule), so each is a fixed slice of the buffer."""

_NBYTES = operator.attrgetter("nbytes")


def pending(sock: socket.socket) -> int:
    """Bytes a TLS or sealed stream holds decrypted already (the poller cannot see
    them); 0 for a plain stream."""
    if isinstance(sock, (ssl.SSLSocket, SealedSocket)):
        return sock.pending()
    return 0


def sendmsg(sock: socket.socket, iov: Sequence[memoryview]) -> int:
    """Write ``iov`` in order as far as the socket takes it: one ``sendmsg`` on a plain
    stream; TLS records one buffer after the other on a TLS stream (whose sockets have
    no ``sendmsg``); whole sealed records on a sealed stream. Raises :data:`RETRY`
    when nothing could be written."""
    if isinstance(sock, SealedSocket):
        return sock.send_records(iov)
    if not isinstance(sock, ssl.SSLSocket):
        return sock.sendmsg(iov, (), socket.MSG_NOSIGNAL)
    sent = 0
    for view in iov:
        while view.nbytes:
            part = view[:_TLS_WRITE]
            try:
                n = sock.send(part)
            except RETRY:
                if sent:
                    return sent
                raise
            sent += n
            if n < part.nbytes:
                return sent
            view = view[n:]
    return sent


def recvmsg_into(sock: socket.socket, iov: Sequence[memoryview]) -> int:
    """Fill ``iov`` in order with what the socket holds: one ``recvmsg_into`` on a plain
    stream; on a TLS stream, TLS records decrypted straight into the buffers one after
    the other (no copy either way); on a sealed stream, records opened into them. 0:
    the peer closed the stream. Raises :data:`RETRY` when nothing is there now."""
    if isinstance(sock, SealedSocket):
        return sock.recv_records(iov)
    if not isinstance(sock, ssl.SSLSocket):
        return sock.recvmsg_into(iov)[0]
    got = 0
    for view in iov:
        while view.nbytes:
            try:
                n = sock.recv_into(view)
            except RETRY:
                if got:
                    return got
                raise
            if n == 0:
                return got
            got += n
            view = view[n:]
    return got


def host_of(address: str) -> str:
    """The host of a ``tcp://HOST:PORT`` address, as ``socket`` takes it (``*`` is every
    IPv4 interface, brackets of an IPv6 host are dropped)."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    if host == "*":
        return "0.0.0.0"
    return host.strip("[]")


def port_of(address: str) -> int:
    """The port of a ``tcp://HOST:PORT`` address."""
    return int(address.rsplit(":", 1)[1])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tune(sock: socket.socket) -> None:
    """No Nagle delay, fixed buffers of :data:`SOCKET_BUFFER`, non-blocking."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def listen(host: str, port: int, *, backlog: int = 128) -> socket.socket:
    """A non-blocking listening socket on ``host:port`` (0: an ephemeral port);
    ConfigError naming the option ``data_port`` when it cannot be bound."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen for data streams on {host}:{port}: {exc}",
                          option="data_port", named=False) from exc
    return sock


def dial(host: str, port: int) -> socket.socket:
    """A non-blocking socket connecting to ``host:port``; writable once connected (then
    :func:`connect_error` says whether it worked). OSError when it cannot even start."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        tune(sock)
        code = sock.connect_ex((host, port))
    except OSError:
        sock.close()
        raise
    if code not in (0, errno.EINPROGRESS, errno.EAGAIN):
        sock.close()
        raise OSError(code, f"connect to {host}:{port}: {errno.errorcode.get(code, code)}")
    return sock


def connect_error(sock: socket.socket) -> int:
    """0 once a :func:`dial`\\ ed socket is connected, else the errno of its failure."""
    return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))


class Gather:
    """Buffers queued for one stream, written in order with ``sendmsg``.

    Each :meth:`push` is one unit (a message): its ``done`` callback runs exactly once,
    when its last byte went to the kernel or when the queue is dropped (the stream
    failed or closed): whoever pinned the buffers unpins them there.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        # [buffers, index of the first unsent one, done callback]
        self._queue: collections.deque[tuple[list[memoryview], list[int],
                                             Callable[[], None] | None]] = (
            collections.deque())
        self.queued_bytes = 0
        #: Bytes the kernel took so far (whether the reader makes progress).
        self.written_bytes = 0

    def __bool__(self) -> bool:
        """Whether something is still to be written."""
        return bool(self._queue)

    def push(self, buffers: Sequence[memoryview], done: Callable[[], None] | None = None
             ) -> None:
        views = [b for b in buffers if b.nbytes]
        self._queue.append((views, [0], done))
        self.queued_bytes += sum(v.nbytes for v in views)

    def flush(self) -> bool:
        """Write what the socket takes now; True once the queue is empty. OSError when
        the stream failed (the caller drops it)."""
        queue = self._queue
        while queue:
            iov: list[memoryview] = []
            for views, at, _ in queue:
                iov.extend(views[at[0]:at[0] + IOV_MAX - len(iov)])
                if len(iov) >= IOV_MAX:
                    break
            try:
                sent = sendmsg(self._sock, iov)
            except RETRY:
                return False
            self.queued_bytes -= sent
            self.written_bytes += sent
            self._advance(sent)
        return True

    def _advance(self, sent: int) -> None:
        queue = self._queue
        while sent and queue:
            views, at, done = queue[0]
            while sent and at[0] < len(views):
                view = views[at[0]]
                if sent >= view.nbytes:
                    sent -= view.nbytes
                    at[0] += 1
                else:
                    views[at[0]] = view[sent:]
                    sent = 0
            if at[0] < len(views):
                return
            queue.popleft()
            if done is not None:
                done()
        while queue and queue[0][1][0] >= len(queue[0][0]):  # empty units
            _, _, done = queue.popleft()
            if done is not None:
                done()

    def drop(self) -> None:
        """Forget everything queued; every unit's ``done`` runs (IO thread)."""
        queue, self._queue = self._queue, collections.deque()
        self.queued_bytes = 0
        for _, _, done in queue:
            if done is not None:
                try:
                    done()
                except Exception:  # a bug in one; every other unit's must still run
                    log.exception("data stream: a dropped unit's completion failed")


class Scatter:
    """Where the next bytes of one stream go: a list of buffers, filled in order with
    ``recvmsg_into``.

    ``tail`` (optional) is a buffer offered after the last one, so that the bytes that
    follow (the next message's header) arrive with the same call; :attr:`spilled` says
    how many went there.

    The buffers' end offsets are summed once, so a receive finds its buffers and moves
    past them by bisection and slicing: a message of 512 blocks of 16 KiB costs no
    Python step per buffer per receive.
    """

    __slots__ = ("_at", "_ends", "_views", "filled", "spilled", "total")

    #: Blocks are hashed by whoever settles them (the compiled twin hashes as they land).
    sums: list[int] | None = None

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.filled = 0
        self.spilled = 0
        self._place(views)

    def _place(self, views: Sequence[memoryview]) -> None:
        sizes = list(map(_NBYTES, views))
        if 0 in sizes:  # empty buffers take no part
            views, sizes = [v for v in views if v.nbytes], [n for n in sizes if n]
        self._views = list(views)
        #: Stream offset (from the start of this scatter) at which each buffer ends.
        self._ends = list(itertools.accumulate(sizes, initial=self.filled))[1:]
        self._at = 0  # the first buffer not filled yet
        self.total = self._ends[-1] if self._ends else self.filled

    @property
    def done(self) -> bool:
        return self.filled >= self.total

    def _first(self) -> memoryview:
        """What is left of the first buffer not filled yet."""
        at = self._at
        view = self._views[at]
        start = self._ends[at] - view.nbytes
        return view[self.filled - start:] if self.filled > start else view

    def receive(self, sock: socket.socket, tail: memoryview | None = None,
                limit: int = 1 << 62) -> int | None:
        """One ``recvmsg_into`` of at most about ``limit`` bytes (whole buffers, at least
        one): bytes received (0: the peer closed the stream), None when nothing is there
        now. OSError when the stream failed."""
        at, ends = self._at, self._ends
        # The last buffer taken is the first one that reaches ``limit`` bytes.
        last = min(bisect.bisect_left(ends, self.filled + limit, at), len(ends) - 1,
                   at + IOV_MAX - 1)
        iov = [self._first(), *self._views[at + 1:last + 1]] if at < len(ends) else []
        if tail is not None and last == len(ends) - 1:
            iov.append(tail)
        try:
            got = recvmsg_into(sock, iov)
        except RETRY:
            return None
        rest = self.total - self.filled
        self.spilled = max(0, got - rest)
        self._advance(min(got, rest))
        return got

    def _advance(self, n: int) -> None:
        self.filled += n
        self._at = bisect.bisect_right(self._ends, self.filled, self._at)

    def put(self, data: memoryview) -> int:
        """Copy already-received bytes (read ahead with an earlier header) into the next
        buffers; how many were taken."""
        taken = 0
        while taken < data.nbytes and not self.done:
            view = self._first()
            n = min(view.nbytes, data.nbytes - taken)
            view[:n] = data[taken:taken + n]
            taken += n
            self._advance(n)
        return taken


AnyScatter: TypeAlias = "Scatter | NativeScatter"


def scatter_for(sock: socket.socket | None, views: Sequence[memoryview], block: int = 0
                ) -> AnyScatter:
    """Where a payload read from ``sock`` lands: ``views`` in order. On a plain stream
    where the compiled helper was built, its Scatter, which also hashes every ``block``
    bytes as one block while they are in cache (``block`` 0: no hashing) and lists the
    sums in ``sums``; otherwise (TLS and sealed streams, no helper) the Python one, whose
    ``sums`` is None (the blocks are hashed when they settle)."""
    if NATIVE_SCATTER and type(sock) is socket.socket:
        return NativeScatter(views, block)
    return Scatter(views)

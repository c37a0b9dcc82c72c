"""The fetching half of ``tcp-data-v1``: land what a bound data stream carries.

Once :class:`~p2pkv.runtime.paths.data_dial.StreamDialer` bound the stream, a
:class:`StreamIn` is the connection's data path (the ``stream`` kind of
:mod:`p2pkv.runtime.paths`). Every message on it is a length-prefixed frame 0, fed to
the session through the same door as one from ZeroMQ (``deliver``); a ``block`` the
session accepted is followed by its blocks' bytes back to back, which ``recvmsg_into``
scatters straight into their destinations (store slots that lookups cannot see yet,
or caller buffers): one kernel copy, nothing copied in Python but the few bytes read
ahead with a header. A message arrives over several loop turns; every block is settled
(:class:`~p2pkv.runtime.paths.landing.Landing`: checksum, commit or drop, its key's outcome)
as soon as its last byte landed. Where the compiled scatter receives a plain stream
(:func:`~p2pkv.transport.datachannel.scatter_for`), the blocks bound for the store are
hashed piece by piece as they land, while in cache, and the store checks those sums.
Whatever is left of a message whose fetch was cancelled, timed out or is being aborted
goes to scratch, and the slots it opened are freed, so nothing more reaches its
buffers. The end of a bound stream ends the connection (every waiting fetch fails); it
never hangs one.

IO thread only.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from p2pkv import protocol as proto
from p2pkv.errors import P2PKVError, P2PKVProtocolError, PeerGone, ProtocolError
from p2pkv.protocol.seal import SealError
from p2pkv.runtime.paths.landing import Landed, Landing
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.state import Receiving, writable
from p2pkv.runtime.stats import RECEIVED, Count, Counters
from p2pkv.runtime.tuning import READ_BURST_BYTES, WAKE_BYTES
from p2pkv.transport.datachannel import RETRY, AnyScatter, pending, recvmsg_into, scatter_for
from p2pkv.transport.sealed import SealedSocket

__all__ = ["DataReceiver", "StreamIn", "StreamOwner", "Striped"]

log = logging.getLogger("p2pkv.node")

_LOOKAHEAD: Final = 16 << 10
"""Bytes read after a message's payload in the same call, for the next header (the
header of a full 1024-block message is ~12 KiB)."""


_RECEIVE_CHUNK: Final = WAKE_BYTES
"""Bytes one receive takes at most, unless a block is larger: as many as a stream waits
for before it wakes (2 MiB). The compiled scatter takes them in ``recvmsg`` pieces of
256 KiB and hashes each as it lands; the Python one hashes the blocks after the call."""


@dataclass(eq=False)
class StreamOwner:
    """What a stream calls back into: its outbound connection."""

    #: The running fetch of a request id, or None (finished, cancelled, timed out).
    fetch_of: Callable[[int], Receiving | None]
    #: Feed one frame 0 read on the stream to the session; returns its output.
    deliver: Callable[[bytes, proto.Payload, float], proto.Output]
    #: The stream ended or carried a violation: the connection ends with this error.
    lost: Callable[[P2PKVError], None]


class DataReceiver:
    """What the data streams of this node's outbound connections share."""

    def __init__(self, reactor: Reactor, landing: Landing, segments: Sequence[int],
                 counters: Counters, budget: proto.CreditBudget, *, enabled: bool,
                 streams: int = 1) -> None:
        self.reactor = reactor
        self.landing = landing
        self.segments = tuple(segments)
        self.bpb = sum(self.segments)
        #: Bytes one receive takes at most (whole blocks): each block is hashed right
        #: after it landed, while it is still in cache.
        self.chunk = max(self.bpb, _RECEIVE_CHUNK)
        self.counters = counters
        #: A connection on a stream has a larger budget (SPEC §18.3).
        self.budget = budget
        self.enabled = enabled
        #: How many data streams to open to a peer that takes several (tcp-streams-v1).
        self.streams = streams

    def stream(self, address: str, sock: socket.socket, owner: StreamOwner,
               detail: str) -> StreamIn:
        """The data path of a connection whose stream ``sock`` was just bound."""
        return StreamIn(self, address, sock, owner, detail)


@dataclass(eq=False)
class _Incoming:
    """The message whose payload is being received."""

    req: int
    recv: Receiving | None
    #: Into caller buffers: each block's destination (None: nowhere to land).
    blocks: list[Landed | None]
    scatter: AnyScatter | None  # None: skipping
    skip: int = 0  # bytes still to skip (scatter None)
    settled: int = 0  # blocks of the message settled (or given up) so far
    views: list[memoryview] = field(default_factory=list)
    #: Into the store: the blocks' key indices, store slots (-1: nowhere to land) and
    #: announced checksums, as arrays (no object per block).
    kis: list[int] = field(default_factory=list)
    slots: list[int] | None = None
    sums: tuple[int | None, ...] = ()


class _StreamPayload:
    """What follows a frame 0 read on the stream (a :class:`~p2pkv.protocol.Payload`)."""

    count = None

    def __init__(self, link: StreamIn) -> None:
        self._link = link
        self.discarded = False

    def follows(self) -> bool:
        return False  # only a block has a payload, and the session knows which is one

    def land(self, arrived: proto.DataArrived) -> None:
        self._link.land(arrived)

    def discard(self) -> None:
        self.discarded = True


class StreamIn:
    """One outbound connection's bound data stream, as its data path (IO thread only)."""

    kind = "stream"
    lanes = 1

    def __init__(self, parts: DataReceiver, address: str, sock: socket.socket,
                 owner: StreamOwner, detail: str) -> None:
        self._parts = parts
        self._address = address
        self._owner = owner
        self._sock: socket.socket | None = sock
        self._closed = False
        self._ahead = bytearray(_LOOKAHEAD)
        self._a0 = self._a1 = 0
        self._incoming: _Incoming | None = None
        self._scratch: bytearray | None = None
        self._lowat = 1
        self.budget = parts.budget
        #: How blocks move on this connection.
        self.detail = detail
        parts.reactor.register(sock, self._on_event)

    # -- the data path -------------------------------------------------------------------

    def open_fetch(self, session: proto.Session, keys: tuple[bytes, ...], window: int,
                   now: float, deadline: float, lane: int = 0) -> proto.Fetch:
        return session.fetch(keys, window, now, deadline=deadline)

    def land(self, arrived: proto.DataArrived) -> None:
        """The session accepted a block message: open where its blocks land (its bytes
        follow on the stream, over as many loop turns as they take)."""
        assert isinstance(arrived, proto.BlockArrived)
        recv = self._owner.fetch_of(arrived.req)
        nbytes = len(arrived.idx) * self._parts.bpb
        with writable(recv, recv) as ok:
            if not ok or recv is None:
                self._incoming = _Incoming(arrived.req, None, [], None, skip=nbytes)
                return
            landing = self._parts.landing
            kis = [recv.index_map[i] for i in arrived.idx]
            views: list[memoryview] = []
            if recv.destinations is None:
                slots = landing.open_slots(recv, kis)
                if min(slots, default=0) >= 0:  # each has its slot: no Python step per block
                    views = list(itertools.chain.from_iterable(landing.views_of_slots(slots)))
                else:
                    for slot in slots:
                        views += landing.slot_views(slot) if slot >= 0 else self._scratch_block()
                # The blocks the peer sent sums for are hashed as they land, if the
                # stream can (the store then checks those sums, not the slots again).
                hashed = self._parts.bpb if arrived.sums.count(None) < len(arrived.sums) else 0
                self._incoming = _Incoming(arrived.req, recv, [],
                                           scatter_for(self._sock, views, hashed),
                                           kis=kis, slots=slots, sums=arrived.sums)
                return
            blocks = landing.open_kept(recv, kis, arrived.sums)
        for block in blocks:
            views.extend(block.views if block is not None else self._scratch_block())
        self._incoming = _Incoming(arrived.req, recv, blocks, scatter_for(self._sock, views))

    def settled(self, session: proto.Session,
                ev: proto.BlockArrived | proto.BlocksLocated) -> list[proto.Message]:
        return []

    def cancel(self, req: int) -> None:
        """Whatever is left of the message being received for ``req`` goes to scratch,
        and the slots it opened are freed now, not at its next byte."""
        inc = self._incoming
        if inc is not None and inc.req == req and inc.scatter is not None:
            self._give_up_message(inc)

    def read_pending(self, now: float) -> None:
        """The ZeroMQ connection ended: handle what the stream still holds first."""
        if not self._closed:
            self._on_event(now)

    def _on_event(self, now: float) -> None:
        try:
            self._read(now)
        except (P2PKVProtocolError, PeerGone) as exc:
            self._lose(exc)
        except SealError as exc:
            self._parts.counters.add(Count.DATA_RECORDS_REFUSED)
            self._lose(PeerGone(f"{self._address}: the sealed data stream failed: {exc}"))
        except OSError as exc:
            self._lose(PeerGone(f"{self._address}: the data stream failed: {exc}"))
        except Exception as exc:
            # A bug must cost one connection, never the node (or its IO thread).
            log.exception("internal error on the data stream of %s", self._address)
            self._lose(P2PKVError(f"internal error on the data stream: {exc!r}"))

    # -- reading -------------------------------------------------------------------------

    def _read(self, now: float) -> None:
        # Bytes read ahead are always handled (the poller cannot know of them), and so
        # are bytes a TLS stream decrypted already; the socket is read until a burst's
        # worth came in, then the others get a turn.
        budget = READ_BURST_BYTES
        sock = self._sock
        while not self._closed:
            more = budget > 0 or (sock is not None and pending(sock) > 0)
            if self._incoming is None:
                if self._next_header(now, may_read=more):
                    continue
                break
            if not more:
                break
            got = self._receive()
            if got is None:
                break
            budget -= got
        if not self._closed:
            self._wake_at(self._expected())

    def _expected(self) -> int:
        """Bytes of the current message's payload still to come (the peer sends them
        whole: a sender that stalls is cut by its own deadline, which ends the stream)."""
        inc = self._incoming
        if inc is None:
            return 1
        if inc.scatter is None:
            return max(inc.skip, 1)
        return max(inc.scatter.total - inc.scatter.filled, 1)

    def _wake_at(self, nbytes: int) -> None:
        """Let the poller wake this stream only once ``nbytes`` (at most
        :data:`~p2pkv.runtime.tuning.WAKE_BYTES`) are there to read (``SO_RCVLOWAT``): a
        receiver faster than its sender otherwise wakes for every few kilobytes, and pays
        the loop's per-receive work each time. Only bytes promised by the message under
        way are waited for, so the wait always ends."""
        sock = self._sock
        if sock is None or isinstance(sock, ssl.SSLSocket):
            return
        if isinstance(sock, SealedSocket):  # its bytes come in records
            nbytes = sock.promised(nbytes)
        want = min(nbytes, WAKE_BYTES)
        if want == self._lowat:
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        self._lowat = want

    def _next_header(self, now: float, *, may_read: bool) -> bool:
        """Deliver the next frame 0 if it is all here (True), else read more when
        allowed (False when nothing more is there now, or reading must wait)."""
        ahead, a0, a1 = self._ahead, self._a0, self._a1
        prefix = proto.FRAME_PREFIX.size
        if a1 - a0 >= prefix:
            n = proto.frame_length(memoryview(ahead)[a0:a0 + prefix])
            if a1 - a0 >= prefix + n:
                head = bytes(ahead[a0 + prefix:a0 + prefix + n])
                self._a0 = a0 + prefix + n
                if self._a0 == self._a1:
                    self._a0 = self._a1 = 0
                self._deliver(head, now)
                return True
            if prefix + n > len(ahead):
                self._ahead = ahead = ahead + bytearray(prefix + n - len(ahead))
        if not may_read:
            return False
        if a0:
            ahead[:a1 - a0] = ahead[a0:a1]
            self._a0, self._a1 = 0, a1 - a0
        sock = self._sock
        assert sock is not None
        try:
            got = sock.recv_into(memoryview(ahead)[self._a1:])
        except RETRY:
            return False
        if got == 0:
            raise PeerGone(f"{self._address} closed the data stream")
        self._a1 += got
        return True

    def _deliver(self, head: bytes, now: float) -> None:
        payload = _StreamPayload(self)
        out = self._owner.deliver(head, payload, now)
        if self._closed or not payload.discarded:
            self._continue()
            return
        # A block the session discards (its fetch is over or being aborted): skip it.
        skip = sum(len(ev.idx) for ev in out.events if type(ev) is proto.BlockDiscarded)
        if not skip:
            raise ProtocolError(proto.Code.UNEXPECTED, "data stream: a block that was "
                                "neither accepted nor discarded")
        self._incoming = _Incoming(0, None, [], None, skip=skip * self._parts.bpb)
        self._continue()

    def _continue(self) -> None:
        """Hand the bytes read ahead with the header to the message just begun."""
        inc = self._incoming
        if inc is None:
            return
        rest = memoryview(self._ahead)[self._a0:self._a1]
        if rest.nbytes:
            taken = self._take(inc, rest)
            self._a0 += taken
        if self._a0 == self._a1:
            self._a0 = self._a1 = 0

    def _take(self, inc: _Incoming, data: memoryview) -> int:
        with self._locked(inc):
            if inc.scatter is not None:
                n = inc.scatter.put(data)
                self._settle(inc)
                return n
        n = min(inc.skip, data.nbytes)
        inc.skip -= n
        if not inc.skip:
            self._incoming = None
        return n

    def _receive(self) -> int | None:
        """One receive into the current message (and the next header after it)."""
        inc = self._incoming
        sock = self._sock
        assert inc is not None and sock is not None
        tail = memoryview(self._ahead)
        with self._locked(inc):
            if inc.scatter is not None:
                got = inc.scatter.receive(sock, tail, self._parts.chunk)
                if got is None:
                    return None
                if got == 0:
                    raise PeerGone(f"{self._address} closed the data stream")
                self._a1 = inc.scatter.spilled
                self._settle(inc)
                return got
        scratch = memoryview(self._scratch_bytes())
        n = min(inc.skip, scratch.nbytes)
        # The next header may follow only once the skipped bytes end in this call.
        iov = [scratch[:n], tail] if n == inc.skip else [scratch[:n]]
        try:
            got = recvmsg_into(sock, iov)
        except RETRY:
            return None
        if got == 0:
            raise PeerGone(f"{self._address} closed the data stream")
        used = min(n, got)
        inc.skip -= used
        if not inc.skip:
            self._incoming = None
        self._a1 = got - used
        return got

    @contextlib.contextmanager
    def _locked(self, inc: _Incoming) -> Iterator[None]:
        """Hold the fetch's ticket lock while its buffers are written; a fetch that was
        cancelled, or is no longer running, gets nothing more (the rest is skipped)."""
        if inc.recv is None:
            yield  # skipping already
            return
        with writable(inc.recv, self._owner.fetch_of(inc.req)) as ok:
            if not ok:
                self._give_up_message(inc)
            yield

    def _give_up_message(self, inc: _Incoming) -> None:
        """The rest of the message goes nowhere; the slots it opened are freed."""
        if inc.scatter is None:
            return
        self._abandon_rest(inc)
        inc.skip = inc.scatter.total - inc.scatter.filled
        inc.scatter = None
        inc.recv = None
        inc.settled = len(inc.blocks)
        self._incoming = inc if inc.skip else None

    def _settle(self, inc: _Incoming) -> None:
        """Settle every block of ``inc`` whose bytes are all here."""
        scatter = inc.scatter
        if scatter is None or inc.recv is None:
            if scatter is None and not inc.skip:
                self._incoming = None
            return
        complete = scatter.filled // self._parts.bpb
        if complete > inc.settled and inc.slots is not None:
            self._settle_slots(inc, complete)
        elif complete > inc.settled:
            ready = [b for b in inc.blocks[inc.settled:complete] if b is not None]
            inc.settled = complete
            if ready:
                landing = self._parts.landing
                try:
                    with landing.guard():
                        landed = landing.settle_many(inc.recv, ready)
                except BaseException:
                    landing.abandon(ready)  # whatever happened, no slot stays open
                    raise
                self._parts.counters.moved(self.kind, RECEIVED, landed,
                                           landed * self._parts.bpb)
        if scatter.done:
            self._incoming = None

    def _settle_slots(self, inc: _Incoming, complete: int) -> None:
        """Commit the store slots of blocks ``inc.settled`` to ``complete``, all here."""
        assert inc.slots is not None and inc.recv is not None
        start, inc.settled = inc.settled, complete
        slots, kis, sums = inc.slots[start:complete], inc.kis[start:complete], \
            inc.sums[start:complete]
        actual = inc.scatter.sums if inc.scatter is not None else None
        if actual is not None:
            actual = actual[start:complete]
        if min(slots) < 0:  # some had nowhere to land (settled when opened)
            kept = [i for i, slot in enumerate(slots) if slot >= 0]
            slots, kis, sums = [slots[i] for i in kept], [kis[i] for i in kept], \
                tuple(sums[i] for i in kept)
            if actual is not None:
                actual = [actual[i] for i in kept]
            if not slots:
                return
        landing = self._parts.landing
        try:
            with landing.guard():
                landed = landing.settle_slots(inc.recv, kis, slots, sums, actual)
        except BaseException:
            landing.abandon_slots(inc.recv, kis, slots)  # whatever happened, none stays open
            raise
        self._parts.counters.moved(self.kind, RECEIVED, landed, landed * self._parts.bpb)

    def _abandon_rest(self, inc: _Incoming) -> None:
        """Free what ``inc`` opened and did not settle."""
        landing = self._parts.landing
        if inc.slots is None:
            landing.abandon(inc.blocks[inc.settled:])
        elif inc.recv is not None:
            landing.abandon_slots(inc.recv, inc.kis[inc.settled:], inc.slots[inc.settled:])

    def _scratch_bytes(self) -> bytearray:
        if self._scratch is None:
            self._scratch = bytearray(max(max(self._parts.segments), 1 << 20))
        return self._scratch

    def _scratch_block(self) -> list[memoryview]:
        view = memoryview(self._scratch_bytes())
        return [view[:size] for size in self._parts.segments]

    # -- the end -------------------------------------------------------------------------

    def _lose(self, exc: P2PKVError) -> None:
        if not self._closed:
            self.close()
            self._owner.lost(exc)

    def close(self) -> None:
        """Close the stream (the connection ended): the slots of a message still being
        received are freed. Idempotent."""
        inc, self._incoming = self._incoming, None
        if inc is not None and inc.scatter is not None:
            self._abandon_rest(inc)
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            self._parts.reactor.unregister(sock)
            sock.close()


class Striped:
    """Several bound data streams of one connection as its data path (``tcp-streams-v1``,
    SPEC §18.6): a caller's fetch is striped over them, one protocol fetch per stream
    (a lane), each naming its stream, so that each stream carries its fetch's blocks and
    its ``done`` in order. Each stream lands what it carries (:class:`StreamIn`)."""

    kind = "stream"

    def __init__(self, streams: dict[int, StreamIn], budget: proto.CreditBudget,
                 detail: str) -> None:
        self._indices = sorted(streams)
        self._streams = [streams[i] for i in self._indices]
        self.lanes = len(self._streams)
        #: The streams share one budget, as large as theirs together.
        self.budget = budget
        self.detail = detail

    def open_fetch(self, session: proto.Session, keys: tuple[bytes, ...], window: int,
                   now: float, deadline: float, lane: int = 0) -> proto.Fetch:
        return session.fetch(keys, window, now, deadline=deadline,
                             stream=self._indices[lane % self.lanes])

    def land(self, arrived: proto.DataArrived) -> None:
        raise AssertionError("each stream lands what it carries")  # pragma: no cover

    def settled(self, session: proto.Session,
                ev: proto.BlockArrived | proto.BlocksLocated) -> list[proto.Message]:
        return []

    def cancel(self, req: int) -> None:
        for stream in self._streams:
            stream.cancel(req)

    def read_pending(self, now: float) -> None:
        for stream in self._streams:
            stream.read_pending(now)

    def close(self) -> None:
        for stream in self._streams:
            stream.close()

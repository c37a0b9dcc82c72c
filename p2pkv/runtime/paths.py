"""The data path of a connection: a fetching half chosen once per connection, and a
serving half chosen for each fetch as it arrives (a connection keeps a default one).

Blocks move one of four ways, each a *path* with a fetching half (on the connection this
node opened) and a serving half (on a peer connected to its ROUTER):

============  ==============================  =======================================
kind          serving half                    fetching half
============  ==============================  =======================================
``zmq``       :class:`FramesOut`: one frame   :class:`FramesIn`: ``recv_into`` each
              per segment, zero-copy, pinned  frame into its destination
              until libzmq lets go
``packed``    :class:`PackedOut`: a batch in  :class:`FramesIn` too: ``packed-v1`` is
              one frame (``packed-v1``)       a form of frames the sender picks per
                                              message (SPEC §17)
``shm``       ``SharedOut``: slots located    ``SharedIn``: copied from the peer's
              in the shared pool, pinned      mapped pool, then released
              until released (``shm-v1``)
``stream``    ``StreamOut``: gathered onto    ``StreamIn``: scattered from the stream
              the peer's bound data stream    straight into destinations
              (``tcp-data-v1``, or TLS:       (``Striped``: several streams, a
              ``tcp-data-tls-v1``)            fetch striped over them)
============  ==============================  =======================================

A connection asks its path, never which path it is on. The fetching half is chosen when
the connection becomes ready (:class:`~p2pkv.runtime.path_choice.PathChoice`): shared
memory once the proof was accepted, else the data streams once bound, else frames. The
serving half of a fetch is chosen when the fetch arrives (its
:attr:`~p2pkv.runtime.state.Sending.path`): shared memory when the fetch asked for it
after an accepted proof, else the stream it names when that one is bound
(``tcp-streams-v1``), else the connection's path (its first bound stream; packed frames
when ``packed-v1`` was negotiated and the layout packs; frames).

Each half owns what differs between the ways: the credit budget (a stream gets a larger
one, SPEC §18.3), how a fetch opens, sending and landing, what a landing sends back, a
cancelled fetch's bytes, stalls, close, and the counts of what it moved
(:meth:`~p2pkv.runtime.stats.Counters.moved`, one shape for every path). Protocol errors
of the peer go back through the session's one door, as they did: a half raises the
:class:`~p2pkv.errors.ProtocolError` inside :meth:`~p2pkv.protocol.Session.receive_data`
(frames, shared memory) or hands it to its connection, which closes with it (stream).

IO thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final, Protocol

import zmq

from p2pkv import protocol as proto
from p2pkv.runtime.receiver import Receiver
from p2pkv.runtime.sender import Sender
from p2pkv.runtime.state import Receiving, Sending, writable
from p2pkv.runtime.stats import PATH_KINDS, RECEIVED, Counters

__all__ = [
    "HANDLE_PATHS",
    "KINDS",
    "FetchPath",
    "FramesIn",
    "FramesOut",
    "PackedOut",
    "ServePath",
    "serving_frames",
]

KINDS: Final = PATH_KINDS
"""Every path's kind, the keys of ``NodeStats.paths`` and the ``path`` label of the
``p2pkv_bytes_*_by_path_total`` metrics."""

Arrived = proto.BlockArrived | proto.BlocksLocated
"""What a fetching half lands: the blocks of a ``block`` or of a ``located``."""

HANDLE_PATHS: Final = {"zmq": "tcp", "packed": "tcp", "shm": "shm", "stream": "tcp-data"}
"""``PeerHandle.data_path`` of a connection whose fetching half is of that kind."""


class FetchPath(Protocol):
    """The fetching half of a connection's data path."""

    #: One of :data:`KINDS`.
    kind: str
    #: How blocks move on this connection and why (``PeerHandle.data_path_detail``).
    detail: str
    #: How much data the fetches of this connection may have in flight together.
    budget: proto.CreditBudget
    #: Over how many lanes a caller's fetch is striped (several data streams: one
    #: protocol fetch per stream; 1 for every other path).
    lanes: int

    def open_fetch(self, session: proto.Session, keys: tuple[bytes, ...], window: int,
                   now: float, deadline: float, lane: int = 0) -> proto.Fetch:
        """Open a fetch in the session, asking for this path (``fetch``, the shared
        form, or a fetch naming the stream of ``lane``); the caller sends it."""

    def land(self, arrived: proto.DataArrived) -> None:
        """Land the blocks of a message the session accepted (called from inside
        :meth:`~p2pkv.protocol.Session.receive_data`), into its fetch's destinations
        while the fetch may be written (:func:`~p2pkv.runtime.state.writable`), or
        nowhere. Raises the peer's :class:`~p2pkv.errors.ProtocolError`."""

    def settled(self, session: proto.Session, ev: Arrived) -> list[proto.Message]:
        """What goes back to the peer once the session reported ``ev`` landed."""

    def cancel(self, req: int) -> None:
        """Fetch ``req`` was cancelled or is over: drop whatever of it is in progress."""

    def read_pending(self, now: float) -> None:
        """The ZeroMQ connection ended: handle what this path still holds first."""

    def close(self) -> None:
        """The connection ended: release what the path holds. Idempotent."""


class ServePath(Protocol):
    """The serving half of a data path (one per peer, shared by its fetches)."""

    kind: str

    def can_send(self, session: proto.Session, job: Sending) -> bool:
        """Whether the path has room for more of ``job`` now (its credit aside)."""

    def send(self, session: proto.Session, job: Sending) -> bool:
        """Send what the credit of ``job`` (and the path's room) allows. False: the peer
        is unreachable (the caller drops it; what failed was unpinned)."""

    def finish(self, session: proto.Session, job: Sending) -> bool:
        """Send the ``done`` of a job whose every key was handled, after its blocks."""

    def abort(self, req: int) -> None:
        """Fetch ``req`` was aborted: unpin whatever the peer still held of it."""

    def stalled_for(self, now: float) -> float:
        """Seconds the peer has taken nothing of what waits for it on this path, while
        blocks stay pinned for it (0: nothing waits, or it moved). Its connection cuts
        it at the send deadline (``send_timeout``)."""

    @property
    def busy(self) -> bool:
        """Whether bytes are still queued on the path."""

    def close(self) -> None:
        """The peer is gone: release what the path holds. Idempotent."""


class FramesIn:
    """Blocks in ZeroMQ frames on the connection's DEALER, plain or packed."""

    kind = "zmq"
    lanes = 1

    def __init__(self, receiver: Receiver, sock: zmq.Socket[bytes],
                 fetch_of: Callable[[int], Receiving | None], budget: proto.CreditBudget,
                 counters: Counters, bytes_per_block: int) -> None:
        self._receiver = receiver
        self._sock = sock
        self._fetch_of = fetch_of
        self._counters = counters
        self._bpb = bytes_per_block
        self.budget = budget
        self.detail = ""

    def open_fetch(self, session: proto.Session, keys: tuple[bytes, ...], window: int,
                   now: float, deadline: float, lane: int = 0) -> proto.Fetch:
        return session.fetch(keys, window, now, deadline=deadline)

    def land(self, arrived: proto.DataArrived) -> None:
        assert isinstance(arrived, proto.BlockArrived)
        recv = self._fetch_of(arrived.req)
        # A cancelled fetch's frames are read and dropped: its buffers get nothing.
        with writable(recv, recv) as ok:
            landed = self._receiver.land(self._sock, recv if ok else None, arrived)
        self._counters.moved("packed" if arrived.packed else "zmq", RECEIVED, landed,
                             landed * self._bpb)

    def settled(self, session: proto.Session, ev: Arrived) -> list[proto.Message]:
        return []

    def cancel(self, req: int) -> None:
        pass  # a message is landed whole, within one call: nothing is left in progress

    def read_pending(self, now: float) -> None:
        pass  # the connection reads its DEALER itself

    def close(self) -> None:
        pass  # the DEALER is the connection's


class FramesOut:
    """Blocks in ZeroMQ frames on the ROUTER: zero-copy, one frame per segment."""

    kind = "zmq"
    packed = False

    def __init__(self, sender: Sender, rid: bytes,
                 send: Callable[[Iterable[proto.Message]], bool]) -> None:
        self._sender = sender
        self._rid = rid
        self._send = send

    def can_send(self, session: proto.Session, job: Sending) -> bool:
        return True  # libzmq queues (bounded by the peer's credit)

    def send(self, session: proto.Session, job: Sending) -> bool:
        return self._sender.send_job(self._rid, session, job, packed=self.packed,
                                     kind=self.kind)

    def finish(self, session: proto.Session, job: Sending) -> bool:
        return self._send([session.fetch_done(job.req, job.outcomes)])

    def abort(self, req: int) -> None:
        pass  # what libzmq still holds is unpinned as libzmq lets go of it

    def stalled_for(self, now: float) -> float:
        # A reader that stops taking its frames (and keeps pinging) leaves them pinned
        # in libzmq's queue; the ledger sees no tracker finish.
        return self._sender.ledger.stalled_for(self._rid, now)

    @property
    def busy(self) -> bool:
        return False

    def close(self) -> None:
        # The ROUTER's ledger unpins as libzmq lets go (the cut peer's queue is dropped).
        self._sender.ledger.forget(self._rid)


class PackedOut(FramesOut):
    """Blocks of a batch copied into one ZeroMQ frame (``packed-v1``, SPEC §17): chosen
    when the peer accepts it and every segment is small enough to be copied anyway."""

    kind = "packed"
    packed = True

    def stalled_for(self, now: float) -> float:
        return 0.0  # packed blocks are copied and unpinned at once: nothing stays pinned


def serving_frames(sender: Sender, rid: bytes, session: proto.Session,
                   send: Callable[[Iterable[proto.Message]], bool]) -> FramesOut:
    """The ZeroMQ half for a peer whose handshake was just accepted: packed when both
    sides take ``packed-v1`` and this pool's blocks pack."""
    kind = PackedOut if session.packed_blocks and sender.packs else FramesOut
    return kind(sender, rid, send)

"""The ZeroMQ halves of a data path: :class:`FramesIn` (blocks ``recv_into`` their
destinations from the connection's DEALER, plain or packed), :class:`FramesOut` (one
frame per segment on the ROUTER, zero-copy, pinned until libzmq lets go) and
:class:`PackedOut` (a batch copied into one frame, ``packed-v1``); the kinds of every
path. The two halves' interfaces are in :mod:`p2pkv.runtime.paths.interfaces`.

IO thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

import zmq

from p2pkv import protocol as proto
from p2pkv.runtime.paths.interfaces import Arrived, Sending
from p2pkv.runtime.paths.receiver import Receiver
from p2pkv.runtime.paths.sender import Sender
from p2pkv.runtime.state import Receiving, writable
from p2pkv.runtime.stats import PATH_KINDS, RECEIVED, Counters

__all__ = ["HANDLE_PATHS", "KINDS", "FramesIn", "FramesOut", "PackedOut", "serving_frames"]

KINDS: Final = PATH_KINDS
"""Every path's kind, the keys of ``NodeStats.paths`` and the ``path`` label of the
``p2pkv_bytes_*_by_path_total`` metrics."""

HANDLE_PATHS: Final = {"zmq": "tcp", "packed": "tcp", "shm": "shm", "stream": "tcp-data",
                        "nixl": "nixl"}
"""``PeerHandle.data_path`` of a connection whose fetching half is of that kind."""


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

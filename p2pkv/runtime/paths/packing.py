"""Capability ``packed-v1`` on the data path: a batch of blocks as one payload frame.

Small segments are copied into libzmq anyway (below
:data:`~p2pkv.runtime.tuning.ZERO_COPY_MIN`), so joining them into one frame costs no
extra copy, and each side then handles one frame per message instead of one per segment
(64 for a batch of 16 KiB blocks, 12 for a seed V2 block). The sender joins the
segments of every block of a batch, block-major, unpins the blocks at once (the bytes
were copied) and sends the frame without another copy. The receiver takes the frame as
libzmq received it, takes the batch's slots in one store call, copies each block's
segments into its slot and commits the batch in one store call, every block checked
against its checksum (``protocol/SPEC.md`` §17; settled by
:class:`~p2pkv.runtime.paths.landing.Landing`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Final

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import MAX_PACKED_BYTES
from p2pkv.runtime.paths.landing import Landed, Landing
from p2pkv.runtime.state import Receiving
from p2pkv.runtime.tuning import ZERO_COPY_MIN
from p2pkv.store import BlockReader, BlockStore

__all__ = ["STAGING_KEPT", "PackedReceiver", "PackedSender", "packs", "start_message"]

log = logging.getLogger("p2pkv.node")

STAGING_KEPT: Final = 32
"""Idle staging buffers a sender keeps for reuse (each one batch of blocks, <= 1 MiB)."""


def packs(segments: Sequence[int]) -> bool:
    """Whether blocks of ``segments`` travel packed when the peer accepts it: every
    segment would be copied into libzmq anyway, and a block fits one packed frame."""
    return max(segments) < ZERO_COPY_MIN and sum(segments) <= MAX_PACKED_BYTES


def start_message(sock: zmq.Socket[bytes], rid: bytes, head: bytes) -> bool:
    """Send the routing id and frame 0 of a message to peer ``rid`` on the ROUTER, its
    payload frames to follow (``SNDMORE``). False, logged, when the peer is unreachable:
    nothing was sent."""
    try:
        sock.send(rid, zmq.SNDMORE | zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        log.info("peer %s unreachable while sending (%s); dropping it", rid.hex(), exc)
        return False
    # ROUTER accepts the rest of a multipart once its first frame went through.
    sock.send(head, zmq.SNDMORE)
    return True


class PackedSender:
    """Sends packed block messages from reusable staging buffers.

    A fresh 1 MiB ``bytes`` per message would cost a page fault on most of its pages (the
    allocator hands large blocks back to the kernel on free), more than the copy itself.
    So each message is assembled in a staging buffer, sent without a copy and tracked;
    the buffer is reused once libzmq let go of it (trackers finish in send order). At
    most :data:`STAGING_KEPT` idle buffers are kept.
    """

    def __init__(self, sock: zmq.Socket[bytes], store: BlockStore, capacity: int) -> None:
        self._sock = sock
        self._store = store
        self._capacity = capacity
        self._free: list[bytearray] = []
        self._inflight: collections.deque[tuple[zmq.MessageTracker, bytearray]] = (
            collections.deque())

    def __bool__(self) -> bool:
        """Whether a buffer is still held by libzmq."""
        return bool(self._inflight)

    def reap(self) -> None:
        q = self._inflight
        while q and q[0][0].done:
            buf = q.popleft()[1]
            if len(self._free) < STAGING_KEPT:
                self._free.append(buf)

    def send(self, rid: bytes, head: bytes, readers: list[BlockReader]) -> bool:
        """``head``, then the segments of ``readers`` in one frame; the blocks are
        unpinned once copied. False: the peer is unreachable."""
        self.reap()
        buf = self._free.pop() if self._free else bytearray(self._capacity)
        view = memoryview(buf)
        off = 0
        try:
            for reader in readers:
                for seg in reader.views:
                    end = off + seg.nbytes
                    view[off:end] = seg
                    off = end
        finally:
            self._store.release_many(readers)
        sock = self._sock
        if not start_message(sock, rid, head):
            self._free.append(buf)
            return False
        self._inflight.append((sock.send(view[:off], 0, copy=False, track=True), buf))
        return True


class PackedReceiver:
    """Lands packed block messages (the receiving half of ``packed-v1``)."""

    def __init__(self, landing: Landing, segments: Sequence[int], bytes_per_block: int) -> None:
        self._landing = landing
        self._segments = tuple(segments)
        self._bpb = bytes_per_block

    def land(self, sock: zmq.Socket[bytes], recv: Receiving | None,
             msg: proto.BlockArrived) -> int:
        """Receive the one payload frame of ``msg`` and land its blocks (inside the
        caller's :meth:`Landing.guard`): the blocks landed. Raises the framing violation
        when the message does not carry what its header announced."""
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise ProtocolError(proto.Code.FRAME_COUNT,
                                "packed block message carries no payload frame") from None
        if sock.getsockopt(zmq.RCVMORE):
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv(zmq.NOBLOCK)
            raise ProtocolError(proto.Code.FRAME_COUNT,
                                "packed block message carries more than one payload frame")
        data = frame.buffer
        bpb = self._bpb
        if data.nbytes != len(msg.idx) * bpb:
            raise ProtocolError(proto.Code.FRAME_COUNT,
                                f"packed payload frame is {data.nbytes} bytes, "
                                f"{len(msg.idx)} block(s) need {len(msg.idx) * bpb}")
        if recv is None:
            return 0  # the fetch is gone or cancelled; nothing to land
        # The session checked every index against the fetch, so index_map holds it.
        kis = [recv.index_map[i] for i in msg.idx]
        placed: list[Landed] = []
        off = 0
        for block in self._landing.open_many(recv, kis, msg.sums):
            if block is not None:
                o = off
                for view, size in zip(block.views, self._segments, strict=True):
                    view[:] = data[o:o + size]
                    o += size
                placed.append(block)
            off += bpb
        return self._landing.settle_many(recv, placed)

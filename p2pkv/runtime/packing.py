"""Capability ``packed-v1`` on the data path: a batch of blocks as one payload frame.

Small segments are copied into libzmq anyway (below
:data:`~p2pkv.runtime.tuning.ZERO_COPY_MIN`), so joining them into one frame costs no
extra copy, and each side then handles one frame per message instead of one per segment
(64 for a batch of 16 KiB blocks, 12 for a seed V2 block). The sender joins the
segments of every block of a batch, block-major, unpins the blocks at once (the bytes
were copied) and sends the frame without another copy. The receiver takes the frame as
libzmq received it, takes the batch's slots in one store call, copies each block's
segments into its slot and commits the batch in one store call, every block checked
against its checksum (``protocol/SPEC.md`` §17).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Final

import zmq

from p2pkv import protocol as proto
from p2pkv.checksum import block_checksum
from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import MAX_PACKED_BYTES
from p2pkv.runtime.public import KeyOutcome
from p2pkv.runtime.state import Receiving
from p2pkv.runtime.stats import Counters
from p2pkv.runtime.tuning import ZERO_COPY_MIN
from p2pkv.store import BlockReader, BlockStore, BlockWriter

__all__ = ["STAGING_KEPT", "PackedReceiver", "PackedSender", "packs"]

log = logging.getLogger("p2pkv.node")

STAGING_KEPT: Final = 32
"""Idle staging buffers a sender keeps for reuse (each one batch of blocks, <= 1 MiB)."""


def packs(segments: Sequence[int]) -> bool:
    """Whether blocks of ``segments`` travel packed when the peer accepts it: every
    segment would be copied into libzmq anyway, and a block fits one packed frame."""
    return max(segments) < ZERO_COPY_MIN and sum(segments) <= MAX_PACKED_BYTES


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
        try:
            sock.send(rid, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._free.append(buf)
            log.info("peer %s unreachable while sending (%s); dropping it", rid.hex(), exc)
            return False
        # ROUTER accepts the rest of a multipart once its first frame went through.
        sock.send(head, zmq.SNDMORE)
        self._inflight.append((sock.send(view[:off], 0, copy=False, track=True), buf))
        return True


class PackedReceiver:
    """Lands packed block messages (the receiving half of ``packed-v1``)."""

    def __init__(self, store: BlockStore, segments: Sequence[int], bytes_per_block: int,
                 counters: Counters) -> None:
        self._store = store
        self._segments = tuple(segments)
        self._bpb = bytes_per_block
        self._counters = counters

    def land(self, sock: zmq.Socket[bytes], recv: Receiving | None,
             msg: proto.Block, writers: list[BlockWriter]) -> ProtocolError | None:
        """Receive the one payload frame of ``msg`` and land its blocks; the framing
        violation when the message does not carry what its header announced. Every
        writer opened is appended to ``writers``: the caller aborts those left open if
        anything goes wrong (no slot stays "being written")."""
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return ProtocolError(proto.Code.FRAME_COUNT,
                                 "packed block message carries no payload frame")
        if sock.getsockopt(zmq.RCVMORE):
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv(zmq.NOBLOCK)
            return ProtocolError(proto.Code.FRAME_COUNT,
                                 "packed block message carries more than one payload frame")
        data = frame.buffer
        bpb = self._bpb
        if data.nbytes != len(msg.idx) * bpb:
            return ProtocolError(proto.Code.FRAME_COUNT,
                                 f"packed payload frame is {data.nbytes} bytes, "
                                 f"{len(msg.idx)} block(s) need {len(msg.idx) * bpb}")
        if recv is None:
            return None  # the fetch is gone (timed out here); nothing to land
        # The session checked every index against the fetch, so index_map holds it.
        kis = [recv.index_map[i] for i in msg.idx]
        if recv.destinations is not None:
            landed = self._land_into(recv, kis, data, msg.sums)
        else:
            landed = self._land_in_store(recv, kis, data, msg.sums, writers)
        self._counters.add("blocks_received", landed)
        self._counters.add("bytes_received", landed * bpb)
        return None

    def _land_in_store(self, recv: Receiving, kis: list[int], data: memoryview,
                       sums: Sequence[int | None], writers: list[BlockWriter]) -> int:
        store, segments, bpb = self._store, self._segments, self._bpb
        opened = store.begin_write_many([recv.keys[k] for k in kis])
        writers.extend(w for w in opened if isinstance(w, BlockWriter))
        committing: list[BlockWriter] = []
        wanted: list[int | None] = []
        placed: list[int] = []
        off = 0
        for ki, writer, want in zip(kis, opened, sums, strict=True):
            if isinstance(writer, BlockWriter):
                if len(segments) == 1:
                    writer.views[0][:] = data[off:off + bpb]
                else:
                    o = off
                    for view, size in zip(writer.views, segments, strict=True):
                        view[:] = data[o:o + size]
                        o += size
                committing.append(writer)
                wanted.append(want)
                placed.append(ki)
            elif writer is None:
                self._not_written(recv, ki,
                                  "the block was being written by another fetch at the time")
            else:
                self._not_written(recv, ki, f"no slot in the local pool: {writer}")
            off += bpb
        landed = 0
        for ki, mismatch in zip(placed, store.commit_many(committing, wanted), strict=True):
            if mismatch is None:
                recv.outcomes[ki] = KeyOutcome.STORED
                landed += 1
            else:
                self._counters.add("checksum_failures")
                recv.outcomes[ki] = KeyOutcome.FAILED
                recv.errors[ki] = f"block dropped: {mismatch}"
        recv.blocks += landed
        recv.nbytes += landed * bpb
        return landed

    def _not_written(self, recv: Receiving, ki: int, why: str) -> None:
        if self._store.contains(recv.keys[ki]):
            # Another fetch stored the same block meanwhile: it is here.
            recv.outcomes[ki] = KeyOutcome.STORED
            recv.errors.pop(ki, None)
        else:
            recv.outcomes[ki] = KeyOutcome.FAILED
            recv.errors[ki] = why

    def _land_into(self, recv: Receiving, kis: list[int], data: memoryview,
                   sums: Sequence[int | None]) -> int:
        """Into caller-owned buffers (``fetch_into``), each block checked."""
        assert recv.destinations is not None
        segments, bpb = self._segments, self._bpb
        landed = 0
        off = 0
        for ki, want in zip(kis, sums, strict=True):
            views = recv.destinations[ki]
            o = off
            for view, size in zip(views, segments, strict=True):
                view[:] = data[o:o + size]
                o += size
            off += bpb
            if want is not None and block_checksum(views) != want:
                self._counters.add("checksum_failures")
                recv.outcomes[ki] = KeyOutcome.FAILED
                recv.errors[ki] = "block dropped: checksum mismatch"
                continue
            recv.outcomes[ki] = KeyOutcome.STORED
            landed += 1
        recv.blocks += landed
        recv.nbytes += landed * bpb
        return landed

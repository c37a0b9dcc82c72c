"""The serving side's data path: batches of blocks sent zero-copy from the pool.

Each block's segments go to ZeroMQ straight from the pool with ``copy=False``; segments
under :data:`~p2pkv.runtime.tuning.ZERO_COPY_MIN` are copied into libzmq instead (cheaper
than tracking them). A sent block stays pinned in the store (so it is never evicted or
overwritten) until ZeroMQ's trackers say libzmq let go of every zero-copy frame of its
message; the :class:`SendLedger` keeps those pins in send order, per peer, and releases
them.

How many blocks go out, and in which batches, is decided by the session's window and
:mod:`p2pkv.protocol.flow`; this module only moves them.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Protocol

import zmq

from p2pkv import protocol as proto
from p2pkv.protocol.codes import OUTCOME_MISSING, OUTCOME_SENT
from p2pkv.runtime.paths.interfaces import Sending
from p2pkv.runtime.paths.packing import PackedSender, packs, start_message
from p2pkv.runtime.stats import SENT, Count, Counters
from p2pkv.runtime.tuning import REAP_TICK_MS, ZERO_COPY_MIN
from p2pkv.store import BlockReader, BlockStore

__all__ = ["SendLedger", "Sender", "Tracker", "send_payload"]


class Tracker(Protocol):
    """What the ledger reads of a :class:`zmq.MessageTracker`."""

    @property
    def done(self) -> bool: ...


def _let_go(trackers: Sequence[Tracker]) -> bool:
    return all(t.done for t in trackers)


class SendLedger:
    """Blocks handed to ZeroMQ without a copy, pinned until libzmq let go of them.

    One queue per peer (routing id), released from its front: a message is unpinned once
    it and every earlier message of that peer are let go (a late release, never an early
    one, should libzmq let go out of order). Connections progress independently, so a
    peer that stops reading holds back only its own pins, never those of the others.
    """

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        # rid -> (trackers, readers) in send order; released once libzmq let go of every
        # zero-copy frame of the message.
        self._inflight: dict[bytes, collections.deque[
            tuple[Sequence[Tracker], list[BlockReader]]]] = {}
        # rid -> since when none of its messages was let go while some waited.
        self._progress: dict[bytes, float] = {}

    def __bool__(self) -> bool:
        return bool(self._inflight)

    def hold(self, rid: bytes, trackers: Sequence[Tracker],
             readers: list[BlockReader]) -> None:
        """Keep ``readers`` pinned until every one of ``trackers`` (those of the message's
        zero-copy frames) is done."""
        queue = self._inflight.get(rid)
        if queue is None:
            queue = self._inflight[rid] = collections.deque()
            self._progress[rid] = time.monotonic()
        queue.append((trackers, readers))

    def reap(self) -> None:
        """Unpin every message libzmq has released (in send order, per peer)."""
        now = time.monotonic()
        for rid, q in list(self._inflight.items()):
            if q and _let_go(q[0][0]):
                self._progress[rid] = now
            while q and _let_go(q[0][0]):
                self._store.release_many(q.popleft()[1])
            if not q:
                del self._inflight[rid]
                self._progress.pop(rid, None)

    def stalled_for(self, rid: bytes, now: float) -> float:
        """Seconds libzmq has let go of none of peer ``rid``'s messages while some were
        pinned for it (0: none pinned). A reader that stops taking its frames but keeps
        pinging would otherwise hold them pinned for as long as it lives."""
        since = self._progress.get(rid)
        return 0.0 if since is None else max(0.0, now - since)

    def forget(self, rid: bytes) -> None:
        """The peer is gone: its pins go as libzmq drops its queue (reaped), but it no
        longer counts as stalled."""
        self._progress.pop(rid, None)

    def release_all(self) -> None:
        """Unpin everything; the socket was closed with LINGER 0, so ZeroMQ dropped it."""
        for q in self._inflight.values():
            while q:
                self._store.release_many(q.popleft()[1])
        self._inflight.clear()
        self._progress.clear()


class Sender:
    """Sends the blocks of served fetches on the ROUTER, within each fetch's credit."""

    def __init__(self, sock: zmq.Socket[bytes], store: BlockStore, bytes_per_block: int,
                 counters: Counters) -> None:
        self._sock = sock
        self._store = store
        self._bpb = bytes_per_block
        self._batch_limit = proto.batch_limit(bytes_per_block)
        self._counters = counters
        #: Whether this pool's blocks travel packed to a peer that accepts packed-v1.
        self.packs = packs(store.pool.segment_sizes)
        self.packed = PackedSender(sock, store, self._batch_limit * bytes_per_block)
        self.ledger = SendLedger(store)

    def busy_wait_ms(self) -> int | None:
        # Sent blocks stay pinned until reaped. Any arriving message (credit) wakes the
        # loop anyway; this slower tick only bounds how long the last ones wait, without
        # spinning a core that the receiving side may need.
        return REAP_TICK_MS if self.ledger else None

    def send_job(self, rid: bytes, session: proto.Session, job: Sending, *, packed: bool,
                 kind: str) -> bool:
        """Send what the credit of ``job`` allows, packed or not (the path of ``kind``
        decided, see :mod:`p2pkv.runtime.paths`). False: the peer is unreachable (the
        caller drops it); the blocks of the failed message were unpinned."""
        store = self._store
        n = len(job.keys)
        checksums = session.checksums
        credit = session.window_left(job.req)
        while credit > 0 and job.next_index < n:
            # Pin the next candidates in one store call; a missing key uses no credit,
            # so a batch may come out smaller than the credit and the loop goes on.
            idx, readers = pin_next_batch(store, job, credit, self._batch_limit)
            credit -= len(idx)
            if not idx:
                continue
            try:
                sums = [r.checksum for r in readers] if checksums else None
                head = proto.encode_head(session.block(job.req, idx, sums, packed=packed))
                # A packed message copies the blocks and unpins them at once; a plain
                # one hands them to the ledger until ZeroMQ lets go.
                sent = (self.packed.send(rid, head, readers) if packed
                        else self._send_message(rid, head, readers))
            except BaseException:
                # Not handed to the ledger: unpin here, whatever went wrong, or the
                # blocks stay pinned forever (never evicted, never overwritten).
                self._store.release_many(readers)
                raise
            if not sent:
                return False
            for i in idx:
                job.outcomes[i] = OUTCOME_SENT
            self._counters.add(Count.BLOCKS_SENT, len(idx))
            self._counters.add(Count.BYTES_SENT, len(idx) * self._bpb)
            self._counters.moved(kind, SENT, len(idx), len(idx) * self._bpb)
        return True

    def _send_message(self, rid: bytes, head: bytes, readers: list[BlockReader]) -> bool:
        if not start_message(self._sock, rid, head):
            self._store.release_many(readers)
            return False
        trackers = send_payload(self._sock, [view for reader in readers
                                             for view in reader.views])
        if trackers:
            self.ledger.hold(rid, trackers, readers)
        else:
            self._store.release_many(readers)  # every segment was copied into libzmq
        return True


def send_payload(sock: zmq.Socket[bytes], frames: Sequence[memoryview]) -> list[Tracker]:
    """Send ``frames`` as the rest of a message: each of at least
    :data:`~p2pkv.runtime.tuning.ZERO_COPY_MIN` bytes without a copy, the others copied
    into libzmq. Returns the trackers of the zero-copy frames, one each: their memory is
    free once every one of them is done (pyzmq does not promise that libzmq lets go of a
    message's frames in order, so no one tracker stands for the others)."""
    trackers: list[Tracker] = []
    final = len(frames) - 1
    for f, view in enumerate(frames):
        flags = 0 if f == final else zmq.SNDMORE
        if view.nbytes >= ZERO_COPY_MIN:
            trackers.append(sock.send(view, flags, copy=False, track=True))
        else:
            sock.send(view, flags, copy=True)
    return trackers


def pin_next_slots(store: BlockStore, job: Sending, credit: int,
                   limit: int) -> tuple[list[int], list[int]]:
    """:func:`pin_next_batch` as arrays: the indices and the pinned store slots (the
    data stream's batches, with no reader object per block)."""
    start = job.next_index
    stop = proto.next_batch(start, len(job.keys), credit, limit)
    job.next_index = stop
    slots = store.slots.pin(job.keys[start:stop])
    if min(slots, default=0) >= 0:
        return list(range(start, stop)), slots
    idx: list[int] = []
    kept: list[int] = []
    for i, slot in zip(range(start, stop), slots, strict=True):
        if slot < 0:
            job.outcomes[i] = OUTCOME_MISSING
        else:
            idx.append(i)
            kept.append(slot)
    return idx, kept


def pin_next_batch(store: BlockStore, job: Sending, credit: int,
                   limit: int) -> tuple[list[int], list[BlockReader]]:
    """Pin the next keys of ``job`` the credit allows, in one store call: their indices
    and readers. A missing key is marked MISSING and uses no credit, so a batch may come
    out smaller than the credit (the caller's loop goes on)."""
    start = job.next_index
    stop = proto.next_batch(start, len(job.keys), credit, limit)
    job.next_index = stop
    idx: list[int] = []
    readers: list[BlockReader] = []
    for i, reader in zip(range(start, stop), store.acquire_read_many(job.keys[start:stop]),
                         strict=True):
        if reader is None:
            job.outcomes[i] = OUTCOME_MISSING
        else:
            idx.append(i)
            readers.append(reader)
    return idx, readers

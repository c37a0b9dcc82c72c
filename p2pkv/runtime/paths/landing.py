"""Settling a landed block: where it goes, whether it is intact, what became of its key.

Bytes of a fetched block arrive four ways: ``recv_into`` straight from its payload
frames (:mod:`~p2pkv.runtime.paths.receiver`), copied out of one packed frame
(:mod:`~p2pkv.runtime.paths.packing`), copied from a same-host peer's shared memory
(:mod:`~p2pkv.runtime.paths.shm_client`), or ``recvmsg_into`` straight from a data stream,
over several loop turns (:mod:`~p2pkv.runtime.paths.data_client`). Each way only moves bytes;
:class:`Landing` does the rest for all four: it opens the block's destination (a
caller-owned buffer, or a store slot that lookups cannot see yet), verifies the block
against its announced checksum (:mod:`p2pkv.checksum`, or the store's verified
commit), commits or drops it, and writes the key's outcome and error. A key that has
nowhere to land is settled when it is opened: it is there already (another fetch stored
it meanwhile), or it failed with the reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from p2pkv.checksum import block_checksum
from p2pkv.errors import StoreFullError
from p2pkv.runtime.public import KeyOutcome
from p2pkv.runtime.state import Receiving
from p2pkv.runtime.stats import Count, Counters
from p2pkv.store import BlockStore, BlockWriter, ChecksumMismatch, StoreError

__all__ = ["Landed", "Landing"]

_BUSY = "the block was being written by another fetch at the time"


@dataclass(eq=False, slots=True)
class Landed:
    """One block of a fetch on its way into its destination, not settled yet."""

    key_index: int
    #: One writable view per segment: the caller's buffers, or the store slot's.
    views: Sequence[memoryview]
    #: The store slot being written; None for caller-owned buffers (``fetch_into``).
    writer: BlockWriter | None
    #: The checksum the peer announced (None: checksums were not negotiated).
    expected: int | None
    #: The checksum of the bytes, when the copy computed it on the way.
    actual: int | None = None


class Landing:
    """Opens destinations and settles landed blocks (IO thread only).

    Every way of landing runs inside :meth:`guard`: whatever happens there (an unexpected
    exception included), no slot it opened stays "being written", since a key stuck there
    could never be fetched again, and the blocks it landed are counted once at its end.
    """

    def __init__(self, store: BlockStore, bytes_per_block: int, counters: Counters) -> None:
        self._store = store
        #: The views of a store slot, one per segment (the pool's own tuple).
        self.slot_views = store.pool.slot_views
        #: The views of a batch of store slots (:meth:`BlockPool.views_of_slots`).
        self.views_of_slots = store.pool.views_of_slots
        self._bpb = bytes_per_block
        self._counters = counters
        self._open: list[BlockWriter] = []
        self._landed = 0

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        try:
            yield
        finally:
            for writer in self._open:
                if not writer.done:
                    writer.abort()
            self._open.clear()
            landed, self._landed = self._landed, 0
            if landed:
                self._counters.add(Count.BLOCKS_RECEIVED, landed)
                self._counters.add(Count.BYTES_RECEIVED, landed * self._bpb)

    # -- destinations --------------------------------------------------------------------

    def open(self, recv: Receiving, key_index: int, expected: int | None) -> Landed | None:
        """Where block ``key_index`` of ``recv`` lands; None when it has nowhere to go
        (its key is settled already)."""
        if recv.destinations is not None:
            return Landed(key_index, recv.destinations[key_index], None, expected)
        try:
            writer = self._store.begin_write(recv.keys[key_index])
        except (StoreError, StoreFullError) as exc:
            self._nowhere(recv, key_index, f"no slot in the local pool: {exc}")
            return None
        if writer is None:
            self._nowhere(recv, key_index, _BUSY)
            return None
        self._open.append(writer)
        return Landed(key_index, writer.views, writer, expected)

    def open_many(self, recv: Receiving, key_indices: Sequence[int],
                  expected: Sequence[int | None]) -> list[Landed | None]:
        """:meth:`open` for a batch of blocks, their store slots taken in one store call."""
        if recv.destinations is not None:
            return [self.open(recv, ki, want)
                    for ki, want in zip(key_indices, expected, strict=True)]
        taken = self._store.begin_write_many([recv.keys[ki] for ki in key_indices])
        out: list[Landed | None] = []
        for ki, writer, want in zip(key_indices, taken, expected, strict=True):
            if isinstance(writer, BlockWriter):
                self._open.append(writer)
                out.append(Landed(ki, writer.views, writer, want))
            else:
                self._unplaced(recv, ki, writer)
                out.append(None)
        return out

    def open_kept(self, recv: Receiving, key_indices: Sequence[int],
                  expected: Sequence[int | None]) -> list[Landed | None]:
        """:meth:`open_many` for a landing that spans several loop turns (a data stream's
        message arrives in pieces): no :meth:`guard` aborts the slots opened here; the
        caller settles each one or gives it back with :meth:`abandon`, whatever happens."""
        mark = len(self._open)
        out = self.open_many(recv, key_indices, expected)
        del self._open[mark:]
        return out

    def open_slots(self, recv: Receiving, key_indices: Sequence[int]) -> list[int]:
        """Store slots for a batch of blocks of a fetch into the store (no
        ``destinations``), with no object per block: a data stream's message of hundreds
        of small blocks. Per block its slot, or -1 where it has nowhere to land (settled
        already, as :meth:`open` does). Like :meth:`open_kept`, no :meth:`guard` aborts
        them: the caller settles each with :meth:`settle_slots` or gives it back with
        :meth:`abandon_slots`, whatever happens."""
        assert recv.destinations is None
        keys = recv.keys
        taken = self._store.slots.begin_write([keys[ki] for ki in key_indices])
        if set(map(type, taken)) == {int}:
            return taken  # type: ignore[return-value]
        out: list[int] = []
        for ki, t in zip(key_indices, taken, strict=True):
            if type(t) is int:
                out.append(t)
            else:
                self._unplaced(recv, ki, t)  # type: ignore[arg-type]
                out.append(-1)
        return out

    def settle_slots(self, recv: Receiving, key_indices: Sequence[int], slots: Sequence[int],
                     expected: Sequence[int | None],
                     actual: Sequence[int] | None = None) -> int:
        """Commit blocks whose bytes are all in the slots :meth:`open_slots` gave them
        (the store verifies each against ``expected``; ``actual``: their checksums,
        computed as they landed) and write their outcomes; how many landed. Inside
        :meth:`guard`."""
        keys = recv.keys
        mismatches = self._store.slots.commit([keys[ki] for ki in key_indices], slots,
                                              expected, actual)
        return self._mark_all_landed(recv, self._intact(recv, key_indices, mismatches))

    def abandon_slots(self, recv: Receiving, key_indices: Sequence[int],
                      slots: Sequence[int]) -> None:
        """Slots of :meth:`open_slots` that will not be settled: freed, nothing committed."""
        pairs = [(recv.keys[ki], slot) for ki, slot in zip(key_indices, slots, strict=True)
                 if slot >= 0]
        if pairs:
            self._store.slots.abort([k for k, _ in pairs], [s for _, s in pairs])

    def abandon(self, blocks: Sequence[Landed | None]) -> None:
        """Blocks opened with :meth:`open_kept` that will not be settled (their fetch is
        gone, or the stream ended): their store slots are freed, nothing is committed."""
        for block in blocks:
            if block is not None and block.writer is not None and not block.writer.done:
                block.writer.abort()

    # -- outcomes ------------------------------------------------------------------------

    def settle(self, recv: Receiving, block: Landed) -> int:
        """Verify one block, commit it or drop it, and write its key's outcome; 1 when it
        landed."""
        verified, want = self._verify(recv, block)
        if not verified:
            return 0
        if block.writer is None:
            return self._mark_landed(recv, block.key_index)
        try:
            block.writer.commit(expected_checksum=want)
        except ChecksumMismatch as mismatch:
            self._corrupt(recv, block.key_index, mismatch)
            return 0
        return self._mark_landed(recv, block.key_index)

    def settle_many(self, recv: Receiving, blocks: Sequence[Landed]) -> int:
        """:meth:`settle` for a batch, its store slots committed in one store call.

        The common case, store slots whose bytes the store verifies on commit, costs no
        call per block here: a stream of 16 KiB blocks settles tens of thousands a
        second."""
        committing: list[BlockWriter] = []
        wanted: list[int | None] = []
        placed: list[int] = []
        landed: list[int] = []
        for block in blocks:
            writer = block.writer
            if writer is not None and block.actual is None:
                committing.append(writer)
                wanted.append(block.expected)
                placed.append(block.key_index)
                continue
            verified, want = self._verify(recv, block)
            if not verified:
                continue
            if writer is None:
                landed.append(block.key_index)
                continue
            committing.append(writer)
            wanted.append(want)
            placed.append(block.key_index)
        if committing:
            mismatches = self._store.commit_many(committing, wanted)
            landed.extend(self._intact(recv, placed, mismatches))
        return self._mark_all_landed(recv, landed)

    def _intact(self, recv: Receiving, key_indices: Sequence[int],
                mismatches: Sequence[ChecksumMismatch | None]) -> Sequence[int]:
        """Of blocks just committed, the key indices that passed their check; each one
        that failed is marked corrupt."""
        if not any(mismatches):
            return key_indices
        intact: list[int] = []
        for ki, mismatch in zip(key_indices, mismatches, strict=True):
            if mismatch is None:
                intact.append(ki)
            else:
                self._corrupt(recv, ki, mismatch)
        return intact

    def _verify(self, recv: Receiving, block: Landed) -> tuple[bool, int | None]:
        """Check a block against its announced checksum where the bytes are known here
        (caller buffers, or hashed while copied): False when it was dropped. Otherwise the
        checksum the store still has to verify on commit (None: nothing left to check)."""
        want = block.expected
        if want is None or (block.writer is not None and block.actual is None):
            return True, want
        actual = block.actual if block.actual is not None else block_checksum(block.views)
        if actual == want:
            return True, None
        if block.writer is not None:
            block.writer.abort()
        self._corrupt(recv, block.key_index,
                      ChecksumMismatch(recv.keys[block.key_index], want, actual))
        return False, None

    def fail(self, recv: Receiving, key_index: int, why: str) -> None:
        """Block ``key_index`` did not land (its frames were not what the header said)."""
        recv.outcomes[key_index] = KeyOutcome.FAILED
        recv.errors[key_index] = why

    def _mark_all_landed(self, recv: Receiving, key_indices: Sequence[int]) -> int:
        outcomes, landed = recv.outcomes, KeyOutcome.LANDED
        for ki in key_indices:
            outcomes[ki] = landed
        n = len(key_indices)
        recv.blocks += n
        recv.nbytes += n * self._bpb
        self._landed += n
        return n

    def _mark_landed(self, recv: Receiving, key_index: int) -> int:
        return self._mark_all_landed(recv, (key_index,))

    def _corrupt(self, recv: Receiving, key_index: int, mismatch: ChecksumMismatch) -> None:
        self._counters.add(Count.CHECKSUM_FAILURES)
        self.fail(recv, key_index, f"block dropped: {mismatch}")

    def _unplaced(self, recv: Receiving, key_index: int, taken: StoreFullError | None
                  ) -> None:
        """A block the store gave no slot: ``taken`` None (its key is stored or being
        written), else the store was full."""
        self._nowhere(recv, key_index, _BUSY if taken is None
                      else f"no slot in the local pool: {taken}")

    def _nowhere(self, recv: Receiving, key_index: int, why: str) -> None:
        if self._store.contains(recv.keys[key_index]):
            # Another fetch stored the same block meanwhile: it is here.
            recv.outcomes[key_index] = KeyOutcome.LANDED
            recv.errors.pop(key_index, None)
        else:
            self.fail(recv, key_index, why)

"""The data path's batch calls on the block store: slot numbers, no object per block.

A data stream (``tcp-data-v1``) lands and sends messages of hundreds of small blocks.
A :class:`~p2pkv.store.handles.BlockWriter` or :class:`~p2pkv.store.handles.BlockReader`
per block, with its segment views, was a large part of the cost of a 16 KiB block:
landing a message's slots as arrays cut the consumer's CPU by 17%, pinning them as
arrays the producer's by 20% (alternating runs; large blocks unchanged).

:class:`SlotBatches` is that API, reached as :attr:`BlockStore.slots
<p2pkv.store.BlockStore.slots>`. It works on the same
:class:`~p2pkv.store.book.StoreBook` as the store's per-key calls, whose handles are its
wrappers (one path each for taking, committing, aborting and pinning a slot).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from p2pkv.checksum import block_checksum, block_checksums
from p2pkv.errors import StoreFullError
from p2pkv.store.book import ChecksumMismatch, StoreBook, StoreError
from p2pkv.store.pool import BlockPool

__all__ = ["SlotBatches"]

_U64_END = 1 << 64


def _check_sums(keys: int, slots: int, expected: Sequence[int | None],
                actual: Sequence[int | None] | None = None) -> None:
    """ValueError unless a commit has one expected checksum (a u64, or None) per block,
    and as many computed ones if any."""
    if not keys == slots == len(expected) == (slots if actual is None else len(actual)):
        raise ValueError(f"{keys} keys, {slots} slots, {len(expected)} checksums"
                         + ("" if actual is None else f", {len(actual)} computed"))
    if set(map(type, expected)) == {int} and \
            0 <= min(expected) <= max(expected) < _U64_END:  # type: ignore[type-var, operator]
        return  # u64s all (the common case): no Python step per block
    for want in expected:
        if want is not None and (type(want) is not int or not 0 <= want < _U64_END):
            raise ValueError(f"expected_checksum must be a u64, got {want!r}")


def _not_being_written(writing: dict[bytes, int], keys: Sequence[bytes],
                       slots: Sequence[int]) -> None:
    """StoreError naming the first key not being written into its slot."""
    for key, slot in zip(keys, slots, strict=True):
        if writing.get(key) != slot:
            raise StoreError(f"block {key.hex()} is not being written into slot {slot}")


def _checksums(pool: BlockPool, slots: Sequence[int], expected: Sequence[int | None]
               ) -> list[int | None]:
    """The checksum of the block in each slot that has an expected checksum, else None."""
    if None not in expected:
        return block_checksums(pool.views_of_slots(slots))  # type: ignore[return-value]
    return [None if want is None else block_checksum(pool.slot_views(slot))
            for slot, want in zip(slots, expected, strict=True)]


class SlotBatches:
    """The store's blocks as slot numbers, a batch per call (``store.slots``).

    Who calls it: the data stream's two halves on the IO thread (the receiving side
    through :class:`~p2pkv.runtime.paths.landing.Landing`'s ``open_slots`` /
    ``settle_slots`` / ``abandon_slots``, the serving side through
    :class:`~p2pkv.runtime.paths.data_sender.DataSender`), and
    :class:`~p2pkv.store.BlockStore` itself, whose writer and reader handles wrap these
    calls.

    A slot number is an index into the store's :class:`~p2pkv.store.pool.BlockPool`
    (``pool.slot_views(slot)`` are its segments). It means something only while it is
    held: a slot from :meth:`begin_write` is its taker's alone to fill, invisible to
    lookup, until it is committed or aborted; a slot from :meth:`pin` holds a committed
    block whose bytes stay still (never evicted, overwritten or reused) until it is
    unpinned. After that the same number may hold another block.

    Keys are trusted: its callers' keys were checked where they entered the node (the
    node's API for this node's requests, the codec for a peer's), and the store's per-key
    API checks its own before it calls here; a batch costs no second pass over them.

    What must be paid back, whatever happens (``finally``):

    - every slot :meth:`begin_write` gave (each int) is finished, by :meth:`commit` or
      :meth:`abort`: a key left "being written" can never be fetched again, and its
      slot never returns to the free list;
    - every pin :meth:`pin` gave (each slot other than -1, as often as it came back) is
      released exactly once with :meth:`unpin`: a pin never released keeps its block
      from eviction, and a discarded block's slot from reuse, for good.

    Threading: any thread may call. A call that changes the store takes its one lock
    once for the whole batch; checksums are computed outside it. A slot being written
    is finished by the thread that took it (:meth:`commit` checks, before it takes the
    lock, that each key is still being written into its slot: only that thread can
    change that). A pin may be released from any thread (for example the one that sees
    a send finish).
    """

    __slots__ = ("_book",)

    def __init__(self, book: StoreBook) -> None:
        self._book = book

    # -- writing -------------------------------------------------------------------------

    def begin_write(self, keys: Sequence[bytes]) -> list[int | StoreFullError | None]:
        """Take a slot for each key, under one lock, without a writer object per block:
        per key, the slot it is being written into (an int); None when it is already
        stored or being written (a key repeated in ``keys`` too); once no slot is left,
        the :class:`StoreFullError`, for that key and every later one that needed a slot.
        Each slot taken is finished with :meth:`commit` or :meth:`abort`, by the thread
        that took it; slots taken stay valid when a later key found none. The keys are
        trusted (see the class docstring)."""
        book = self._book
        taken: list[int | StoreFullError | None] = []
        full: StoreFullError | None = None
        with book.lock:
            entries, writing = book.entries, book.writing
            for key in keys:
                if key in entries or key in writing:
                    taken.append(None)
                elif full is not None:
                    taken.append(full)
                else:
                    try:
                        writing[key] = slot = book.take_slot_locked()
                    except StoreFullError as exc:
                        full = exc
                    taken.append(full or slot)
        return taken

    def commit(self, keys: Sequence[bytes], slots: Sequence[int],
               expected_checksums: Sequence[int | None],
               actual: Sequence[int | None] | None = None) -> list[ChecksumMismatch | None]:
        """Make the blocks written into ``slots`` (from :meth:`begin_write`) visible,
        each verified against its expected checksum (None: not verified) under one
        lock: per block, the :class:`ChecksumMismatch` of one that failed its check
        (dropped, its slot freed, never visible), else None. Listeners hear each block
        that became visible.

        ``actual``: each slot's checksum, computed by its writer as the bytes landed
        (None: hashed here); it is kept as the block's checksum, also where none was
        expected.

        Raises :class:`StoreError` (committing nothing) unless every key is being
        written into its slot, ValueError (committing nothing) if an expected checksum
        is not a u64 or the counts differ.
        """
        _check_sums(len(keys), len(slots), expected_checksums, actual)
        book = self._book
        writing = book.writing
        if list(map(writing.get, keys)) != list(slots):
            _not_being_written(writing, keys, slots)
        if actual is None:
            # Hashing outside the lock is safe: each slot belongs to its writer.
            actual = _checksums(book.pool, slots, expected_checksums)
        out: list[ChecksumMismatch | None] = []
        with book.lock:
            # One loop for every batch, whether or not each block passed: a second pass
            # for batches whose blocks all passed saved 0.025 µs of about 3 µs per
            # 16 KiB block, not worth a second copy of these rules.
            entries, sums = book.entries, book.sums
            for key, slot, want, got in zip(keys, slots, expected_checksums, actual,
                                            strict=True):
                del writing[key]
                if want is not None and got != want:
                    assert got is not None
                    book.free.append(slot)
                    book.checksum_failures += 1
                    out.append(ChecksumMismatch(key, want, got))
                    continue
                entries[key] = slot
                sums[slot] = got
                out.append(None)
                if book.listeners:
                    book.notify_locked(key, True)
        return out

    def abort(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Release slots taken with :meth:`begin_write` and not committed: their blocks
        never existed. A key not being written into that slot (finished already) is
        left alone, so aborting twice, or after a commit, is harmless."""
        book = self._book
        with book.lock:
            writing = book.writing
            for key, slot in zip(keys, slots, strict=True):
                if writing.get(key) == slot:
                    del writing[key]
                    book.free.append(slot)

    # -- reading -------------------------------------------------------------------------

    def pin(self, keys: Sequence[bytes]) -> list[int]:
        """Pin each stored key's block, under one lock, without a reader object per
        block: per key, the slot now pinned for it, or -1 when it is not stored (a key
        repeated in ``keys`` is pinned once per time). Pinned blocks become most
        recently used. Each pin is released once with :meth:`unpin`; the slot's bytes
        stay still until then (:meth:`checksums` gives their checksums). The keys are
        trusted (see the class docstring)."""
        book = self._book
        pinned: list[int] = []
        with book.lock:
            entries, readers = book.entries, book.readers
            for key in keys:
                slot = entries.get(key)
                if slot is None:
                    pinned.append(-1)
                    continue
                readers[slot] += 1
                entries.move_to_end(key)
                pinned.append(slot)
        return pinned

    def checksums(self, slots: Sequence[int]) -> list[int]:
        """The checksum of the block in each slot pinned by :meth:`pin`, computed once
        per stored block (as :attr:`BlockReader.checksum
        <p2pkv.store.handles.BlockReader.checksum>`). Only for slots the caller pins."""
        book = self._book
        sums, views = book.sums, book.pool.slot_views
        for slot in slots:
            if sums[slot] is None:
                # Safe without the lock: the pin keeps the bytes still and the slot taken,
                # and two threads racing here store the same value.
                sums[slot] = block_checksum(views(slot))
        return [sums[slot] for slot in slots]  # type: ignore[misc]

    def unpin(self, slots: Sequence[int]) -> None:
        """Release one pin of each slot :meth:`pin` gave (once per pin); a discarded
        block's slot is freed at its last. :class:`StoreError` (nothing released) if a
        slot is not pinned as many times as it appears."""
        book = self._book
        with book.lock:
            readers = book.readers
            counts = collections.Counter(slots)
            for slot, n in counts.items():
                if not 0 <= slot < len(readers) or readers[slot] < n:
                    raise StoreError(f"slot {slot} is not pinned {n} time(s)")
            for slot in slots:
                book.unpin_locked(slot)

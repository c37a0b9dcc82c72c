"""Key -> slot store over a :class:`~p2pkv.store.pool.BlockPool`: LRU, pins, checksums.

Block lifecycle::

    begin_write(key) -> BlockWriter      slot taken from the free list or by
        |                                evicting the least recently used
        |  fill writer.views             unpinned block; invisible to lookup
        v
    writer.commit([expected_checksum])   verified, then visible  (or
    writer.abort()                       slot back to the free list, no trace)

    acquire_read(key) -> BlockReader     slot pinned (reference counted): never
        |  send reader.views             evicted, overwritten or reused until
        v                                every reader has released it
    reader.release()                     idempotent, any thread

Eviction only takes committed blocks that no reader pins. :meth:`BlockStore.discard`
of a pinned block hides it at once but returns its slot to the free list only
when the last reader releases it, so memory never moves under a reader (e.g. a
``zmq`` zero-copy send still in flight: release after its ``MessageTracker`` is
done).

Threading: every method of :class:`BlockStore`, :class:`BlockWriter` and
:class:`BlockReader` may be called from any thread (the IO thread and engine
threads). One lock guards the bookkeeping; payload bytes are copied and hashed
outside it, which is safe because a slot being written or read is pinned. A
writer's views belong to the writer alone until commit/abort; a reader's views
must not be written.

Listeners (:meth:`BlockStore.add_listener`) hear every change of the visible set, in
order: ``listener(key, True)`` when a block is committed, ``listener(key, False)`` when
it is evicted or discarded. A directory of who holds what (``p2pkv.cluster``) is built
on them.

Keys are non-empty ``bytes`` of at most 64 bytes (block keys are 20): the rule of
:func:`p2pkv.keys.check_keys`, checked once, where a key enters the store through the
per-key API (one pass in C for a valid batch; ValueError naming the first bad key).
:attr:`BlockStore.slots` trusts its callers: the data path's keys were checked where
they entered the node (its API, or the codec for a peer's). LRU order is
updated by lookup hits, pins (:meth:`BlockStore.acquire_read`, ``slots.pin``) and
commits; :meth:`BlockStore.contains` is a pure query. ``hits``/``misses`` count
:meth:`BlockStore.lookup` only.

The store is three parts over one :class:`~p2pkv.store.book.StoreBook` (key -> slot in
LRU order, the free list, pins, keys being written, listeners, counters, the one lock):

- :class:`BlockStore`, here: the per-key API above;
- :attr:`BlockStore.slots`, a :class:`~p2pkv.store.slots.SlotBatches`: the data path's
  batch calls, which take and pin slots by number with no handle per block (it states
  what each slot taken or pinned that way owes back);
- the handles :class:`BlockWriter` and :class:`BlockReader`
  (:mod:`p2pkv.store.handles`), wrappers of those calls that finish through the store.

The handles, the errors and :class:`StoreStats` are exported from here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from p2pkv.checksum import BytesLike, block_checksum
from p2pkv.errors import StoreFullError
from p2pkv.keys import MAX_KEY_LEN, check_keys, keys_well_formed
from p2pkv.store.book import (
    ChecksumMismatch,
    StoreBook,
    StoreError,
    StoreListener,
    StoreStats,
)
from p2pkv.store.handles import BlockReader, BlockWriter, split_segments
from p2pkv.store.pool import BlockPool
from p2pkv.store.slots import SlotBatches

_KEYS = "block store keys"
"""How the store's ValueError names the keys it was given."""

__all__ = [
    "BlockReader",
    "BlockStore",
    "BlockWriter",
    "BytesLike",
    "ChecksumMismatch",
    "StoreError",
    "StoreFullError",
    "StoreListener",
    "StoreStats",
    "block_checksum",
]


class BlockStore:
    """Maps block keys to pool slots; see the module docstring for the lifecycle.

    The per-key API: lookups, writer and reader handles, discard. The bookkeeping is a
    :class:`~p2pkv.store.book.StoreBook` it shares with :attr:`slots`, the data path's
    batch calls on slot numbers; a handle is a wrapper of those calls.
    """

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._book = StoreBook(pool)
        self._slots = SlotBatches(self._book)

    @property
    def pool(self) -> BlockPool:
        return self._pool

    @property
    def capacity(self) -> int:
        return self._pool.num_blocks

    @property
    def slots(self) -> SlotBatches:
        """The same blocks as slot numbers, a batch per call, with no handle per block
        (the data stream's landing and sending); see
        :class:`~p2pkv.store.slots.SlotBatches` for what each slot owes back."""
        return self._slots

    # -- queries -------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` are stored. Counts hits/misses; hits become most recent."""
        check_keys(keys, MAX_KEY_LEN, what=_KEYS)
        book = self._book
        with book.lock:
            entries = book.entries
            result = list(map(entries.__contains__, keys))
            hits = sum(result)
            if hits:
                touch = entries.move_to_end
                for key in itertools.compress(keys, result):
                    touch(key)
            book.hits += hits
            book.misses += len(result) - hits
        return result

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (committed). No counters, no LRU change."""
        check_keys((key,), MAX_KEY_LEN, what=_KEYS)
        with self._book.lock:
            return key in self._book.entries

    def __contains__(self, key: object) -> bool:
        # ``in`` answers False for what is not a key (the one key rule, keys.py).
        return keys_well_formed((key,), MAX_KEY_LEN) and self.contains(key)  # type: ignore[arg-type]

    def __len__(self) -> int:
        with self._book.lock:
            return len(self._book.entries)

    def stored_keys(self) -> list[bytes]:
        """Snapshot of the stored keys, least recently used first."""
        with self._book.lock:
            return list(self._book.entries)

    def stats(self) -> StoreStats:
        return self._book.stats()

    # -- listeners -----------------------------------------------------------

    def add_listener(self, listener: StoreListener) -> None:
        """Call ``listener(key, visible)`` on every commit (True), eviction and discard
        (False) from now on.

        Listeners run on the thread that changed the store, with the store's lock
        held, so they see changes in exactly the order they happened (a key evicted
        and stored again is never reported the other way round). They must be quick,
        must not raise, and must not call back into the store: queue the change and
        act on it elsewhere. Register first, then take :meth:`stored_keys`, to miss
        nothing. Commits through :attr:`slots` are heard like any other.
        """
        book = self._book
        with book.lock:
            book.listeners = (*book.listeners, listener)

    def remove_listener(self, listener: StoreListener) -> None:
        """Stop calling ``listener``; a no-op if it was not added."""
        book = self._book
        with book.lock:
            book.listeners = tuple(x for x in book.listeners if x is not listener)

    # -- writing -------------------------------------------------------------

    def begin_write(self, key: bytes) -> BlockWriter | None:
        """Take a slot for ``key``; the block is invisible until ``commit``.

        Returns None when ``key`` is already stored or already being written
        (there is nothing to do: the block is there or about to be). Raises
        :class:`StoreFullError` when no slot is free and every stored block is
        pinned by a reader, or all slots are being written.
        """
        (writer,) = self.begin_write_many((key,))
        if isinstance(writer, StoreFullError):
            raise writer
        return writer

    def begin_write_many(self, keys: Sequence[bytes]) -> list[BlockWriter | StoreFullError | None]:
        """:meth:`begin_write` for each key, under one lock (a batch of received blocks).

        Per key: its writer; None when it is already stored or being written (a key
        repeated in ``keys`` too); once no slot is left, the :class:`StoreFullError`, for
        that key and every later one that needed a slot. Writers taken stay valid.
        ValueError (nothing taken) if a key is malformed.
        """
        check_keys(keys, MAX_KEY_LEN, what=_KEYS)
        taken = self._slots.begin_write(keys)
        views = self._pool.slot_views
        return [BlockWriter(self, key, t, views(t)) if type(t) is int else t  # type: ignore[misc]
                for key, t in zip(keys, taken, strict=True)]

    def commit_many(self, writers: Sequence[BlockWriter],
                    expected_checksums: Sequence[int | None]) -> list[ChecksumMismatch | None]:
        """:meth:`BlockWriter.commit` for each writer, under one lock; per writer, the
        :class:`ChecksumMismatch` of a block that failed its check (dropped), else None.

        Raises :class:`StoreError` (committing nothing) if a writer is already finished,
        ValueError if an expected checksum is not a u64 or the counts differ. A writer
        belongs to one thread.
        """
        for writer in writers:
            if writer.done:
                raise StoreError(f"write of block {writer.key.hex()} is already finished")
        out = self._slots.commit([w.key for w in writers], [w.slot for w in writers],
                                 expected_checksums)
        for writer in writers:
            writer.finish()
        return out

    def abort_write(self, writer: BlockWriter) -> None:
        """:meth:`BlockWriter.abort`: release its slot unless it is already finished."""
        if writer.finish():  # a writer belongs to one thread
            self._slots.abort((writer.key,), (writer.slot,))

    def put(
        self,
        key: bytes,
        data: BytesLike | Sequence[BytesLike],
        *,
        expected_checksum: int | None = None,
    ) -> bool:
        """Copy ``data`` into a new block and commit it (a convenience for tools/tests).

        ``data`` is either one buffer of ``bytes_per_block`` bytes (segments
        back to back) or a sequence of per-segment buffers. Returns False when
        the key was already stored or being written. Raises ValueError on a
        size mismatch (no slot is taken), :class:`StoreFullError` and
        :class:`ChecksumMismatch` as ``begin_write``/``commit`` do.
        """
        segments = split_segments(data, self._pool.segment_sizes, self._pool.bytes_per_block)
        writer = self.begin_write(key)
        if writer is None:
            return False
        with writer:
            for dst, src in zip(writer.views, segments, strict=True):
                dst[:] = src
            writer.commit(expected_checksum)
        return True

    # -- reading -------------------------------------------------------------

    def acquire_read(self, key: bytes) -> BlockReader | None:
        """Pin the stored block ``key`` for reading, or None if it is not stored.

        The block becomes most recently used. Call ``release()`` when done.
        """
        return self.acquire_read_many((key,))[0]

    def acquire_read_many(self, keys: Sequence[bytes]) -> list[BlockReader | None]:
        """:meth:`acquire_read` for each key, under one lock (the sender's batches).
        ValueError (nothing pinned) if a key is malformed."""
        check_keys(keys, MAX_KEY_LEN, what=_KEYS)
        pinned = self._slots.pin(keys)
        views = self._pool.slot_views
        return [None if slot < 0 else BlockReader(self, key, slot, views(slot))
                for key, slot in zip(keys, pinned, strict=True)]

    def release_many(self, readers: Iterable[BlockReader]) -> None:
        """:meth:`BlockReader.release` for each reader, under one lock."""
        book = self._book
        with book.lock:
            for reader in readers:
                if reader.unpin():
                    book.unpin_locked(reader.slot)

    def checksum_of(self, reader: BlockReader) -> int:
        """:attr:`BlockReader.checksum`: :func:`block_checksum` of the block ``reader``
        pins, computed once. :class:`StoreError` once it is released."""
        if reader.released:
            raise StoreError(f"reader of block {reader.key.hex()} was released")
        book = self._book
        slot = reader.slot
        value = book.sums[slot]
        if value is None:
            # Safe without the lock: the pin keeps the bytes still and the slot taken,
            # and two readers racing here store the same value.
            value = block_checksum(reader.views)
            with book.lock:
                # Released meanwhile (another thread): the slot may be another block's.
                if not reader.released:
                    book.sums[slot] = value
        return value

    def get(self, key: bytes) -> bytes | None:
        """A copy of the block's bytes (segments concatenated), or None if absent.

        For tools and tests; the data path uses :meth:`acquire_read` views.
        """
        reader = self.acquire_read(key)
        if reader is None:
            return None
        with reader:
            return b"".join(reader.views)

    def checksum(self, key: bytes) -> int | None:
        """:func:`block_checksum` of the stored block, or None if absent."""
        reader = self.acquire_read(key)
        if reader is None:
            return None
        with reader:
            return reader.checksum

    # -- removal -------------------------------------------------------------

    def discard(self, key: bytes) -> bool:
        """Remove ``key`` if stored; returns whether it was.

        The block disappears from lookup at once; if readers pin it, its slot
        is freed only when the last one releases. Writes in progress are not
        affected (abort those through their writer).
        """
        check_keys((key,), MAX_KEY_LEN, what=_KEYS)
        book = self._book
        with book.lock:
            slot = book.entries.pop(key, None)
            if slot is None:
                return False
            if book.listeners:
                book.notify_locked(key, False)
            if book.readers[slot]:
                book.discarded.add(slot)
            else:
                book.free.append(slot)
            return True

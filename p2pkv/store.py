"""Key -> slot store over a :class:`~p2pkv.pool.BlockPool`: LRU, pins, checksums.

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

Keys are non-empty ``bytes`` of at most 64 bytes (block keys are 20). LRU order
is updated by lookup hits, :meth:`BlockStore.acquire_read` and commits;
:meth:`BlockStore.contains` is a pure query. ``hits``/``misses`` count
:meth:`BlockStore.lookup` only.

The handles themselves (:class:`BlockWriter`, :class:`BlockReader`) are defined in
:mod:`p2pkv.store_handles` and exported from here as well; this module holds the
bookkeeping they finish through.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from p2pkv.checksum import BytesLike, block_checksum, block_checksums
from p2pkv.errors import P2PKVError, StoreFullError
from p2pkv.keys import MAX_KEY_LEN, check_keys, keys_well_formed
from p2pkv.pool import BlockPool, MemoryKind
from p2pkv.store_handles import BlockReader, BlockWriter, split_segments

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

#: ``listener(key, visible)``: ``visible`` is True when ``key`` was committed, False when
#: it was evicted or discarded. See :meth:`BlockStore.add_listener`.
StoreListener: TypeAlias = Callable[[bytes, bool], None]

_U64_END = 1 << 64


class StoreError(P2PKVError):
    """A block store call that cannot be carried out (see subclasses).

    :class:`~p2pkv.errors.StoreFullError` (raised when every slot is pinned)
    is the package-wide error of that name and derives from ``P2PKVError``
    directly.
    """


class ChecksumMismatch(StoreError):
    """A block's bytes did not hash to the checksum its sender announced.

    The block was dropped (never visible). ``expected``/``actual`` are xxh3-64.
    """

    def __init__(self, key: bytes, expected: int, actual: int) -> None:
        super().__init__(
            f"checksum mismatch for block {key.hex()}: expected {expected:#018x}, "
            f"got {actual:#018x}; block dropped"
        )
        self.key = key
        self.expected = expected
        self.actual = actual


def _check_key(key: object) -> bytes:
    return check_keys((key,), MAX_KEY_LEN, what="block store keys")[0]


def _check_batch(keys: Sequence[bytes]) -> None:
    """ValueError naming the first bad key, unless every key is well formed (the common
    case costs no Python step per key)."""
    if not keys_well_formed(keys, MAX_KEY_LEN):
        check_keys(keys, MAX_KEY_LEN, what="block store keys")


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


@dataclass(frozen=True)
class StoreStats:
    """A consistent snapshot of the store's counters.

    ``used``: slots not on the free list (committed, being written, or
    discarded but still pinned). ``pinned``: slots that cannot be reclaimed
    now (writes in progress plus blocks held by at least one reader).
    ``stored``: blocks visible to lookup.
    """

    capacity: int
    used: int
    pinned: int
    stored: int
    hits: int
    misses: int
    evictions: int
    checksum_failures: int
    memory_kind: MemoryKind
    bytes_per_block: int


class BlockStore:
    """Maps block keys to pool slots; see the module docstring for the lifecycle."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        # Committed, visible blocks -> their slot; iteration order is LRU (oldest first).
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        # What the store knows of each slot, in flat per-slot lists rather than an object
        # per block: a stream of small blocks commits tens of thousands a second, and an
        # object per stored block makes the interpreter's full garbage collections
        # (which walk every live object) both more frequent and longer.
        #: Readers pinning the slot's block.
        self._readers: list[int] = [0] * pool.num_blocks
        #: xxh3-64 of the block committed in the slot, once known (computed at most once:
        #: a stored block is immutable, and it is sent to many peers).
        self._sums: list[int | None] = [None] * pool.num_blocks
        # Keys whose write is in progress -> their slot.
        self._writing: dict[bytes, int] = {}
        # Slots of discarded blocks still pinned by readers (eviction skips pinned ones).
        self._discarded: set[int] = set()
        # Popped from the end: slot 0 is handed out first.
        self._free: list[int] = list(reversed(range(pool.num_blocks)))
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._checksum_failures = 0
        self._listeners: tuple[StoreListener, ...] = ()

    @property
    def pool(self) -> BlockPool:
        return self._pool

    @property
    def capacity(self) -> int:
        return self._pool.num_blocks

    # -- queries -------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` are stored. Counts hits/misses; hits become most recent."""
        _check_batch(keys)
        with self._lock:
            entries = self._entries
            result = list(map(entries.__contains__, keys))
            hits = sum(result)
            if hits:
                touch = entries.move_to_end
                for key in itertools.compress(keys, result):
                    touch(key)
            self._hits += hits
            self._misses += len(result) - hits
        return result

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (committed). No counters, no LRU change."""
        _check_key(key)
        with self._lock:
            return key in self._entries

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_LEN and self.contains(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stored_keys(self) -> list[bytes]:
        """Snapshot of the stored keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> StoreStats:
        with self._lock:
            readers = self._readers
            read_pinned = (sum(1 for slot in self._entries.values() if readers[slot])
                           + len(self._discarded))
            return StoreStats(
                capacity=self._pool.num_blocks,
                used=self._pool.num_blocks - len(self._free),
                pinned=len(self._writing) + read_pinned,
                stored=len(self._entries),
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                checksum_failures=self._checksum_failures,
                memory_kind=self._pool.memory_kind,
                bytes_per_block=self._pool.bytes_per_block,
            )

    # -- listeners -----------------------------------------------------------

    def add_listener(self, listener: StoreListener) -> None:
        """Call ``listener(key, visible)`` on every commit (True), eviction and discard
        (False) from now on.

        Listeners run on the thread that changed the store, with the store's lock
        held, so they see changes in exactly the order they happened (a key evicted
        and stored again is never reported the other way round). They must be quick,
        must not raise, and must not call back into the store: queue the change and
        act on it elsewhere. Register first, then take :meth:`stored_keys`, to miss
        nothing.
        """
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: StoreListener) -> None:
        """Stop calling ``listener``; a no-op if it was not added."""
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def _notify_locked(self, key: bytes, visible: bool) -> None:
        for listener in self._listeners:
            listener(key, visible)

    # -- writing -------------------------------------------------------------

    def begin_write(self, key: bytes) -> BlockWriter | None:
        """Take a slot for ``key``; the block is invisible until ``commit``.

        Returns None when ``key`` is already stored or already being written
        (there is nothing to do: the block is there or about to be). Raises
        :class:`StoreFullError` when no slot is free and every stored block is
        pinned by a reader, or all slots are being written.
        """
        (writer,) = self.begin_write_many((_check_key(key),))
        if isinstance(writer, StoreFullError):
            raise writer
        return writer

    def begin_write_many(self, keys: Sequence[bytes]) -> list[BlockWriter | StoreFullError | None]:
        """:meth:`begin_write` for each key, under one lock (a batch of received blocks).

        Per key: its writer; None when it is already stored or being written (a key
        repeated in ``keys`` too); once no slot is left, the :class:`StoreFullError`, for
        that key and every later one that needed a slot. Writers taken stay valid.
        """
        taken = self.begin_write_slots(keys)
        views = self._pool.slot_views
        return [BlockWriter(self, key, t, views(t)) if type(t) is int else t  # type: ignore[misc]
                for key, t in zip(keys, taken, strict=True)]

    def begin_write_slots(self, keys: Sequence[bytes]) -> list[int | StoreFullError | None]:
        """:meth:`begin_write_many` with slots (ints) for writers, no object per block (a
        data stream's batch); each is finished with :meth:`commit_slots` or
        :meth:`abort_slots` by the thread that took it."""
        _check_batch(keys)
        taken: list[int | StoreFullError | None] = []
        full: StoreFullError | None = None
        with self._lock:
            entries, writing = self._entries, self._writing
            for key in keys:
                if key in entries or key in writing:
                    taken.append(None)
                elif full is not None:
                    taken.append(full)
                else:
                    try:
                        writing[key] = slot = self._take_slot_locked()
                    except StoreFullError as exc:
                        full = exc
                    taken.append(full or slot)
        return taken

    def commit_many(self, writers: Sequence[BlockWriter],
                    expected_checksums: Sequence[int | None]) -> list[ChecksumMismatch | None]:
        """:meth:`BlockWriter.commit` for each writer, under one lock; per writer, the
        :class:`ChecksumMismatch` of a block that failed its check (dropped), else None.

        Raises :class:`StoreError` (committing nothing) if a writer is already finished,
        ValueError if an expected checksum is not a u64. A writer belongs to one thread.
        """
        for writer in writers:
            if writer._done:
                raise StoreError(f"write of block {writer.key.hex()} is already finished")
        out = self.commit_slots([w.key for w in writers], [w.slot for w in writers],
                                expected_checksums)
        for writer in writers:
            writer._done = True
        return out

    def commit_slots(self, keys: Sequence[bytes], slots: Sequence[int],
                     expected_checksums: Sequence[int | None],
                     actual: Sequence[int | None] | None = None
                     ) -> list[ChecksumMismatch | None]:
        """:meth:`commit_many` for slots of :meth:`begin_write_slots`; StoreError
        (committing nothing) unless every key is being written into its slot. ``actual``:
        each slot's checksum, computed by its writer as the bytes landed (None: hashed
        here)."""
        _check_sums(len(keys), len(slots), expected_checksums, actual)
        writing = self._writing
        if list(map(writing.get, keys)) != list(slots):
            _not_being_written(writing, keys, slots)
        if actual is None:  # hashed outside the lock: each slot belongs to its writer
            actual = _checksums(self._pool, slots, expected_checksums)
        out: list[ChecksumMismatch | None] = []
        with self._lock:
            entries, sums = self._entries, self._sums
            for key, slot, want, got in zip(keys, slots, expected_checksums, actual,
                                            strict=True):
                del writing[key]
                if want is not None and got != want:
                    assert got is not None
                    self._free.append(slot)
                    self._checksum_failures += 1
                    out.append(ChecksumMismatch(key, want, got))
                    continue
                entries[key] = slot
                sums[slot] = got
                out.append(None)
                if self._listeners:
                    self._notify_locked(key, True)
        return out

    def abort_slots(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Free slots of :meth:`begin_write_slots` not committed (their blocks never
        existed); a key not being written into that slot is left alone."""
        with self._lock:
            writing = self._writing
            for key, slot in zip(keys, slots, strict=True):
                if writing.get(key) == slot:
                    del writing[key]
                    self._free.append(slot)

    def _take_slot_locked(self) -> int:
        if self._free:
            return self._free.pop()
        readers = self._readers
        for victim, slot in self._entries.items():
            if readers[slot] == 0:
                del self._entries[victim]
                self._evictions += 1
                if self._listeners:
                    self._notify_locked(victim, False)
                return slot
        raise StoreFullError(
            f"all {self._pool.num_blocks} slots are pinned "
            f"({len(self._writing)} being written, the rest held by readers)"
        )

    def _abort(self, writer: BlockWriter) -> None:
        if not writer._done:  # a writer belongs to one thread
            writer._done = True
            self.abort_slots((writer.key,), (writer.slot,))

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
        """:meth:`acquire_read` for each key, under one lock (the sender's batches)."""
        pinned = self.pin_slots(keys)
        views = self._pool.slot_views
        return [None if slot < 0 else BlockReader(self, key, slot, views(slot))
                for key, slot in zip(keys, pinned, strict=True)]

    def pin_slots(self, keys: Sequence[bytes]) -> list[int]:
        """:meth:`acquire_read_many` with slots for readers (-1: not stored), no object
        per block (a data stream's batch); each pin is released once with
        :meth:`unpin_slots`, and holds the slot's bytes still until then."""
        _check_batch(keys)
        pinned: list[int] = []
        with self._lock:
            entries, readers = self._entries, self._readers
            for key in keys:
                slot = entries.get(key)
                if slot is None:
                    pinned.append(-1)
                    continue
                readers[slot] += 1
                entries.move_to_end(key)
                pinned.append(slot)
        return pinned

    def slot_checksums(self, slots: Sequence[int]) -> list[int]:
        """The checksum of the block in each slot pinned by :meth:`pin_slots`, computed
        once per stored block (as :attr:`BlockReader.checksum`)."""
        sums, views = self._sums, self._pool.slot_views
        for slot in slots:
            if sums[slot] is None:
                # Safe without the lock: the pin keeps the bytes still and the slot taken,
                # and two threads racing here store the same value.
                sums[slot] = block_checksum(views(slot))
        return [sums[slot] for slot in slots]  # type: ignore[misc]

    def unpin_slots(self, slots: Sequence[int]) -> None:
        """Release one pin of each slot :meth:`pin_slots` gave (once per pin)."""
        with self._lock:
            readers = self._readers
            counts = collections.Counter(slots)
            for slot, n in counts.items():
                if not 0 <= slot < len(readers) or readers[slot] < n:
                    raise StoreError(f"slot {slot} is not pinned {n} time(s)")
            for slot in slots:
                self._unpin_locked(slot)

    def release_many(self, readers: Iterable[BlockReader]) -> None:
        """:meth:`BlockReader.release` for each reader, under one lock."""
        with self._lock:
            for reader in readers:
                self._release_locked(reader)

    def _release_locked(self, reader: BlockReader) -> None:
        if reader._released:
            return
        reader._released = True
        self._unpin_locked(reader.slot)

    def _unpin_locked(self, slot: int) -> None:
        self._readers[slot] -= 1
        if self._readers[slot] == 0 and slot in self._discarded:
            self._discarded.remove(slot)
            self._free.append(slot)

    def _checksum_of(self, reader: BlockReader) -> int:
        """:func:`block_checksum` of the block ``reader`` pins, computed once."""
        if reader._released:
            raise StoreError(f"reader of block {reader.key.hex()} was released")
        slot = reader.slot
        value = self._sums[slot]
        if value is None:
            # Safe without the lock: the pin keeps the bytes still and the slot taken,
            # and two readers racing here store the same value.
            value = block_checksum(reader.views)
            with self._lock:
                # Released meanwhile (another thread): the slot may be another block's.
                if not reader._released:
                    self._sums[slot] = value
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
        _check_key(key)
        with self._lock:
            slot = self._entries.pop(key, None)
            if slot is None:
                return False
            if self._listeners:
                self._notify_locked(key, False)
            if self._readers[slot]:
                self._discarded.add(slot)
            else:
                self._free.append(slot)
            return True

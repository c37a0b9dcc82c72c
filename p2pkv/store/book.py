"""The block store's bookkeeping: what it knows of each pool slot, under one lock.

:class:`StoreBook` is the state that both halves of the store share: the per-key API of
:class:`~p2pkv.store.BlockStore` (writer and reader handles, lookups, discard) and the
data path's batch calls on slot numbers, :class:`~p2pkv.store.slots.SlotBatches`
(``store.slots``). Neither half keeps state of its own, so a block taken through one is
seen by the other at once: a slot being written by a data stream is "being written"
for :meth:`~p2pkv.store.BlockStore.begin_write` too, and a slot pinned by a sender is
never evicted by a writer of either kind.

The book holds, for the pool's ``num_blocks`` slots:

- :attr:`StoreBook.entries`: committed, visible blocks -> their slot, in LRU order;
- :attr:`StoreBook.writing`: keys whose write is in progress -> their slot;
- :attr:`StoreBook.discarded`: slots of discarded blocks that readers still pin;
- :attr:`StoreBook.free`: slots that hold nothing;
- per slot, its readers (pins) and the block's checksum once known;
- the listeners, and the counters of :class:`StoreStats`.

Every slot is in exactly one of ``free``, ``writing``, ``entries`` or ``discarded``, and
only a slot in ``entries`` or ``discarded`` has readers. A slot with readers is never
taken: eviction skips it, and a discarded one goes back to ``free`` at its last unpin,
so memory never moves under a reader (e.g. a ``zmq`` zero-copy send still in flight).

Threading: one lock, :attr:`StoreBook.lock`, guards all of it. The ``*_locked`` steps
run with it held, and so does every change but one: the checksum of a pinned block,
which two threads racing may both store without it (it is the same value). Payload
bytes are not the book's: they are copied and hashed outside the lock, which is safe
because a slot being written belongs to its writer and a pinned slot's bytes stay
still. Listeners hear every change of the visible set (``entries``' keys) with the lock
held, in the order the changes happened.

The store's errors and its counters' snapshot are defined here, where both halves can
raise and return them; :mod:`p2pkv.store` exports them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from p2pkv.errors import P2PKVError, StoreFullError
from p2pkv.store.pool import BlockPool, MemoryKind

__all__ = [
    "ChecksumMismatch",
    "StoreBook",
    "StoreError",
    "StoreListener",
    "StoreStats",
]

#: ``listener(key, visible)``: ``visible`` is True when ``key`` was committed, False when
#: it was evicted or discarded. See :meth:`BlockStore.add_listener`.
StoreListener: TypeAlias = Callable[[bytes, bool], None]


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


class StoreBook:
    """The bookkeeping of one store over ``pool``; see the module docstring.

    Its attributes are shared by :class:`~p2pkv.store.BlockStore` and
    :class:`~p2pkv.store.slots.SlotBatches`, and read or changed only with :attr:`lock`
    held, except where a comment says why not.
    """

    __slots__ = ("checksum_failures", "discarded", "entries", "evictions", "free", "hits",
                 "listeners", "lock", "misses", "pool", "readers", "sums", "writing")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        # Committed, visible blocks -> their slot; iteration order is LRU (oldest first).
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        # What the store knows of each slot, in flat per-slot lists rather than an object
        # per block: a stream of small blocks commits tens of thousands a second, and an
        # object per stored block makes the interpreter's full garbage collections
        # (which walk every live object) both more frequent and longer.
        #: Readers pinning the slot's block.
        self.readers: list[int] = [0] * pool.num_blocks
        #: xxh3-64 of the block committed in the slot, once known (computed at most once:
        #: a stored block is immutable, and it is sent to many peers). Set at every
        #: commit, so a reused slot never shows the sum of the block it held before.
        self.sums: list[int | None] = [None] * pool.num_blocks
        # Keys whose write is in progress -> their slot.
        self.writing: dict[bytes, int] = {}
        # Slots of discarded blocks still pinned by readers (eviction skips pinned ones).
        self.discarded: set[int] = set()
        # Popped from the end: slot 0 is handed out first.
        self.free: list[int] = list(reversed(range(pool.num_blocks)))
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.checksum_failures = 0
        self.listeners: tuple[StoreListener, ...] = ()

    def stats(self) -> StoreStats:
        """A consistent snapshot of the counters (takes the lock)."""
        with self.lock:
            readers = self.readers
            read_pinned = (sum(1 for slot in self.entries.values() if readers[slot])
                           + len(self.discarded))
            return StoreStats(
                capacity=self.pool.num_blocks,
                used=self.pool.num_blocks - len(self.free),
                pinned=len(self.writing) + read_pinned,
                stored=len(self.entries),
                hits=self.hits,
                misses=self.misses,
                evictions=self.evictions,
                checksum_failures=self.checksum_failures,
                memory_kind=self.pool.memory_kind,
                bytes_per_block=self.pool.bytes_per_block,
            )

    def notify_locked(self, key: bytes, visible: bool) -> None:
        """Tell every listener that ``key`` became visible (True) or stopped being
        visible (False). Called with the lock held, right where the change is made, so
        listeners hear changes in exactly the order they happened."""
        for listener in self.listeners:
            listener(key, visible)

    def take_slot_locked(self) -> int:
        """A slot for a new write: a free one, else the least recently used committed
        block that no reader pins is evicted (its listeners told) and its slot reused.
        :class:`StoreFullError` when every slot is being written or pinned."""
        if self.free:
            return self.free.pop()
        readers = self.readers
        for victim, slot in self.entries.items():
            if readers[slot] == 0:
                del self.entries[victim]
                self.evictions += 1
                if self.listeners:
                    self.notify_locked(victim, False)
                return slot
        raise StoreFullError(
            f"all {self.pool.num_blocks} slots are pinned "
            f"({len(self.writing)} being written, the rest held by readers)"
        )

    def unpin_locked(self, slot: int) -> None:
        """Drop one pin of ``slot``; a discarded block's slot is freed at its last pin,
        not before: memory never moves under a reader."""
        self.readers[slot] -= 1
        if self.readers[slot] == 0 and slot in self.discarded:
            self.discarded.remove(slot)
            self.free.append(slot)

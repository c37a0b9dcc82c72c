"""The storage layer: a preallocated pool of fixed-size slots, the store's bookkeeping
over it, and the copies between an engine's tensors and the pool.

* :mod:`p2pkv.store.pool`: :class:`~p2pkv.store.pool.BlockPool`, the pinned,
  page-aligned or shared memory the slots live in.
* :mod:`p2pkv.store.book`: the bookkeeping under one lock (key -> slot in LRU order,
  free list, pins, keys being written, listeners, counters), the store's errors and
  :class:`StoreStats`.
* :mod:`p2pkv.store.handles`: :class:`BlockWriter` / :class:`BlockReader`, a hold on one
  slot, finished through the store.
* :mod:`p2pkv.store.slots`: the data path's batch calls on slot numbers (``store.slots``).
* :mod:`p2pkv.store.core`: :class:`BlockStore`, the per-key API over them.
* :mod:`p2pkv.store.engine`: engine tensors <-> pool (on a CUDA stream when present).

The store's public names are exported here, as they were from the module ``p2pkv.store``
(the modules of this package import each other by their own names, never this one).
"""

from __future__ import annotations

from p2pkv.store.core import (
    BlockReader,
    BlockStore,
    BlockWriter,
    BytesLike,
    ChecksumMismatch,
    StoreError,
    StoreFullError,
    StoreListener,
    StoreStats,
    block_checksum,
)

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

"""The preallocated block pool: one block of host memory per slot, never regrown.

The pool is allocated once when the node starts. It holds ``num_blocks``
slots; slot ``s`` of a layout with segments ``[n0, n1, ...]`` is segment ``i``
at byte offset ``s * n_i`` of region ``i``. Regions start on 4096-byte
boundaries so DMA engines and ``O_DIRECT``-style IO can use them as they are.

Memory is page-locked (``pin_memory=True``) when CUDA is available, because a
CUDA engine copies blocks to and from the GPU asynchronously only from pinned
memory; otherwise it is ordinary pageable memory, aligned by hand.

With ``shared=True`` the pool lives in a named shared-memory segment
(:class:`p2pkv.shm.SharedSegment`, mode 0600) that same-host peers map read-only
to copy blocks straight out of it (``protocol/SPEC.md`` §16). Where CUDA is
available the segment is registered with ``cudaHostRegister`` so it stays
page-locked; if that fails it is used pageable, and ``memory_kind`` says which.
Shared memory is opt-in: the default stays private pinned (CUDA) or pageable memory.

Two views of the same bytes are exposed, and neither copies:

- :attr:`BlockPool.kv_tensors`: engine-facing tensors in the model dtype, one
  per region, shaped ``(num_blocks, *layout.block_shapes[i])``.
- :meth:`BlockPool.segment_views`: per-slot writable ``memoryview`` objects
  (format ``"B"``) for ``zmq`` ``send(view, copy=False)`` / ``recv_into(view)``.

Threading: the pool itself has no mutable state after construction; deciding
who may touch which slot is the job of :class:`p2pkv.store.BlockStore`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from p2pkv.layout import torch_dtype
from p2pkv.shm import SharedSegment

if TYPE_CHECKING:
    from p2pkv.layout import KVLayout

__all__ = ["PAGE_SIZE", "BlockPool", "MemoryKind"]

logger = logging.getLogger("p2pkv.pool")

PAGE_SIZE = 4096
MemoryKind = Literal["pinned", "pageable", "shared", "shared-pinned"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


_CACHED_VIEWS = 1 << 20
"""Most per-slot segment views a pool keeps made (slots × segments)."""


class BlockPool:
    """Fixed-size host memory for ``num_blocks`` blocks of ``layout``.

    Lifecycle: construct once at start; the memory lives as long as the pool
    (and any view handed out) is referenced. ``pin=None`` pins iff
    ``torch.cuda.is_available()``; ``pin=True`` without CUDA raises. ``shared=True``
    puts the pool in a shared-memory segment (:attr:`segment`); it raises
    :class:`~p2pkv.shm.ShmUnavailable` when no segment can be made, and :meth:`close`
    removes the segment's name.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, *, pin: bool | None = None,
                 shared: bool = False) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        elif pin and not cuda:
            raise ValueError("pin=True needs CUDA; torch.cuda.is_available() is False")

        self.layout: KVLayout = layout
        self.num_blocks: int = num_blocks
        self.segment_sizes: tuple[int, ...] = layout.segment_sizes
        self.bytes_per_block: int = layout.bytes_per_block
        self.pinned: bool = pin
        self.memory_kind: MemoryKind = "pinned" if pin else "pageable"

        #: The shared-memory segment holding the pool (``shared=True``), else None.
        self.segment: SharedSegment | None = None
        # Each region starts on a page boundary: pad every region to whole pages.
        strides = [_round_up(num_blocks * size, PAGE_SIZE) for size in self.segment_sizes]
        total = sum(strides)
        if shared:
            self.segment = SharedSegment(self.segment_sizes, num_blocks)
            backing = torch.frombuffer(self.segment.buffer, dtype=torch.uint8)
            offsets = list(self.segment.region_offsets)
            self.memory_kind = "shared"
            if pin:
                self.pinned = _register_with_cuda(backing)
                self.memory_kind = "shared-pinned" if self.pinned else "shared"
        else:
            # One extra page lets us move the start to a page boundary ourselves;
            # pinned allocations are page-aligned already, but checking is cheap.
            backing = torch.empty(total + PAGE_SIZE, dtype=torch.uint8, pin_memory=pin)
            start = -backing.data_ptr() % PAGE_SIZE
            offsets = [start + sum(strides[:i]) for i in range(len(strides))]
        self._backing = backing
        self.nbytes: int = num_blocks * self.bytes_per_block

        dtype = torch_dtype(layout.geometry.dtype)
        regions: list[torch.Tensor] = []
        typed: list[torch.Tensor] = []
        for size, offset, shape in zip(
            self.segment_sizes, offsets, layout.engine_shapes(num_blocks), strict=True
        ):
            region = backing[offset : offset + num_blocks * size]
            if region.data_ptr() % PAGE_SIZE:  # pragma: no cover - arithmetic guarantees it
                raise RuntimeError("pool region is not page-aligned")
            regions.append(region)
            typed.append(region.view(dtype).view(shape))
        self._regions: tuple[torch.Tensor, ...] = tuple(regions)
        #: Engine-facing typed views, one per region (V1: one, V2: one per layer).
        self.kv_tensors: tuple[torch.Tensor, ...] = tuple(typed)
        # Built once: slicing a memoryview is cheap and allocates no tensor, so
        # segment_views() stays fast on the data path.
        self._region_views: tuple[memoryview, ...] = tuple(
            region.numpy().data for region in regions
        )
        # Each slot's views, made on first use: a data stream lands tens of thousands
        # of small blocks per second, and slicing them anew each time shows (bounded,
        # so that a pool of many small segments does not hold millions of views).
        self._slot_views: list[tuple[memoryview, ...] | None] | None = (
            [None] * num_blocks if num_blocks * len(self.segment_sizes) <= _CACHED_VIEWS
            else None)
        logger.info(
            "block pool: %d blocks x %d bytes (%d segments, layout %s) = %d bytes in %s memory",
            num_blocks,
            self.bytes_per_block,
            len(self.segment_sizes),
            layout.name,
            self.nbytes,
            self.memory_kind,
        )

    @classmethod
    def for_bytes(
        cls, layout: KVLayout, capacity_bytes: int, *, pin: bool | None = None,
        shared: bool = False,
    ) -> BlockPool:
        """As many whole blocks as fit in ``capacity_bytes`` (at least one)."""
        blocks = capacity_bytes // layout.bytes_per_block
        if blocks <= 0:
            raise ValueError(
                f"capacity of {capacity_bytes} bytes holds no block of "
                f"{layout.bytes_per_block} bytes"
            )
        return cls(layout, blocks, pin=pin, shared=shared)

    def close(self) -> None:
        """Remove the shared segment's name (idempotent; nothing to do for a private
        pool). The memory stays valid for as long as the pool is referenced."""
        if self.segment is not None:
            self.segment.close()

    def segment_views(self, slot: int) -> list[memoryview]:
        """Writable, C-contiguous ``"B"`` views of slot ``slot``, one per segment.

        The views alias pool memory: anything written through them is what the
        typed tensors see. They stay valid as long as the pool exists, but the
        bytes belong to whoever holds the slot in the store.
        """
        return list(self.slot_views(slot))

    def slot_views(self, slot: int) -> tuple[memoryview, ...]:
        """:meth:`segment_views` as the pool's own tuple, not a fresh list: the store's
        per-block path (tens of thousands of small blocks per second) takes it as is."""
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"slot {slot} out of range [0, {self.num_blocks})")
        cache = self._slot_views
        if cache is None:
            return self._views_of(slot)
        cached = cache[slot]
        if cached is None:
            cached = cache[slot] = self._views_of(slot)
        return cached

    def views_of_slots(self, slots: Sequence[int]) -> list[tuple[memoryview, ...]]:
        """:meth:`slot_views` of each slot in ``slots``, checked as one batch (a data
        stream's message of hundreds of small blocks)."""
        if slots and not (min(slots) >= 0 and max(slots) < self.num_blocks):
            bad = next(s for s in slots if not 0 <= s < self.num_blocks)
            raise IndexError(f"slot {bad} out of range [0, {self.num_blocks})")
        cache = self._slot_views
        if cache is None:
            return [self._views_of(slot) for slot in slots]
        got = [cache[slot] for slot in slots]
        if not all(got):  # some not made yet (a slot's tuple is never empty)
            for n, slot in enumerate(slots):
                if got[n] is None:
                    got[n] = cache[slot] = self._views_of(slot)
        return got  # type: ignore[return-value]

    def _views_of(self, slot: int) -> tuple[memoryview, ...]:
        return tuple(view[slot * size : (slot + 1) * size]
                     for view, size in zip(self._region_views, self.segment_sizes, strict=True))

    def block_tensors(self, slot: int) -> list[torch.Tensor]:
        """Typed views of slot ``slot``, one per segment (shapes ``layout.block_shapes``)."""
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"slot {slot} out of range [0, {self.num_blocks})")
        return [tensor[slot] for tensor in self.kv_tensors]

    def region_data_ptrs(self) -> tuple[int, ...]:
        """Start address of every region; constant for the pool's life."""
        return tuple(region.data_ptr() for region in self._regions)

    def __repr__(self) -> str:
        return (
            f"BlockPool(layout={self.layout.name!r}, num_blocks={self.num_blocks}, "
            f"bytes_per_block={self.bytes_per_block}, memory_kind={self.memory_kind!r})"
        )


def _register_with_cuda(backing: torch.Tensor) -> bool:
    """Page-lock a shared mapping for CUDA (``cudaHostRegister``); False when refused."""
    try:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(backing.data_ptr(), backing.numel(), 0)
    except Exception as exc:  # pragma: no cover - needs CUDA
        logger.warning("cannot page-lock the shared pool for CUDA (%s); it stays pageable",
                       exc)
        return False
    if int(err) != 0:  # pragma: no cover - needs CUDA
        logger.warning("cudaHostRegister refused the shared pool (error %s); it stays "
                       "pageable", err)
        return False
    return True  # pragma: no cover - needs CUDA

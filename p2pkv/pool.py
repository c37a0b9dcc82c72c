"""The preallocated block pool: one block of host memory per slot, never regrown.

The pool is allocated once when the node starts. It holds ``num_blocks``
slots; slot ``s`` of a layout with segments ``[n0, n1, ...]`` is segment ``i``
at byte offset ``s * n_i`` of region ``i``. Regions start on 4096-byte
boundaries so DMA engines and ``O_DIRECT``-style IO can use them as they are.

Memory is page-locked (``pin_memory=True``) when CUDA is available, because a
CUDA engine copies blocks to and from the GPU asynchronously only from pinned
memory; otherwise it is ordinary pageable memory, aligned by hand.

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
from typing import TYPE_CHECKING, Literal

import torch

from p2pkv.layout import torch_dtype

if TYPE_CHECKING:
    from p2pkv.layout import KVLayout

__all__ = ["PAGE_SIZE", "BlockPool", "MemoryKind"]

logger = logging.getLogger("p2pkv.pool")

PAGE_SIZE = 4096
MemoryKind = Literal["pinned", "pageable"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class BlockPool:
    """Fixed-size host memory for ``num_blocks`` blocks of ``layout``.

    Lifecycle: construct once at start; the memory lives as long as the pool
    (and any view handed out) is referenced. ``pin=None`` pins iff
    ``torch.cuda.is_available()``; ``pin=True`` without CUDA raises.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, *, pin: bool | None = None) -> None:
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

        # Each region starts on a page boundary: pad every region to whole pages.
        strides = [_round_up(num_blocks * size, PAGE_SIZE) for size in self.segment_sizes]
        total = sum(strides)
        # One extra page lets us move the start to a page boundary ourselves;
        # pinned allocations are page-aligned already, but checking is cheap.
        backing = torch.empty(total + PAGE_SIZE, dtype=torch.uint8, pin_memory=pin)
        start = -backing.data_ptr() % PAGE_SIZE
        self._backing = backing
        self.nbytes: int = num_blocks * self.bytes_per_block

        dtype = torch_dtype(layout.geometry.dtype)
        regions: list[torch.Tensor] = []
        typed: list[torch.Tensor] = []
        offset = start
        for size, stride, shape in zip(
            self.segment_sizes, strides, layout.engine_shapes(num_blocks), strict=True
        ):
            region = backing[offset : offset + num_blocks * size]
            if region.data_ptr() % PAGE_SIZE:  # pragma: no cover - arithmetic guarantees it
                raise RuntimeError("pool region is not page-aligned")
            regions.append(region)
            typed.append(region.view(dtype).view(shape))
            offset += stride
        self._regions: tuple[torch.Tensor, ...] = tuple(regions)
        #: Engine-facing typed views, one per region (V1: one, V2: one per layer).
        self.kv_tensors: tuple[torch.Tensor, ...] = tuple(typed)
        # Built once: slicing a memoryview is cheap and allocates no tensor, so
        # segment_views() stays fast on the data path.
        self._region_views: tuple[memoryview, ...] = tuple(
            region.numpy().data for region in regions
        )
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
        cls, layout: KVLayout, capacity_bytes: int, *, pin: bool | None = None
    ) -> BlockPool:
        """As many whole blocks as fit in ``capacity_bytes`` (at least one)."""
        blocks = capacity_bytes // layout.bytes_per_block
        if blocks <= 0:
            raise ValueError(
                f"capacity of {capacity_bytes} bytes holds no block of "
                f"{layout.bytes_per_block} bytes"
            )
        return cls(layout, blocks, pin=pin)

    def segment_views(self, slot: int) -> list[memoryview]:
        """Writable, C-contiguous ``"B"`` views of slot ``slot``, one per segment.

        The views alias pool memory: anything written through them is what the
        typed tensors see. They stay valid as long as the pool exists, but the
        bytes belong to whoever holds the slot in the store.
        """
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"slot {slot} out of range [0, {self.num_blocks})")
        return [
            view[slot * size : (slot + 1) * size]
            for view, size in zip(self._region_views, self.segment_sizes, strict=True)
        ]

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

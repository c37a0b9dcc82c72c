"""A vLLM engine's p2pkv identity, derived from its offloading spec.

The run config reproduces ``FileMapper.from_offloading_spec`` field by field (the same
opt-in vLLM's own P2P tier uses: parallel-agnostic sharing, one file per offload chunk),
so the fingerprint a p2pkv tier advertises is the digest vLLM computes for the same
spec. The block-key hash is vLLM's: its name (``vllm-<prefix_caching_hash_algo>``) and a
seed derived from ``NONE_HASH``, the value every block-hash chain starts from. Two engines
whose ``NONE_HASH`` differ (another hash function, or another ``PYTHONHASHSEED``) would
never compute a common key, so the handshake refuses them and says why.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from p2pkv.identity import RunConfig

#: Prefix of the ``khash.algo`` a vLLM engine advertises (``vllm-sha256``, ...).
KEY_HASH_PREFIX = "vllm-"


def run_config_from_spec(spec: Any, *, parallel_agnostic: bool = True) -> RunConfig:
    """The run config of an ``OffloadingSpec``, as ``FileMapper.from_offloading_spec``
    builds it with ``blocks_per_file=spec.blocks_per_chunk``."""
    config = spec.config
    groups = [
        {"tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)}
        for g in config.groups
    ]
    canonical_format = None
    if config.canonical_layout:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )

        canonical_format = canonical_format_id(config.kv_cache_layout)
    parallel = config.parallel
    return RunConfig.resolve(
        config.model.name,
        parallel_agnostic=parallel_agnostic,
        is_parallelism_agnostic=bool(parallel.is_parallelism_agnostic),
        replicated_layout=bool(config.replicated_layout),
        tokens_per_hash=config.cache.tokens_per_hash,
        blocks_per_file=spec.blocks_per_chunk,
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size,
        rank=parallel.rank,
        dtype=str(config.model.dtype),
        kv_cache_groups=groups,
        canonical_format=canonical_format,
    )


@dataclass(frozen=True)
class VLLMKeyHash:
    """vLLM's block-hash identity: the hash function and the chain's start value."""

    #: ``prefix_caching_hash_algo`` (``sha256``, ``sha256_cbor``, ``xxhash``, ...).
    function: str
    #: ``NONE_HASH``: the hash of the seed, where every block-hash chain starts.
    none_hash: bytes

    @property
    def algo(self) -> str:
        """The ``khash.algo`` name advertised at the handshake."""
        return KEY_HASH_PREFIX + self.function

    @property
    def seed(self) -> int:
        """A u64 derived from ``NONE_HASH`` (the ``khash.seed`` advertised)."""
        return int.from_bytes(hashlib.sha256(self.none_hash).digest()[:8], "big")

    @property
    def seed_digest(self) -> str:
        """A short, printable digest of ``NONE_HASH`` (never the seed itself)."""
        return hashlib.sha256(self.none_hash).hexdigest()[:16]


def current_key_hash() -> VLLMKeyHash:
    """vLLM's key hash in this process. Call it after the engine initialised its
    block hashing (``init_none_hash``), which happens after the scheduler is built."""
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        raise RuntimeError("vLLM has not initialised NONE_HASH yet (init_none_hash has not "
                           "run); the key hash is only known once the engine core started")
    return VLLMKeyHash(function=_hash_function_name(bytes(none_hash)),
                       none_hash=bytes(none_hash))


def _hash_function_name(none_hash: bytes) -> str:
    """Which of vLLM's prefix-caching hash functions made ``none_hash``.

    ``NONE_HASH`` is the hash function applied to the seed, so re-hashing the seed with
    each candidate names the function without reading the engine's configuration.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    seed = get_none_hash_seed()
    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        try:
            if bytes(get_hash_fn_by_name(name)(seed)) == none_hash:
                return name
        except Exception:  # a function this vLLM build lacks
            continue
    return "unknown"

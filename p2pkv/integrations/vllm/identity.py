"""A vLLM engine's p2pkv identity, derived from its offloading spec.

The run config reproduces ``FileMapper.from_offloading_spec`` field by field (the same
opt-in vLLM's own P2P tier uses: parallel-agnostic sharing, one file per offload chunk),
so the fingerprint a p2pkv tier advertises is the digest vLLM computes for the same
spec. What that digest lets through is declared in the identity extension:

- ``kv_memory_layout``: the byte order of a block in the engine's KV cache (vLLM's CPU
  backend stores all K of a block before its V: ``HND_K_THEN_V``; on GPUs the spec's
  ``kv_cache_layout``);
- ``key_hash``: vLLM's prefix-caching hash function and a digest of the seed its block
  hashes start from (``get_none_hash_seed()``: ``PYTHONHASHSEED``, a fixed default, or a
  random per-process value). Engines whose seeds differ never compute a common key, so
  the handshake refuses them and says to set ``PYTHONHASHSEED`` equal everywhere;
- ``model_revision`` and ``model_overrides``: vLLM does not hand them to a tier, so the
  operator declares them in the tier config (the same on every engine);
- ``engine``: ``vllm <version>``, informational.

Block keys are vLLM's offload keys, carried opaquely under ``khash.algo =
"vllm-<hash function>"`` (SPEC 15.2); the seed travels only as the extension's digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pkv.identity import IdentityExtension, RunConfig, key_hash_identity, model_overrides_digest

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
    """vLLM's block-hash identity: the hash function and the seed of the chain."""

    #: ``prefix_caching_hash_algo`` (``sha256``, ``sha256_cbor``, ``xxhash``, ...).
    function: str
    #: ``get_none_hash_seed()``: what ``NONE_HASH``, every chain's start, is hashed from.
    seed: str

    @property
    def algo(self) -> str:
        """The ``khash.algo`` name advertised at the handshake (SPEC 15.2)."""
        return KEY_HASH_PREFIX + self.function

    @property
    def identity(self) -> str:
        """The extension's ``key_hash``: the function and a digest of the seed (the
        seed itself never leaves the process)."""
        return key_hash_identity(self.function, self.seed)


def current_key_hash() -> VLLMKeyHash:
    """vLLM's key hash in this process. Call it after the engine initialised its
    block hashing (``init_none_hash``), which happens after the scheduler is built."""
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        raise RuntimeError("vLLM has not initialised NONE_HASH yet (init_none_hash has not "
                           "run); the key hash is only known once the engine core started")
    return VLLMKeyHash(function=_hash_function_name(bytes(none_hash)),
                       seed=kv_cache_utils.get_none_hash_seed())


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
        except Exception:
            continue
    return "unknown"


def memory_layout(spec: Any) -> str | None:
    """How this engine orders a block's bytes in its KV cache (an extension name)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # The CPU attention backend reports an HND layout, but its kernels keep all K of a
        # (block, head) before its V: not interchangeable with a GPU engine's HND.
        return "HND_K_THEN_V"
    layout = spec.config.kv_cache_layout
    if layout is None:
        try:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            layout = get_kv_cache_layout()
        except Exception:
            return None
    return str(layout)


def extension_for(spec: Any, key_hash: VLLMKeyHash, *, kv_memory_layout: str | None = None,
                  model_revision: str | None = None,
                  model_overrides: dict[str, Any] | None = None) -> IdentityExtension:
    """The identity extension of a vLLM engine; explicit values win over detection."""
    import vllm

    return IdentityExtension(
        kv_memory_layout=kv_memory_layout or memory_layout(spec),
        model_revision=model_revision,
        model_overrides=(None if model_overrides is None
                         else model_overrides_digest(model_overrides)),
        key_hash=key_hash.identity,
        engine=f"vllm {vllm.__version__}",
    )

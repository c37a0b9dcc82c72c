"""A vLLM engine's p2pkv identity, derived from the engine itself.

The run config reproduces ``FileMapper.from_offloading_spec`` field by field (the same
opt-in vLLM's own P2P tier uses: parallel-agnostic sharing, one file per offload chunk),
so the fingerprint a p2pkv tier advertises is the digest vLLM computes for the same
spec. What that digest cannot see, the tier finds out from the engine, with no operator
action, and declares in the identity extension:

- ``model_weights``: a content digest of the checkpoint's weight files
  (:mod:`p2pkv.identity.checkpoint`: Hugging Face blob names, a digest cache, or hashed
  in a background thread while the engine finishes starting);
- ``model_config``: a digest of the checkpoint's ``config.json``;
- ``model_overrides``: the digest of what the engine changes on top of the checkpoint
  (``hf_overrides``, the quantization method), ``{}`` when nothing;
- ``model_revision``: ``ModelConfig.revision``, else the Hugging Face snapshot commit;
- ``kv_memory_layout``: the byte order of a block in the engine's KV cache (vLLM's CPU
  backend stores all K of a block before its V: ``HND_K_THEN_V``; on GPUs the spec's
  ``kv_cache_layout``);
- ``key_hash``: vLLM's prefix-caching hash function and a digest of the seed its block
  hashes start from (``get_none_hash_seed()``), read once the engine core seeded it;
- ``engine``: ``vllm <version>``, informational.

The engine configuration (``VllmConfig``) is not handed to a tier by vLLM's API: the
tier takes it from :class:`~p2pkv.integrations.vllm.P2PKVConnector`, which makes it
known to the tiers built inside its constructor (:func:`~.connector.building`), else as
vLLM's current config when the caller set one (``set_current_vllm_config``). Without it
the tier does not start: an identity it cannot derive is never treated as matching. A
value the operator declares in the tier config must equal what is derived, or the engine
stops at start with both values in the error.

Block keys are vLLM's offload keys, carried opaquely under ``khash.algo =
"vllm-<hash function>"`` (SPEC 15.2); the seed travels only as the extension's digest.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.identity import (
    IdentityExtension,
    RunConfig,
    canonical_model_overrides,
    key_hash_identity,
    model_overrides_digest,
)
from p2pkv.identity.checkpoint import (
    CheckpointError,
    CheckpointIdentity,
    checkpoint_identity,
    hub_snapshot_revision,
    modeling_code_digest,
    readable_weight_files,
)
from p2pkv.integrations.vllm.options import CONNECTOR_KEYS

log = logging.getLogger("vllm.p2pkv")

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


def key_hash_ready() -> bool:
    """Whether vLLM has seeded its block hashing in this process (``init_none_hash``,
    which the engine core runs right after building its scheduler), so that
    :func:`current_key_hash` can answer."""
    from vllm.v1.core import kv_cache_utils

    return getattr(kv_cache_utils, "NONE_HASH", None) is not None


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
        except Exception as exc:  # one candidate this vLLM cannot run: try the next
            log.debug("p2pkv tier: hash function %s unavailable: %s: %s", name,
                      type(exc).__name__, exc)
            continue
    log.warning("p2pkv tier: vLLM's block-hash function is none of sha256, sha256_cbor, "
                "xxhash, xxhash_cbor; the identity says 'unknown'")
    return "unknown"


def memory_layout(spec: Any, use_mla: bool = False) -> str | None:
    """How this engine orders a block's bytes in its KV cache (an extension name)."""
    from vllm.platforms import current_platform

    if use_mla:
        # vLLM's MLA backends (CPU_MLA included) cache one compact latent row per token,
        # [blocks, tokens, kv_lora_rank + qk_rope_head_dim] per layer: no KV heads, no
        # K/V split, whatever the attention backend of other models would report.
        return "MLA_LATENT"
    if current_platform.is_cpu():
        # The CPU attention backend reports an HND layout, but its kernels keep all K of a
        # (block, head) before its V: not interchangeable with a GPU engine's HND.
        return "HND_K_THEN_V"
    layout = spec.config.kv_cache_layout
    if layout is None:
        try:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            layout = get_kv_cache_layout()
        except Exception as exc:
            log.warning("p2pkv tier: vLLM does not say its KV cache layout (%s: %s); the "
                        "identity leaves it out", type(exc).__name__, exc)
            return None
    return str(layout)


def find_vllm_config() -> Any | None:
    """The engine's ``VllmConfig``: the one :class:`~p2pkv.integrations.vllm.P2PKVConnector`
    was built with, when it is building the calling tier; else vLLM's current one (set
    by whoever builds a tier directly, with ``set_current_vllm_config``); else None."""
    from vllm.config import get_current_vllm_config_or_none

    from p2pkv.integrations.vllm.connector import building

    context = building()
    if context is not None:
        return context.vllm_config
    return get_current_vllm_config_or_none()


@dataclass(frozen=True)
class EngineIdentity:
    """What the tier derived from the engine at start (the weights digest comes later,
    from :attr:`checkpoint_path`), each field with where it came from."""

    kv_memory_layout: str | None
    model_revision: str | None
    model_overrides: str
    #: The canonical text behind ``model_overrides``, for logs and errors.
    overrides_canonical: str
    #: The local checkpoint to hash; None when the engine loads no checkpoint (dummy).
    checkpoint_path: str | None
    #: ``model_weights`` when no checkpoint is read (``load_format="dummy"``).
    fixed_weights: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    #: True when the engine serves LoRA adapters (``VllmConfig.lora_config`` is set):
    #: requests are then shared by their adapter's content (adapters.py).
    lora_enabled: bool = False


def _plain(value: Any) -> Any:
    """``value`` with every leaf the canonical form has no rule for (a dtype, an enum)
    written as its ``repr``: deterministic, and never an error at engine start."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _overrides_of(model_config: Any) -> dict[str, Any]:
    """What the engine changes on top of the checkpoint, in the SPEC 1.4 key names."""
    hf = model_config.hf_overrides
    if callable(hf):
        hf = f"callable {getattr(hf, '__module__', '?')}.{getattr(hf, '__qualname__', '?')}"
    elif isinstance(hf, Mapping):
        hf = _plain(dict(hf)) or None
    quantization = model_config.quantization
    return {"hf_overrides": hf,
            "quantization": None if quantization is None else str(quantization)}


#: RoPE types whose values depend on the run, not only on ``config.json`` (vLLM 0.32:
#: Phi-3's long RoPE takes its long factors when ``max_model_len`` exceeds
#: ``original_max_position_embeddings``). Dynamic NTK (``dynamic``) is not among them:
#: vLLM caches it for ``max_position_embeddings`` times its factor, both in config.json.
RUN_DEPENDENT_ROPE = ("longrope", "su")


def _rope_of_run(model_config: Any) -> dict[str, Any] | None:
    """What a run-dependent RoPE (:data:`RUN_DEPENDENT_ROPE`) takes from this run: the
    factors it chose (long or short), else ``max_model_len`` itself; None for every
    other RoPE, whose values ``config.json`` and ``hf_overrides`` already identify."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config",
                                                                  None)
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    if not isinstance(params, Mapping):
        return None
    # transformers 5 keeps one entry per attention type in some models.
    candidates = ([v for v in params.values() if isinstance(v, Mapping)]
                  if params and all(isinstance(v, Mapping) for v in params.values())
                  else [params])
    max_len = getattr(model_config, "max_model_len", None)
    for entry in candidates:
        kind = entry.get("rope_type") or entry.get("type")
        if kind not in RUN_DEPENDENT_ROPE:
            continue
        original = (entry.get("original_max_position_embeddings")
                    or getattr(hf, "original_max_position_embeddings", None))
        if isinstance(original, int) and isinstance(max_len, int):
            return {"rope_type": kind, "long_factors": max_len > original}
        return {"rope_type": kind, "max_model_len": max_len}
    return None


def _checkpoint_path(model_config: Any, load_config: Any) -> str:
    """The local files of the checkpoint the engine loaded (hub ids through the local
    Hugging Face cache, as vLLM itself resolved them)."""
    model = str(model_config.model)
    if os.path.exists(model):
        return model
    if os.path.isabs(model) or model.startswith("."):
        raise CheckpointError(f"model path {model!r} does not exist here, so its weights "
                              "cannot be hashed; p2pkv shares nothing without that digest")
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(
            model, revision=model_config.revision,
            cache_dir=getattr(load_config, "download_dir", None), local_files_only=True))
    except Exception as exc:
        raise CheckpointError(
            f"cannot find the files of model {model!r} locally ({type(exc).__name__}: "
            f"{exc}); p2pkv hashes the weights the engine loaded and shares nothing "
            "without that digest") from None


def _derived_layout(spec: Any, model_config: Any, want: str | None,
                    sources: dict[str, str]) -> str | None:
    """The engine's KV memory layout, against the declared one (``want``)."""
    use_mla = bool(getattr(model_config, "use_mla", False))
    layout = memory_layout(spec, use_mla)
    sources["kv_memory_layout"] = (
        "vLLM's MLA backend (ModelConfig.use_mla)" if use_mla
        else "vLLM's CPU attention backend" if layout == "HND_K_THEN_V"
        else "the offloading spec's kv_cache_layout")
    if want is not None and layout is None:
        # Nothing detected (a backend that does not say): the operator's word stands.
        layout = want
        sources["kv_memory_layout"] = "declared in the tier config (not detectable)"
    if want is not None and IdentityExtension(kv_memory_layout=want).kv_memory_layout != \
            IdentityExtension(kv_memory_layout=layout).kv_memory_layout:
        raise ConfigError(f"P2PKVTier: kv_memory_layout is declared {want!r} but the engine "
                          f"uses {layout!r} ({sources['kv_memory_layout']}); remove the "
                          "declaration or run the engine with that layout")
    return layout


def _derived_overrides(model_config: Any, mine: Any, sources: dict[str, str]
                       ) -> tuple[dict[str, Any], str, str]:
    """The overrides the engine applies (with their canonical form and digest), against
    the declared ones (``mine``)."""
    overrides = _overrides_of(model_config)
    try:
        canonical = canonical_model_overrides(overrides)
    except ValueError as exc:  # NaN, an out-of-range integer
        raise ConfigError(f"P2PKVTier: the engine's hf_overrides have no canonical form, "
                          f"so they cannot be part of the identity: {exc}") from None
    digest = model_overrides_digest(overrides)
    sources["model_overrides"] = f"ModelConfig.hf_overrides and .quantization: {canonical}"
    if mine is not None and model_overrides_digest(mine) != digest:
        raise ConfigError(
            f"P2PKVTier: model_overrides is declared {canonical_model_overrides(mine)} "
            f"(digest {model_overrides_digest(mine)}) but the engine applies {canonical} "
            f"(digest {digest}); remove the declaration: the tier derives it")
    return overrides, canonical, digest


def derive_engine_identity(spec: Any, vllm_config: Any | None,
                           declared: Mapping[str, Any]) -> EngineIdentity:
    """Everything the tier can derive at start, checked against what the operator
    declared (``kv_memory_layout``, ``model_revision``, ``model_overrides`` tier
    options). Raises :class:`ConfigError` when the engine's configuration cannot be
    reached, the checkpoint cannot be read, or a declaration disagrees."""
    if vllm_config is None:
        raise ConfigError(
            "P2PKVTier: the engine's configuration (VllmConfig) does not reach the tier, so "
            "the weights, revision and overrides cannot be derived, and p2pkv refuses to "
            "start with an identity it cannot see. vLLM's plain OffloadingConnector does "
            f"not hand it over: load p2pkv's connector, with {CONNECTOR_KEYS} in "
            "--kv-transfer-config")
    model_config = vllm_config.model_config
    load_config = vllm_config.load_config
    sources: dict[str, str] = {}

    layout = _derived_layout(spec, model_config, declared.get("kv_memory_layout"), sources)
    overrides, canonical, digest = _derived_overrides(model_config,
                                                      declared.get("model_overrides"), sources)

    revision = model_config.revision
    sources["model_revision"] = "ModelConfig.revision (--revision)"
    load_format = str(getattr(load_config, "load_format", "auto"))
    path = fixed = None
    if load_format == "dummy":
        import vllm

        fixed = hashlib.sha256(f"dummy weights, vllm {vllm.__version__}".encode()
                               ).hexdigest()[:16]
        sources["model_weights"] = f"load_format=dummy (vLLM {vllm.__version__}'s initializer)"
    else:
        path = _checkpoint_path(model_config, load_config)
        readable_weight_files(path)  # a checkpoint it cannot hash fails at start
        if revision is None:
            revision = hub_snapshot_revision(path)
            sources["model_revision"] = "the Hugging Face cache snapshot of the model"
    if revision is None:
        sources["model_revision"] = "not set: a local checkpoint without a revision"
    want = declared.get("model_revision")
    if want is not None and revision is not None and want != revision:
        raise ConfigError(f"P2PKVTier: model_revision is declared {want!r} but the engine "
                          f"loaded revision {revision!r} ({sources['model_revision']})")
    if want is not None and revision is None:
        revision = want
        sources["model_revision"] = "declared in the tier config"
    # What decides the K/V values beyond the weights, config.json and the declared
    # overrides: the modeling code the engine runs under trust_remote_code, and what a
    # run-dependent RoPE takes from this run. Absent (old digests unchanged) otherwise.
    run: dict[str, Any] = {}
    if getattr(model_config, "trust_remote_code", False) and path is not None:
        try:
            code = modeling_code_digest(path)
        except CheckpointError as exc:
            raise ConfigError(f"P2PKVTier: trust_remote_code is on and {exc}") from None
        if code is not None:
            run["remote_code"] = code
    if (rope := _rope_of_run(model_config)) is not None:
        run["run_rope"] = rope
    if run:
        overrides = {**overrides, **run}
        canonical = canonical_model_overrides(overrides)
        digest = model_overrides_digest(overrides)
        sources["model_overrides"] = (f"ModelConfig.hf_overrides and .quantization, the "
                                      f"modeling code and run-dependent RoPE: {canonical}")
    return EngineIdentity(kv_memory_layout=layout, model_revision=revision,
                          model_overrides=digest, overrides_canonical=canonical,
                          checkpoint_path=path, fixed_weights=fixed, sources=sources,
                          lora_enabled=getattr(vllm_config, "lora_config", None) is not None)


def extension_for(engine: EngineIdentity, checkpoint: CheckpointIdentity | None,
                  key_hash: VLLMKeyHash) -> IdentityExtension:
    """The identity extension of a vLLM engine, once the weights digest is known."""
    import vllm

    return IdentityExtension(
        kv_memory_layout=engine.kv_memory_layout,
        model_revision=engine.model_revision,
        model_overrides=engine.model_overrides,
        key_hash=key_hash.identity,
        engine=f"vllm {vllm.__version__}",
        model_weights=checkpoint.model_weights if checkpoint else engine.fixed_weights,
        model_config=checkpoint.model_config if checkpoint else None,
    )


class TierIdentity:
    """A tier's identity as it becomes known: derived from the engine at start (raises
    :class:`ConfigError` there), the weights digest from a daemon thread (a shutdown
    never waits for a hash nobody needs any more), the key hash once the engine core
    seeded it. Thread-safe."""

    def __init__(self, spec: Any, declared: Mapping[str, Any]) -> None:
        try:
            self.engine = derive_engine_identity(spec, find_vllm_config(), declared)
        except CheckpointError as exc:
            raise ConfigError(f"P2PKVTier: {exc}") from None
        self.lora_enabled = self.engine.lora_enabled
        self._checkpoint: Future[CheckpointIdentity | None] = Future()
        self._key_hash: VLLMKeyHash | None = None
        threading.Thread(target=self._derive, args=(self.engine.checkpoint_path,),
                         daemon=True, name="p2pkv-identity").start()

    def _derive(self, path: str | None) -> None:
        try:
            result = checkpoint_identity(path) if path is not None else None
        except BaseException as exc:
            self._checkpoint.set_exception(exc)
        else:
            self._checkpoint.set_result(result)

    @property
    def pending(self) -> bool:
        """True while the weights digest is being computed."""
        return not self._checkpoint.done()

    def wait(self, timeout: float) -> bool:
        """True once the weights digest is known (waiting up to ``timeout`` seconds);
        raises what computing it raised."""
        try:
            self._checkpoint.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def extension(self, key_hash: VLLMKeyHash) -> IdentityExtension:
        """The extension to advertise (call once :meth:`wait` returned True)."""
        self._key_hash = key_hash
        return extension_for(self.engine, self._checkpoint.result(timeout=0), key_hash)

    def describe(self) -> str:
        """Every field known so far, with where it came from (one log line)."""
        engine = self.engine
        values: dict[str, str | None] = {
            "kv_memory_layout": engine.kv_memory_layout,
            "model_revision": engine.model_revision,
            "model_overrides": engine.model_overrides}
        sources = dict(engine.sources)
        if not self._checkpoint.done():
            values["model_weights"] = "(being computed)"
            sources["model_weights"] = f"hashing {engine.checkpoint_path}"
        elif self._checkpoint.exception() is not None:
            values["model_weights"] = "(unknown)"
            sources["model_weights"] = f"failed: {self._checkpoint.exception()}"
        elif (checkpoint := self._checkpoint.result()) is not None:
            values.update(model_weights=checkpoint.model_weights,
                          model_config=checkpoint.model_config)
            sources.update(checkpoint.sources)
        else:
            values["model_weights"] = engine.fixed_weights
        if self._key_hash is not None:
            values["key_hash"] = self._key_hash.identity
            sources["key_hash"] = (f"vLLM's NONE_HASH: {self._key_hash.function}, seeded "
                                   "by get_none_hash_seed()")
        order = ("kv_memory_layout", "model_weights", "model_config", "model_revision",
                 "model_overrides", "key_hash")
        return "; ".join(f"{name}={values[name]} ({sources.get(name, 'derived')})"
                         for name in order if name in values)

"""The identity extension (``protocol/SPEC.md``, section 1.4): what a node declares about
its KV cache beyond the run config.

Two engines with the same run config, and so the same fingerprint and namespace, can
still hold KV caches that are not interchangeable: the block byte order in the engine's
memory, the weights revision, the model overrides that change the K/V values, or the
engine's block-key hash differ. Every such case ends in silently wrong output. The
extension names each cause so the handshake can refuse it with a reason. It travels in
the handshake next to the run config and is never hashed into the fingerprint, so
namespaces stay equal to vLLM's. This module is pure: no IO, no torch, no zmq.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from p2pkv.identity.runconfig import ABSENT, FINGERPRINT_HEX_LEN, FieldDiff, canonical_json

__all__ = [
    "EXTENSION_FIELDS",
    "EXTENSION_REFUSAL_FIELDS",
    "IDENTITY_POLICIES",
    "KV_MEMORY_LAYOUTS",
    "KV_MEMORY_LAYOUT_ALIASES",
    "IdentityExtension",
    "canonical_model_overrides",
    "extension_diff",
    "key_hash_identity",
    "kv_memory_layout_meaning",
    "model_overrides_digest",
]

IDENTITY_POLICIES: Final = ("strict", "lenient")
"""``strict``: a field only one side declares refuses the handshake; ``lenient``: it is
accepted with a logged warning and a counted metric. Fields both sides declare must be
equal under either policy."""

EXTENSION_REFUSAL_FIELDS: Final = (
    "kv_memory_layout", "model_revision", "model_overrides", "key_hash", "model_weights",
    "model_config",
)
"""The extension fields that must agree (in reason order); ``engine`` is informational.
``model_weights`` and ``model_config`` (protocol 1.2) come last so that the reasons and
digests of 1.1 declarations stay what they were."""
EXTENSION_FIELDS: Final = (*EXTENSION_REFUSAL_FIELDS, "engine")

# In vLLM's KV cache layout names (RFC #42082) the logical order is [L, B, H, N, C]:
# layer, block, KV head, token, and C, the content of one token for one head: its K
# vector followed by its V vector ("K+V" below). Each name spells the physical (memory)
# order. vLLM's CPU backend allocates LBHNC but its kernels read each (block, head) as
# all K rows then all V rows (cpu_attn.py views [.., tokens, 2 * head] as
# [.., 2 * tokens, head] and splits it in two), hence its own name here.
KV_MEMORY_LAYOUTS: Final[dict[str, str]] = {
    "NHD": "token-major: in each layer a block is [tokens, KV heads, K+V] (vLLM LBNHC, its "
           "default; FlashAttention/FlashInfer NHD)",
    "HND": "head-major: in each layer a block is [KV heads, tokens, K+V] (vLLM LBHNC; "
           "FlashInfer HND; p2pkv's V2 per-layer layout)",
    "HND_K_THEN_V": "head-major, all K before V (vLLM's CPU backend, CPU_ATTN): in each layer "
                    "a block is [KV heads, K of every token, then V of every token], not K+V "
                    "per token; same size as HND, different byte order",
    "LHBNC": "head-outermost per layer: [KV heads, blocks, tokens, K+V], a block's bytes "
             "strided across the layer (vLLM LHBNC)",
    "BLHNC": "cross-layer rows, head-major: each block is one row [layers, KV heads, tokens, "
             "K+V] (vLLM BLHNC)",
    "BLNHC": "cross-layer rows, token-major: each block is one row [layers, tokens, KV heads, "
             "K+V] (vLLM BLNHC)",
    "BHLNC": "cross-layer rows, head-outermost: each block is one row [KV heads, layers, "
             "tokens, K+V] (vLLM BHLNC; p2pkv's V1 cross-layer layout)",
    "MLA_LATENT": "multi-head latent attention (vLLM's MLA backends, CPU_MLA included): in "
                  "each layer a block is [tokens, latent], one compact row per token (the "
                  "compressed KV, kv_lora_rank wide, then the RoPE key, qk_rope_head_dim "
                  "wide); no KV heads, no K/V split, the same row on every TP rank",
    # vLLM's offloading spec reports these two names; a declaration folds them to NHD/HND.
    "LBNHC": "vLLM's name for NHD (declared as NHD)",
    "LBHNC": "vLLM's name for HND (declared as HND)",
}
"""Known ``kv_memory_layout`` names and what each means (vLLM's offloading
``kv_cache_layout`` strings included). Other names are allowed; they compare by exact
spelling and show as unknown in a refusal's meaning."""

KV_MEMORY_LAYOUT_ALIASES: Final[dict[str, str]] = {"LBNHC": "NHD", "LBHNC": "HND"}
"""Other spellings of registry names (vLLM's legacy NHD/HND names are aliases of its
LBNHC/LBHNC). A declared name that matches a registry name or alias, ignoring case, is
written as the registry name, so ``lbhnc`` and ``HND`` are the same declaration."""

# Aliases last, so that LBNHC/LBHNC fold to NHD/HND.
_LAYOUT_BY_FOLDED: Final[dict[str, str]] = {
    **{name.upper(): name for name in KV_MEMORY_LAYOUTS},
    **{alias.upper(): name for alias, name in KV_MEMORY_LAYOUT_ALIASES.items()},
}
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.+-]{1,64}")
_HEX16_RE: Final = re.compile(r"[0-9a-f]{16}")
_KEY_HASH_RE: Final = re.compile(r"([A-Za-z0-9_.+-]{1,64}):([0-9a-f]{16})")
_MAX_EXT_TEXT: Final = 256
_MAX_OVERRIDES_DEPTH: Final = 32
_MAX_SAFE_INTEGER: Final = 2**53


def kv_memory_layout_meaning(name: str) -> str:
    """What a ``kv_memory_layout`` name means, or that p2pkv does not know it."""
    canonical = _LAYOUT_BY_FOLDED.get(name.upper(), name) if isinstance(name, str) else name
    known = KV_MEMORY_LAYOUTS.get(canonical)
    if known is not None:
        return known
    return "a name unknown to p2pkv's registry: compare the two engines' attention backends"


def _short_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX_LEN]


def _canonical_value(value: Any, where: str, depth: int) -> Any:
    """One override value in canonical form (see :func:`canonical_model_overrides`)."""
    if depth > _MAX_OVERRIDES_DEPTH:
        raise ValueError(f"model_overrides: {where} is nested deeper than "
                         f"{_MAX_OVERRIDES_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if abs(value) >= 2**63:
            raise ValueError(f"model_overrides: {where} = {value} is outside the signed "
                             "64-bit range")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"model_overrides: {where} = {value!r} is not a finite number")
        # 500000.0 and 500000 are the same RoPE theta: integral floats become integers.
        if value.is_integer() and abs(value) < _MAX_SAFE_INTEGER:
            return int(value)
        return value
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"model_overrides: {where} has a key {key!r} that is not "
                                 "a string")
            # An override set to null is no override: it equals an absent key.
            if item is None:
                continue
            out[key] = _canonical_value(item, f"{where}.{key}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical_value(item, f"{where}[{i}]", depth + 1)
                for i, item in enumerate(value)]
    raise ValueError(f"model_overrides: {where} has type {type(value).__name__}; only null, "
                     "booleans, numbers, strings, lists and string-keyed mappings are allowed")


def canonical_model_overrides(overrides: Mapping[str, Any]) -> str:
    """The canonical JSON text of ``overrides`` whose digest is ``model_overrides``.

    Canonical form (SPEC 1.4): map entries whose value is null are dropped at every
    level; a float with an integral value below 2**53 in magnitude is written as an
    integer (``500000.0`` equals ``500000``); other floats as Python's ``repr`` (the
    shortest text that reads back to the same double); NaN and infinities are refused;
    then the canonical JSON of the run config (sorted keys, no whitespace, ASCII only).
    """
    if not isinstance(overrides, Mapping):
        raise ValueError(f"model_overrides must be a mapping (a JSON object), got "
                         f"{type(overrides).__name__}")
    return canonical_json(_canonical_value(overrides, "overrides", 0))


def model_overrides_digest(overrides: Mapping[str, Any]) -> str:
    """16-hex digest of everything that changes the values written to the KV cache.

    Give the overrides the engine applies (RoPE type, theta and scaling, ``hf_overrides``,
    KV-cache quantization and its scales; SPEC 1.4 names the keys to use). Two engines
    compute the same digest exactly when their overrides are equal in canonical form
    (:func:`canonical_model_overrides`): key order, null entries and ``1.0`` vs ``1`` do
    not matter.
    """
    return _short_digest(canonical_model_overrides(overrides))


def key_hash_identity(algo: str, seed_material: bytes | bytearray | memoryview | str) -> str:
    """``"<algo>:<16 hex of sha256(seed_material)>"``: the engine's block-key hash.

    ``algo`` names the hash function (for vLLM: ``sha256``, ``sha256_cbor``, ``xxhash``,
    ...), ``seed_material`` is what its first block hash is derived from (for vLLM: the
    NONE_HASH seed, ``get_none_hash_seed()``; a ``str`` is hashed as UTF-8). Only a digest
    travels, so a secret seed stays secret.
    """
    if not isinstance(algo, str) or _NAME_RE.fullmatch(algo) is None:
        raise ValueError(f"key_hash algorithm must be 1..64 characters of letters, digits "
                         f"and _ . + -, got {algo!r}")
    if isinstance(seed_material, str):
        material = seed_material.encode("utf-8")
    elif isinstance(seed_material, (bytes, bytearray, memoryview)):
        material = bytes(seed_material)
    else:
        raise ValueError(f"key_hash seed material must be bytes or str, got "
                         f"{type(seed_material).__name__}")
    return f"{algo}:{hashlib.sha256(material).hexdigest()[:FINGERPRINT_HEX_LEN]}"


def _check_ext_text(name: str, value: object) -> str:
    if type(value) is not str:
        raise ValueError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError(f"{name} must not be empty (leave it unset to declare nothing)")
    if len(value) > _MAX_EXT_TEXT:
        raise ValueError(f"{name} is longer than {_MAX_EXT_TEXT} characters ({len(value)})")
    if not value.isprintable() or value != value.strip():
        raise ValueError(f"{name} must be printable, without surrounding blanks, got "
                         f"{value[:80]!r}")
    return value


@dataclass(frozen=True)
class IdentityExtension:
    """What a node declares about its KV cache beyond the run config (SPEC 1.4).

    Every field is optional; ``None`` means "not declared". Fields both peers declare must
    be equal; a field only one peer declares refuses the handshake under the ``strict``
    identity policy (the default) and is a warning under ``lenient``. ``engine`` is
    informational and never refuses. Nothing here enters the run-config fingerprint.

    - ``kv_memory_layout``: how a block's bytes are ordered in the engine's memory, a
      name from :data:`KV_MEMORY_LAYOUTS` (or any other name; aliases and case are
      folded to the registry spelling).
    - ``model_revision``: the weights revision, or a digest of the weight files' index.
    - ``model_overrides``: :func:`model_overrides_digest` of the overrides that change
      the values written to the KV cache.
    - ``key_hash``: :func:`key_hash_identity` of the engine's block-key hash.
    - ``model_weights``: 16 hex, the content digest of the checkpoint's weight files
      (:func:`p2pkv.identity.checkpoint.checkpoint_identity`).
    - ``model_config``: 16 hex, the digest of the checkpoint's ``config.json`` without
      its metadata keys (:func:`p2pkv.identity.checkpoint.config_digest`).
    - ``engine``: engine name and version, e.g. ``"vllm 0.32.0"``.
    """

    kv_memory_layout: str | None = None
    model_revision: str | None = None
    model_overrides: str | None = None
    key_hash: str | None = None
    engine: str | None = None
    model_weights: str | None = None
    model_config: str | None = None

    REFUSAL_FIELDS: ClassVar[tuple[str, ...]] = EXTENSION_REFUSAL_FIELDS
    FIELDS: ClassVar[tuple[str, ...]] = EXTENSION_FIELDS

    def __post_init__(self) -> None:
        layout = self.kv_memory_layout
        if layout is not None:
            _check_ext_text("kv_memory_layout", layout)
            if _NAME_RE.fullmatch(layout) is None:
                raise ValueError(f"kv_memory_layout must be 1..64 characters of letters, "
                                 f"digits and _ . + -, got {layout!r}")
            object.__setattr__(self, "kv_memory_layout",
                               _LAYOUT_BY_FOLDED.get(layout.upper(), layout))
        if self.model_revision is not None:
            _check_ext_text("model_revision", self.model_revision)
        for name, maker in (("model_overrides", "model_overrides_digest(overrides)"),
                            ("model_weights", "checkpoint_identity(path)"),
                            ("model_config", "config_digest(config)")):
            value = getattr(self, name)
            if value is None:
                continue
            _check_ext_text(name, value)
            if _HEX16_RE.fullmatch(value) is None:
                raise ValueError(f"{name} must be 16 lowercase hex digits, the digest "
                                 f"{maker} gives, got {value[:80]!r}")
        if self.key_hash is not None:
            _check_ext_text("key_hash", self.key_hash)
            if _KEY_HASH_RE.fullmatch(self.key_hash) is None:
                raise ValueError(
                    "key_hash must be '<algorithm>:<16 lowercase hex>', as "
                    f"key_hash_identity(algo, seed_material) gives, got {self.key_hash[:80]!r}")
        if self.engine is not None:
            _check_ext_text("engine", self.engine)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> IdentityExtension:
        """Rebuild from the wire map (``ext``). Unknown keys are ignored: a newer peer
        may declare more, and compares those itself."""
        if not isinstance(data, Mapping):
            raise ValueError(f"identity extension must be a mapping, got "
                             f"{type(data).__name__}")
        return cls(**{name: data[name] for name in EXTENSION_FIELDS if name in data})

    def to_wire(self) -> dict[str, str]:
        """The declared fields only (an undeclared field is absent, never null)."""
        return {name: value for name in EXTENSION_FIELDS
                if (value := getattr(self, name)) is not None}

    @property
    def is_empty(self) -> bool:
        """True when nothing at all is declared (a 1.0 peer looks like this)."""
        return all(getattr(self, name) is None for name in EXTENSION_FIELDS)

    def refusal_fields(self) -> dict[str, str]:
        """The declared fields that decide compatibility (``engine`` excluded)."""
        return {name: value for name in EXTENSION_REFUSAL_FIELDS
                if (value := getattr(self, name)) is not None}

    @property
    def digest(self) -> str:
        """16-hex SHA-256 of the canonical JSON of :meth:`refusal_fields`.

        Equal digests mean equal declarations; it is what ``fingerprint --json`` prints
        to compare two hosts at a glance. It is never part of the run-config fingerprint.
        """
        return _short_digest(canonical_json(self.refusal_fields()))

    def describe(self) -> str:
        """One line for logs: the declared fields, or ``(nothing declared)``."""
        wire = self.to_wire()
        if not wire:
            return "(nothing declared)"
        return ", ".join(f"{name}={value}" for name, value in wire.items())


def _key_hash_parts(value: str) -> tuple[str, str]:
    algo, _, seed = value.partition(":")
    return algo, seed


_EXT_PURPOSE: Final = {
    "kv_memory_layout": "the byte order of a block in the engine's memory",
    "model_revision": "the weights revision",
    "model_overrides": "the model overrides that change the K/V values",
    "key_hash": "the block-key hash function and seed",
    "model_weights": "a content digest of the weights",
    "model_config": "a digest of the model's config.json",
}
_EXT_FIX: Final = {
    "kv_memory_layout": "--kv-memory-layout",
    "model_revision": "--model-revision",
    "model_overrides": "--model-overrides",
    "key_hash": "key_hash_identity(), in the engine integration",
    "model_weights": "--model-path; the vLLM tier derives it",
    "model_config": "--model-path; the vLLM tier derives it",
}


def _extension_meaning(name: str, local: Any, remote: Any) -> str:
    if local is ABSENT or remote is ABSENT:
        return (
            f"only one side declares {_EXT_PURPOSE[name]}, so equal run configs cannot "
            f"prove the KV caches interchangeable: declare it on both sides "
            f"({_EXT_FIX[name]}), or accept the peer with identity_policy = \"lenient\""
        )
    if name == "kv_memory_layout":
        return (
            f"block bytes are ordered differently in memory: {local} ({_brief(local)}) vs "
            f"{remote} ({_brief(remote)}): blocks would be read in the wrong order and "
            "decode to garbage without an error: run both engines with the same attention "
            "backend and KV cache layout (vLLM: VLLM_KV_CACHE_LAYOUT)"
        )
    if name == "model_revision":
        return (
            f"different weights under the same model name ({local} vs {remote}): KV written "
            "by other weights is wrong here: serve the same model revision on both sides "
            "(vLLM: --revision)"
        )
    if name == "model_overrides":
        return (
            f"model overrides that change the K/V values differ (digest {local} vs {remote}: "
            "RoPE type/theta/scaling, hf_overrides, KV-cache quantization or scales): use "
            "the same overrides on both sides (compare 'p2pkv-node fingerprint --json')"
        )
    if name == "model_weights":
        return (
            f"different weights under the same model name (content digest {local} vs "
            f"{remote}): KV computed by other weights decodes to garbage here: serve the "
            "same checkpoint on both sides (compare 'p2pkv-node fingerprint --model-path "
            "DIR --json' on both hosts)"
        )
    if name == "model_config":
        return (
            f"the checkpoints' config.json differ (digest {local} vs {remote}: RoPE, "
            "attention or architecture settings change the K/V values): serve the same "
            "model configuration on both sides"
        )
    la, ls = _key_hash_parts(str(local))
    ra, rs = _key_hash_parts(str(remote))
    if la != ra:
        return (
            f"block keys are hashed with different functions ({la} vs {ra}): no key would "
            "ever match: use the same prefix-cache hash function everywhere (vLLM: "
            "--prefix-caching-hash-algo)"
        )
    return (
        f"block-key hash seeds differ (seed digest {ls} vs {rs}, both {la}): no key would "
        "ever match: set PYTHONHASHSEED to the same value for every engine (vLLM picks a "
        "random seed per process for non-cryptographic hashes when it is unset)"
    )


def _brief(layout: str) -> str:
    return kv_memory_layout_meaning(layout).split(":", 1)[0]


def extension_diff(local: IdentityExtension, remote: IdentityExtension,
                   *, include_engine: bool = False) -> list[FieldDiff]:
    """Every refusal-relevant extension field that differs, in :data:`EXTENSION_FIELDS`
    order, with what it means and what to change.

    A field declared on one side only is reported with :data:`ABSENT` on the other side
    (whether that refuses is the handshake policy's decision, not this function's). With
    ``include_engine``, a differing ``engine`` is reported too, as information.
    """
    out: list[FieldDiff] = []
    for name in EXTENSION_REFUSAL_FIELDS:
        lv, rv = getattr(local, name), getattr(remote, name)
        if lv == rv:
            continue
        lv = ABSENT if lv is None else lv
        rv = ABSENT if rv is None else rv
        out.append(FieldDiff(name, lv, rv, _extension_meaning(name, lv, rv)))
    if include_engine and local.engine != remote.engine:
        out.append(FieldDiff(
            "engine", ABSENT if local.engine is None else local.engine,
            ABSENT if remote.engine is None else remote.engine,
            "engines differ (information only, never a reason to refuse)"))
    return out

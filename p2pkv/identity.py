"""The identity of a node's KV cache: the run config, its digest and the field-level diff.

The hashed dict reproduces vLLM's ``FileMapper`` run config exactly, so a p2pkv namespace
equals the one vLLM computes for the same configuration (see ``protocol/SPEC.md``,
section "Identity"). This module is pure: no IO, no torch, no zmq.

Rules (normative text in the spec):

1. parallel-agnostic: ``tp_size``, ``pp_size``, ``pcp_size``, ``dcp_size`` forced to 1 and
   ``rank`` to 0 before hashing.
2. not parallel-agnostic: ``"parallel_agnostic": false`` is added (absent otherwise).
3. ``"replicated_layout": true`` only when replicated; never written as false.
4. ``RunConfig.resolve`` applies the caller opt-in of ``FileMapper.from_offloading_spec``.
5. ``canonical_format`` / ``storage_format`` only when set.
6. ``rank`` is never hashed.

The **identity extension** (:class:`IdentityExtension`) declares what the run config
cannot see but that still decides whether two KV caches are interchangeable: the block
byte order in the engine's memory, the weights revision, the model overrides that change
the K/V values, and the engine's block-key hash. It travels in the handshake next to the
run config and is never hashed into the fingerprint, so namespaces stay equal to vLLM's.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

__all__ = [
    "ABSENT",
    "EXTENSION_FIELDS",
    "EXTENSION_REFUSAL_FIELDS",
    "FINGERPRINT_HEX_LEN",
    "IDENTITY_POLICIES",
    "KV_MEMORY_LAYOUTS",
    "KV_MEMORY_LAYOUT_ALIASES",
    "NAMESPACE_HEX_LEN",
    "FieldDiff",
    "IdentityExtension",
    "RunConfig",
    "canonical_json",
    "canonical_model_overrides",
    "diff",
    "digest",
    "extension_diff",
    "fingerprint_of",
    "key_hash_identity",
    "kv_memory_layout_meaning",
    "model_overrides_digest",
]

FINGERPRINT_HEX_LEN: Final = 16
NAMESPACE_HEX_LEN: Final = 12

_PARALLEL_FIELDS: Final = ("tp_size", "pp_size", "pcp_size", "dcp_size")
_INT_FIELDS: Final = ("tokens_per_hash", "blocks_per_file", *_PARALLEL_FIELDS)
_REQUIRED_FIELDS: Final = frozenset(
    {"model_name", *_INT_FIELDS, "dtype", "kv_cache_groups", "inference_engine"}
)
_OPTIONAL_FIELDS: Final = frozenset(
    {"parallel_agnostic", "replicated_layout", "canonical_format", "storage_format"}
)
# Bounds keep a hostile run config from costing unbounded memory or time to validate.
_MAX_STR: Final = 512
_MAX_GROUPS: Final = 64
_MAX_LAYERS_PER_GROUP: Final = 4096
_MAX_INT: Final = 2**31 - 1


class _Absent:
    """Marker for a key that one side's run config does not contain."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<absent>"

    def __reduce__(self) -> str:
        return "ABSENT"


ABSENT: Final = _Absent()


def canonical_json(fields: Mapping[str, Any]) -> str:
    """The exact string that is hashed: sorted keys, no whitespace (vLLM's form)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def digest(fields: Mapping[str, Any]) -> str:
    """Full SHA-256 hex digest of a run-config dict."""
    return hashlib.sha256(canonical_json(fields).encode("utf-8")).hexdigest()


def fingerprint_of(fields: Mapping[str, Any]) -> str:
    """The 16-hex P2P fingerprint of a run-config dict."""
    return digest(fields)[:FINGERPRINT_HEX_LEN]


def _check_int(name: str, value: object, minimum: int) -> int:
    # bool is a subclass of int; a flag passed where a size belongs is a caller bug.
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or value > _MAX_INT:
        raise ValueError(f"{name} must be in [{minimum}, {_MAX_INT}], got {value!r}")
    return value


def _check_str(name: str, value: object, *, allow_empty: bool = False) -> str:
    if type(value) is not str:
        raise ValueError(f"{name} must be a str, got {type(value).__name__} {value!r}")
    if not allow_empty and not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > _MAX_STR:
        raise ValueError(f"{name} is longer than {_MAX_STR} characters ({len(value)})")
    return value


def _check_bool(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_groups(value: object) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"kv_cache_groups must be a list of groups, got {value!r}")
    if len(value) > _MAX_GROUPS:
        raise ValueError(f"kv_cache_groups has more than {_MAX_GROUPS} groups ({len(value)})")
    groups: list[dict[str, Any]] = []
    for i, group in enumerate(value):
        where = f"kv_cache_groups[{i}]"
        if not isinstance(group, Mapping):
            raise ValueError(f"{where} must be a mapping, got {group!r}")
        keys = set(group)
        if keys != {"tokens_per_block", "layer_names"}:
            raise ValueError(
                f"{where} must have exactly the keys 'layer_names' and 'tokens_per_block', "
                f"got {sorted(map(str, keys))}"
            )
        tokens = _check_int(f"{where}.tokens_per_block", group["tokens_per_block"], 1)
        names = group["layer_names"]
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise ValueError(f"{where}.layer_names must be a list of str, got {names!r}")
        if len(names) > _MAX_LAYERS_PER_GROUP:
            raise ValueError(
                f"{where}.layer_names has more than {_MAX_LAYERS_PER_GROUP} entries ({len(names)})"
            )
        layer_names = [_check_str(f"{where}.layer_names[{j}]", n) for j, n in enumerate(names)]
        groups.append({"tokens_per_block": tokens, "layer_names": layer_names})
    return groups


@dataclass(frozen=True, eq=False)
class RunConfig:
    """Immutable identity of a node's KV cache, hashed exactly like vLLM's ``FileMapper``.

    The constructor takes the flags already resolved (vLLM's ``FileMapper.__init__``);
    use :meth:`resolve` to apply the caller's parallel-agnostic opt-in. Two configs are
    equal when their hashed fields are equal (``rank`` is not part of the identity).
    """

    model_name: str
    tokens_per_hash: int = 16
    blocks_per_file: int = 1
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0
    dtype: str = "float16"
    kv_cache_groups: Sequence[Mapping[str, Any]] | None = None
    inference_engine: str = "vllm"
    parallel_agnostic: bool = False
    replicated_layout: bool = False
    canonical_format: str | None = None
    storage_format: str | None = None

    def __post_init__(self) -> None:
        _check_str("model_name", self.model_name)
        _check_int("tokens_per_hash", self.tokens_per_hash, 1)
        _check_int("blocks_per_file", self.blocks_per_file, 1)
        for name in _PARALLEL_FIELDS:
            _check_int(name, getattr(self, name), 1)
        _check_int("rank", self.rank, 0)
        _check_str("dtype", self.dtype)
        _check_str("inference_engine", self.inference_engine)
        _check_bool("parallel_agnostic", self.parallel_agnostic)
        _check_bool("replicated_layout", self.replicated_layout)
        for name in ("canonical_format", "storage_format"):
            value = getattr(self, name)
            if value is not None:
                _check_str(name, value)
        groups = _check_groups(self.kv_cache_groups)
        # Store deep-frozen groups so the instance stays immutable even if the caller
        # mutates the lists it passed in.
        frozen = tuple(
            {"tokens_per_block": g["tokens_per_block"], "layer_names": tuple(g["layer_names"])}
            for g in groups
        )
        object.__setattr__(self, "kv_cache_groups", frozen)
        if self.parallel_agnostic:
            for name in _PARALLEL_FIELDS:
                object.__setattr__(self, name, 1)
            object.__setattr__(self, "rank", 0)
        fields = self._build_fields()
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_digest", digest(fields))

    def _build_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "model_name": self.model_name,
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_file": self.blocks_per_file,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "pcp_size": self.pcp_size,
            "dcp_size": self.dcp_size,
            "dtype": self.dtype,
            "kv_cache_groups": self._groups_as_lists(),
            "inference_engine": self.inference_engine,
        }
        if not self.parallel_agnostic:
            fields["parallel_agnostic"] = False
        if self.replicated_layout:
            fields["replicated_layout"] = True
        if self.canonical_format is not None:
            fields["canonical_format"] = self.canonical_format
        if self.storage_format is not None:
            fields["storage_format"] = self.storage_format
        return fields

    def _groups_as_lists(self) -> list[dict[str, Any]]:
        assert self.kv_cache_groups is not None
        return [
            {"tokens_per_block": g["tokens_per_block"], "layer_names": list(g["layer_names"])}
            for g in self.kv_cache_groups
        ]

    @classmethod
    def resolve(
        cls,
        model_name: str,
        *,
        parallel_agnostic: bool,
        is_parallelism_agnostic: bool,
        replicated_layout: bool,
        **kwargs: Any,
    ) -> RunConfig:
        """Build a config the way ``FileMapper.from_offloading_spec`` does.

        ``parallel_agnostic`` is the caller's opt-in; ``is_parallelism_agnostic`` and
        ``replicated_layout`` describe the layout. Sizes collapse only when the caller
        opted in and the layout is parallelism-agnostic or replicated; the replicated
        flag is recorded only with the opt-in.
        """
        _check_bool("parallel_agnostic", parallel_agnostic)
        _check_bool("is_parallelism_agnostic", is_parallelism_agnostic)
        _check_bool("replicated_layout", replicated_layout)
        for forbidden in ("parallel_agnostic", "replicated_layout"):
            if forbidden in kwargs:
                raise ValueError(f"{forbidden} is resolved here; do not pass it twice")
        return cls(
            model_name,
            parallel_agnostic=parallel_agnostic and (is_parallelism_agnostic or replicated_layout),
            replicated_layout=parallel_agnostic and replicated_layout,
            **kwargs,
        )

    @classmethod
    def from_run_config(cls, fields: Mapping[str, Any], *, rank: int = 0) -> RunConfig:
        """Rebuild a config from a run-config dict (for example one a peer sent).

        Strict: every required field present with its exact type, no unknown keys, and
        the optional keys only with the values the rules allow (``parallel_agnostic``
        only as false, ``replicated_layout`` only as true).
        """
        if not isinstance(fields, Mapping):
            raise ValueError(f"run config must be a mapping, got {type(fields).__name__}")
        keys = set(fields)
        missing = _REQUIRED_FIELDS - keys
        if missing:
            raise ValueError(f"run config is missing field(s) {sorted(missing)}")
        unknown = keys - _REQUIRED_FIELDS - _OPTIONAL_FIELDS
        if unknown:
            raise ValueError(f"run config has unknown field(s) {sorted(map(str, unknown))}")
        agnostic = True
        if "parallel_agnostic" in fields:
            if fields["parallel_agnostic"] is not False:
                raise ValueError(
                    "parallel_agnostic may only appear as false, got "
                    f"{fields['parallel_agnostic']!r}"
                )
            agnostic = False
        replicated = False
        if "replicated_layout" in fields:
            if fields["replicated_layout"] is not True:
                raise ValueError(
                    "replicated_layout may only appear as true, got "
                    f"{fields['replicated_layout']!r}"
                )
            replicated = True
        if agnostic:
            for name in _PARALLEL_FIELDS:
                if fields[name] != 1 or type(fields[name]) is not int:
                    raise ValueError(
                        f"{name} must be 1 in a parallel-agnostic run config, got {fields[name]!r}"
                    )
        for name in ("canonical_format", "storage_format"):
            if name in fields and fields[name] is None:
                raise ValueError(f"{name} may only appear as a string, got None")
        config = cls(
            fields["model_name"],
            tokens_per_hash=fields["tokens_per_hash"],
            blocks_per_file=fields["blocks_per_file"],
            tp_size=fields["tp_size"],
            pp_size=fields["pp_size"],
            pcp_size=fields["pcp_size"],
            dcp_size=fields["dcp_size"],
            rank=rank,
            dtype=fields["dtype"],
            kv_cache_groups=fields["kv_cache_groups"],
            inference_engine=fields["inference_engine"],
            parallel_agnostic=agnostic,
            replicated_layout=replicated,
            canonical_format=fields.get("canonical_format"),
            storage_format=fields.get("storage_format"),
        )
        return config

    def get_run_config(self) -> dict[str, Any]:
        """A fresh deep copy of exactly the hashed fields."""
        fields: dict[str, Any] = self._fields  # type: ignore[attr-defined]
        copy = dict(fields)
        copy["kv_cache_groups"] = self._groups_as_lists()
        return copy

    @property
    def digest(self) -> str:
        """Full SHA-256 hex digest of the run config."""
        value: str = self._digest  # type: ignore[attr-defined]
        return value

    @property
    def fingerprint(self) -> str:
        """The 16-hex fingerprint exchanged at handshake."""
        return self.digest[:FINGERPRINT_HEX_LEN]

    def namespace(self, root_dir: str) -> str:
        """``<root_dir>/<model_name with "/" as "_">_<12 hex>``, vLLM's storage base path."""
        safe = self.model_name.replace("/", "_")
        return f"{root_dir}/{safe}_{self.digest[:NAMESPACE_HEX_LEN]}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunConfig):
            return NotImplemented
        return self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"RunConfig({canonical_json(self._fields)}, rank={self.rank})"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FieldDiff:
    """One differing run-config field: both values and what the difference means.

    ``local`` and ``remote`` are the values as found, or :data:`ABSENT` when the key
    is missing on that side.
    """

    field: str
    local: Any
    remote: Any
    meaning: str

    def to_wire(self) -> dict[str, Any]:
        """A msgpack/JSON friendly form: absent values become ``{"absent": true}``."""
        return {
            "field": self.field,
            "local": _value_to_wire(self.local),
            "remote": _value_to_wire(self.remote),
            "meaning": self.meaning,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> FieldDiff:
        return cls(
            field=str(data["field"]),
            local=_value_from_wire(data["local"]),
            remote=_value_from_wire(data["remote"]),
            meaning=str(data["meaning"]),
        )

    def swapped(self) -> FieldDiff:
        """The same difference seen from the other side."""
        return FieldDiff(self.field, self.remote, self.local, self.meaning)

    def describe(self) -> str:
        return f"{self.field}: {_show(self.local)} vs {_show(self.remote)} ({self.meaning})"


def _value_to_wire(value: Any) -> Any:
    return {"absent": True} if value is ABSENT else value


def _value_from_wire(value: Any) -> Any:
    if isinstance(value, Mapping) and dict(value) == {"absent": True}:
        return ABSENT
    return value


def _show(value: Any) -> str:
    if value is ABSENT:
        return "absent"
    return json.dumps(value, sort_keys=True, default=repr)


def _layout_kind(fields: Mapping[str, Any]) -> str:
    if "parallel_agnostic" not in fields:
        return "V1 cross-layer (parallel-agnostic)"
    return "V2 per-layer (parallel-specific)"


_PARALLEL_NAMES: Final = {
    "tp_size": "tensor parallelism",
    "pp_size": "pipeline parallelism",
    "pcp_size": "prefill context parallelism",
    "dcp_size": "decode context parallelism",
}

_SIMPLE_MEANINGS: Final = {
    "model_name": "different models: their KV caches are unrelated",
    "dtype": "KV cache element type differs: bytes would be decoded as the wrong type",
    "tokens_per_hash": "block size in tokens differs: block keys cover different prefixes",
    "blocks_per_file": "blocks per storage file differ: storage grouping is incompatible",
    "inference_engine": "different inference engines lay out KV bytes differently",
    "canonical_format": "canonical KV byte format differs (or is only used on one side)",
    "storage_format": "storage format differs (or is only used on one side)",
}


def _meaning(name: str, local: Any, remote: Any, lf: Mapping[str, Any],
             rf: Mapping[str, Any]) -> str:
    if name == "parallel_agnostic":
        return f"{_layout_kind(lf)} vs {_layout_kind(rf)} layout"
    if name == "replicated_layout":
        ls = "replicated (compact MLA)" if local is True else "plain"
        rs = "replicated (compact MLA)" if remote is True else "plain"
        return f"{ls} vs {rs} layout"
    if name in _PARALLEL_NAMES:
        return (
            f"{_PARALLEL_NAMES[name]} degree differs: each rank holds a different shard of "
            "the KV heads/layers"
        )
    if name in _SIMPLE_MEANINGS:
        return _SIMPLE_MEANINGS[name]
    if name.startswith("kv_cache_groups"):
        return "KV cache group layout differs: blocks map to different layers or block sizes"
    return "field unknown to this node (sent by a newer peer): identities cannot be compared"


def _diff_groups(local: Any, remote: Any, lf: Mapping[str, Any], rf: Mapping[str, Any],
                 out: list[FieldDiff]) -> None:
    if not isinstance(local, list) or not isinstance(remote, list):
        out.append(FieldDiff("kv_cache_groups", local, remote,
                             _meaning("kv_cache_groups", local, remote, lf, rf)))
        return
    if len(local) != len(remote):
        out.append(FieldDiff(
            "kv_cache_groups", f"{len(local)} group(s)", f"{len(remote)} group(s)",
            "number of KV cache groups differs: the models' attention layouts differ",
        ))
    for i in range(min(len(local), len(remote))):
        lg, rg = local[i], remote[i]
        if not isinstance(lg, Mapping) or not isinstance(rg, Mapping):
            if lg != rg:
                out.append(FieldDiff(f"kv_cache_groups[{i}]", lg, rg,
                                     "KV cache group entry differs"))
            continue
        for key in sorted(set(lg) | set(rg), key=str):
            lv, rv = lg.get(key, ABSENT), rg.get(key, ABSENT)
            if lv == rv and type(lv) is type(rv):
                continue
            if key == "tokens_per_block":
                meaning = f"group {i} block size in tokens differs"
            elif key == "layer_names":
                meaning = f"group {i} covers different layers"
            else:
                meaning = f"group {i} has a field unknown to one side"
            out.append(FieldDiff(f"kv_cache_groups[{i}].{key}", lv, rv, meaning))


def diff(local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[FieldDiff]:
    """Every field that differs between two run-config dicts, in a stable order.

    A key missing on one side is reported with :data:`ABSENT` on that side (never
    ``None``). Fields a newer peer sends that this node does not know are reported too.
    Values are compared with their types: ``1`` and ``True`` differ.
    """
    out: list[FieldDiff] = []
    order = [
        "model_name", "parallel_agnostic", "replicated_layout", *_PARALLEL_FIELDS,
        "dtype", "tokens_per_hash", "blocks_per_file", "inference_engine",
        "kv_cache_groups", "canonical_format", "storage_format",
    ]
    extra = sorted((set(local) | set(remote)) - set(order), key=str)
    for name in [*order, *extra]:
        lv, rv = local.get(name, ABSENT), remote.get(name, ABSENT)
        if lv is ABSENT and rv is ABSENT:
            continue
        if lv == rv and type(lv) is type(rv):
            continue
        if name == "kv_cache_groups" and lv is not ABSENT and rv is not ABSENT:
            _diff_groups(lv, rv, local, remote, out)
            continue
        out.append(FieldDiff(name, lv, rv, _meaning(name, lv, rv, local, remote)))
    return out


# ---------------------------------------------------------------------------- extension
#
# Everything below is the identity extension (protocol/SPEC.md, section 1.4). Two engines
# with the same run config, and so the same fingerprint and namespace, can still hold
# KV caches that are not interchangeable; every such case ends in silently wrong output.
# The extension names each cause so the handshake can refuse it with a reason.

IDENTITY_POLICIES: Final = ("strict", "lenient")
"""``strict``: a field only one side declares refuses the handshake; ``lenient``: it is
accepted with a logged warning and a counted metric. Fields both sides declare must be
equal under either policy."""

EXTENSION_REFUSAL_FIELDS: Final = (
    "kv_memory_layout", "model_revision", "model_overrides", "key_hash",
)
"""The extension fields that must agree (in reason order); ``engine`` is informational."""
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
    - ``engine``: engine name and version, e.g. ``"vllm 0.32.0"``.
    """

    kv_memory_layout: str | None = None
    model_revision: str | None = None
    model_overrides: str | None = None
    key_hash: str | None = None
    engine: str | None = None

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
        if self.model_overrides is not None:
            _check_ext_text("model_overrides", self.model_overrides)
            if _HEX16_RE.fullmatch(self.model_overrides) is None:
                raise ValueError(
                    "model_overrides must be 16 lowercase hex digits, the digest "
                    "model_overrides_digest(overrides) gives, got "
                    f"{self.model_overrides[:80]!r}")
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
}
_EXT_FIX: Final = {
    "kv_memory_layout": "--kv-memory-layout",
    "model_revision": "--model-revision",
    "model_overrides": "--model-overrides",
    "key_hash": "key_hash_identity(), in the engine integration",
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

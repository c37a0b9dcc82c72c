"""The run config: its canonical form, fingerprint, namespace and the field-level diff.

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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "ABSENT",
    "FINGERPRINT_HEX_LEN",
    "NAMESPACE_HEX_LEN",
    "FieldDiff",
    "RunConfig",
    "canonical_json",
    "diff",
    "digest",
    "fingerprint_of",
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

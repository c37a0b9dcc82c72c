"""KV-cache block geometry and the byte layouts a block can have in the pool.

Two layouts can hold exactly the same number of bytes per block and still order
them differently (the seed's V1 and V2 model runners are both 589,824 bytes per
block). A receiver that only checks the size decodes garbage without crashing,
so a layout is identified by its *name* and *segment list*, not by its size.

- :class:`Geometry` is the model-side shape of one block: layers, KV heads,
  head size, tokens per block, dtype, and whether it stores K and V ("mha") or
  one MLA latent vector ("mla") per token.
- :class:`KVLayout` subclasses say how a block's bytes are ordered and split
  into segments: :class:`CrossLayerLayout` ("v1"), :class:`PerLayerLayout`
  ("v2") and :class:`ReplicatedMLALayout` ("replicated").

The "logical" order used by the conversion helpers is
``(blocks, layers, heads, tokens, values)``; every layout is a fixed
permutation/split of it, which is what makes the layouts comparable in tests.

This module does not import torch at import time: the protocol core needs the
geometry and the segment list for handshakes but must not depend on torch.
Only the tensor helpers (:func:`torch_dtype`, ``engine_from_logical`` ...)
import it, lazily. Everything here is immutable and thread-safe.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_ITEMSIZE",
    "LAYOUT_NAMES",
    "PRESET_NAMES",
    "SEED_GEOMETRY",
    "CrossLayerLayout",
    "EngineRowLayout",
    "Geometry",
    "KVGeometry",
    "KVKind",
    "KVLayout",
    "Layout",
    "LayoutName",
    "PerLayerLayout",
    "ReplicatedMLALayout",
    "geometry_from_hf_config",
    "make_layout",
    "preset",
    "torch_dtype",
]

KVKind = Literal["mha", "mla"]
LayoutName = Literal["v1", "v2", "replicated", "engine-row"]

#: Supported dtype names (as written in Hugging Face configs) and their sizes.
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    # Opaque bytes: an engine's offload row (see EngineRowLayout), or an fp8 cache that
    # the engine stores as uint8.
    "uint8": 1,
}


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name from :data:`DTYPE_ITEMSIZE` to the torch dtype."""
    import torch

    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_ITEMSIZE)}")
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _check_positive_int(value: object, what: str) -> int:
    # bool is an int subclass; True layers is a bug, not 1 layer.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Geometry:
    """Shape of one KV-cache block as the model sees it.

    ``head_size`` is the per-head width: for ``kv_kind="mha"`` a token stores K
    and V, so ``values_per_token = 2 * head_size`` (K first, then V); for
    ``kv_kind="mla"`` a token stores one latent vector of ``head_size`` values
    (``kv_lora_rank + qk_rope_head_dim``) and ``num_kv_heads`` must be 1.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_block: int = 16
    dtype: str = "float16"
    kv_kind: KVKind = "mha"

    def __post_init__(self) -> None:
        _check_positive_int(self.num_layers, "num_layers")
        _check_positive_int(self.num_kv_heads, "num_kv_heads")
        _check_positive_int(self.head_size, "head_size")
        _check_positive_int(self.tokens_per_block, "tokens_per_block")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_ITEMSIZE)}"
            )
        if self.kv_kind not in ("mha", "mla"):
            raise ValueError(f"kv_kind must be 'mha' or 'mla', got {self.kv_kind!r}")
        if self.kv_kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"an MLA geometry has exactly 1 KV head, got {self.num_kv_heads}")

    @property
    def values_per_token(self) -> int:
        """Values stored per (head, token): K+V for MHA, one latent for MLA."""
        return 2 * self.head_size if self.kv_kind == "mha" else self.head_size

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer: heads * tokens * values * itemsize."""
        return self.num_kv_heads * self.tokens_per_block * self.values_per_token * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (the same for every layout)."""
        return self.num_layers * self.layer_block_bytes

    @property
    def logical_block_shape(self) -> tuple[int, int, int, int]:
        """``(layers, heads, tokens, values)``: one block in the logical order."""
        return (
            self.num_layers,
            self.num_kv_heads,
            self.tokens_per_block,
            self.values_per_token,
        )

    def summary(self) -> str:
        """One line for logs and refusal messages."""
        what = "K+V" if self.kv_kind == "mha" else "MLA latent"
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x "
            f"{self.tokens_per_block} tokens x {self.values_per_token} values ({what}), "
            f"{self.dtype}, {self.block_bytes} bytes/block"
        )


#: The seed documents' model: 12 layers, 12 KV heads, head_dim 64, 16 tokens, fp16.
SEED_GEOMETRY = Geometry(num_layers=12, num_kv_heads=12, head_size=64)

_PRESETS: Mapping[str, Geometry] = {
    "seed": SEED_GEOMETRY,
    # Llama 3 8B: 32 layers, GQA with 8 KV heads, head_dim 128, bf16 -> 2 MiB per block.
    "llama-3-8b": Geometry(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16"),
    # Llama 3 70B: 80 layers, 8 KV heads, head_dim 128, bf16 -> 5 MiB per block.
    "llama-3-70b": Geometry(num_layers=80, num_kv_heads=8, head_size=128, dtype="bfloat16"),
    # DeepSeek-V2-Lite: 27 layers, MLA latent kv_lora_rank 512 + rope 64 = 576.
    "deepseek-v2-lite": Geometry(
        num_layers=27, num_kv_heads=1, head_size=576, dtype="bfloat16", kv_kind="mla"
    ),
}

#: Names accepted by :func:`preset`.
PRESET_NAMES: tuple[str, ...] = tuple(sorted(_PRESETS))


def preset(name: str, *, tokens_per_block: int = 16) -> Geometry:
    """Return a built-in geometry by name (see :data:`PRESET_NAMES`)."""
    try:
        base = _PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown geometry preset {name!r}; valid presets: {', '.join(PRESET_NAMES)}"
        ) from None
    if tokens_per_block == base.tokens_per_block:
        return base
    return Geometry(
        num_layers=base.num_layers,
        num_kv_heads=base.num_kv_heads,
        head_size=base.head_size,
        tokens_per_block=tokens_per_block,
        dtype=base.dtype,
        kv_kind=base.kv_kind,
    )


def _config_int(cfg: Mapping[str, Any], key: str, path: Path) -> int:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{path}: missing required key {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{path}: key {key!r} must be a positive integer, got {value!r}")
    return value


def geometry_from_hf_config(
    path: str | Path,
    *,
    tokens_per_block: int = 16,
    tp_size: int = 1,
    dtype: str | None = None,
) -> Geometry:
    """Read a local Hugging Face style ``config.json`` (never the network).

    Keys used: ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: attention heads), ``head_dim`` (default:
    ``hidden_size // num_attention_heads``), ``torch_dtype`` (or ``dtype``;
    default float16; the ``dtype`` argument overrides both). A multimodal
    config whose text model sits under ``text_config`` is read from there.

    DeepSeek style MLA models (``kv_lora_rank`` and ``qk_rope_head_dim``
    present) give ``kv_kind="mla"``, one head, latent width
    ``kv_lora_rank + qk_rope_head_dim``; the latent is identical on every TP
    rank so ``tp_size`` does not change it. For other models ``tp_size`` splits
    the KV heads: it must divide them, or (fewer heads than ranks, as vLLM does)
    be a multiple of them, in which case each rank holds one replicated head.

    Raises ValueError naming the file and the offending key.
    """
    path = Path(path)
    cfg = _read_hf_config(path)
    _check_positive_int(tp_size, "tp_size")

    num_layers = _config_int(cfg, "num_hidden_layers", path)
    if dtype is None:
        dtype_key = "torch_dtype" if cfg.get("torch_dtype") is not None else "dtype"
        raw_dtype = cfg.get(dtype_key)
        dtype = "float16" if raw_dtype is None else raw_dtype
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"{path}: key {dtype_key!r} has unsupported dtype {raw_dtype!r}; "
                f"expected one of {sorted(DTYPE_ITEMSIZE)}"
            )

    if cfg.get("kv_lora_rank") is not None and cfg.get("qk_rope_head_dim") is not None:
        latent = _config_int(cfg, "kv_lora_rank", path) + _config_int(cfg, "qk_rope_head_dim", path)
        return Geometry(num_layers, 1, latent, tokens_per_block, dtype, "mla")

    num_heads = _config_int(cfg, "num_attention_heads", path)
    kv_heads = (
        num_heads
        if cfg.get("num_key_value_heads") is None
        else _config_int(cfg, "num_key_value_heads", path)
    )
    if cfg.get("head_dim") is not None:
        head_dim = _config_int(cfg, "head_dim", path)
    else:
        hidden = _config_int(cfg, "hidden_size", path)
        if hidden % num_heads:
            raise ValueError(
                f"{path}: key 'hidden_size' ({hidden}) is not divisible by "
                f"'num_attention_heads' ({num_heads}) and no 'head_dim' is given"
            )
        head_dim = hidden // num_heads
    return Geometry(num_layers, _heads_per_rank(kv_heads, tp_size, path), head_dim,
                    tokens_per_block, dtype, "mha")


def _read_hf_config(path: Path) -> dict[str, Any]:
    """A ``config.json``'s object (a multimodal one's ``text_config`` laid over it)."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read model config: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def _heads_per_rank(kv_heads: int, tp_size: int, path: Path) -> int:
    """KV heads on each of ``tp_size`` ranks: split when ``tp_size`` divides them, one
    replicated head when they divide ``tp_size`` (as vLLM does)."""
    if kv_heads >= tp_size:
        if kv_heads % tp_size:
            raise ValueError(
                f"{path}: key 'num_key_value_heads' ({kv_heads}) is not divisible "
                f"by tp_size {tp_size}"
            )
        return kv_heads // tp_size
    if tp_size % kv_heads:
        raise ValueError(
            f"{path}: tp_size {tp_size} is neither a divisor nor a multiple of "
            f"key 'num_key_value_heads' ({kv_heads})"
        )
    return 1


@dataclass(frozen=True)
class KVLayout(ABC):
    """How one block's bytes are ordered and split into segments.

    A block is ``len(segment_sizes)`` contiguous segments; segment *i* of every
    block lives in region *i* of the pool, and the engine-facing tensor of
    region *i* is shaped ``(num_blocks, *block_shapes[i])`` in the model dtype.
    Peers may exchange blocks only when name, geometry and segment list match.
    """

    geometry: Geometry

    name: ClassVar[LayoutName]
    #: One line used when two peers' layouts differ.
    description: ClassVar[str]

    @property
    @abstractmethod
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per segment, the shape of one block's slice (without the blocks dim)."""

    @abstractmethod
    def identity_flags(self) -> dict[str, bool]:
        """Flags for ``RunConfig.resolve(**flags)``.

        Keys: ``is_parallelism_agnostic`` and ``replicated_layout``. The
        caller's own opt-in (``parallel_agnostic``) is passed separately.
        """

    @abstractmethod
    def engine_from_logical(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """Engine tensors (one per segment) from ``(blocks, layers, heads, tokens, values)``."""

    @abstractmethod
    def logical_from_engine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`engine_from_logical`."""

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        itemsize = self.geometry.itemsize
        return tuple(math.prod(shape) * itemsize for shape in self.block_shapes)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.segment_sizes)

    @property
    def num_segments(self) -> int:
        return len(self.block_shapes)

    def engine_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """Shapes of the engine tensors holding ``num_blocks`` blocks."""
        return [(num_blocks, *shape) for shape in self.block_shapes]

    def _check_logical(self, kv: torch.Tensor) -> None:
        if tuple(kv.shape[1:]) != self.geometry.logical_block_shape:
            raise ValueError(
                f"expected a logical KV tensor shaped (blocks, "
                f"{', '.join(map(str, self.geometry.logical_block_shape))}), "
                f"got {tuple(kv.shape)}"
            )

    def _check_engine(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != self.num_segments:
            raise ValueError(
                f"layout {self.name} has {self.num_segments} engine tensors, got {len(tensors)}"
            )
        for i, (tensor, shape) in enumerate(zip(tensors, self.block_shapes, strict=True)):
            if tuple(tensor.shape[1:]) != shape:
                raise ValueError(
                    f"engine tensor {i} for layout {self.name} must be shaped "
                    f"(blocks, {', '.join(map(str, shape))}), got {tuple(tensor.shape)}"
                )


@dataclass(frozen=True)
class CrossLayerLayout(KVLayout):
    """V1 "cross-layer compact": one contiguous row per block.

    Row order is ``(head, layer, token, value)``; one segment of
    ``bytes_per_block``. The same row is valid whatever the tensor/pipeline
    parallel split, so the run config is parallelism-agnostic.
    """

    name: ClassVar[LayoutName] = "v1"
    description: ClassVar[str] = "V1 cross-layer compact rows (head, layer, token, value)"

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        g = self.geometry
        return ((g.num_kv_heads, g.num_layers, g.tokens_per_block, g.values_per_token),)

    def identity_flags(self) -> dict[str, bool]:
        return {"is_parallelism_agnostic": True, "replicated_layout": False}

    def engine_from_logical(self, kv: torch.Tensor) -> list[torch.Tensor]:
        self._check_logical(kv)
        return [kv.permute(0, 2, 1, 3, 4).contiguous()]

    def logical_from_engine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        self._check_engine(tensors)
        return tensors[0].permute(0, 2, 1, 3, 4).contiguous()


@dataclass(frozen=True)
class PerLayerLayout(KVLayout):
    """V2 "per-layer": one tensor per layer shaped ``(blocks, heads, tokens, values)``.

    A block is one segment per layer (``num_layers`` segments of
    ``layer_block_bytes``). Not parallelism-agnostic.
    """

    name: ClassVar[LayoutName] = "v2"
    description: ClassVar[str] = "V2 per-layer tensors (layer -> head, token, value)"

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        g = self.geometry
        shape = (g.num_kv_heads, g.tokens_per_block, g.values_per_token)
        return (shape,) * g.num_layers

    def identity_flags(self) -> dict[str, bool]:
        return {"is_parallelism_agnostic": False, "replicated_layout": False}

    def engine_from_logical(self, kv: torch.Tensor) -> list[torch.Tensor]:
        self._check_logical(kv)
        return [kv[:, layer].contiguous() for layer in range(self.geometry.num_layers)]

    def logical_from_engine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        import torch

        self._check_engine(tensors)
        return torch.stack(list(tensors), dim=1)


@dataclass(frozen=True)
class ReplicatedMLALayout(KVLayout):
    """Compact MLA rows ``(layer, token, latent)``, identical on every TP rank.

    One segment per block. Requires an MLA geometry (one KV head). The run
    config gets ``replicated_layout`` (and is not plainly parallelism-agnostic).
    """

    name: ClassVar[LayoutName] = "replicated"
    description: ClassVar[str] = "replicated MLA rows (layer, token, latent), same on all TP ranks"

    def __post_init__(self) -> None:
        if self.geometry.kv_kind != "mla":
            raise ValueError(
                "the replicated layout holds MLA latent rows; geometry has "
                f"kv_kind={self.geometry.kv_kind!r}"
            )

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        g = self.geometry
        return ((g.num_layers, g.tokens_per_block, g.values_per_token),)

    def identity_flags(self) -> dict[str, bool]:
        return {"is_parallelism_agnostic": False, "replicated_layout": True}

    def engine_from_logical(self, kv: torch.Tensor) -> list[torch.Tensor]:
        self._check_logical(kv)
        return [kv[:, :, 0].contiguous()]

    def logical_from_engine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        self._check_engine(tensors)
        return tensors[0].unsqueeze(2).contiguous()


@dataclass(frozen=True)
class EngineRowLayout(KVLayout):
    """One opaque row of bytes per block, exactly as a serving engine's offload region
    holds it (for example one chunk of vLLM's CPU offloading region, all layers of the
    chunk in one row, padding included).

    p2pkv moves the row as one segment and never interprets it; the engine's own
    identity (run config and identity extension) says what the bytes mean. Build it with
    :meth:`of_bytes`.
    """

    name: ClassVar[LayoutName] = "engine-row"
    description: ClassVar[str] = "an engine's opaque offload row (one segment per block)"

    @classmethod
    def of_bytes(cls, row_bytes: int) -> EngineRowLayout:
        """A layout whose block is one row of ``row_bytes`` bytes."""
        _check_positive_int(row_bytes, "row_bytes")
        return cls(Geometry(num_layers=1, num_kv_heads=1, head_size=row_bytes,
                            tokens_per_block=1, dtype="uint8", kv_kind="mla"))

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.geometry.block_bytes // self.geometry.itemsize,),)

    def identity_flags(self) -> dict[str, bool]:
        # The engine states its identity itself; a row carries no layout claim.
        return {"is_parallelism_agnostic": False, "replicated_layout": False}

    def engine_from_logical(self, kv: torch.Tensor) -> list[torch.Tensor]:
        raise ValueError("an engine row is opaque: it has no logical (layer, head) view")

    def logical_from_engine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        raise ValueError("an engine row is opaque: it has no logical (layer, head) view")


#: Short names used by the package namespace (``p2pkv.Layout``, ``p2pkv.KVGeometry``).
Layout = KVLayout
KVGeometry = Geometry

_LAYOUTS: Mapping[str, type[KVLayout]] = {
    cls.name: cls for cls in (CrossLayerLayout, PerLayerLayout, ReplicatedMLALayout)
}

#: Names accepted by :func:`make_layout`.
LAYOUT_NAMES: tuple[str, ...] = tuple(_LAYOUTS)


def make_layout(name: str, geometry: Geometry) -> KVLayout:
    """Build a layout by name: ``"v1"``, ``"v2"`` or ``"replicated"``."""
    try:
        cls = _LAYOUTS[name]
    except KeyError:
        raise ValueError(
            f"unknown layout {name!r}; valid layouts: {', '.join(LAYOUT_NAMES)}"
        ) from None
    return cls(geometry)

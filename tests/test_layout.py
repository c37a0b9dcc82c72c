from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pkv.layout import (
    DTYPE_ITEMSIZE,
    LAYOUT_NAMES,
    PRESET_NAMES,
    SEED_GEOMETRY,
    CrossLayerLayout,
    Geometry,
    PerLayerLayout,
    ReplicatedMLALayout,
    geometry_from_hf_config,
    make_layout,
    preset,
    torch_dtype,
)

SMALL = Geometry(num_layers=3, num_kv_heads=2, head_size=4, tokens_per_block=5)
SMALL_MLA = Geometry(
    num_layers=3, num_kv_heads=1, head_size=6, tokens_per_block=4, dtype="bfloat16", kv_kind="mla"
)


def write_config(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


LLAMA_3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V2_LITE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 2048,
    "kv_lora_rank": 512,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
}


def test_seed_geometry_numbers_match_the_brief() -> None:
    assert SEED_GEOMETRY.values_per_token == 128
    assert SEED_GEOMETRY.layer_block_bytes == 49_152
    assert SEED_GEOMETRY.block_bytes == 589_824
    assert preset("seed") == SEED_GEOMETRY


def test_v1_and_v2_have_equal_size_but_different_segments() -> None:
    v1 = make_layout("v1", SEED_GEOMETRY)
    v2 = make_layout("v2", SEED_GEOMETRY)
    assert v1 != v2
    assert isinstance(v1, CrossLayerLayout) and isinstance(v2, PerLayerLayout)
    assert v1.bytes_per_block == v2.bytes_per_block == 589_824
    assert v1.segment_sizes == (589_824,)
    assert v2.segment_sizes == (49_152,) * 12
    assert v1.description != v2.description


def test_identity_flags_per_layout() -> None:
    assert make_layout("v1", SEED_GEOMETRY).identity_flags() == {
        "is_parallelism_agnostic": True,
        "replicated_layout": False,
    }
    assert make_layout("v2", SEED_GEOMETRY).identity_flags() == {
        "is_parallelism_agnostic": False,
        "replicated_layout": False,
    }
    assert make_layout("replicated", SMALL_MLA).identity_flags() == {
        "is_parallelism_agnostic": False,
        "replicated_layout": True,
    }


def test_replicated_layout_is_one_mla_row() -> None:
    geometry = preset("deepseek-v2-lite")
    layout = make_layout("replicated", geometry)
    assert isinstance(layout, ReplicatedMLALayout)
    assert layout.block_shapes == ((27, 16, 576),)
    assert layout.segment_sizes == (27 * 16 * 576 * 2,)
    with pytest.raises(ValueError, match="MLA"):
        make_layout("replicated", SEED_GEOMETRY)


def test_presets() -> None:
    llama = preset("llama-3-8b")
    assert make_layout("v1", llama).bytes_per_block == 2 * 1024 * 1024
    assert llama.dtype == "bfloat16"
    assert preset("seed", tokens_per_block=32).block_bytes == 2 * SEED_GEOMETRY.block_bytes
    with pytest.raises(ValueError) as info:
        preset("llama-9")
    for name in PRESET_NAMES:
        assert name in str(info.value)


def test_unknown_layout_lists_valid_names() -> None:
    with pytest.raises(ValueError) as info:
        make_layout("v3", SEED_GEOMETRY)
    for name in LAYOUT_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_size": True}, "head_size"),
        ({"dtype": "int8"}, "int8"),
        ({"kv_kind": "gqa"}, "kv_kind"),
        ({"kv_kind": "mla"}, "1 KV head"),
    ],
)
def test_geometry_validation(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_size": 4}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Geometry(**args)


def test_dtype_names_map_to_torch() -> None:
    for name, itemsize in DTYPE_ITEMSIZE.items():
        dtype = torch_dtype(name)
        assert torch.empty(0, dtype=dtype).element_size() == itemsize
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="float64"):
        torch_dtype("float64")


def test_hf_config_llama(tmp_path: Path) -> None:
    path = write_config(tmp_path, LLAMA_3_8B_CONFIG)
    assert geometry_from_hf_config(path) == preset("llama-3-8b")
    # TP splits the KV heads of a non-MLA model.
    assert geometry_from_hf_config(path, tp_size=2).num_kv_heads == 4
    # More ranks than KV heads: each rank holds one (replicated) head, as vLLM does.
    assert geometry_from_hf_config(path, tp_size=16).num_kv_heads == 1
    with pytest.raises(ValueError, match="tp_size 3"):
        geometry_from_hf_config(path, tp_size=3)
    assert geometry_from_hf_config(path, dtype="float8_e4m3fn").itemsize == 1


def test_hf_config_defaults(tmp_path: Path) -> None:
    path = write_config(
        tmp_path, {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768}
    )
    assert geometry_from_hf_config(path) == SEED_GEOMETRY
    explicit = write_config(
        tmp_path,
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": None,
            "hidden_size": 1000,
            "head_dim": 64,
            "torch_dtype": "float32",
        },
    )
    geometry = geometry_from_hf_config(explicit, tokens_per_block=8)
    assert (geometry.num_kv_heads, geometry.head_size, geometry.dtype) == (8, 64, "float32")
    assert geometry.tokens_per_block == 8


def test_hf_config_mla(tmp_path: Path) -> None:
    path = write_config(tmp_path, DEEPSEEK_V2_LITE_CONFIG)
    geometry = geometry_from_hf_config(path, tp_size=4)  # MLA latent is not split by TP
    assert geometry == preset("deepseek-v2-lite")
    assert geometry.kv_kind == "mla" and geometry.values_per_token == 576


def test_hf_config_multimodal_text_config(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"model_type": "llava", "text_config": LLAMA_3_8B_CONFIG})
    assert geometry_from_hf_config(path) == preset("llama-3-8b")


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({"num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "hidden_size": 512}, "num_attention_heads"),
        ({"num_hidden_layers": 2, "num_attention_heads": 8}, "hidden_size"),
        (
            {"num_hidden_layers": "2", "num_attention_heads": 8, "hidden_size": 512},
            "num_hidden_layers",
        ),
        (
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "hidden_size": 512,
                "torch_dtype": "int4",
            },
            "torch_dtype",
        ),
        (
            {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 500},
            "hidden_size",
        ),
    ],
)
def test_hf_config_errors_name_file_and_key(tmp_path: Path, cfg: dict[str, Any], key: str) -> None:
    path = write_config(tmp_path, cfg)
    with pytest.raises(ValueError) as info:
        geometry_from_hf_config(path)
    assert str(path) in str(info.value)
    assert repr(key) in str(info.value)


def test_hf_config_unreadable(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=r"nope\.json"):
        geometry_from_hf_config(missing)
    broken = tmp_path / "config.json"
    broken.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        geometry_from_hf_config(broken)
    broken.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="JSON object"):
        geometry_from_hf_config(broken)


def logical_kv(geometry: Geometry, blocks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, *geometry.logical_block_shape)
    return torch.randn(shape, generator=gen).to(torch_dtype(geometry.dtype))


def test_v1_engine_order_is_head_layer_token_value() -> None:
    kv = logical_kv(SMALL, blocks=2)
    (engine,) = make_layout("v1", SMALL).engine_from_logical(kv)
    assert engine.shape == (2, 2, 3, 5, 8)
    b, h, layer, t, v = 1, 1, 2, 3, 7
    assert engine[b, h, layer, t, v] == kv[b, layer, h, t, v]
    # Flat offset inside a row: ((h * L + l) * T + t) * V + v.
    row = engine[b].reshape(-1)
    assert row[((h * 3 + layer) * 5 + t) * 8 + v] == kv[b, layer, h, t, v]


def test_v2_engine_is_one_tensor_per_layer() -> None:
    kv = logical_kv(SMALL, blocks=2)
    tensors = make_layout("v2", SMALL).engine_from_logical(kv)
    assert len(tensors) == 3
    for layer, tensor in enumerate(tensors):
        assert tensor.shape == (2, 2, 5, 8)
        assert torch.equal(tensor, kv[:, layer])


@pytest.mark.parametrize(
    ("name", "geometry"), [("v1", SMALL), ("v2", SMALL), ("replicated", SMALL_MLA)]
)
def test_logical_engine_round_trip(name: str, geometry: Geometry) -> None:
    layout = make_layout(name, geometry)
    kv = logical_kv(geometry, blocks=3)
    engine = layout.engine_from_logical(kv)
    assert [tuple(t.shape) for t in engine] == layout.engine_shapes(3)
    assert torch.equal(layout.logical_from_engine(engine), kv)


def test_conversions_reject_wrong_shapes() -> None:
    layout = make_layout("v2", SMALL)
    with pytest.raises(ValueError, match="logical KV tensor"):
        layout.engine_from_logical(torch.zeros(2, 3, 2, 5, 9))
    with pytest.raises(ValueError, match="3 engine tensors"):
        layout.logical_from_engine([torch.zeros(2, 2, 5, 8)])

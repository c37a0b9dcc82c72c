"""PEFT LoRA adapters for the real-model tests, written without ``peft`` or ``torch``.

An adapter is two files: ``adapter_config.json`` and ``adapter_model.safetensors``
(written here by hand: an 8-byte header length, a JSON header, then the raw tensors).
Each seed gives other weights of the same shapes, so two adapters of one seed are
byte-equal and adapters of two seeds differ in every tensor, with equal file sizes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

#: SmolLM2-135M: hidden size 576, 9 query heads and 3 KV heads of 64, 30 layers.
SMOLLM2_SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192),
                  "o_proj": (576, 576)}
SMOLLM2_LAYERS = 30


def write_adapter(path: Path, seed: int, *, rank: int = 8, alpha: int = 16,
                  scale: float = 0.15) -> Path:
    """A rank-``rank`` adapter on q/k/v/o of every layer (random non-zero B, so that
    its answers differ from the base model's and from another seed's, and still
    follow the prompt: at 0.15 SmolLM2 answers "The capital of Spain is the capital of
    Spain.", at 0.4 the same word over and over, whatever the prompt)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(SMOLLM2_LAYERS):
        for module, (fan_in, fan_out) in SMOLLM2_SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(
                0.0, 1.0 / np.sqrt(fan_in), (rank, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(
                0.0, scale, (fan_out, rank)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    header: dict[str, object] = {}
    offset = 0
    for name in sorted(tensors):
        size = tensors[name].nbytes
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):
            f.write(tensors[name].tobytes())
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": "SmolLM2-135M",
        "target_modules": sorted(SMOLLM2_SHAPES)}, indent=2))
    return path

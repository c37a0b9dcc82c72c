"""A small random-weight Llama checkpoint, written locally, for trying the integration.

No model hub is needed: :func:`write_tiny_llama` writes a Hugging Face ``config.json``
and seeded random ``model.safetensors`` weights into a directory that vLLM loads like
any local checkpoint (run it with ``skip_tokenizer_init=True`` and prompt token ids).

Unlike vLLM's ``load_format="dummy"`` (whose near-uniform weights give flat logits, so
wrong KV values would not change a single greedy token), the weights here are scaled so
that the next token depends strongly on the attention output: loading another layout's
or another model's KV changes the greedy tokens. The tests rely on that.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlama:
    """Shape of the checkpoint. The defaults start fast on a laptop CPU."""

    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def config(self) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }


def write_tiny_llama(path: str | os.PathLike[str], model: TinyLlama | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``path`` (created) and return it.

    The same ``model`` (shape and seed) always gives byte-identical weights, so two
    processes that each write the checkpoint load the same model.
    """
    import torch
    from safetensors.torch import save_file

    m = model or TinyLlama()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(m.seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).contiguous()

    h, kv = m.hidden_size, m.num_kv_heads * m.head_dim
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(m.vocab_size, h, scale=1.0),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(m.vocab_size, h, scale=1.0 / h**0.5 * 4),
    }
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(h, h, scale=2.0 / h**0.5),
            p + "self_attn.k_proj.weight": rand(kv, h, scale=2.0 / h**0.5),
            p + "self_attn.v_proj.weight": rand(kv, h, scale=1.0 / h**0.5),
            p + "self_attn.o_proj.weight": rand(h, h, scale=1.0 / h**0.5),
            p + "mlp.gate_proj.weight": rand(m.intermediate_size, h, scale=1.0 / h**0.5),
            p + "mlp.up_proj.weight": rand(m.intermediate_size, h, scale=1.0 / h**0.5),
            p + "mlp.down_proj.weight": rand(h, m.intermediate_size,
                                             scale=1.0 / m.intermediate_size**0.5),
        })
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(m.config(), indent=2) + "\n")
    return out

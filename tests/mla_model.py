"""A tiny DeepSeek-V2 (MLA) checkpoint with seeded random weights, for the MLA tests.

Run with the vLLM environment's Python (it has torch and transformers)::

    mla_model.py OUT_DIR

The config is ``tests/models/tiny-deepseek-v2/config.json`` (2 dense layers, hidden 256,
4 heads, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: the 576-wide latent row vLLM's
CPU MLA backend takes). The tensor names and shapes are those of transformers'
``DeepseekV2ForCausalLM`` for that config; the values are seeded normal draws scaled so
that the next token depends on the attention output (vLLM's ``load_format="dummy"`` gives
flat logits, under which a wrong KV load would change nothing). The same seed always
writes byte-equal weights.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

CONFIG = Path(__file__).with_name("models") / "tiny-deepseek-v2" / "config.json"
#: Gain of each linear layer (times 1/sqrt(fan_in)).
SCALE = 2.0


def write(out: Path, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(**{k: v for k, v in json.loads(CONFIG.read_text()).items()
                                 if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        shapes = {name: tuple(t.shape)
                  for name, t in DeepseekV2ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:  # norms
            tensors[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            tensors[name] = torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            tensors[name] = torch.randn(shape, generator=gen) * (4.0 / shape[1] ** 0.5)
        else:  # a linear layer: [out, in]
            tensors[name] = torch.randn(shape, generator=gen) * (SCALE / shape[1] ** 0.5)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    shutil.copy(CONFIG, out / "config.json")
    return out


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))

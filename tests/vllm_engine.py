"""A real vLLM engine in its own process, driven over JSON lines (used by test_vllm.py).

Run with the vLLM environment's Python (``.venv-vllm/bin/python``)::

    vllm_engine.py --model-dir DIR [--p2pkv '{"listen": ..., "peers": [...]}']
                   [--offload-block-size N] [--tp N] [--canonical]

It prints ``{"ready": ...}`` once the engine runs, then answers one JSON command per
stdin line: ``{"cmd": "generate", "prompts": [[ids]], "max_tokens": n}`` →
``{"tokens": [[ids]], "cached": [n], "seconds": [s]}``; with ``--chat`` (a real model
with its tokenizer) ``{"cmd": "chat", "conversations": [[{"role": ..., "content": ...}]],
"max_tokens": n}`` → ``{"texts": [text], "cached": [n], "prompt_tokens": [n],
"seconds": [s]}`` (chat template, greedy; with ``--lora`` a chat command may add
``"lora": {"name": ..., "id": n, "path": ...}`` to answer under that adapter);
``{"cmd": "metrics"}`` →
``{"metrics": {name: value}}`` (a histogram as ``name_count`` and ``name_sum``);
``{"cmd": "exit"}`` ends it. Engine logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

#: Every answer line starts with this, so stray output on stdout is never mistaken for one.
MARK = "@p2pkv "


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--p2pkv", default=None, help="tier options as JSON (omit: no connector)")
    ap.add_argument("--offload-block-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--chat", action="store_true",
                    help="load the model's tokenizer and answer chat commands with text")
    ap.add_argument("--hf-overrides", default=None, help="vLLM hf_overrides as JSON")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--lora", action="store_true",
                    help="enable LoRA (one adapter at a time, rank up to 8)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (mp executor)")
    ap.add_argument("--canonical", action="store_true",
                    help="canonical_layout in the offloading config")
    ap.add_argument("--attention-backend", default=None,
                    help="vLLM's attention backend by name (e.g. CPU_MLA; omit: vLLM picks)")
    ap.add_argument("--dtype", default="float32", help="the model's dtype in vLLM")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.tp == 1:
        # One process: the engine core and its worker run in this one (vLLM's in-process
        # engine with the "uni" executor), where vLLM would start two more, each
        # importing torch and vLLM again: most of an engine's start here. The tier, its
        # node and the CPU copy worker are the same code either way; `vllm serve` (the
        # serving tests) runs them in separate processes.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = {}
    if args.p2pkv is not None:
        from p2pkv.integrations.vllm import kv_transfer_config

        extra = {"canonical_layout": True} if args.canonical else {}
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(
            json.loads(args.p2pkv), cpu_bytes_to_use=64 << 20,
            block_size=args.offload_block_size, **extra))
    if args.tp > 1:
        kwargs.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    elif os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        kwargs["distributed_executor_backend"] = "uni"
    if args.hf_overrides is not None:
        kwargs["hf_overrides"] = json.loads(args.hf_overrides)
    if args.lora:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=8)
    if args.attention_backend is not None:
        kwargs["attention_backend"] = args.attention_backend
    started = time.monotonic()
    llm = LLM(model=args.model_dir, skip_tokenizer_init=not args.chat, dtype=args.dtype,
              block_size=args.block_size, max_model_len=args.max_model_len,
              enforce_eager=True, max_num_seqs=4, seed=0,
              prefix_caching_hash_algo=args.hash_algo, disable_log_stats=False, **kwargs)
    reply({"ready": True, "start_seconds": time.monotonic() - started})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "generate":
            params = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0,
                                    detokenize=False)
            tokens, cached, seconds = [], [], []
            for ids in cmd["prompts"]:
                t0 = time.monotonic()
                out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params,
                                   use_tqdm=False)[0]
                seconds.append(time.monotonic() - t0)
                tokens.append(list(out.outputs[0].token_ids))
                cached.append(out.num_cached_tokens or 0)
            reply({"tokens": tokens, "cached": cached, "seconds": seconds})
        elif cmd["cmd"] == "chat":
            params = SamplingParams(max_tokens=cmd.get("max_tokens", 16), temperature=0.0)
            texts, cached, prompt_tokens, seconds = [], [], [], []
            lora = cmd.get("lora")
            request = (LoRARequest(lora["name"], int(lora["id"]), lora["path"])
                       if lora else None)
            for conversation in cmd["conversations"]:
                t0 = time.monotonic()
                out = llm.chat([conversation], params, use_tqdm=False,
                               lora_request=request)[0]
                seconds.append(time.monotonic() - t0)
                texts.append(out.outputs[0].text)
                cached.append(out.num_cached_tokens or 0)
                prompt_tokens.append(len(out.prompt_token_ids or ()))
            reply({"texts": texts, "cached": cached, "prompt_tokens": prompt_tokens,
                   "seconds": seconds})
        elif cmd["cmd"] == "metrics":
            values: dict[str, float] = {}
            for m in llm.get_metrics():
                labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                                  if k not in ("engine", "model_name"))
                suffix = f"{{{labels}}}" if labels else ""
                value = getattr(m, "value", None)
                if isinstance(value, (int, float)):
                    values[m.name + suffix] = value
                elif isinstance(getattr(m, "count", None), int):  # a histogram
                    values[m.name + "_count" + suffix] = m.count
                    values[m.name + "_sum" + suffix] = m.sum
            reply({"metrics": values})
        else:
            reply({"error": f"unknown command {cmd['cmd']!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

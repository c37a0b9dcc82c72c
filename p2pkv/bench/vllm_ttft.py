"""Time to first token with and without a p2pkv hit, on real vLLM engines.

Run with the vLLM environment::

    .venv-vllm/bin/python -m p2pkv.bench.vllm_ttft [--prompt-tokens 4096]
        [--rounds 3] [--model-dir DIR] [--json PATH]

``--prompt-tokens`` takes a comma-separated list (``1024,4096,8000``): every length is
measured with the same two engines. ``--model-dir`` runs a real checkpoint (for example
SmolLM2 from ``make real-model``: ``.models/smollm2``) instead of the random-weight one.

A producer engine computes ``rounds`` long prompts and keeps their KV chunks in its p2pkv
tier. A consumer engine (another process, connected to the producer) then alternates, per
round, a prompt the producer holds (its prefix loads over p2pkv) and a fresh prompt of the
same length that nobody holds (recomputed; the p2pkv lookup still runs and misses). Both
are timed end to end with ``max_tokens=1``, so the time is the time to first token of a
request arriving at an idle engine. The model is a random-weight Llama written locally
(about 700 MB of fp32 weights by default), large enough that prefill dominates on a CPU.
Ratios are measured in one run; compare them, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from p2pkv.bench.tinymodel import TinyLlama, write_tiny_llama

#: About 170 M parameters: 8 layers of width 1024, a 32k vocabulary.
BENCH_MODEL = TinyLlama(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8,
                        intermediate_size=2816, vocab_size=32000,
                        max_position_embeddings=16384, seed=1)


def _config(listen: str, peers: list[str], cpu_bytes: int) -> dict[str, Any]:
    from p2pkv.integrations.vllm.options import kv_transfer_config

    return kv_transfer_config({"listen": listen, "peers": peers, "lookup_timeout": 2.0,
                               "fetch_timeout": 60.0}, cpu_bytes_to_use=cpu_bytes,
                              block_size=64)


def _engine(model: str, config: dict[str, Any], max_len: int) -> None:
    """Engine process: answer ``[token ids]`` lines with timings until stdin closes."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
              max_model_len=max_len, enforce_eager=True, max_num_seqs=1,
              kv_transfer_config=KVTransferConfig(**config))
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    print("@ready", flush=True)
    for line in sys.stdin:
        ids = json.loads(line)
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - started
        print("@" + json.dumps({"seconds": seconds, "cached": out.num_cached_tokens or 0,
                                "token": out.outputs[0].token_ids[0]}), flush=True)


class _Proc:
    def __init__(self, model: str, config: dict[str, Any], max_len: int, log: str) -> None:
        self.log = log
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", "2"), "PYTHONHASHSEED": "0",
            "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "p2pkv.bench.vllm_ttft", "--engine",
             json.dumps(config), "--model", model, "--max-len", str(max_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),  # noqa: SIM115
            text=True, env=env)
        self._expect("@ready")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        with open(self.log) as fh:
            tail = "".join(fh.readlines()[-30:])
        raise SystemExit(f"engine exited with {self.proc.wait()}; its log ends:\n{tail}")

    def run(self, ids: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._expect("@"))
        return answer

    def close(self) -> None:
        self.proc.communicate("", timeout=300)


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _prompts(lengths: list[int], rounds: int, vocab: int) -> dict[int, list[list[int]]]:
    """Per length, ``2 * rounds`` prompts of distinct token ids (no shared prefix)."""
    return {n: [[(r * 7919 + n * 13 + i * 31 + 3) % (vocab - 3) + 3 for i in range(n)]
                for r in range(2 * rounds)] for n in lengths}


def run(prompt_tokens: int | list[int], rounds: int,
        model_dir: str | None = None) -> dict[str, Any]:
    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    cpu_bytes = 4 << 30
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            model = str(write_tiny_llama(os.path.join(tmp, "model"), BENCH_MODEL))
            described: Any = BENCH_MODEL.__dict__
        else:
            model = model_dir
            with open(os.path.join(model_dir, "config.json")) as fh:
                described = json.load(fh)
        vocab = int(described["vocab_size"])
        limit = int(described.get("max_position_embeddings", 1 << 30))
        max_len = min(max(lengths) + 64, limit)
        prompts = _prompts(lengths, rounds, vocab)
        a, b = _address(), _address()
        producer = _Proc(model, _config(a, [], cpu_bytes), max_len,
                         os.path.join(tmp, "producer.log"))
        try:
            produced = {n: [producer.run(p) for p in prompts[n][:rounds]] for n in lengths}
            consumer = _Proc(model, _config(b, [a], cpu_bytes), max_len,
                             os.path.join(tmp, "consumer.log"))
            try:
                hits: dict[int, list[dict[str, Any]]] = {n: [] for n in lengths}
                misses: dict[int, list[dict[str, Any]]] = {n: [] for n in lengths}
                for r in range(rounds):  # lengths interleaved, hit and miss alternating
                    for n in lengths:
                        hits[n].append(consumer.run(prompts[n][r]))
                        misses[n].append(consumer.run(prompts[n][rounds + r]))
            finally:
                consumer.close()
        finally:
            producer.close()
    rows = []
    for n in lengths:
        hit_s = [h["seconds"] for h in hits[n]]
        miss_s = [m["seconds"] for m in misses[n]]
        rows.append({
            "prompt_tokens": n,
            "producer_prefill_s": [p["seconds"] for p in produced[n]],
            "hit_ttft_s": hit_s,
            "miss_ttft_s": miss_s,
            "hit_cached_tokens": [h["cached"] for h in hits[n]],
            "same_first_token": all(h["token"] == p["token"]
                                    for h, p in zip(hits[n], produced[n], strict=True)),
            "ttft_ratio_hit_over_miss": statistics.median(hit_s) / statistics.median(miss_s),
        })
    result: dict[str, Any] = {"rounds": rounds, "model": model_dir or "random-weight Llama",
                              "model_config": described, "rows": rows}
    if len(rows) == 1:
        result.update(rows[0])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM TTFT with and without a p2pkv hit")
    ap.add_argument("--prompt-tokens", default="4096",
                    help="prompt length, or a comma-separated list of lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-dir", default=None,
                    help="a real checkpoint (default: a random-weight Llama written here)")
    ap.add_argument("--json", help="also write the result to this file")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        _engine(args.model, json.loads(args.engine), args.max_len)
        return 0
    lengths = [int(n) for n in str(args.prompt_tokens).split(",")]
    result = run(lengths, args.rounds, args.model_dir)
    print(f"model {result['model']}, {result['rounds']} rounds")
    for row in result["rows"]:
        med_hit = statistics.median(row["hit_ttft_s"])
        med_miss = statistics.median(row["miss_ttft_s"])
        print(f"prompt {row['prompt_tokens']} tokens")
        print(f"  TTFT with the p2pkv hit   median {med_hit:.3f} s  all "
              f"{[round(x, 3) for x in row['hit_ttft_s']]}  cached tokens "
              f"{row['hit_cached_tokens']}")
        print(f"  TTFT recomputing (miss)   median {med_miss:.3f} s  all "
              f"{[round(x, 3) for x in row['miss_ttft_s']]}")
        print(f"  ratio hit/miss {row['ttft_ratio_hit_over_miss']:.3f}   "
              f"same first token as the producer: {row['same_first_token']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

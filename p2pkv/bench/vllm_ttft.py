"""Time to first token with and without a p2pkv hit, on real vLLM engines.

Run with the vLLM environment::

    .venv-vllm/bin/python -m p2pkv.bench.vllm_ttft [--prompt-tokens 4096]
        [--rounds 3] [--model-dir DIR] [--policy on|off|both] [--throttle MB_PER_S]
        [--warmup N] [--json PATH]

``--prompt-tokens`` takes a comma-separated list (``256,4096``): every length is
measured with the same engines. ``--model-dir`` runs a real checkpoint (for example
SmolLM2 from ``make real-model``: ``.models/smollm2``) instead of the random-weight one.

A producer engine computes one prompt per length and keeps its KV chunks in its p2pkv
tier. A consumer engine (another process, connected to the producer) then runs, per
round and length, a fresh prompt that nobody holds (recomputed; the p2pkv lookup still
runs and misses) and the prompt the producer holds (its prefix loads over p2pkv, or is
recomputed where the load policy says a load would be slower), and then forgets both
(``reset_prefix_cache`` with the connector; the tier's pool stays), so that every round
asks again. Both are timed end to end with ``max_tokens=1``: the time to first token of
a request arriving at an idle engine.

``--policy both`` runs one consumer with the tier's ``load_policy`` off and one with it
on. ``--throttle`` puts a relay between consumer and producer
(:class:`~p2pkv.bench.chaos.proxy.FaultProxy`), first unlimited (``fast``), then limited
to that many MB/s each way (``throttled``); the first ``--warmup`` rounds of each link
(default 1 with a relay) are reported apart: they are where the policy learns the link.
The default model is a random-weight Llama written locally (about 700 MB of fp32
weights), large enough that prefill dominates on a CPU. Ratios are measured in one run;
compare them, not the absolute times.
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


#: Tokens per offloaded chunk.
CHUNK_TOKENS = 64


def _config(listen: str, peers: list[str], cpu_bytes: int, pool_blocks: int,
            policy: bool = True) -> dict[str, Any]:
    from p2pkv.integrations.vllm.options import kv_transfer_config

    return kv_transfer_config({"listen": listen, "peers": peers, "lookup_timeout": 2.0,
                               "fetch_timeout": 120.0, "load_policy": policy,
                               "pool_blocks": pool_blocks},
                              cpu_bytes_to_use=cpu_bytes, block_size=CHUNK_TOKENS)


def _kv_bytes_per_token(config: dict[str, Any]) -> int:
    """fp32 K and V of every layer for one token (a Hugging Face config.json, or the
    random model's fields)."""
    layers = int(config.get("num_hidden_layers") or config["num_layers"])
    heads = int(config.get("num_attention_heads") or config["num_heads"])
    kv_heads = int(config.get("num_key_value_heads") or config.get("num_kv_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return layers * kv_heads * head_dim * 2 * 4


def _engine(model: str, config: dict[str, Any], max_len: int) -> None:
    """Engine process: answer ``[token ids]`` lines with timings (and ``{"metrics": 1}``
    with the engine's ``vllm:p2pkv_*`` metrics) until stdin closes."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
              max_model_len=max_len, enforce_eager=True, max_num_seqs=1,
              disable_log_stats=False, kv_transfer_config=KVTransferConfig(**config))
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    print("@ready", flush=True)
    for line in sys.stdin:
        ids = json.loads(line)
        if isinstance(ids, dict) and "reset" in ids:
            # Forget every prompt (prefix cache and the connector's primary region; the
            # p2pkv tier's pool stays): the next request of a held prompt loads again.
            print("@" + json.dumps({"reset": llm.reset_prefix_cache(reset_connector=True)}),
                  flush=True)
            continue
        if isinstance(ids, dict):
            values = {}
            for m in llm.get_metrics():
                value = getattr(m, "value", None)
                if m.name.startswith("vllm:p2pkv_") and isinstance(value, (int, float)):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                                      if k not in ("engine", "model_name"))
                    values[m.name + (f"{{{labels}}}" if labels else "")] = value
            print("@" + json.dumps(values), flush=True)
            continue
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
            tail = "".join(line for line in fh.readlines()[-400:]
                           if "Error" in line or "error" in line or "Traceback" in line
                           or line.startswith("  "))[-6000:]
        raise SystemExit(f"engine exited with {self.proc.wait()}; its log ends:\n{tail}")

    def run(self, ids: list[int] | dict[str, int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(ids) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._expect("@"))
        return answer

    def metrics(self) -> dict[str, float]:
        return self.run({"metrics": 1})

    def reset(self) -> None:
        if not self.run({"reset": 1})["reset"]:
            raise SystemExit("the consumer engine could not reset its prefix cache")

    def close(self) -> None:
        self.proc.communicate("", timeout=300)


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _prompts(lengths: list[int], count: int, vocab: int) -> dict[int, list[list[int]]]:
    """Per length, ``count`` prompts of distinct token ids (no shared prefix)."""
    return {n: [[(r * 7919 + n * 13 + i * 31 + 3) % (vocab - 3) + 3 for i in range(n)]
                for r in range(count)] for n in lengths}


#: The consumer's link to the producer: ``direct``, or through a relay (``fast``: no
#: limit; ``throttled``: ``--throttle`` MB/s each way).
DIRECT, FAST, THROTTLED = "direct", "fast", "throttled"


def run(prompt_tokens: int | list[int], rounds: int, model_dir: str | None = None, *,
        policies: tuple[str, ...] = ("on",), throttle: float | None = None,
        warmup: int | None = None) -> dict[str, Any]:
    """``policies``: one consumer engine per value (``on``/``off``: the tier's
    ``load_policy``), each measured over every link. ``throttle`` (MB/s): the consumer
    reaches the producer through a relay, first unlimited, then at that rate."""
    from p2pkv.bench.chaos.proxy import FaultProxy

    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    links = [FAST, THROTTLED] if throttle else [DIRECT]
    warm = (1 if throttle else 0) if warmup is None else warmup
    per = warm + rounds
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
        # One prompt per length the producer holds, and one nobody holds: the consumer
        # forgets both after each round (reset), so every round asks again.
        prompts = _prompts(lengths, 2, vocab)
        held = {n: prompts[n][0] for n in lengths}
        fresh = {n: prompts[n][1] for n in lengths}
        # Memory sized to what is held (the machine is shared).
        chunk_bytes = CHUNK_TOKENS * _kv_bytes_per_token(described)
        longest = max(lengths) // CHUNK_TOKENS + 1
        held_chunks = sum(n // CHUNK_TOKENS + 1 for n in lengths)
        region = max(256 << 20, 2 * longest * chunk_bytes)
        a = _address()
        producer = _Proc(model, _config(a, [], region, held_chunks + 8), max_len,
                         os.path.join(tmp, "producer.log"))
        relay: FaultProxy | None = None
        cells: dict[tuple[str, str, int], dict[str, Any]] = {}
        decisions: dict[tuple[str, str], dict[str, float]] = {}
        estimates: dict[str, dict[str, float]] = {}
        try:
            produced = {n: producer.run(held[n]) for n in lengths}
            if throttle:
                port = int(a.rsplit(":", 1)[1])
                relay = FaultProxy(int(_address().rsplit(":", 1)[1]), port, seed=0)
            for policy in policies:
                peer = relay.address if relay else a
                consumer = _Proc(model, _config(_address(), [peer], region, longest,
                                                policy == "on"),
                                 max_len, os.path.join(tmp, f"consumer-{policy}.log"))
                try:
                    for link in links:
                        if relay is not None:
                            relay.set_rate(throttle * 1e6 if link == THROTTLED and throttle
                                           else None)
                        before = consumer.metrics()
                        for n in lengths:
                            cells[(policy, link, n)] = {"hit": [], "miss": []}
                        for _ in range(per):  # lengths interleaved, miss then hit
                            for n in lengths:
                                miss = consumer.run(fresh[n])
                                hit = consumer.run(held[n])
                                hit["same_token"] = hit["token"] == produced[n]["token"]
                                consumer.reset()
                                cells[(policy, link, n)]["hit"].append(hit)
                                cells[(policy, link, n)]["miss"].append(miss)
                        after = consumer.metrics()
                        counted = {k: v - before.get(k, 0.0) for k, v in after.items()
                                   if "load_decisions" in k or "load_skipped" in k}
                        decisions[(policy, link)] = {k: v for k, v in counted.items() if v}
                        estimates[f"{policy}/{link}"] = {
                            k: v for k, v in after.items()
                            if "bandwidth" in k or "prefill_tokens" in k}
                finally:
                    consumer.close()
        finally:
            if relay is not None:
                relay.close()
            producer.close()
    rows = []
    for (policy, link, n), cell in cells.items():
        hits, misses = cell["hit"][warm:], cell["miss"][warm:]
        hit_s = [h["seconds"] for h in hits]
        miss_s = [m["seconds"] for m in misses]
        rows.append({
            "policy": policy, "link": link, "prompt_tokens": n,
            "producer_prefill_s": produced[n]["seconds"],
            "hit_ttft_s": hit_s, "miss_ttft_s": miss_s,
            "warmup_hit_ttft_s": [h["seconds"] for h in cell["hit"][:warm]],
            "warmup_miss_ttft_s": [m["seconds"] for m in cell["miss"][:warm]],
            "hit_cached_tokens": [h["cached"] for h in hits],
            "warmup_hit_cached_tokens": [h["cached"] for h in cell["hit"][:warm]],
            "same_first_token": all(h["same_token"] for h in cell["hit"]),
            "ttft_ratio_hit_over_miss": statistics.median(hit_s) / statistics.median(miss_s),
            # Each hit over the recompute measured just before it: drift cancels.
            "paired_ratio_median": statistics.median(
                h / m for h, m in zip(hit_s, miss_s, strict=True)),
            "decisions": decisions[(policy, link)],
        })
    result: dict[str, Any] = {
        "rounds": rounds, "warmup": warm, "throttle_mb_s": throttle,
        "model": model_dir or "random-weight Llama", "model_config": described,
        "rows": rows, "estimates": estimates}
    if len(rows) == 1:
        result.update(rows[0])
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"model {result['model']}, {result['rounds']} rounds (+{result['warmup']} warm-up "
          f"round(s) not counted), throttled link {result['throttle_mb_s']} MB/s")
    print(f"{'policy':6}  {'link':9}  {'prompt':>6}  {'TTFT hit':>9}  {'recompute':>9}  "
          f"{'hit/rec':>7}  {'paired':>7}  {'cached tokens':24}  decisions (this link, all "
          f"lengths)")
    for row in result["rows"]:
        med_hit = statistics.median(row["hit_ttft_s"])
        med_miss = statistics.median(row["miss_ttft_s"])
        decided = ", ".join(f"{k.split('reason=')[-1].rstrip('}')}"
                            f"{' (skipped chunks)' if 'skipped' in k else ''}={v:g}"
                            for k, v in row["decisions"].items())
        print(f"{row['policy']:6}  {row['link']:9}  {row['prompt_tokens']:>6}  "
              f"{med_hit:>8.3f}s  {med_miss:>8.3f}s  {row['ttft_ratio_hit_over_miss']:>6.3f}x  "
              f"{row['paired_ratio_median']:>6.3f}x  "
              f"{row['hit_cached_tokens']!s:24}  {decided}")
        print(f"{'':6}  {'':9}  {'':>6}  all hit {[round(x, 3) for x in row['hit_ttft_s']]}"
              f"  all recompute {[round(x, 3) for x in row['miss_ttft_s']]}  warm-up hit "
              f"{[round(x, 3) for x in row['warmup_hit_ttft_s']]} (cached "
              f"{row['warmup_hit_cached_tokens']})  same first token: "
              f"{row['same_first_token']}")
    for name, values in result["estimates"].items():
        shown = ", ".join(f"{k.split('{')[-1].rstrip('}')}: {v:,.0f}" for k, v in values.items())
        print(f"estimates after {name}: {shown}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM TTFT with and without a p2pkv hit")
    ap.add_argument("--prompt-tokens", default="4096",
                    help="prompt length, or a comma-separated list of lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-dir", default=None,
                    help="a real checkpoint (default: a random-weight Llama written here)")
    ap.add_argument("--policy", choices=("on", "off", "both"), default="on",
                    help="the consumer tier's load_policy (both: one consumer each)")
    ap.add_argument("--throttle", type=float, default=None, metavar="MB_PER_S",
                    help="reach the producer through a relay, unlimited and then at this "
                         "many MB/s each way (default: a direct link only)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="rounds per link not counted (default 1 with --throttle, else 0)")
    ap.add_argument("--json", help="also write the result to this file")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        _engine(args.model, json.loads(args.engine), args.max_len)
        return 0
    lengths = [int(n) for n in str(args.prompt_tokens).split(",")]
    policies = ("off", "on") if args.policy == "both" else (args.policy,)
    result = run(lengths, args.rounds, args.model_dir, policies=policies,
                 throttle=args.throttle, warmup=args.warmup)
    _print(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

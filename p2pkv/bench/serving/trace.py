"""The trace workload: a window of a Mooncake trace replayed on its own schedule.

The other workloads of the serving benchmark are synthetic: every prefix equally hot, or
a chosen few. This one is real traffic's arrivals and prefix sharing, from Mooncake's
conversation trace (:mod:`~p2pkv.bench.serving.mooncake` reads it, cuts the window and
maps its blocks to token ids). :func:`replay` sends every request at its time (the
trace's, divided by the squeeze), never waiting for the earlier ones (an open loop, as
real users do), and measures TTFT, end-to-end latency, the lag behind the schedule,
errors and the generated text; :class:`Replay` sums it up, with goodput (requests
answered with a TTFT within a bound, per second of the schedule).

Run it against a server (it needs ``aiohttp``: the vLLM environment has it)::

    .venv-vllm/bin/python -m p2pkv.bench.serving.trace --url http://127.0.0.1:8000 \\
        --model smollm2 --count 100 --squeeze 0.5 --json trace.json
    .venv/bin/python -m p2pkv.bench.serving.trace --stats     # the window, nothing sent

``--client aiperf --tokenizer MODEL_DIR`` replays the same mapped window with aiperf
instead (:mod:`~p2pkv.bench.serving.aiperf_client`), a second opinion on the figures.

Exit status: 0 when every request succeeded, 1 when some failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.clients import sse_payloads, summarize_latencies
from p2pkv.bench.serving.mooncake import (
    DEFAULT_TRACE,
    BlockMapping,
    MappedRequest,
    TraceWindow,
    load_trace,
    map_requests,
    schedule,
    window_stats,
)

__all__ = ["DEFAULT_TIMEOUT", "Replay", "RequestResult", "main", "replay"]

#: Seconds a request may take in all, by default.
DEFAULT_TIMEOUT = 600.0
#: Goodput's TTFT bounds by default, in milliseconds.
DEFAULT_TTFT_BOUNDS_MS = (1000.0, 5000.0)


# -- the replay --------------------------------------------------------------------------

@dataclass
class RequestResult:
    """One request as sent: times in seconds (``sent_s`` from the replay's start),
    ``ttft_s`` to the first streamed token, ``e2e_s`` to the end of the stream (or of the
    try, for a failed request); the completion tokens the server counted and why it
    stopped (``length``, with ``ignore_eos``), its HTTP status, and an error (None: it
    succeeded)."""

    index: int
    scheduled_s: float
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    text: str = ""
    output_tokens: int | None = None
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.scheduled_s


@dataclass
class Replay:
    """What :func:`replay` measured: every request's result in request order, the span
    of the schedule and the wall time from the start to the last answer."""

    results: list[RequestResult]
    squeeze: float
    schedule_span_s: float
    duration_s: float

    def texts(self) -> list[str]:
        """The generated texts in request order ("" for a failed request): what two
        configurations are compared on."""
        return [r.text if r.ok else "" for r in self.results]

    def goodput(self, ttft_bound_ms: float) -> float:
        """Requests that succeeded with a TTFT within ``ttft_bound_ms``, per second of
        the schedule (so the figure compares configurations on the same schedule)."""
        if self.schedule_span_s <= 0:
            raise ValueError("a schedule of one instant has no rate")
        good = sum(1 for r in self.results if r.ok and r.ttft_s is not None
                   and r.ttft_s * 1000 <= ttft_bound_ms)
        return good / self.schedule_span_s

    def summary(self, ttft_bounds_ms: Sequence[float] = DEFAULT_TTFT_BOUNDS_MS
                ) -> dict[str, Any]:
        """Counts, failures by cause (the error's text up to its first colon: ``HTTP
        500``, ``timeout``, ...), TTFT and end-to-end percentiles of the requests that
        succeeded, the lag behind the schedule of all, and goodput per TTFT bound."""
        ok = [r for r in self.results if r.ok]
        failures: dict[str, int] = {}
        for r in self.results:
            if r.error is not None:
                kind = r.error.split(":", 1)[0]
                failures[kind] = failures.get(kind, 0) + 1
        pcts = (50, 90, 99)
        lags = summarize_latencies([max(0.0, r.lag_s) for r in self.results], (50, 99))
        return {
            "requests": len(self.results), "completed": len(ok),
            "failed": len(self.results) - len(ok), "failures": failures,
            "squeeze": self.squeeze, "schedule_span_s": self.schedule_span_s,
            "duration_s": self.duration_s,
            "ttft": summarize_latencies([r.ttft_s for r in ok if r.ttft_s is not None], pcts),
            "e2e": summarize_latencies([r.e2e_s for r in ok if r.e2e_s is not None], pcts),
            "schedule_lag": {**lags, "max_ms": max((r.lag_s for r in self.results),
                                                   default=0.0) * 1000},
            "output_tokens": sum(r.output_tokens or 0 for r in ok),
            "goodput": {f"ttft<={b:g}ms": self.goodput(b) for b in ttft_bounds_ms}
            if self.schedule_span_s > 0 else {}}

    def to_json(self, ttft_bounds_ms: Sequence[float] = DEFAULT_TTFT_BOUNDS_MS
                ) -> dict[str, Any]:
        """The summary and every request's record (its text included)."""
        return {"summary": self.summary(ttft_bounds_ms),
                "records": [{**asdict(r), "lag_s": r.lag_s} for r in self.results]}


def _body(model: str, req: MappedRequest) -> bytes:
    return json.dumps({
        "model": model, "prompt": list(req.prompt), "max_tokens": req.output_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}).encode()


async def _send(session: Any, url: str, body: bytes, result: RequestResult, start: float,
                timeout: float) -> None:
    import aiohttp

    loop = asyncio.get_running_loop()
    sent = loop.time()
    result.sent_s = sent - start
    text: list[str] = []
    try:
        async with session.post(url + "/v1/completions", data=body,
                                headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            result.status = r.status
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for chunk in sse_payloads(r):
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
                    return
                # vLLM sends a chunk per token, its text empty while a character's
                # bytes are incomplete: the first chunk with a choice is the first token
                # (as vLLM's own benchmark client counts TTFT).
                if chunk.get("choices"):
                    if result.ttft_s is None:
                        result.ttft_s = loop.time() - sent
                    choice = chunk["choices"][0]
                    text.append(choice.get("text") or "")
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens")
        if result.ttft_s is None:
            result.error = "no token: the stream ended without one"
    except asyncio.TimeoutError:
        result.error = f"timeout: no complete answer within {timeout:g} s"
    except Exception as exc:  # a failed request is recorded, the others go on
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.e2e_s = loop.time() - sent
        result.text = "".join(text)


async def replay(url: str, model: str, requests: Sequence[MappedRequest], *,
                 squeeze: float = 1.0, timeout: float = DEFAULT_TIMEOUT) -> Replay:
    """Send every request to ``url``'s ``/v1/completions`` at its time on the schedule
    (:func:`schedule`), streaming, greedy, with ``ignore_eos`` so that every
    configuration generates the same number of tokens. No request waits for another:
    one that is late (``lag_s``) is late because this client or its machine was. Every
    request ends within ``timeout`` seconds, answered or not."""
    import aiohttp

    if not timeout > 0:
        raise ValueError(f"the timeout ({timeout} s) must be above 0")
    times = schedule(requests, squeeze)
    bodies = [_body(model, r) for r in requests]  # made before the clock starts
    results = [RequestResult(r.index, t, t) for r, t in zip(requests, times, strict=True)]
    loop = asyncio.get_running_loop()
    # No limit on connections: a pool limit would queue requests behind slow ones.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = loop.time()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + times[i] - loop.time()))
            await _send(session, url.rstrip("/"), bodies[i], results[i], start, timeout)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = loop.time() - start
    return Replay(results, squeeze, max(times, default=0.0), duration)


# -- the command -------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m p2pkv.bench.serving.trace",
        description="Replay a window of a Mooncake trace against an OpenAI completions "
                    "server, on the trace's schedule.")
    p.add_argument("--url", help="the server (or balancer), e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the served model name")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="a Mooncake JSONL trace (default: the committed window)")
    p.add_argument("--start-s", type=float, default=0.0,
                   help="the window starts this many seconds after the trace's first request")
    cut = p.add_mutually_exclusive_group()
    cut.add_argument("--count", type=int, help="the window's number of requests")
    cut.add_argument("--duration-s", type=float, help="the window's length in trace seconds")
    p.add_argument("--block-tokens", type=int, default=64,
                   help="tokens per trace block of 512 (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=3072)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--squeeze", type=float, default=1.0,
                   help="send at trace time divided by this (2: twice as fast)")
    p.add_argument("--seed", type=int, default=0, help="the token ids' seed")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds a request may take in all")
    p.add_argument("--ttft-bound-ms", type=float, action="append",
                   help="goodput's TTFT bound (repeatable; default 1000 and 5000)")
    p.add_argument("--stats", action="store_true",
                   help="print the window's statistics and send nothing")
    p.add_argument("--json", type=Path, help="write the summary and every request here")
    p.add_argument("--client", choices=("ours", "aiperf"), default="ours",
                   help="the replayer: this module's, or aiperf on the same mapped window "
                        "(needs --tokenizer; see p2pkv.bench.serving.aiperf_client)")
    p.add_argument("--tokenizer", type=Path,
                   help="aiperf: the model's directory, for its tokenizer")
    p.add_argument("--aiperf-bin", type=Path, help="aiperf: the command "
                   "(default: .venv-aiperf/bin/aiperf of this checkout)")
    p.add_argument("--workdir", type=Path,
                   help="aiperf: where its files go (default: a temporary directory)")
    return p


def _run_aiperf(args: argparse.Namespace, mapped: Sequence[MappedRequest]) -> dict[str, Any]:
    """aiperf on the same mapped window; its files stay in ``--workdir`` (default: a new
    temporary directory, named in the summary's ``export``)."""
    from p2pkv.bench.serving.aiperf_client import DEFAULT_AIPERF, run_aiperf

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2pkv-aiperf-"))
    return run_aiperf(args.url, args.model, mapped, workdir, block_tokens=args.block_tokens,
                      squeeze=args.squeeze, tokenizer_dir=args.tokenizer,
                      aiperf=args.aiperf_bin or DEFAULT_AIPERF, request_timeout=args.timeout,
                      timeout=max(schedule(mapped, args.squeeze)) + args.timeout + 300)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        window = TraceWindow(args.start_s, args.duration_s, args.count)
        mapping = BlockMapping(args.block_tokens, args.max_prompt_tokens,
                               args.max_output_tokens, args.seed)
        trace = window.cut(load_trace(args.trace))
        mapped = map_requests(trace, mapping)
        times = schedule(mapped, args.squeeze)
        if not args.stats and not (args.url and args.model):
            raise ValueError("--url and --model are needed to send (or --stats)")
        if not args.timeout > 0:
            raise ValueError(f"--timeout ({args.timeout}) must be above 0")
        if args.client == "aiperf" and not args.stats and args.tokenizer is None:
            raise ValueError("--client aiperf needs --tokenizer (the model's directory)")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    described = {"trace": str(args.trace), "window": window.describe(),
                 "mapping": mapping.describe(), "squeeze": args.squeeze,
                 "stats": window_stats(trace, mapped)}
    if args.stats:
        print(json.dumps({**described, "schedule_span_s": max(times)}, indent=2))
        return 0
    print(f"replaying {len(mapped)} requests over {max(times):.1f} s to {args.url} "
          f"({args.client})", flush=True)
    if args.client == "aiperf":
        try:
            result = {"summary": _run_aiperf(args, mapped)}
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (RuntimeError, TimeoutError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    else:
        done = asyncio.run(replay(args.url, args.model, mapped, squeeze=args.squeeze,
                                  timeout=args.timeout))
        result = done.to_json(args.ttft_bound_ms or DEFAULT_TTFT_BOUNDS_MS)
    print(json.dumps(result["summary"], indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps({**described, **result}, indent=1))
    return 0 if result["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

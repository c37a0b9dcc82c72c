"""Mooncake's traces: read one, cut a window, map its blocks to token ids.

Mooncake's FAST'25 release (github kvcache-ai/Mooncake, ``FAST25-release/traces/``) gives
what real traffic looked like: per request its arrival time (ms), prompt and output
lengths, and one hash id per 512-token block of the prompt, chained like vLLM's block
hashes (equal ids = equal prefix). A window of its conversation trace is in ``traces/``
beside this file (its README says which, and what it holds).

- :func:`load_trace` reads the JSONL and refuses anything a replay would get wrong,
  naming the line (not JSON, a missing field, a negative length, ids that do not cover
  the prompt, a block whose size differs from the same id elsewhere, time going back).
- :class:`TraceWindow` cuts a window by time or by count.
- :class:`BlockMapping` shrinks each 512-token block to ``block_tokens`` tokens (64 by
  default) so that this CPU machine serves a window in minutes, and caps the prompt (the
  engines run with a 4,096-token context) and the output. Every id becomes a fixed
  sequence of token ids drawn from a generator seeded by the id and the sitting's seed,
  so equal ids give equal tokens and different ids different ones. Prompts are sent as
  token ids: nothing is detokenized and tokenized again on the way, which could change
  the tokens at block boundaries and break the sharing the trace records.
- :func:`schedule` puts each request at its trace time divided by the squeeze.

:mod:`~p2pkv.bench.serving.trace` replays the result against a server.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["CONVERSATIONS_TRACE", "DEFAULT_TRACE", "TRACE_BLOCK_TOKENS", "VOCAB_HIGH",
           "VOCAB_LOW", "BlockMapping", "MappedRequest", "TraceRequest", "TraceWindow",
           "block_token_ids", "cut_window",
           "load_trace", "map_requests", "schedule", "window_stats", "write_mapped"]

#: The committed window of Mooncake's conversation trace (``traces/README.md``).
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake-conversation-window.jsonl"
#: Every request of the first 16 conversations of Mooncake's conversation trace that have
#: a later turn (``traces/README.md``): the serving bench's trace workload.
CONVERSATIONS_TRACE = DEFAULT_TRACE.with_name("mooncake-conversations-16.jsonl")
#: Tokens per hash id in Mooncake's traces.
TRACE_BLOCK_TOKENS = 512
#: Token ids are drawn from ``[VOCAB_LOW, VOCAB_HIGH)``: inside SmolLM2's vocabulary of
#: 49,152, clear of its special tokens (the first ids) and of the last ids.
VOCAB_LOW, VOCAB_HIGH = 100, 49_000
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_sizes(self) -> list[int]:
        """Tokens of each block in the trace: 512, except a partial last block."""
        last = self.input_length - TRACE_BLOCK_TOKENS * (len(self.hash_ids) - 1)
        return [TRACE_BLOCK_TOKENS] * (len(self.hash_ids) - 1) + [last]


def _int_field(record: dict[str, Any], name: str, where: str, low: int) -> int:
    if name not in record:
        raise ValueError(f"{where}: missing field {name!r} (a line needs {', '.join(_FIELDS)})")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer, not {value!r}")
    if value < low:
        raise ValueError(f"{where}: {name} is {value}; it must be at least {low}")
    return value


def _parse(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object")
    timestamp = _int_field(record, "timestamp", where, 0)
    input_length = _int_field(record, "input_length", where, 1)
    output_length = _int_field(record, "output_length", where, 1)
    if "hash_ids" not in record:
        raise ValueError(f"{where}: missing field 'hash_ids' (a line needs "
                         f"{', '.join(_FIELDS)})")
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers of 0 or more")
    blocks = math.ceil(input_length / TRACE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise ValueError(f"{where}: input_length {input_length} is {blocks} blocks of "
                         f"{TRACE_BLOCK_TOKENS} tokens, but hash_ids has {len(ids)}")
    return TraceRequest(timestamp, input_length, output_length, tuple(ids))


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a Mooncake JSONL trace, in its order (blank lines skipped).

    Raises ValueError naming the line when a line is not a request, when the trace goes
    back in time, or when a hash id has another block size than on an earlier line:
    equal ids must be equal blocks, and a replayer (ours, or aiperf, which refuses such
    a file) would otherwise make different tokens for one id."""
    path = Path(path)
    out: list[TraceRequest] = []
    sizes: dict[int, tuple[int, int]] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            req = _parse(line, where)
            if out and req.timestamp_ms < out[-1].timestamp_ms:
                raise ValueError(f"{where}: timestamp {req.timestamp_ms} ms comes before the "
                                 f"previous request's {out[-1].timestamp_ms} ms; the trace "
                                 f"must be in time order")
            for h, size in zip(req.hash_ids, req.block_sizes(), strict=True):
                seen = sizes.setdefault(h, (size, number))
                if seen[0] != size:
                    raise ValueError(f"{where}: hash id {h} is a block of {size} tokens here "
                                     f"but of {seen[0]} on line {seen[1]}; equal ids must be "
                                     f"equal blocks")
            out.append(req)
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


@dataclass(frozen=True)
class TraceWindow:
    """The requests from ``start_s`` seconds after the trace's first one: the next
    ``count`` of them, or those within ``duration_s`` seconds (neither: all the rest)."""

    start_s: float = 0.0
    duration_s: float | None = None
    count: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.start_s) or self.start_s < 0:
            raise ValueError(f"the window's start ({self.start_s} s) must be 0 or more")
        if self.duration_s is not None and self.count is not None:
            raise ValueError("a window is cut by a duration or by a count, not both")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"the window's duration ({self.duration_s} s) must be above 0")
        if self.count is not None and self.count < 1:
            raise ValueError(f"the window's count ({self.count}) must be at least 1")

    def cut(self, requests: Sequence[TraceRequest]) -> list[TraceRequest]:
        """The window's requests; ValueError when it holds none, or fewer than ``count``."""
        if not requests:
            raise ValueError("the trace has no requests")
        begin = requests[0].timestamp_ms + self.start_s * 1000
        out = [r for r in requests if r.timestamp_ms >= begin]
        if self.duration_s is not None:
            out = [r for r in out if r.timestamp_ms < begin + self.duration_s * 1000]
        if self.count is not None:
            if len(out) < self.count:
                raise ValueError(f"{self.count} requests asked for, but the trace has only "
                                 f"{len(out)} from {self.start_s:g} s on")
            out = out[:self.count]
        if not out:
            span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
            raise ValueError(f"no request in the window {self.describe()}; the trace spans "
                             f"{span:g} s")
        return out

    def describe(self) -> dict[str, float | int | None]:
        return asdict(self)


def cut_window(requests: Sequence[TraceRequest], start_s: float = 0.0, *,
               duration_s: float | None = None, count: int | None = None
               ) -> list[TraceRequest]:
    """:meth:`TraceWindow.cut` in one call."""
    return TraceWindow(start_s, duration_s, count).cut(requests)


@functools.lru_cache(maxsize=65536)
def _whole_block(hash_id: int, block_tokens: int, seed: int) -> tuple[int, ...]:
    # A str seed goes through SHA-512 in random.Random: the same on every machine and
    # whatever PYTHONHASHSEED is.
    rng = random.Random(f"p2pkv-trace:{seed}:{hash_id}:{block_tokens}")
    return tuple(rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(block_tokens))


def block_token_ids(hash_id: int, tokens: int, block_tokens: int, seed: int) -> tuple[int, ...]:
    """The token ids of block ``hash_id``: the first ``tokens`` of the id's whole block
    of ``block_tokens`` ids (a function of the id, the block size and the seed only)."""
    if not 1 <= tokens <= block_tokens:
        raise ValueError(f"a block has 1 to {block_tokens} tokens, not {tokens}")
    return _whole_block(hash_id, block_tokens, seed)[:tokens]


@dataclass(frozen=True)
class BlockMapping:
    """How a trace's requests become prompts this machine can serve.

    Each 512-token block becomes ``block_tokens`` tokens. A partial last block (the rest
    of a prompt after its whole blocks) keeps its share of a block, rounded half up, at
    least 1 token. That keeps every id at one size: :func:`load_trace` has checked that
    an id is the same size wherever it appears (in Mooncake's release a partial last
    block's id never appears as a whole block), so the mapped size is a function of the
    id too, and aiperf's rule (one size per id) holds for the mapped window. A prompt
    over ``max_prompt_tokens`` loses whole blocks from its end, the partial one first,
    so a capped prompt ends on a whole block; the output is cut to
    ``max_output_tokens``."""

    block_tokens: int = 64
    max_prompt_tokens: int = 3072
    max_output_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens ({self.block_tokens}) must be 1 to "
                             f"{TRACE_BLOCK_TOKENS}")
        if self.max_prompt_tokens < self.block_tokens:
            raise ValueError(f"max_prompt_tokens ({self.max_prompt_tokens}) must hold one "
                             f"block of {self.block_tokens} tokens")
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens ({self.max_output_tokens}) must be at "
                             f"least 1")

    def size(self, trace_tokens: int) -> int:
        """Mapped tokens of a block of ``trace_tokens`` tokens in the trace."""
        if trace_tokens >= TRACE_BLOCK_TOKENS:
            return self.block_tokens
        return max(1, (trace_tokens * self.block_tokens + TRACE_BLOCK_TOKENS // 2)
                   // TRACE_BLOCK_TOKENS)

    def describe(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class MappedRequest:
    """A request ready to send: ``offset_s`` seconds after the window's first request
    in the trace, its blocks (id and mapped size), its prompt's token ids, its output
    length, and whether the mapping capped the prompt or the output."""

    index: int
    offset_s: float
    blocks: tuple[tuple[int, int], ...]
    prompt: tuple[int, ...]
    output_tokens: int
    prompt_capped: bool
    output_capped: bool


def map_requests(requests: Sequence[TraceRequest], mapping: BlockMapping
                 ) -> list[MappedRequest]:
    """The window's requests as prompts of token ids (see :class:`BlockMapping`)."""
    if not requests:
        return []
    t0 = requests[0].timestamp_ms
    out = []
    for i, req in enumerate(requests):
        blocks: list[tuple[int, int]] = []
        total = 0
        for h, trace_tokens in zip(req.hash_ids, req.block_sizes(), strict=True):
            size = mapping.size(trace_tokens)
            if total + size > mapping.max_prompt_tokens:
                break
            blocks.append((h, size))
            total += size
        prompt = tuple(t for h, size in blocks
                       for t in block_token_ids(h, size, mapping.block_tokens, mapping.seed))
        out.append(MappedRequest(
            i, (req.timestamp_ms - t0) / 1000, tuple(blocks), prompt,
            min(req.output_length, mapping.max_output_tokens),
            len(blocks) < len(req.hash_ids), req.output_length > mapping.max_output_tokens))
    return out


def schedule(requests: Sequence[MappedRequest], squeeze: float) -> list[float]:
    """When each request is sent, in seconds after the start: its trace offset divided by
    ``squeeze`` (2: twice as fast as the trace; 0.5: half as fast)."""
    if not (math.isfinite(squeeze) and squeeze > 0):
        raise ValueError(f"the squeeze ({squeeze}) must be a number above 0")
    return [r.offset_s / squeeze for r in requests]


def write_mapped(requests: Sequence[MappedRequest], path: Path, squeeze: float) -> Path:
    """Write mapped requests back in Mooncake's format, for another replayer (aiperf with
    ``--isl-block-size`` = the mapping's ``block_tokens``): the kept ids, the mapped
    prompt and output lengths, timestamps on the squeezed schedule (aiperf's fixed
    schedule has no speed factor for this format). Every id keeps one size, and only a
    last block is partial, which that reader needs."""
    times = schedule(requests, squeeze)
    with open(path, "w", encoding="utf-8") as f:
        for req, at in zip(requests, times, strict=True):
            f.write(json.dumps({"timestamp": round(at * 1000), "input_length": len(req.prompt),
                                "output_length": req.output_tokens,
                                "hash_ids": [h for h, _ in req.blocks]}) + "\n")
    return path


def window_stats(requests: Sequence[TraceRequest],
                 mapped: Sequence[MappedRequest] | None = None) -> dict[str, Any]:
    """What a window holds: its requests and span, the share of its blocks that repeat
    an earlier block of the window (what a prefix cache that never forgets could skip),
    and how many distinct first-two-block prefixes it has (every request of Mooncake's
    conversation trace starts with id 0, a system prompt, and a conversation's later
    turns extend its earlier ones: an estimate of its conversations). With ``mapped``,
    the same after the mapping, in tokens, and how many requests it capped."""
    seen: set[int] = set()
    blocks = repeated = reusing = 0
    for r in requests:
        hits = [h in seen for h in r.hash_ids]
        blocks += len(hits)
        repeated += sum(hits)
        reusing += any(hits[1:])
        seen.update(r.hash_ids)
    out: dict[str, Any] = {
        "requests": len(requests),
        "span_s": (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
        if requests else 0.0,
        "blocks": blocks, "repeated_block_share": repeated / blocks if blocks else 0.0,
        "requests_reusing_beyond_first_block": reusing,
        "prefix_groups": len({r.hash_ids[:2] for r in requests})}
    if mapped is not None:
        seen.clear()
        tokens = repeated_tokens = 0
        for m in mapped:
            for h, size in m.blocks:
                tokens += size
                repeated_tokens += size if h in seen else 0
                seen.add(h)
        out["mapped"] = {
            "prompt_tokens": tokens, "repeated_block_tokens": repeated_tokens,
            "repeated_token_share": repeated_tokens / tokens if tokens else 0.0,
            "output_tokens": sum(m.output_tokens for m in mapped),
            "prompts_capped": sum(m.prompt_capped for m in mapped),
            "outputs_capped": sum(m.output_capped for m in mapped)}
    return out

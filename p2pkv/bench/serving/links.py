"""Links shaped like a GPU cluster's, set from what this machine's engines compute.

What decides whether loading a prefix from a peer beats computing it is the ratio of
the link's rate to the rate at which an engine's prefill produces KV bytes. One H100
prefills an 8B model at very roughly 20-25k tokens/s, and its KV is 131 KB a token (32
layers x 2 x 8 KV heads x 128 x 2 bytes): about 3 GB/s of KV. A 25 Gb/s link (about
3 GB/s) moves KV about as fast as the GPU makes it; a 100 Gb/s link about 4x as fast.
The engines here compute far slower than a GPU (SmolLM2 in fp32 on one core), so a link
at the GPU cluster's rate would make every load free. A profile is therefore a multiple
of the rate this machine's engine makes KV, measured at the start of a sitting
(:func:`measure_kv_rate`):

- ``100G``: 4x the engine's KV rate (a 100 Gb/s link beside an H100);
- ``25G``: 1x (a 25 Gb/s link: loading a prefix takes about as long as computing it);
- ``slow``: 0.5x (a load loses to recomputing: the load policy must recompute);
- ``unshaped``: the veth as it is (no ``tc``).

No profile adds delay: the kernel here has no ``netem``, and a datacenter's 50-200 µs
round trip is small beside the tens of milliseconds a prefix takes to move.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.clients import complete

__all__ = ["PROFILES", "KvRate", "LinkProfile", "kv_bytes_per_token", "measure_kv_rate",
           "parse_profiles", "profile_rows"]


@dataclass(frozen=True)
class LinkProfile:
    """A named link: a multiple of the engine's measured KV rate (``None``: unshaped),
    and what it stands for in a GPU cluster."""

    name: str
    times_kv_rate: float | None
    stands_for: str

    def rate_bits(self, kv_bytes_per_s: float) -> int | None:
        """The link's rate in bits per second for an engine making ``kv_bytes_per_s``."""
        if self.times_kv_rate is None:
            return None
        return max(1_000_000, round(kv_bytes_per_s * self.times_kv_rate * 8))


PROFILES = {p.name: p for p in (
    LinkProfile("100G", 4.0, "100 Gb/s beside an H100 prefilling an 8B model "
                             "(about 3 GB/s of KV): a link 4x the KV rate"),
    LinkProfile("25G", 1.0, "25 Gb/s beside the same GPU: the link moves KV as fast as "
                            "the engine makes it"),
    LinkProfile("slow", 0.5, "half the KV rate: loading a prefix loses to computing it"),
    LinkProfile("unshaped", None, "the veth as it is, no tc"),
)}


def parse_profiles(text: str) -> list[LinkProfile]:
    """A comma-separated list of profile names; ValueError names the unknown ones."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if unknown or not names:
        raise ValueError(f"unknown link profile(s) {unknown or [text]}; choose from "
                         f"{', '.join(PROFILES)}")
    return [PROFILES[n] for n in dict.fromkeys(names)]


def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    """KV-cache bytes one token of the model takes (keys and values of every layer),
    from its ``config.json``; the engines here run fp32 (4 bytes)."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KvRate:
    """One engine's prefill: tokens per second and KV bytes per token, whose product is
    the rate it makes KV; with the prompt length and the seconds of each cold prompt it
    was measured on (none: given, ``--kv-rate``)."""

    tokens_per_s: float
    bytes_per_token: int
    prompt_tokens: int = 0
    seconds: tuple[float, ...] = ()

    @classmethod
    def measured(cls, prompt_tokens: int, seconds: tuple[float, ...],
                 bytes_per_token: int) -> KvRate:
        """The median of prompts of ``prompt_tokens`` tokens computed in ``seconds``."""
        return cls(prompt_tokens / statistics.median(seconds), bytes_per_token,
                   prompt_tokens, seconds)

    @classmethod
    def given(cls, bytes_per_s: float, bytes_per_token: int) -> KvRate:
        return cls(bytes_per_s / bytes_per_token, bytes_per_token)

    @property
    def bytes_per_s(self) -> float:
        return self.tokens_per_s * self.bytes_per_token

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1),
                "bytes_per_s": round(self.bytes_per_s),
                "how": "measured" if self.seconds else "given"}


def measure_kv_rate(url: str, model_name: str, model: Path, *, prompt_tokens: int = 1024,
                    samples: int = 3, seed: int = 0, timeout: float = 300.0) -> KvRate:
    """The rate at which the engine at ``url`` makes KV bytes: ``samples`` cold prompts
    of ``prompt_tokens`` random token ids (none shares a block with another, so each is
    computed whole), one output token each, after one short request that warms the
    engine up. The median prompt's time counts (one request at a time: a prefill alone,
    as the engine does it at its fastest)."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    complete(url, model_name, prompt(64), 1, timeout)
    seconds: list[float] = []
    for _ in range(samples):
        tokens = prompt(prompt_tokens)
        started = time.perf_counter()
        complete(url, model_name, tokens, 1, timeout)
        seconds.append(time.perf_counter() - started)
    return KvRate.measured(prompt_tokens, tuple(round(s, 4) for s in seconds),
                           kv_bytes_per_token(model))


def profile_rows(profiles: Sequence[LinkProfile], rate: KvRate) -> list[dict[str, Any]]:
    """What each profile's links were set to, for a sitting's record."""
    return [{"profile": p.name, "times_kv_rate": p.times_kv_rate,
             "rate_bits": p.rate_bits(rate.bytes_per_s), "stands_for": p.stands_for}
            for p in profiles]

"""The serving benchmark's figures: each run's counters, its table row, the table, the
targets' ratios and the plot, from what :mod:`~p2pkv.bench.serving.run` recorded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "counters", "engine_cpu", "plot", "ratios", "run_label", "summarize",
           "table"]

def _sum(metrics: Sequence[Mapping[str, float]], prefix: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in metrics:
        for k, v in m.items():
            if k.startswith(prefix):
                out[k] = out.get(k, 0.0) + v
    return out


def counters(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The counters the table reports, summed over a configuration's engines."""
    cached = _sum(metrics, "vllm:prompt_tokens_cached_by_source_total")
    p2pkv = _sum(metrics, "vllm:p2pkv_")
    offload = _sum(metrics, "vllm:kv_offload_total_bytes_total")
    # vLLM's sources: device (the engine's own prefix cache), host (the CPU primary
    # region), p2p (a peer tier: p2pkv), disk (a file-system tier).
    out = {f"cached_tokens[{k.split('source=', 1)[1].rstrip('}').split(',')[0]}]": v
           for k, v in cached.items() if "source=" in k}
    out["prompt_tokens"] = sum(_sum(metrics, "vllm:prompt_tokens_total").values())
    for k, v in offload.items():
        out["offload_bytes[" + k.split("transfer_type=", 1)[1].rstrip("}") + "]"] = v
    # vLLM's own lookup timings: a synchronous lookup per scheduler visit, and a
    # deferred one per request it skipped (a RETRY, or a load under way) until answered.
    for kind in ("sync", "async"):
        name = f"vllm:kv_offload_lookup_{kind}_delay_seconds"
        for part in ("count", "sum"):
            total = sum(_sum(metrics, f"{name}_{part}").values())
            if total:
                out[f"lookup_{kind}_delay_{part}"] = total
    for k, v in p2pkv.items():
        if k.split("{")[0].endswith("_created"):  # a counter's creation time
            continue
        if any(
                s in k for s in ("loaded_blocks", "stored_blocks", "load_failures",
                                 "lookup_hits", "handshakes_refused", "loaded_bytes",
                                 "load_skipped", "lookup_keys", "lookup_steps",
                                 "lookup_wait_seconds", "load_decisions",
                                 "idle_pause_seconds")):
            out[k.removeprefix("vllm:")] = v
        elif "request_hook" in k:
            # Calls and seconds add up over the engines; the longest call is the max.
            out[k.removeprefix("vllm:")] = max(m.get(k, 0.0) for m in metrics) \
                if "max_seconds" in k else v
    return out


def run_label(config: str, balancer: str, profile: str | None = None) -> str:
    """A run's name in the table: the configuration, the balancer unless it is nginx,
    and the link profile on emulated hosts (``p2pkv``, ``p2pkv@router:cache_aware``,
    ``p2pkv/25G``)."""
    label = config if balancer == "nginx" else f"{config}@{balancer}"
    return label if profile is None else f"{label}/{profile}"


def _mismatch(texts: Sequence[str], reference: Sequence[str]) -> float:
    pairs = list(zip(texts, reference, strict=False))
    return sum(a != b for a, b in pairs) / len(pairs) if pairs else 0.0


#: vLLM's names for an engine's processes (``comm``), by the part each plays; any other
#: process of the engine's group is counted with its API server.
CPU_PARTS = {"VLLM::EngineCor": "cpu_core_s", "VLLM::Worker": "cpu_workers_s"}


def engine_cpu(cpu_seconds: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """A run's CPU seconds summed over its engines, by part: API servers, engine cores
    (vLLM's scheduler, and the p2pkv tier with its node), workers (the forward passes)."""
    parts = {"cpu_server_s": 0.0, "cpu_core_s": 0.0, "cpu_workers_s": 0.0}
    for by_name in cpu_seconds.values():
        for name, seconds in by_name.items():
            parts[CPU_PARTS.get(name, "cpu_server_s")] += seconds
    row: dict[str, Any] = {k: round(v, 1) for k, v in parts.items()}
    row["engine_cpu"] = " / ".join(f"{row[k]:.1f}" for k in parts)
    return row


def summarize(run: Mapping[str, Any], reference: Mapping[str, Any] | None) -> dict[str, Any]:
    """One table row: the figures the issue asks for, from one configuration's run."""
    b = run["bench"]
    row: dict[str, Any] = {
        "config": run["label"], "balancer": run.get("balancer", "nginx"),
        "profile": run.get("profile"),
        "engines": run["engines"],
        "ttft_p50_ms": b["median_ttft_ms"], "ttft_p99_ms": b["p99_ttft_ms"],
        "ttft_mean_ms": b["mean_ttft_ms"], "itl_p50_ms": b["median_itl_ms"],
        "req_per_s": b["request_throughput"], "out_tok_per_s": b["output_throughput"],
        "failed": b["failed"], "completed": b["completed"],
    }
    per_engine = run.get("bench_requests_per_engine")
    if per_engine:
        row["requests_per_engine"] = "/".join(str(n) for n in per_engine)
    c = run["counters"]
    row["tokens_from_peer"] = c.get("cached_tokens[p2p]", 0.0)
    row["tokens_from_region"] = c.get("cached_tokens[host]", 0.0)
    row["tokens_from_disk"] = c.get("cached_tokens[disk]", 0.0)
    row["tokens_local_prefix_cache"] = c.get("cached_tokens[device]", 0.0)
    if reference is not None:
        row["text_mismatch_vs_none"] = _mismatch(b["generated_texts"],
                                                 reference["bench"]["generated_texts"])
    for k, v in run.get("cold_profile", {}).items():
        row[k] = v
    if run.get("cpu_seconds"):
        row.update(engine_cpu(run["cpu_seconds"]))
    row.update(trace_row(run.get("trace"), reference.get("trace") if reference else None))
    m = run.get("multi_turn")
    if m:
        s = m["summary"]
        row["mt_ttft_later_p50_ms"] = s["ttft_later_turns"]["p50_ms"]
        row["mt_ttft_later_p99_ms"] = s["ttft_later_turns"]["p99_ms"]
        row["mt_failed"] = s["failed"]
        if reference is not None and reference.get("multi_turn"):
            texts = [r.get("text") for r in m["records"]]
            ref = [r.get("text") for r in reference["multi_turn"]["records"]]
            row["mt_text_mismatch_vs_none"] = _mismatch(texts, ref)
    return row


def trace_row(trace: Mapping[str, Any] | None,
              reference: Mapping[str, Any] | None) -> dict[str, Any]:
    """A run's trace replay as row fields: TTFT p50/p90/p99/mean, failures, goodput
    within each TTFT bound, prompt tokens served from a peer or the ``fs`` tier during it,
    and the share of its texts that differ from ``reference``'s (the ``none`` run's)."""
    if not trace:
        return {}
    s = trace["summary"]
    c = trace.get("counters", {})
    row = {f"trace_ttft_{k}": v for k, v in s["ttft"].items()}
    row.update(trace_failed=s["failed"], trace_lag_p99_ms=s["schedule_lag"]["p99_ms"],
               trace_tokens_from_peer=c.get("cached_tokens[p2p]", 0.0),
               trace_tokens_from_disk=c.get("cached_tokens[disk]", 0.0))
    for bound, rate in s.get("goodput", {}).items():
        row[f"trace_goodput[{bound}]"] = rate
    if reference and trace.get("records") is not None \
            and reference.get("records") is not None:
        texts = [r["text"] if r["error"] is None else None for r in trace["records"]]
        ref = [r["text"] if r["error"] is None else None for r in reference["records"]]
        both = [(a, b) for a, b in zip(texts, ref, strict=False)
                if a is not None and b is not None]
        row["trace_text_mismatch_vs_none"] = (sum(a != b for a, b in both) / len(both)
                                              if both else 0.0)
    return row


COLUMNS = (("config", "config", "{}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
           ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("itl_p50_ms", "ITL p50 ms", "{:.0f}"),
           ("req_per_s", "req/s", "{:.2f}"), ("out_tok_per_s", "out tok/s", "{:.1f}"),
           ("failed", "failed", "{}"), ("requests_per_engine", "requests per engine", "{}"),
           ("tokens_from_peer", "tokens from peer", "{:.0f}"),
           ("tokens_from_disk", "tokens from fs", "{:.0f}"),
           ("tokens_from_region", "tokens from CPU region", "{:.0f}"),
           ("text_mismatch_vs_none", "texts != none", "{:.0%}"),
           ("mt_ttft_later_p50_ms", "turn>1 TTFT p50", "{:.0f}"),
           ("mt_ttft_later_p99_ms", "turn>1 TTFT p99", "{:.0f}"),
           ("mt_text_mismatch_vs_none", "turn texts != none", "{:.0%}"),
           ("trace_ttft_p50_ms", "trace TTFT p50", "{:.0f}"),
           ("trace_ttft_p90_ms", "trace TTFT p90", "{:.0f}"),
           ("trace_ttft_p99_ms", "trace TTFT p99", "{:.0f}"),
           ("trace_ttft_mean_ms", "trace TTFT mean", "{:.0f}"),
           ("trace_failed", "trace failed", "{}"),
           ("trace_tokens_from_peer", "trace tokens from peer", "{:.0f}"),
           ("trace_text_mismatch_vs_none", "trace texts != none", "{:.0%}"),
           ("engine_cpu", "engine CPU s: servers / cores / workers", "{}"))


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of the rows (absent figures as a dash)."""
    lines = ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [fmt.format(row[k]) if row.get(k) is not None else "–"
                 for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The issue's targets as ratios of this sitting's rows, p2pkv against each other
    configuration behind the same balancer (keys name the balancer unless it is nginx)."""
    out: dict[str, float] = {}
    for balancer, profile in dict.fromkeys((r.get("balancer", "nginx"), r.get("profile"))
                                           for r in rows):
        by = {r["config"]: r for r in rows if r.get("balancer", "nginx") == balancer
              and r.get("profile") == profile}
        at = ("" if balancer == "nginx" else f" @{balancer}") + (
            "" if profile is None else f" /{profile}")
        p = by.get(run_label("p2pkv", balancer, profile))
        if p is None:
            continue
        for base in ("none", "offload", "single", "fs", "fs-net"):
            b = by.get(run_label(base, balancer, profile))
            if b is None:
                continue
            out[f"ttft_p50 p2pkv/{base}{at}"] = p["ttft_p50_ms"] / b["ttft_p50_ms"]
            out[f"ttft_p99 p2pkv/{base}{at}"] = p["ttft_p99_ms"] / b["ttft_p99_ms"]
            out[f"req_per_s p2pkv/{base}{at}"] = p["req_per_s"] / b["req_per_s"]
            for q in ("p50", "p90", "p99", "mean"):
                key = f"trace_ttft_{q}_ms"
                if p.get(key) and b.get(key):
                    out[f"trace ttft_{q} p2pkv/{base}{at}"] = p[key] / b[key]
            for key in (k for k in p if k.startswith("trace_goodput[")):
                if b.get(key):
                    out[f"{key.replace('_', ' ', 1)} p2pkv/{base}{at}"] = p[key] / b[key]
            if p.get("mt_ttft_later_p50_ms") and b.get("mt_ttft_later_p50_ms"):
                out[f"turn>1 ttft_p50 p2pkv/{base}{at}"] = (p["mt_ttft_later_p50_ms"]
                                                           / b["mt_ttft_later_p50_ms"])
    return out


def plot(rows: Sequence[Mapping[str, Any]], path: Path,
         workload: str = "prefix_repetition") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], [r["ttft_p50_ms"] / 1000 for r in rows], 0.4,
                label="p50")
    axes[0].bar([i + 0.2 for i in x], [r["ttft_p99_ms"] / 1000 for r in rows], 0.4,
                label="p99")
    axes[0].set_title(f"{workload}: TTFT (s)")
    axes[0].legend()
    axes[1].bar(list(x), [r["req_per_s"] for r in rows], 0.6, color="#2ca02c")
    axes[1].set_title(f"{workload}: requests/s")
    mt = [(r.get("mt_ttft_later_p50_ms") or 0) / 1000 for r in rows]
    axes[2].bar(list(x), mt, 0.6, color="#9467bd")
    axes[2].set_title("multi-turn, later turns: TTFT p50 (s)")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

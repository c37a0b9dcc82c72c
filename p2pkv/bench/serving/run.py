"""One sitting of the serving benchmark: every configuration on the same requests."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.balancers import ROUTER_POLICIES, parse_balancers
from p2pkv.bench.serving.clients import (
    BenchWorkload,
    cold_profile,
    prefix_ids,
    run_multi_turn,
    run_vllm_bench,
)
from p2pkv.bench.serving.cluster import ServingCluster
from p2pkv.bench.serving.configs import (
    CONFIGS,
    OFFLOAD_BLOCK_TOKENS,
    engine_specs,
    parse_tier_option,
    tier_options,
)
from p2pkv.bench.serving.processes import cpu_used

__all__ = ["main", "run_config", "summarize", "table"]

SERVED_NAME = "smollm2"


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
        if not k.endswith("_created") and any(
                s in k for s in ("loaded_blocks", "stored_blocks", "load_failures",
                                 "lookup_hits", "handshakes_refused", "loaded_bytes",
                                 "load_skipped", "lookup_keys", "lookup_steps",
                                 "lookup_wait_seconds", "load_decisions",
                                 "idle_pause_seconds")):
            out[k.removeprefix("vllm:")] = v
        elif "request_hook" in k and not k.split("{")[0].endswith("_created"):
            # Calls and seconds add up over the engines; the longest call is the max.
            out[k.removeprefix("vllm:")] = max(m.get(k, 0.0) for m in metrics) \
                if "max_seconds" in k else v
    return out


def run_label(config: str, balancer: str) -> str:
    """A run's name in the table: the configuration, and the balancer unless it is nginx
    (``p2pkv``, ``p2pkv@router:cache_aware``)."""
    return config if balancer == "nginx" else f"{config}@{balancer}"


def run_config(config: str, args: argparse.Namespace, workdir: Path,
               workload: BenchWorkload, label: str, balancer: str = "nginx") -> dict[str, Any]:
    """Start a configuration's engines and balancer, run both workloads, stop.

    Behind nginx the multi-turn workload sends each turn to another engine than the turn
    before (the worst case, as round-robin would). Behind vLLM's router it goes through
    the router, whose policy then places every turn."""
    specs = engine_specs(config, args.engines, cpu_bytes=int(args.cpu_gib * 2**30),
                         workdir=workdir, tier_options=tier_options(args))
    where = workdir / label.replace(":", "-")
    cluster = ServingCluster(Path(args.model), specs, where, served_name=SERVED_NAME,
                             max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                             balancer=balancer, start_timeout=args.start_timeout)
    print(f"[{label}] starting {len(specs)} engine(s) behind {balancer}", flush=True)
    started = time.monotonic()
    with cluster:
        print(f"[{label}] up in {time.monotonic() - started:.0f}s; vllm bench serve ...",
              flush=True)
        cpu_before = cluster.cpu()
        bench = run_vllm_bench(cluster.url, SERVED_NAME, Path(args.model), workload, where,
                               label.replace(":", "-"))
        # What the balancer did with the bench's requests (before the multi-turn ones).
        per_engine = cluster.requests_per_engine()
        multi = None
        if args.turns > 0:
            print(f"[{label}] multi-turn ...", flush=True)
            urls = ([cluster.engine_url(s.name) for s in cluster.specs] if balancer == "nginx"
                    else [cluster.url])
            multi = run_multi_turn(urls, SERVED_NAME, count=args.conversations,
                                   turns=args.turns, concurrency=workload.concurrency,
                                   seed=workload.seed)
        metrics = [cluster.metrics(s.name) for s in specs]
        cpu_after = cluster.cpu()
    return {"config": config, "label": label, "balancer": balancer, "engines": len(specs),
            "bench": bench, "bench_requests_per_engine": [per_engine.get(s.name, 0)
                                                          for s in specs],
            "multi_turn": multi,
            "multi_turn_via": "engines in turn" if balancer == "nginx" else "balancer",
            "counters": counters(metrics),
            # Each engine's load-policy estimates at the end (peer bandwidth, prefill
            # rate by prompt band): what its load-or-recompute decisions went by.
            "estimates": [{k.removeprefix("vllm:"): v for k, v in m.items()
                           if "peer_bandwidth" in k or "prefill_tokens_per_second" in k}
                          for m in metrics],
            # CPU seconds each engine's processes used during both workloads, by process
            # name (the API server, vLLM's engine core, its workers).
            "cpu_seconds": {name: cpu_used(cpu_before.get(name, {}), after)
                            for name, after in cpu_after.items()}}


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
    for balancer in dict.fromkeys(r.get("balancer", "nginx") for r in rows):
        by = {r["config"]: r for r in rows if r.get("balancer", "nginx") == balancer}
        at = "" if balancer == "nginx" else f" @{balancer}"
        p = by.get(run_label("p2pkv", balancer))
        if p is None:
            continue
        for base in ("none", "offload", "single", "fs"):
            b = by.get(run_label(base, balancer))
            if b is None:
                continue
            out[f"ttft_p50 p2pkv/{base}{at}"] = p["ttft_p50_ms"] / b["ttft_p50_ms"]
            out[f"ttft_p99 p2pkv/{base}{at}"] = p["ttft_p99_ms"] / b["ttft_p99_ms"]
            out[f"req_per_s p2pkv/{base}{at}"] = p["req_per_s"] / b["req_per_s"]
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m p2pkv.bench.serving",
                                description="vllm serve engines behind a load balancer "
                                            "(nginx or vLLM's router), side by side")
    p.add_argument("--configs", default="none,offload,p2pkv,fs,single",
                   help=f"comma-separated, from: {', '.join(CONFIGS)}")
    p.add_argument("--balancer", default="nginx",
                   help="comma-separated, each configuration runs behind each: nginx "
                        "(round-robin) or router:POLICY (vLLM's router), POLICY from: "
                        f"{', '.join(ROUTER_POLICIES)}")
    p.add_argument("--repeat-none", action="store_true",
                   help="run 'none' a second time: how often two unshared runs differ")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--model", default=".models/smollm2")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--prefix-skew", type=float, default=0.0,
                   help="0: vLLM's prefix_repetition (every prefix as often); above 0, "
                        "a prefix's share of the requests falls as 1/rank^SKEW, so that "
                        "a few hot prefixes take most of them (see serving/skew.py)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4, help="0: no multi-turn workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-gib", type=float, default=0.5,
                   help="the offloading connector's CPU primary region per engine")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--lookup-timeout", type=float, default=1.0)
    p.add_argument("--pending-wait", type=float, default=None,
                   help="the p2pkv tier's pending_wait (0: never wait for chunks a peer "
                        "is computing); default: the tier's")
    p.add_argument("--tier-option", action="append", default=[], metavar="NAME=VALUE",
                   help="a p2pkv tier option for every p2pkv engine (VALUE as JSON), "
                        "e.g. load_policy=false; may be repeated")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--faults", action="store_true",
                   help="instead of the comparison: kill -9 one p2pkv engine mid-run, "
                        "then restart it (see p2pkv.bench.serving.faults)")
    p.add_argument("--kill-after", type=float, default=60.0,
                   help="--faults: seconds into the bench before the kill")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="--faults: the tiers' heartbeat deadline")
    p.add_argument("--report", metavar="JSON",
                   help="no engines: print the table (and --plot) of a sitting saved "
                        "with --json")
    p.add_argument("--workdir", help="logs and results (default: a new temporary dir)")
    p.add_argument("--json", help="write every run and the table rows here")
    p.add_argument("--plot", help="draw the table's figures into this PNG")
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _problem(args: argparse.Namespace) -> str | None:
    """What makes the command line unusable, or ``None``."""
    unknown = [c for c in _split(args.configs) if c not in CONFIGS]
    if unknown:
        return f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}"
    try:
        balancers = [b.label for b in parse_balancers(args.balancer)]
    except ValueError as exc:
        return str(exc)
    if args.faults and balancers != ["nginx"]:
        return ("--faults reads nginx's access log (which requests were in flight on the "
                "killed engine); run it with --balancer nginx")
    for text in args.tier_option:
        try:
            parse_tier_option(text)
        except ValueError as exc:
            return str(exc)
    if not (Path(args.model) / "config.json").exists():
        return f"no model at {args.model} (make real-model builds .models/smollm2)"
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib: pip install matplotlib"
    return None


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _problem(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        workload = BenchWorkload(**saved["sitting"]["workload"])
        finish(saved["sitting"], saved["runs"], workload, args)
        return 0
    try:
        workload = BenchWorkload(prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                                 num_prefixes=args.num_prefixes,
                                 num_prompts=args.num_prompts, output_len=args.output_len,
                                 concurrency=args.concurrency, seed=args.seed,
                                 prefix_skew=args.prefix_skew)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    # SIGTERM stops like Ctrl-C: the clusters' ``with`` blocks stop every process.
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="p2pkv-serving-"))
    try:
        if args.faults:
            return _faults(args, workdir, workload)
        return _sitting(args, workdir, workload)
    except KeyboardInterrupt:
        print("interrupted: every engine and the balancer were stopped", file=sys.stderr)
        return 130


def _faults(args: argparse.Namespace, workdir: Path, workload: BenchWorkload) -> int:
    from p2pkv.bench.serving.faults import run_faults

    faults = run_faults(args, workdir, workload, SERVED_NAME)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": workload.describe(),
                                               "faults": faults}, indent=1))
    return 0 if faults["failed_elsewhere"] == 0 else 1


def _sitting(args: argparse.Namespace, workdir: Path, workload: BenchWorkload) -> int:
    """Every configuration behind every balancer, in this order, on the same requests."""
    order = _split(args.configs)
    if args.repeat_none and "none" in order:
        order.insert(order.index("none") + 1, "none#2")
    balancers = list(dict.fromkeys(b.label for b in parse_balancers(args.balancer)))
    print(f"workdir {workdir}", flush=True)
    runs: list[dict[str, Any]] = []
    sitting = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "workload": workload.describe(), "engines": args.engines,
               "balancers": balancers,
               "cpu_gib": args.cpu_gib, "offload_block_tokens": OFFLOAD_BLOCK_TOKENS,
               "tier_options": tier_options(args),
               "multi_turn": {"conversations": args.conversations, "turns": args.turns}}
    for balancer in balancers:
        for name in order:
            runs.append(run_config(name.split("#")[0], args, workdir, workload,
                                   run_label(name, balancer), balancer))
    sitting["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    finish(sitting, runs, workload, args)
    return 0


def finish(sitting: dict[str, Any], runs: list[dict[str, Any]], workload: BenchWorkload,
           args: argparse.Namespace) -> None:
    """Print the table, the targets' ratios and the cold-prefill profile; write the JSON
    and the plot."""
    prefixes = prefix_ids(workload, Path(args.model))
    for r in runs:
        r["cold_profile"] = cold_profile(r["bench"], prefixes)
    # Greedy texts do not depend on where a request ran: one 'none' run (nginx's, when
    # the sitting has it) is every run's reference.
    reference = next((r for r in runs if r["config"] == "none" and "#" not in r["label"]),
                     None)
    rows = [summarize(r, reference if r is not reference else None) for r in runs]
    print()
    print(table(rows))
    for k, v in ratios(rows).items():
        print(f"{k}: {v:.2f}x")
    print("\nwhere the cold prefills come from (requests; warm = TTFT under 3/4 of the "
          "fastest first request of a prefix):")
    for row in rows:
        print(f"  {row['config']}: first of their prefix {row['first_of_prefix']}; "
              f"arrived after the prefix was computed {row['after_prefix_computed']} "
              f"({row['after_prefix_computed_warm']} warm); arrived while it was being "
              f"computed {row['while_prefix_computing']} "
              f"({row['while_prefix_computing_warm']} warm)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"sitting": sitting, "rows": rows, "ratios": ratios(rows), "runs": runs},
            indent=1))
    if args.plot:
        plot(rows, Path(args.plot), workload.name)

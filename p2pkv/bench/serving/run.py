"""One sitting of the serving benchmark: every configuration on the same requests."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from p2pkv.bench.netns import Unavailable
from p2pkv.bench.redis_servers import LocalRedis
from p2pkv.bench.serving.aiperf_client import DEFAULT_AIPERF, run_aiperf
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
from p2pkv.bench.serving.links import (
    PROFILES,
    KvRate,
    LinkProfile,
    kv_bytes_per_token,
    parse_profiles,
    profile_rows,
)
from p2pkv.bench.serving.mooncake import (
    CONVERSATIONS_TRACE,
    BlockMapping,
    MappedRequest,
    load_trace,
    map_requests,
)
from p2pkv.bench.serving.processes import cpu_used
from p2pkv.bench.serving.tables import counters, plot, ratios, run_label, summarize, table
from p2pkv.bench.serving.topology import Topology
from p2pkv.bench.serving.trace import replay

__all__ = ["main", "run_config"]

SERVED_NAME = "smollm2"


def run_config(config: str, args: argparse.Namespace, workdir: Path,
               workload: BenchWorkload, label: str, balancer: str = "nginx",
               topology: Topology | None = None,
               directory: str | None = None) -> dict[str, Any]:
    """Start a configuration's engines and balancer, run the workloads, stop.

    Behind nginx the multi-turn workload sends each turn to another engine than the turn
    before (the worst case, as round-robin would). Behind vLLM's router it goes through
    the router, whose policy then places every turn. On emulated hosts (``topology``)
    each engine runs on its own host, and the run records the bytes each engine host
    received over its link."""
    topology = topology or Topology(args.engines, workdir, on_hosts=False)
    slug = label.replace(":", "-").replace("/", "-")
    where = workdir / slug
    where.mkdir(parents=True, exist_ok=True)
    specs = engine_specs(config, args.engines, cpu_bytes=int(args.cpu_gib * 2**30),
                         workdir=where, tier_options=tier_options(args),
                         hosts=topology.engine_hosts,
                         fs_net_roots=topology.fs_net_roots(where.name),
                         directory=directory)
    cluster = ServingCluster(Path(args.model), specs, where, served_name=SERVED_NAME,
                             max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                             balancer=balancer, start_timeout=args.start_timeout)
    print(f"[{label}] starting {len(specs)} engine(s) behind {balancer}", flush=True)
    started = time.monotonic()
    with cluster:
        print(f"[{label}] up in {time.monotonic() - started:.0f}s; vllm bench serve ...",
              flush=True)
        cpu_before = cluster.cpu()
        rx_before = topology.received()
        bench = run_vllm_bench(cluster.url, SERVED_NAME, Path(args.model), workload, where,
                               slug)
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
        trace = None
        if args.trace != "none":
            print(f"[{label}] trace ...", flush=True)
            before_trace = counters([cluster.metrics(s.name) for s in specs])
            if args.trace_client == "aiperf":
                summary = run_aiperf(cluster.url, SERVED_NAME, trace_requests(args),
                                     where / "aiperf", block_tokens=args.trace_block_tokens,
                                     squeeze=args.trace_squeeze,
                                     tokenizer_dir=Path(args.model))
                # aiperf's prompts are its own text: no texts to hold against none's.
                trace = {"client": "aiperf", "summary": summary, "records": None}
            else:
                trace = {"client": "p2pkv", **asyncio.run(replay(
                    cluster.url, SERVED_NAME, trace_requests(args),
                    squeeze=args.trace_squeeze)).to_json()}
            after_trace = counters([cluster.metrics(s.name) for s in specs])
            trace["counters"] = {k: v - before_trace.get(k, 0.0)
                                 for k, v in after_trace.items()}
        metrics = [cluster.metrics(s.name) for s in specs]
        cpu_after = cluster.cpu()
        rx_after = topology.received()
    return {"config": config, "label": label, "balancer": balancer, "engines": len(specs),
            "profile": None if topology.profile is None else topology.profile.name,
            # Bytes each engine host received over its link during the workloads (the
            # kernel's count): what crossed the network, blocks and requests alike.
            "link_rx_bytes": {h: rx_after[h] - rx_before.get(h, 0) for h in rx_after},
            "bench": bench, "bench_requests_per_engine": [per_engine.get(s.name, 0)
                                                          for s in specs],
            "multi_turn": multi, "trace": trace,
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
    p.add_argument("--trace", default=str(CONVERSATIONS_TRACE),
                   help="a Mooncake trace (JSONL) replayed on its schedule through the "
                        "balancer after the other workloads, or 'none' (default: 16 "
                        "conversations of Mooncake's conversation trace, "
                        "serving/traces/README.md)")
    p.add_argument("--trace-client", choices=("p2pkv", "aiperf"), default="p2pkv",
                   help="who replays the trace: p2pkv's own replayer (serving/trace.py), or "
                        "aiperf from .venv-aiperf (serving/aiperf_client.py; its prompts "
                        "are its own text, so no texts are compared)")
    p.add_argument("--trace-squeeze", type=float, default=20.0,
                   help="the trace is sent at its own time divided by this")
    p.add_argument("--trace-block-tokens", type=int, default=64,
                   help="tokens per 512-token block of the trace")
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
    p.add_argument("--hosts", action="store_true",
                   help="each engine on an emulated host of its own (a network namespace "
                        "on a bridge; root only): the balancer and clients on a 'front' "
                        "host, p2pkv's blocks and the fs-net volume over shaped links")
    p.add_argument("--links", default="unshaped",
                   help="--hosts: comma-separated link profiles, each a pass over every "
                        f"configuration, from: {', '.join(PROFILES)} (multiples of one "
                        "engine's KV rate, measured at the start; see serving/links.py)")
    p.add_argument("--kv-rate", type=float, default=None, metavar="BYTES_PER_S",
                   help="--hosts: one engine's KV rate to set the links from, instead of "
                        "measuring it at the start")
    p.add_argument("--directory", choices=("none", "redis"), default="none",
                   help="how p2pkv's engines find each other: by address (none), or "
                        "through a Redis directory started for the sitting (on the front "
                        "host with --hosts, reached over the engines' links)")
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


def trace_requests(args: argparse.Namespace) -> list[MappedRequest]:
    """The ``--trace`` file's requests, mapped for these engines (every configuration the
    same: the token ids are seeded by ``--seed``)."""
    return map_requests(load_trace(args.trace),
                        BlockMapping(block_tokens=args.trace_block_tokens, seed=args.seed))


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
    try:
        profiles = parse_profiles(args.links)
    except ValueError as exc:
        return str(exc)
    if not args.hosts and (profiles != [PROFILES["unshaped"]] or args.kv_rate is not None
                           or "fs-net" in _split(args.configs)):
        return ("--links, --kv-rate and the fs-net configuration need --hosts (engines on "
                "hosts of their own)")
    if args.trace != "none":
        try:
            trace_requests(args)
        except (OSError, ValueError) as exc:
            return f"--trace {args.trace}: {exc}"
        if args.trace_client == "aiperf" and not DEFAULT_AIPERF.exists():
            return (f"--trace-client aiperf: no aiperf at {DEFAULT_AIPERF} (python3 -m venv "
                    f".venv-aiperf && .venv-aiperf/bin/pip install 'aiperf==0.13.*')")
        if not args.trace_squeeze > 0:
            return f"--trace-squeeze must be > 0, got {args.trace_squeeze}"
    if args.kv_rate is not None and not args.kv_rate > 0:
        return f"--kv-rate must be a number of bytes per second > 0, got {args.kv_rate}"
    if args.faults and args.hosts and profiles[0].times_kv_rate is None:
        return ("--faults --hosts slows a link to half the KV rate and back: give a shaped "
                "profile first in --links (100G or 25G)")
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
    except Unavailable as exc:
        print(f"--hosts: emulated hosts cannot be made here: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every engine and the balancer were stopped", file=sys.stderr)
        return 130


def _faults(args: argparse.Namespace, workdir: Path, workload: BenchWorkload) -> int:
    """An engine killed (one host), or every fault across hosts (``--hosts``: on the
    first ``--links`` profile); 0 when nothing failed beyond the killed engine's requests
    in flight and, across hosts, every text equals ``none``'s."""
    from p2pkv.bench.serving.faults import run_faults
    from p2pkv.bench.serving.hostfaults import run_host_faults

    if not args.hosts:
        faults = run_faults(args, workdir, workload, SERVED_NAME)
        differ = 0
    else:
        profile = parse_profiles(args.links)[0]
        with Topology(args.engines, workdir, on_hosts=True) as topology, \
                topology.entered():
            kv_rate = _kv_rate(args, topology, workdir)
            topology.shape(profile, kv_rate)
            faults = run_host_faults(args, workdir, workload, SERVED_NAME, topology,
                                     kv_rate)
        differ = faults["texts_vs_none"]["differ"]
    print(json.dumps(faults, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": workload.describe(),
                                               "faults": faults}, indent=1))
    return 0 if faults["failed_elsewhere"] == 0 and differ == 0 else 1


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
               "multi_turn": {"conversations": args.conversations, "turns": args.turns},
               "trace": None if args.trace == "none" else {
                   "file": args.trace, "squeeze": args.trace_squeeze,
                   "block_tokens": args.trace_block_tokens, "client": args.trace_client,
                   "requests": len(trace_requests(args))}}
    profiles: list[LinkProfile | None] = list(parse_profiles(args.links)) if args.hosts \
        else [None]
    with contextlib.ExitStack() as stack:
        topology = stack.enter_context(Topology(args.engines, workdir, on_hosts=args.hosts,
                                                fs_net="fs-net" in order))
        stack.enter_context(topology.entered())
        directory = stack.enter_context(_directory(args, topology))
        sitting["directory"] = directory
        kv_rate = None
        if any(p is not None and p.times_kv_rate is not None for p in profiles):
            kv_rate = _kv_rate(args, topology, workdir)
            sitting["kv_rate"] = kv_rate.describe()
            sitting["links"] = profile_rows([p for p in profiles if p], kv_rate)
        for profile in profiles:
            if profile is not None:
                topology.shape(profile, kv_rate)
                print(f"links: {profile.name} ({profile.stands_for}): "
                      f"{topology.describe()['hosts']}", flush=True)
            for balancer in balancers:
                for name in order:
                    runs.append(run_config(
                        name.split("#")[0], args, workdir, workload,
                        run_label(name, balancer, None if profile is None else profile.name),
                        balancer, topology, directory))
        sitting["topology"] = topology.describe()
    sitting["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    finish(sitting, runs, workload, args)
    return 0


@contextlib.contextmanager
def _directory(args: argparse.Namespace, topology: Topology) -> Iterator[str | None]:
    """``--directory redis``: a Redis server for the sitting (on the front host with
    ``--hosts``, listening on its address too), its URL; else ``None``."""
    if args.directory != "redis":
        yield None
        return
    address = topology.front_address
    with LocalRedis(args=["--bind", "127.0.0.1", address]) as redis:
        yield f"redis://{address}:{redis.port}/0"


def _kv_rate(args: argparse.Namespace, topology: Topology, workdir: Path) -> KvRate:
    """``--kv-rate`` as given, or one engine's rate measured on the first engine host."""
    if args.kv_rate is not None:
        return KvRate.given(args.kv_rate, kv_bytes_per_token(Path(args.model)))
    print("measuring one engine's KV rate (a cold prefill on the first engine host) ...",
          flush=True)
    rate = topology.measure_kv_rate(Path(args.model), workdir, python=sys.executable,
                                    start_timeout=args.start_timeout,
                                    served_name=SERVED_NAME)
    print(f"one engine makes {rate.tokens_per_s:.0f} tokens/s of prefill = "
          f"{rate.bytes_per_s / 1e6:.1f} MB/s of KV", flush=True)
    return rate


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

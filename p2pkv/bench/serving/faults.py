"""A p2pkv engine killed under serving traffic, and brought back.

``python -m p2pkv.bench.serving --faults`` starts the p2pkv configuration, runs the
``prefix_repetition`` workload through the balancer, and ``kill -9``s one engine's whole
process group (API server, engine core, workers) ``--kill-after`` seconds in. It reports:

- the requests that failed, split into those that were in flight on the killed engine
  (they end with its socket; nothing can save them) and the rest, which must be 0: nginx
  takes the dead engine out (``proxy_next_upstream error``) and the survivors answer;
- the survivors' load failures by reason (a load from the dead engine fails at the
  heartbeat deadline and the chunk is recomputed) and their slowest TTFT after the kill;
- after the run, the killed engine is restarted: a prompt computed by a survivor is then
  asked of it, and it must load that prompt from the survivor (it rejoined and shares)
  and answer with the same text.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.clients import BenchWorkload, complete, run_vllm_bench
from p2pkv.bench.serving.cluster import ServingCluster
from p2pkv.bench.serving.configs import engine_specs, tier_options

__all__ = ["in_flight", "rejoined", "run_faults"]

PEER_TOKENS = "vllm:prompt_tokens_cached_by_source_total{source=p2p}"


def run_faults(args: argparse.Namespace, workdir: Path, workload: BenchWorkload,
               served_name: str) -> dict[str, Any]:
    specs = engine_specs("p2pkv", args.engines, cpu_bytes=int(args.cpu_gib * 2**30),
                         workdir=workdir,
                         tier_options=tier_options(args,
                                                   heartbeat_timeout=args.heartbeat_timeout))
    victim = specs[-1]
    cluster = ServingCluster(Path(args.model), specs, workdir / "faults",
                             served_name=served_name, max_model_len=args.max_model_len,
                             kv_cache_gib=args.kv_cache_gib, start_timeout=args.start_timeout)
    result: dict[str, Any] = {"engines": len(specs), "victim": victim.name,
                              "heartbeat_timeout_s": args.heartbeat_timeout}
    with cluster:
        print(f"[faults] {len(specs)} engines up; bench, kill -9 {victim.name} after "
              f"{args.kill_after:.0f}s", flush=True)
        bench: dict[str, Any] = {}

        def drive() -> None:
            try:
                bench.update(run_vllm_bench(cluster.url, served_name, Path(args.model),
                                            workload, workdir / "faults", "faults"))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                bench["error"] = str(exc)

        driver = threading.Thread(target=drive, name="faults-bench", daemon=True)
        driver.start()
        time.sleep(args.kill_after)
        killed_at = time.time()
        cluster.kill(victim.name)
        driver.join(1800)
        if "error" in bench or not bench:
            raise RuntimeError(f"the bench did not finish: {bench.get('error', 'timeout')}")
        log = cluster.balancer_requests()
        victim_addr = f"{victim.address}:{victim.port}"
        in_flight_at_kill = in_flight(log, victim_addr, killed_at)
        survivors = [s for s in specs if s is not victim]
        after = [r for r in log if r["end"] - r["seconds"] > killed_at
                 and r["upstreams"][-1] != victim_addr]
        metrics = {s.name: cluster.metrics(s.name) for s in survivors}
        result.update(
            requests=len(bench["errors"]), failed=bench["failed"],
            failed_in_flight_on_victim=len(in_flight_at_kill),
            failed_elsewhere=max(0, bench["failed"] - len(in_flight_at_kill)),
            requests_after_kill=len(after),
            non_200_after_kill=sum(1 for r in after if r["status"] != 200),
            slowest_survivor_request_after_kill_s=max((r["seconds"] for r in after),
                                                      default=0.0),
            survivor_load_failures={k.removeprefix("vllm:p2pkv_load_failures_total"): v
                                    for m in metrics.values() for k, v in m.items()
                                    if k.startswith("vllm:p2pkv_load_failures_total")},
            ttft_p50_ms=bench["median_ttft_ms"], ttft_p99_ms=bench["p99_ttft_ms"])
        print(f"[faults] restarting {victim.name}", flush=True)
        cluster.start_engine(victim.name)
        result.update(rejoined(cluster, survivors[0].name, victim.name, served_name))
    return result


def in_flight(log: list[dict[str, Any]], upstream: str, at: float) -> list[dict[str, Any]]:
    """The requests of nginx's ``log`` that ``upstream`` (``ADDRESS:PORT``) was serving at
    time ``at`` (epoch seconds): a request killed with its engine ends at the kill or
    just after."""
    return [r for r in log if r["upstreams"] and r["upstreams"][-1] == upstream
            and r["end"] >= at and r["end"] - r["seconds"] <= at]


def rejoined(cluster: ServingCluster, survivor: str, victim: str,
             served_name: str) -> dict[str, Any]:
    """After ``victim`` came back: a prompt nobody held, computed by ``survivor``, then
    asked of ``victim``. It must load it from the survivor (it rejoined and shares) and
    answer alike: the tokens it took from the peer, and whether the texts are equal."""
    prompt = " ".join(f"Step {i}: move the {w} to shelf {i % 7}." for i, w in
                      enumerate(["crate", "barrel", "lamp", "rope"] * 30))
    # The restarted engine reconnects to its peers within the reconnect interval.
    time.sleep(5)
    computed = complete(cluster.engine_url(survivor), served_name, prompt, 24)
    before = cluster.metrics(victim).get(PEER_TOKENS, 0.0)
    loaded = complete(cluster.engine_url(victim), served_name, prompt, 24)
    return {"rejoined_tokens_from_peer": cluster.metrics(victim).get(PEER_TOKENS, 0.0)
            - before, "rejoined_text_equal": loaded == computed}

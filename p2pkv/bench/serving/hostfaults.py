"""Faults across hosts, under traffic: a host's cable pulled and plugged back, its link
slowed and restored, its engine killed and restarted, all in one run of p2pkv's engines
on emulated hosts (``python -m p2pkv.bench.serving --hosts --faults``).

The same workload runs first on ``none`` engines on the same hosts: their texts are the
reference. Then p2pkv's engines take it behind nginx while the last engine's host (the
victim) goes through, on a timeline from the workload's start (:class:`Timeline`):

1. ``cut``: its cable pulled (its port on the switch down: no FIN, no RST) for
   ``cut_seconds``, then plugged back. Requests nginx sends it meanwhile go to the
   others after nginx's connect timeout; those it was serving resume after the heal;
   the others' lookups and loads from it time out and their chunks are computed;
2. ``slow``: its link set to the ``slow`` profile (half one engine's KV rate) for
   ``slow_seconds``, then back to the sitting's profile: loading from it loses to
   computing, so the others' load policy should recompute, and load again after;
3. ``kill``: its engine (API server, engine core, workers) ``kill -9``'d, then restarted
   on the same host; once up, a prompt a survivor computed must be loaded by it.

Between events the run reads every engine's counters (an engine cut off reads as
``None``), so each phase has its own loads, recompute decisions and load failures. The
result: requests failed (in flight on the killed engine, and elsewhere: must be 0), texts
against ``none``'s (of requests that succeeded in both), and per phase what each engine
loaded, skipped and failed.
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.clients import BenchWorkload, run_vllm_bench
from p2pkv.bench.serving.cluster import ServingCluster
from p2pkv.bench.serving.configs import engine_specs, tier_options
from p2pkv.bench.serving.faults import in_flight, rejoined
from p2pkv.bench.serving.links import PROFILES, KvRate
from p2pkv.bench.serving.processes import scrape
from p2pkv.bench.serving.topology import Topology

__all__ = ["Timeline", "run_host_faults"]

#: The counters read per engine and phase, by the table's name.
COUNTERS = {"loaded_blocks": "vllm:p2pkv_loaded_blocks",
            "skipped_blocks": "vllm:p2pkv_load_skipped_blocks",
            "load_failures": "vllm:p2pkv_load_failures",
            "tokens_from_peer": "vllm:prompt_tokens_cached_by_source_total{source=p2p}"}


@dataclass(frozen=True)
class Timeline:
    """When each fault starts (seconds from the workload's start) and how long it lasts.
    The workload must outlast ``kill_at``, or nothing is in flight when the host dies
    (the result says how long it ran: ``workload_seconds``)."""

    cut_at: float = 15.0
    cut_seconds: float = 6.0
    slow_at: float = 30.0
    slow_seconds: float = 15.0
    #: After the restore, long enough for the load policy's forced probe of a peer found
    #: slow (60 s after its last sample) to come before the kill.
    kill_at: float = 110.0

    def __post_init__(self) -> None:
        if not (self.cut_at >= 0 and self.cut_at + self.cut_seconds <= self.slow_at
                and self.slow_at + self.slow_seconds <= self.kill_at):
            raise ValueError(f"the faults must come one after another: {self}")


def _read(cluster: ServingCluster, names: Sequence[str]) -> dict[str, dict[str, float] | None]:
    """Each engine's counters now; ``None`` for one that does not answer in 3 s."""
    out: dict[str, dict[str, float] | None] = {}
    for name in names:
        spec = cluster.spec(name)
        try:
            metrics = scrape(spec.port, timeout=3.0, host=spec.address)
        except OSError:
            out[name] = None
            continue
        out[name] = {k: sum(v for m, v in metrics.items()
                            if m.startswith(prefix) and "_created" not in m)
                     for k, prefix in COUNTERS.items()}
    return out


def _phases(marks: list[tuple[str, float, dict[str, dict[str, float] | None]]]
            ) -> list[dict[str, Any]]:
    """Per phase (between two reads): its name, start, length, and each engine's counter
    deltas (``None`` where either read failed)."""
    out = []
    for (name, t0, a), (_, t1, b) in itertools.pairwise(marks):
        engines: dict[str, dict[str, float] | None] = {}
        for engine in a:
            x, y = a[engine], b.get(engine)
            # Unread (cut off), or counting from zero again (restarted): no delta.
            engines[engine] = None if x is None or y is None or any(
                y[k] < x[k] for k in COUNTERS) else {k: round(y[k] - x[k], 1)
                                                     for k in COUNTERS}
        out.append({"phase": name, "start_s": round(t0, 1), "seconds": round(t1 - t0, 1),
                    "engines": engines})
    return out


def _texts_vs(texts: Sequence[str], errors: Sequence[str], reference: Sequence[str],
              ref_errors: Sequence[str]) -> dict[str, int]:
    both = [i for i in range(min(len(texts), len(reference)))
            if not errors[i] and not ref_errors[i]]
    return {"compared": len(both), "differ": sum(texts[i] != reference[i] for i in both)}


def run_host_faults(args: argparse.Namespace, workdir: Path, workload: BenchWorkload,
                    served_name: str, topology: Topology, kv_rate: KvRate | None,
                    timeline: Timeline = Timeline()) -> dict[str, Any]:
    """The reference run on ``none``, then p2pkv's engines through the timeline."""
    if kv_rate is None or topology.profile is None or not topology.engine_hosts:
        raise ValueError("faults across hosts need engines on hosts, a shaped profile "
                         "and the KV rate")
    model = Path(args.model)

    def cluster_of(config: str) -> ServingCluster:
        specs = engine_specs(config, args.engines, cpu_bytes=int(args.cpu_gib * 2**30),
                             workdir=workdir / config, hosts=topology.engine_hosts,
                             tier_options=tier_options(
                                 args, heartbeat_timeout=args.heartbeat_timeout))
        return ServingCluster(model, specs, workdir / f"faults-{config}",
                              served_name=served_name, max_model_len=args.max_model_len,
                              kv_cache_gib=args.kv_cache_gib,
                              start_timeout=args.start_timeout)

    print("[faults] the reference: none on the same hosts", flush=True)
    with cluster_of("none") as reference_cluster:
        reference = run_vllm_bench(reference_cluster.url, served_name, model, workload,
                                   workdir / "faults-none", "none")
    cluster = cluster_of("p2pkv")
    victim = cluster.specs[-1]
    host = topology.engine_hosts[-1].name
    names = [s.name for s in cluster.specs]
    slow = PROFILES["slow"].rate_bits(kv_rate.bytes_per_s)
    base = topology.profile.rate_bits(kv_rate.bytes_per_s)
    result: dict[str, Any] = {"victim": victim.name, "victim_host": host,
                              "timeline": asdict(timeline), "profile": topology.profile.name,
                              "rate_bits": base, "slow_rate_bits": slow}
    with cluster:
        bench: dict[str, Any] = {}

        def drive() -> None:
            try:
                bench.update(run_vllm_bench(cluster.url, served_name, model, workload,
                                            workdir / "faults-p2pkv", "p2pkv"))
            except Exception as exc:  # reported as the run's failure below
                bench["error"] = f"{type(exc).__name__}: {exc}"

        driver = threading.Thread(target=drive, name="host-faults-bench", daemon=True)
        started = time.monotonic()
        driver.start()
        marks: list[tuple[str, float, dict[str, dict[str, float] | None]]] = []

        def mark(phase: str, at: float | None = None) -> None:
            """Wait until ``at`` seconds into the workload (``None``: now), then read
            every engine: where phase ``phase`` starts."""
            if at is not None:
                time.sleep(max(0.0, started + at - time.monotonic()))
            marks.append((phase, time.monotonic() - started, _read(cluster, names)))

        mark("before")
        mark("cut", timeline.cut_at)
        with topology.cut(host):
            time.sleep(max(0.0, started + timeline.cut_at + timeline.cut_seconds
                           - time.monotonic()))
        mark("healed")
        mark("slow", timeline.slow_at)
        topology.set_rate(host, slow)
        mark("restored", timeline.slow_at + timeline.slow_seconds)
        topology.set_rate(host, base)
        mark("killed", timeline.kill_at)
        killed_at = time.time()
        cluster.kill(victim.name)
        cluster.start_engine(victim.name)
        mark("restarted")
        driver.join(1800)
        mark("end")
        if "error" in bench or not bench:
            raise RuntimeError(f"the bench did not finish: {bench.get('error', 'timeout')}")
        lost = in_flight(cluster.balancer_requests(), f"{victim.address}:{victim.port}",
                         killed_at)
        result.update(
            requests=len(bench["errors"]), failed=bench["failed"],
            failed_in_flight_on_victim=len(lost),
            failed_elsewhere=max(0, bench["failed"] - len(lost)),
            workload_seconds=round(bench["duration"], 1),
            texts_vs_none=_texts_vs(bench["generated_texts"], bench["errors"],
                                    reference["generated_texts"], reference["errors"]),
            phases=_phases(marks),
            ttft_p50_ms=bench["median_ttft_ms"], ttft_p99_ms=bench["p99_ttft_ms"])
        result.update(rejoined(cluster, names[0], victim.name, served_name))
    return result

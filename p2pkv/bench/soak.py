"""``p2pkv-node bench --soak SECONDS``: eight consumers fetch from one producer."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from p2pkv.bench.data import (
    BULK_CASES,
    KIB,
    MIB,
    BenchError,
    fd_count,
    node_spec,
    proc_status,
)
from p2pkv.bench.pairs import log
from p2pkv.bench.report import Row, machine_info, ratio_of, report
from p2pkv.bench.worker import Worker


def _buckets(progress: dict[int, list[tuple[float, int]]], t0: float, seconds: float,
             width: float = 10.0) -> list[tuple[float, float, int]]:
    """(start, end, bytes) per ``width``-second bucket from cumulative progress samples."""
    n = max(1, math.ceil(seconds / width))
    moved = [0] * n
    for samples in progress.values():
        prev = 0
        for t, total in sorted(samples):
            if t >= t0:  # bytes of the warm-up before t0 are not counted
                k = min(n - 1, int((t - t0) // width))
                moved[k] += total - prev
            prev = total
    return [(k * width, min(seconds, (k + 1) * width), moved[k]) for k in range(n)]


def _flat(samples: list[tuple[float, int]], seconds: float,
          tolerance: Callable[[float], float]) -> tuple[float, float, bool]:
    first = [v for t, v in samples if t < seconds / 4]
    last = [v for t, v in samples if t >= 3 * seconds / 4]
    if not first or not last:
        return math.nan, math.nan, False
    a, b = float(np.median(first)), float(np.median(last))  # robust to ramp-up samples
    return a, b, b - a <= tolerance(a)


def run_soak(seconds: float, *, json_path: str | None = None, consumers: int = 8,
             out: IO[str] | None = None) -> int:
    """Eight consumers fetch from one producer for ``seconds``; non-zero on any error."""
    out = out or sys.stdout
    if seconds <= 0:
        print("p2pkv-node bench: --soak needs a positive number of seconds", file=sys.stderr)
        return 2
    case = BULK_CASES[0]
    blocks = max(4, (32 * MIB) // case.bytes_per_block)
    spec = node_spec("soak", case, blocks)
    workers: list[Worker] = []
    errors: list[str] = []
    progress: dict[int, list[tuple[float, int]]] = {}
    finals: list[dict[str, Any]] = []
    rss: list[tuple[float, int]] = []
    fds: list[tuple[float, int]] = []
    t0 = time.monotonic()
    try:
        producer = Worker("soak-producer", "node-server", {"nodes": [spec]})
        workers.append(producer)
        address = producer.next(300)["addresses"]["soak"]
        clients = [Worker(f"soak-consumer-{i}", "soak-client", {**spec, "address": address})
                   for i in range(consumers)]
        workers += clients
        for c in clients:
            c.next(600)
        log(f"soak: {consumers} consumers, {seconds:g} s after a short warm-up")
        for c in clients:
            c.send_line("go")
        # A warm-up (first touch of every pool, libzmq buffers) is left out of the
        # throughput buckets and of the RSS/fd quarters: it lasts until every consumer
        # has finished two rounds.
        warm: set[int] = set()
        warm_deadline = time.monotonic() + 180
        while len(warm) < consumers:
            if time.monotonic() > warm_deadline:
                raise BenchError("soak consumers did not finish a first round within 180 s")
            for i, c in enumerate(clients):
                while (ev := c.poll_event()) is not None:
                    if ev.get("event") == "progress":
                        progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                        if int(ev["rounds"]) >= 2:
                            warm.add(i)
                if c.proc.poll() is not None:
                    raise BenchError(f"{c.name} died (rc={c.proc.returncode}): "
                                     f"{c.stderr_tail()}")
            time.sleep(0.1)
        t0 = time.monotonic()
        end = t0 + seconds
        next_sample = t0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                rss.append((now - t0, proc_status(producer.pid).get("VmRSS", 0)))
                fds.append((now - t0, fd_count(producer.pid)))
                next_sample = now + 1.0
            for i, c in enumerate(clients):
                while (ev := c.poll_event()) is not None:
                    if ev.get("event") == "progress":
                        progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                if c.proc.poll() is not None:
                    raise BenchError(f"{c.name} died (rc={c.proc.returncode}): "
                                     f"{c.stderr_tail()}")
            time.sleep(0.2)
        for c in clients:
            c.close_stdin()
        for i, c in enumerate(clients):
            deadline = time.monotonic() + 120
            while True:
                ev = c.next(max(1.0, deadline - time.monotonic()))
                if ev.get("event") == "progress":
                    progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                    continue
                if ev.get("event") == "final":
                    finals.append(ev)
                    progress.setdefault(i, []).append((float(ev["t"]), int(ev["bytes"])))
                    break
        stats = producer.ask({"op": "stats"}, 60)
        if stats["nodes"]["soak"]["protocol_violations"]:
            errors.append(f"producer saw {stats['nodes']['soak']['protocol_violations']} "
                          "protocol violations")
    except BenchError as exc:
        errors.append(str(exc))
    finally:
        for w in workers:
            w.close_stdin()
        for w in workers:
            w.stop(30)
    fetch_errors = sum(int(f["errors"]) for f in finals)
    messages = [str(m) for f in finals for m in f.get("messages", [])]
    if len(finals) != consumers and not errors:
        errors.append(f"only {len(finals)} of {consumers} consumers reported")
    verified = len(finals) == consumers and all(f.get("verified") for f in finals)
    total_errors = fetch_errors + len(errors)
    errors += messages
    rows: list[Row] = [Row(f"soak {consumers} consumers, {case.label}", "errors",
                           float(total_errors), None, None, "= 0", total_errors == 0, verified,
                           baseline_kind="-", details={"messages": errors[:10]})]
    for start, stop, nbytes in _buckets(progress, t0, seconds):
        span = max(stop - start, 1e-9)
        rows.append(Row(f"soak throughput {start:.0f}-{stop:.0f} s", "GB/s (all consumers)",
                        nbytes / span / 1e9, None, None, "-", None, verified,
                        baseline_kind="-"))
    a, b, flat = _flat(rss, seconds, lambda first: max(16 * MIB / KIB, 0.05 * first))
    rows.append(Row("soak producer RSS (median), last vs first quarter", "MiB", b / KIB, a / KIB,
                    ratio_of(b, a), "flat (+16 MiB or 5%)", flat, verified,
                    baseline_kind="first quarter"))
    a, b, flat = _flat([(t, v) for t, v in fds], seconds, lambda first: 0.0)
    fd_max_first = max((v for t, v in fds if t < seconds / 4), default=-1)
    fd_max_last = max((v for t, v in fds if t >= 3 * seconds / 4), default=-1)
    rows.append(Row("soak producer open fds, last vs first quarter", "count (max)",
                    float(fd_max_last), float(fd_max_first),
                    ratio_of(fd_max_last, fd_max_first), "flat",
                    fd_max_first >= 0 and fd_max_last <= fd_max_first, verified,
                    baseline_kind="first quarter", details={"median_first": a, "median_last": b}))
    ok = total_errors == 0 and verified
    result = {"version": 1, "mode": "soak", "ok": ok, "errors": errors, "seconds": seconds,
              "consumers": consumers, "machine": machine_info(),
              "samples": {"rss_kib": rss, "fds": fds},
              "cases": [dataclasses.asdict(r) for r in rows]}
    print(f"p2pkv soak ({consumers} consumers, {seconds:g} s)", file=out)
    return report(rows, [f"error: {e}" for e in errors[:10]], result, ok, out, json_path)

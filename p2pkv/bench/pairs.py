"""One comparison of ``p2pkv-node bench``: a baseline and a case, measured alike.

The two sides run alternately, round by round, in ABBA order (a b, b a, a b, ...) so
that drift of a noisy machine hits both alike; each side's figure is the median of its
rounds, and the ratio of the rounds paired in time gives the spread of the ratio itself.
:func:`bulk_pair` moves a dataset per round (after one untimed warm-up round of each
side) and charges CPU time to the processes of each side; :func:`latency_pair` runs
batches of a latency command (lookups, handshakes). Both verify the bytes moved.

What is compared with what, and the figure each case is held to, is in
:mod:`p2pkv.bench.run`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from p2pkv.bench.data import MIB, BenchError, percentile
from p2pkv.bench.worker import Worker


def rounds_for(total: int, per_round: int) -> int:
    return max(1, -(-total // per_round))


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def bulk_timeout(nbytes: int) -> float:
    return 120.0 + nbytes / 20e6


def alternate(rounds: int, a: Callable[[int], None], b: Callable[[int], None]) -> None:
    """a b, b a, a b, ... (ABBA) so linear drift hits both sides alike."""
    for r in range(rounds):
        first, second = (a, b) if r % 2 == 0 else (b, a)
        first(r)
        second(r)


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of every thread of ``pids`` so far (``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / tick


def bulk_pair(name: str, rounds: int, nbytes: int, a: tuple[Worker, str],
              b: tuple[Worker, str], *, pids_a: Sequence[int] = (),
              pids_b: Sequence[int] = ()) -> dict[str, Any]:
    """Alternate bulk rounds of ``a`` (the baseline) and ``b`` (the case) after one
    untimed warm-up round each (first touch of the receiving pages); verify both.
    ``pids_*``: (sender, receiver) processes whose CPU time is charged to that side; the
    receiver's share is reported on its own too: the CPU its process spent in the timed
    fetch when the worker reports it (``cpu``; not the untimed set-up of a round, such
    as discarding the blocks fetched last round), else from ``/proc`` around the whole
    command. GB/s is the median of the rounds."""
    out: dict[str, Any] = {"a_s": [], "b_s": [], "a_bytes": 0, "b_bytes": 0,
                           "a_cpu": 0.0, "b_cpu": 0.0, "a_rx_cpu": 0.0, "b_rx_cpu": 0.0}
    timeout = bulk_timeout(nbytes)

    def side(which: str, worker: Worker, wid: str, pids: Sequence[int],
             timed: bool = True) -> Callable[[int], None]:
        def run(r: int) -> None:
            cpu0, rx0 = cpu_seconds(pids), cpu_seconds(pids[1:])
            reply = worker.ask({"op": "bulk", "id": wid, "clear": r == rounds - 1}, timeout)
            cpu, rx = cpu_seconds(pids) - cpu0, cpu_seconds(pids[1:]) - rx0
            if "cpu" in reply and len(pids) > 1:  # the timed fetch only
                cpu, rx = cpu - rx + float(reply["cpu"]), float(reply["cpu"])
            if int(reply["bytes"]) != nbytes:
                raise BenchError(f"{worker.name} {wid}: round moved {reply['bytes']} of "
                                 f"{nbytes} bytes")
            if timed:
                out[f"{which}_s"].append(float(reply["seconds"]))
                out[f"{which}_bytes"] += int(reply["bytes"])
                out[f"{which}_cpu"] += cpu
                out[f"{which}_rx_cpu"] += rx
        return run

    log(f"{name}: warm-up, then {rounds} alternating rounds of {nbytes / MIB:.0f} MiB "
         "each side")
    side("a", *a, pids_a, timed=False)(-1)
    side("b", *b, pids_b, timed=False)(-1)
    alternate(rounds, side("a", *a, pids_a), side("b", *b, pids_b))
    va = a[0].ask({"op": "verify", "id": a[1]}, 300)
    vb = b[0].ask({"op": "verify", "id": b[1]}, 300)
    out["a_verified"] = va["bad"] == 0 and va["good"] > 0
    out["b_verified"] = vb["bad"] == 0 and vb["good"] > 0
    out["a_extra"] = {k: v for k, v in va.items() if k not in ("good", "bad")}
    for x, pids in (("a", pids_a), ("b", pids_b)):
        gb = out[f"{x}_bytes"] / 1e9
        out[f"{x}_round_gbps"] = [nbytes / s / 1e9 for s in out[f"{x}_s"]]
        out[f"{x}_gbps"] = percentile(out[f"{x}_round_gbps"], 50)
        out[f"{x}_mean_gbps"] = gb / sum(out[f"{x}_s"])
        out[f"{x}_cpu_s_per_gb"] = out[f"{x}_cpu"] / gb if pids else None
        out[f"{x}_rx_cpu_s_per_gb"] = out[f"{x}_rx_cpu"] / gb if len(pids) > 1 else None
    # Ratio of the rounds paired in time (ABBA), for the spread of the ratio itself.
    out["round_ratios"] = [b / a for a, b in zip(out["a_round_gbps"], out["b_round_gbps"],
                                                 strict=True)]
    return out


def spread(res: dict[str, Any]) -> dict[str, Any]:
    """min / median / max of the case's rounds, the baseline's and their paired ratios."""
    def mmm(values: Sequence[float]) -> list[float]:
        return [min(values), percentile(values, 50), max(values)]
    return {"node_gbps": mmm(res["b_round_gbps"]), "baseline_gbps": mmm(res["a_round_gbps"]),
            "ratio": mmm(res["round_ratios"])}


def latency_pair(count: int, batches: int, cmd: dict[str, Any], a: tuple[Worker, str],
                 b: tuple[Worker, str]) -> dict[str, Any]:
    """Alternate batches of a latency command on ``a`` (baseline) and ``b`` (case)."""
    out: dict[str, Any] = {"a_ms": [], "b_ms": [], "a_verified": True, "b_verified": True,
                           "a_bulk_gbps": [], "b_bulk_gbps": []}
    per = max(1, count // batches)

    def side(which: str, worker: Worker, wid: str) -> Callable[[int], None]:
        def run(r: int) -> None:
            reply = worker.ask({**cmd, "id": wid, "count": per}, 600)
            out[f"{which}_ms"] += reply["ms"]
            out[f"{which}_verified"] = out[f"{which}_verified"] and bool(reply["verified"])
            if "bulk_gbps" in reply:
                out[f"{which}_bulk_gbps"].append(reply["bulk_gbps"])
        return run

    alternate(batches, side("a", *a), side("b", *b))
    return out

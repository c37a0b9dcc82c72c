"""``p2pkv-node bench``: every case against its baseline, in one run.

The run: its plan (the sizes, default or ``--quick``), the worker processes it starts
and stops, each row of the table (what each case is compared with and the figure it is
held to) and the result, printed and written as JSON. How one case and its baseline are
measured side by side is :mod:`p2pkv.bench.pairs`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import zmq

from p2pkv.bench.data import (
    BASELINE_KIND,
    BULK_CASES,
    DATA_CHANNEL_PREFIX,
    GIB,
    KERNEL_KIND,
    KERNEL_TARGETS,
    KIB,
    MIB,
    MULTI_PREFIX,
    MULTI_STREAMS,
    NOSUM_CASE,
    RECEIVER_CPU_TARGET,
    SHM_CASES,
    SHM_THREADS,
    SHM_THREADS_PREFIX,
    BenchError,
    BulkCase,
    node_spec,
    percentile,
)
from p2pkv.bench.node_roles import chunk_keys
from p2pkv.bench.pairs import bulk_pair, latency_pair, log, rounds_for, spread
from p2pkv.bench.report import Row, error_row, machine_info, ratio_of, report
from p2pkv.bench.stream_rows import data_channel_rows, multi_stream_rows, nixl_rows
from p2pkv.bench.worker import Worker
from p2pkv.checksum import NATIVE


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (the default or ``--quick``)."""

    quick: bool
    dataset_bytes: int
    bulk_bytes: int
    mem_bytes: int
    curve_bytes: int
    lookup_counts: tuple[tuple[int, int], ...]
    batches: int
    handshakes: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(True, 32 * MIB, 64 * MIB, 128 * MIB, 32 * MIB,
                       ((1000, 20), (10_000, 10)), 2, 20)
        return cls(False, 256 * MIB, 2 * GIB, 4 * GIB, 512 * MIB,
                   ((1000, 200), (10_000, 100)), 4, 200)


def _bench_rows(plan: Plan, workers: dict[str, Worker], cases: Sequence[BulkCase],
                blocks: dict[str, int], curve_ok: bool, skipped: list[str]) -> list[Row]:
    """Every row; what cannot run here is left out, and ``skipped`` says why."""
    if not curve_ok:
        skipped.append("CURVE rows: this libzmq has no CURVE")
    rows = _bulk_rows(plan, workers, cases, blocks)
    rows += data_channel_rows(plan.bulk_bytes, workers, cases, blocks)
    rows += multi_stream_rows(plan.bulk_bytes, workers, cases, blocks)
    rows += nixl_rows(plan.bulk_bytes, workers, cases, blocks, skipped, quick=plan.quick)
    rows += _shm_rows(plan, workers, blocks)
    rows += _other_rows(plan, workers, cases, blocks, curve_ok)
    return rows


def _encrypted_stream_row(plan: Plan, node: Worker, seed: BulkCase, seed_bytes: int,
                          node_pids: tuple[int, int], form: str, label: str,
                          target: str) -> Row:
    """The encrypted data stream of ``form`` against the plaintext one, same run."""
    name = f"CURVE + {label} data stream, {seed.label}, vs plaintext stream"
    try:
        rounds = rounds_for(plan.bulk_bytes, seed_bytes)
        res = bulk_pair(form, rounds, seed_bytes,
                        (node, f"{DATA_CHANNEL_PREFIX}{seed.name}"),
                        (node, f"seed-v2-curve-{form}"), pids_a=node_pids, pids_b=node_pids)
    except BenchError as exc:
        return error_row(name, "fetch GB/s", target, exc)
    ratio = ratio_of(res["b_gbps"], res["a_gbps"])
    met = None if target == "(info)" else ratio is not None and ratio >= 0.6
    return Row(
        name, "fetch GB/s", res["b_gbps"], res["a_gbps"], ratio, target, met,
        res["a_verified"] and res["b_verified"],
        baseline_kind="p2pkv, plaintext data stream",
        details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                 "spread": spread(res),
                 "plain_receiver_cpu_s_per_gb": res["a_rx_cpu_s_per_gb"],
                 f"{form}_receiver_cpu_s_per_gb": res["b_rx_cpu_s_per_gb"],
                 "plain_cpu_s_per_gb": res["a_cpu_s_per_gb"],
                 f"{form}_cpu_s_per_gb": res["b_cpu_s_per_gb"]})


def _bulk_rows(plan: Plan, workers: dict[str, Worker], cases: Sequence[BulkCase],
               blocks: dict[str, int]) -> list[Row]:
    """TCP bulk fetch per geometry, then the receiver's CPU per GB of each."""
    rows: list[Row] = []
    cpu_rows: list[Row] = []
    kernel_rows: list[Row] = []
    raw, node = workers["raw-client"], workers["node-client"]
    raw_pids = (workers["raw-server"].pid, raw.pid)
    node_pids = (workers["node-server"].pid, node.pid)
    for case in cases:
        kernel_rows.append(_kernel_row(plan, workers, case, blocks, node_pids))
        nbytes = blocks[case.name] * case.bytes_per_block
        rounds = rounds_for(plan.bulk_bytes, nbytes)
        metric = "fetch GB/s"
        target = f">= {case.target_ratio:.1f}x raw"
        try:
            res = bulk_pair(f"bulk {case.name}", rounds, nbytes, (raw, case.name),
                            (node, case.name), pids_a=raw_pids, pids_b=node_pids)
            ratio = ratio_of(res["b_gbps"], res["a_gbps"])
            rows.append(Row(
                f"bulk {case.label}", metric, res["b_gbps"], res["a_gbps"], ratio, target,
                ratio is not None and ratio >= case.target_ratio,
                res["a_verified"] and res["b_verified"],
                details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                         "bytes_per_block": case.bytes_per_block, "segments": len(case.segments),
                         "keys_per_fetch": chunk_keys(case.bytes_per_block),
                         "pipelined_fetches": 2, "value": "median of rounds",
                         "node_round_gbps": res["b_round_gbps"],
                         "raw_round_gbps": res["a_round_gbps"], "spread": spread(res),
                         "node_mean_gbps": res["b_mean_gbps"],
                         "raw_mean_gbps": res["a_mean_gbps"],
                         "raw_verified": res["a_verified"], "node_verified": res["b_verified"],
                         "node_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                         "raw_cpu_s_per_gb": res["a_cpu_s_per_gb"]}))
            node_rx, raw_rx = res["b_rx_cpu_s_per_gb"], res["a_rx_cpu_s_per_gb"]
            if not node_rx or not raw_rx:
                continue  # below the clock-tick resolution of /proc (a tiny --quick run)
            rx_ratio = ratio_of(node_rx, raw_rx)
            cpu_rows.append(Row(
                f"receiver CPU, {case.label}", "CPU s per GB", node_rx, raw_rx, rx_ratio,
                f"<= {RECEIVER_CPU_TARGET:.1f}x raw",
                rx_ratio is not None and rx_ratio <= RECEIVER_CPU_TARGET,
                res["a_verified"] and res["b_verified"],
                details={"note": "all threads of the fetching process, over the timed rounds",
                         "node_sender_and_receiver": res["b_cpu_s_per_gb"],
                         "raw_sender_and_receiver": res["a_cpu_s_per_gb"]}))
        except BenchError as exc:
            rows.append(error_row(f"bulk {case.label}", metric, target, exc))
    return rows + kernel_rows + cpu_rows


def _kernel_row(plan: Plan, workers: dict[str, Worker], case: BulkCase,
                blocks: dict[str, int], node_pids: Sequence[int]) -> Row:
    """The node against the kernel's own ceiling (plain sockets, sendmsg gather from the
    pool, recvmsg_into scatter into the receiving pool's slots), in the same run."""
    kernel, node = workers["kernel-client"], workers["node-client"]
    nbytes = blocks[case.name] * case.bytes_per_block
    rounds = rounds_for(plan.bulk_bytes, nbytes)
    target_ratio = KERNEL_TARGETS.get(case.name, 0.9)
    name, metric, target = (f"bulk {case.label} vs kernel", "fetch GB/s",
                            f">= {target_ratio:.1f}x kernel")
    try:
        res = bulk_pair(name, rounds, nbytes, (kernel, case.name), (node, case.name),
                        pids_a=(workers["kernel-server"].pid, kernel.pid), pids_b=node_pids)
    except BenchError as exc:
        return error_row(name, metric, target, exc)
    ratio = ratio_of(res["b_gbps"], res["a_gbps"])
    return Row(name, metric, res["b_gbps"], res["a_gbps"], ratio, target,
               ratio is not None and ratio >= target_ratio,
               res["a_verified"] and res["b_verified"],
               baseline_kind=KERNEL_KIND,
               details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                        "node_round_gbps": res["b_round_gbps"],
                        "kernel_round_gbps": res["a_round_gbps"], "spread": spread(res),
                        "kernel_verified": res["a_verified"],
                        "node_verified": res["b_verified"],
                        "node_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                        "kernel_cpu_s_per_gb": res["a_cpu_s_per_gb"]})


def _shm_rows(plan: Plan, workers: dict[str, Worker], blocks: dict[str, int]) -> list[Row]:
    """Same-host fetches through shared memory against a memcpy of the same bytes."""
    rows: list[Row] = []
    node = workers["node-client"]
    node_pids = (workers["node-server"].pid, node.pid)
    for case in SHM_CASES:
        nbytes = blocks[case.name] * case.bytes_per_block
        rounds = rounds_for(plan.bulk_bytes, nbytes)
        name = f"same-host fetch {case.label}"
        target = f">= {case.target_ratio:.1f}x memcpy"
        try:
            res = bulk_pair(name, rounds, nbytes, (node, f"memcpy-{case.name}"),
                            (node, case.name), pids_b=node_pids)
            ratio = ratio_of(res["b_gbps"], res["a_gbps"])
            rows.append(Row(
                name, "fetch GB/s", res["b_gbps"], res["a_gbps"], ratio, target,
                ratio is not None and ratio >= case.target_ratio,
                res["a_verified"] and res["b_verified"],
                baseline_kind="memcpy of the same bytes, one copy per block, in the "
                              "fetching process",
                details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                         "value": "median of rounds", "data_path": "shm (shm-v1)",
                         "checksums": True, "spread": spread(res),
                         "node_round_gbps": res["b_round_gbps"],
                         "memcpy_round_gbps": res["a_round_gbps"],
                         "memcpy_whole_dataset_gbps": res["a_extra"].get("whole_copy_gbps"),
                         "node_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                         "node_receiver_cpu_s_per_gb": res["b_rx_cpu_s_per_gb"]}))
        except BenchError as exc:
            rows.append(error_row(name, "fetch GB/s", target, exc))
    rows.append(_shm_threads_row(plan, node, node_pids, blocks))
    return rows


def _shm_threads_row(plan: Plan, node: Worker, node_pids: tuple[int, int],
                     blocks: dict[str, int]) -> Row:
    """The same-host fetch copied over ``SHM_THREADS`` threads against one (for the
    record: whether it pays depends on the host's cores and memory bandwidth)."""
    case = SHM_CASES[0]
    nbytes = blocks[case.name] * case.bytes_per_block
    name = f"same-host fetch {case.label}, {SHM_THREADS} copy threads vs 1"
    try:
        res = bulk_pair(name, rounds_for(plan.bulk_bytes, nbytes), nbytes, (node, case.name),
                        (node, f"{SHM_THREADS_PREFIX}{case.name}"), pids_a=node_pids,
                        pids_b=node_pids)
    except BenchError as exc:
        return error_row(name, "fetch GB/s", "(info)", exc)
    return Row(name, "fetch GB/s", res["b_gbps"], res["a_gbps"],
               ratio_of(res["b_gbps"], res["a_gbps"]), "(info)", None,
               res["a_verified"] and res["b_verified"], baseline_kind="one copy thread",
               details={"data_path": "shm (shm-v1)", "native": NATIVE,
                        "threads_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                        "one_thread_cpu_s_per_gb": res["a_cpu_s_per_gb"],
                        "spread": spread(res)})


def _other_rows(plan: Plan, workers: dict[str, Worker], cases: Sequence[BulkCase],
                blocks: dict[str, int], curve_ok: bool) -> list[Row]:
    rows: list[Row] = []
    raw, node = workers["raw-client"], workers["node-client"]
    node_pids = (workers["node-server"].pid, node.pid)
    seed = cases[0]
    seed_bytes = blocks[seed.name] * seed.bytes_per_block

    # -- checksums on vs off (issue 8)
    target = ">= 0.90x off"
    try:
        rounds = rounds_for(plan.bulk_bytes, seed_bytes)
        res = bulk_pair("checksums on/off", rounds, seed_bytes, (node, "seed-v2-nosum"),
                        (node, seed.name), pids_a=node_pids, pids_b=node_pids)
        ratio = ratio_of(res["b_gbps"], res["a_gbps"])
        rows.append(Row(
            f"checksums on vs off, {seed.label}", "fetch GB/s", res["b_gbps"], res["a_gbps"],
            ratio, target, ratio is not None and ratio >= 0.9,
            res["a_verified"] and res["b_verified"], baseline_kind="p2pkv, checksums=False",
            details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                     "cost_fraction": None if ratio is None else 1 - ratio,
                     "off_cpu_s_per_gb": res["a_cpu_s_per_gb"],
                     "on_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                     "note": "the producer hashes a block once and caches it; the "
                             "receiver hashes every block it lands"}))
    except BenchError as exc:
        rows.append(error_row("checksums on vs off", "fetch GB/s", target, exc))

    # -- CURVE
    if curve_ok:
        try:
            rounds = rounds_for(plan.curve_bytes, seed_bytes)
            res = bulk_pair("curve", rounds, seed_bytes, (node, seed.name),
                            (node, "seed-v2-curve"), pids_a=node_pids, pids_b=node_pids)
            rows.append(Row(
                f"CURVE encryption, {seed.label}", "fetch GB/s", res["b_gbps"], res["a_gbps"],
                ratio_of(res["b_gbps"], res["a_gbps"]), "(info)", None,
                res["a_verified"] and res["b_verified"], baseline_kind="p2pkv, plaintext",
                details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                         "plain_cpu_s_per_gb": res["a_cpu_s_per_gb"],
                         "curve_cpu_s_per_gb": res["b_cpu_s_per_gb"]}))
        except BenchError as exc:
            rows.append(error_row("CURVE encryption", "fetch GB/s", "(info)", exc))
        # The encrypted data stream against the plaintext one: sealed (tcp-data-aead-v1,
        # the default, with its target) and TLS 1.3 (tcp-data-tls-v1, for information).
        for form, label, target in (("sealed", "sealed", ">= 0.6x plaintext stream"),
                                    ("tls", "TLS", "(info)")):
            rows.append(_encrypted_stream_row(plan, node, seed, seed_bytes, node_pids,
                                              form, label, target))

    # -- lookups, idle and during a bulk fetch from the same peer
    for during in (False, True):
        for n, count in plan.lookup_counts:
            when = "during bulk fetch" if during else "idle"
            limit = (100.0 if during else 20.0) if n >= 10_000 else None
            case_name = f"lookup {n:,} keys, {when}"
            try:
                log(f"{case_name}: {count} lookups each side")
                res = latency_pair(count, plan.batches,
                                   {"op": "lookup", "n": n, "during_bulk": during},
                                   (raw, seed.name), (node, seed.name))
                verified = res["a_verified"] and res["b_verified"]
                details: dict[str, Any] = {"samples": len(res["b_ms"]),
                                           "keys_held_by_peer": blocks[seed.name]}
                if during:
                    details["node_bulk_gbps_meanwhile"] = res["b_bulk_gbps"]
                    details["raw_bulk_gbps_meanwhile"] = res["a_bulk_gbps"]
                for q in (50, 99):
                    v, bl = percentile(res["b_ms"], q), percentile(res["a_ms"], q)
                    tgt = f"< {limit:.0f} ms" if (limit is not None and q == 99) else "-"
                    met = (v < limit) if (limit is not None and q == 99) else None
                    rows.append(Row(case_name, f"p{q} ms", v, bl, ratio_of(v, bl), tgt, met,
                                    verified, details=details))
            except BenchError as exc:
                rows.append(error_row(case_name, "p99 ms", "-", exc))

    # -- handshake
    try:
        log(f"handshake: {plan.handshakes} connects each side")
        res = latency_pair(plan.handshakes, plan.batches, {"op": "handshake"},
                           (raw, seed.name), (node, seed.name))
        verified = res["a_verified"] and res["b_verified"]
        for q in (50, 99):
            v, bl = percentile(res["b_ms"], q), percentile(res["a_ms"], q)
            rows.append(Row("handshake (connect to ready)", f"p{q} ms", v, bl, ratio_of(v, bl),
                            "< 5 ms" if q == 50 else "-", (v < 5.0) if q == 50 else None,
                            verified, baseline_kind="raw pyzmq connect + one ping",
                            details={"samples": len(res["b_ms"])}))
    except BenchError as exc:
        rows.append(error_row("handshake (connect to ready)", "p50 ms", "< 5 ms", exc))

    # -- receiver peak RSS while moving mem_bytes
    mem_name = f"receiver peak RSS, {plan.mem_bytes / GIB:g} GiB moved"
    try:
        rounds = rounds_for(plan.mem_bytes, seed_bytes)
        res = bulk_pair("memory", rounds, seed_bytes, (workers["mem-raw"], seed.name),
                        (workers["mem-node"], seed.name))
        mn = workers["mem-node"].ask({"op": "mem"}, 60)
        mr = workers["mem-raw"].ask({"op": "mem"}, 60)
        grow_n = (mn["VmHWM"] - mn["rss_before_kib"]) / KIB
        grow_r = (mr["VmHWM"] - mr["rss_before_kib"]) / KIB
        pool_mib = mn["pool_bytes"] / MIB
        rows.append(Row(
            mem_name, "MiB over pre-pool RSS", grow_n, grow_r, ratio_of(grow_n, grow_r),
            f"<= pool {pool_mib:.0f} + 100 MiB", grow_n <= pool_mib + 100,
            res["a_verified"] and res["b_verified"],
            baseline_kind="raw pyzmq receiver, same buffer size",
            details={"node_vmhwm_mib": mn["VmHWM"] / KIB,
                     "node_rss_before_pool_mib": mn["rss_before_kib"] / KIB,
                     "raw_vmhwm_mib": mr["VmHWM"] / KIB,
                     "raw_rss_before_buffers_mib": mr["rss_before_kib"] / KIB,
                     "pool_mib": pool_mib, "bytes_moved": res["b_bytes"],
                     "node_gbps": res["b_gbps"], "raw_gbps": res["a_gbps"],
                     "note": "the RSS before the pool includes the interpreter, torch and "
                             "numpy (the node imports torch for its pool)"}))
    except BenchError as exc:
        rows.append(error_row(mem_name, "MiB over pre-pool RSS", "<= pool + 100 MiB", exc))
    return rows


def spread_lines(rows: Sequence[Row]) -> list[str]:
    """The spread of every bulk row over its rounds (GB/s min / median / max)."""
    lines = []
    for r in rows:
        sp = r.details.get("spread")
        if not sp:
            continue
        n, b, q = sp["node_gbps"], sp["baseline_gbps"], sp["ratio"]
        lines.append(f"spread {r.case}: p2pkv {n[0]:.3g} / {n[1]:.3g} / {n[2]:.3g}, "
                     f"baseline {b[0]:.3g} / {b[1]:.3g} / {b[2]:.3g}, paired ratio "
                     f"{q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} (min / median / max)")
    if lines:
        lines.insert(0, "")
    return lines


def run_bench(*, quick: bool = False, json_path: str | None = None,
              out: IO[str] | None = None, plot_path: str | None = None) -> int:
    """Run every case; print the table; return 0 iff every case ran and verified."""
    out = out or sys.stdout
    plan = Plan.make(quick)
    cases = BULK_CASES
    blocks = {c.name: max(4, plan.dataset_bytes // c.bytes_per_block)
              for c in (*cases, *SHM_CASES)}
    seed = cases[0]
    curve_ok = bool(zmq.has("curve"))
    hwm = 16
    t_start = time.perf_counter()

    server_nodes = [node_spec(c.name, c, blocks[c.name]) for c in cases]
    client_nodes = [node_spec(c.name, c, blocks[c.name], server=c.name) for c in cases]
    client_nodes.append(node_spec("seed-v2-nosum", seed, blocks[seed.name], checksums=False,
                                  server=seed.name))
    client_nodes += [node_spec(f"{DATA_CHANNEL_PREFIX}{c.name}", c, blocks[c.name],
                               data_channel=True, server=c.name) for c in cases]
    client_nodes += [node_spec(f"{DATA_CHANNEL_PREFIX}nosum-{c.name}", c, blocks[c.name],
                               data_channel=True, checksums=False, server=c.name)
                     for c in cases if c.name == NOSUM_CASE]
    client_nodes += [node_spec(f"{MULTI_PREFIX}{c.name}", c, blocks[c.name], data_channel=True,
                               data_streams=MULTI_STREAMS, server=c.name)
                     for c in cases if c.name == NOSUM_CASE]
    for c in SHM_CASES:
        server_nodes.append(node_spec(c.name, c, blocks[c.name], shm=True))
        client_nodes.append(node_spec(c.name, c, blocks[c.name], shm=True, server=c.name))
    shm_seed = SHM_CASES[0]
    client_nodes.append(node_spec(f"{SHM_THREADS_PREFIX}{shm_seed.name}", shm_seed,
                                  blocks[shm_seed.name], shm=True,
                                  shm_copy_threads=SHM_THREADS, server=shm_seed.name))
    memcpy = [{"id": f"memcpy-{c.name}", "bytes": blocks[c.name] * c.bytes_per_block,
               "bytes_per_block": c.bytes_per_block} for c in SHM_CASES]
    if curve_ok:
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        server_nodes.append(node_spec("seed-v2-curve", seed, blocks[seed.name], curve={
            "public": spub.decode(), "secret": ssec.decode()}))
        client_nodes.append(node_spec("seed-v2-curve", seed, blocks[seed.name], curve={
            "public": cpub.decode(), "secret": csec.decode(), "server_key": spub.decode()},
            server="seed-v2-curve"))
        for form in ("sealed", "tls"):
            client_nodes.append(node_spec(
                f"seed-v2-curve-{form}", seed, blocks[seed.name], curve={
                    "public": cpub.decode(), "secret": csec.decode(),
                    "server_key": spub.decode()},
                data_channel=True, data_encryption=form, server="seed-v2-curve"))
    raw_sets = [{"name": c.name, "segments": list(c.segments), "blocks": blocks[c.name]}
                for c in cases]

    workers: dict[str, Worker] = {}
    rows: list[Row] = []
    errors: list[str] = []
    skipped: list[str] = []
    server_stats: dict[str, Any] = {}
    try:
        log("starting servers")
        workers["node-server"] = Worker("node-server", "node-server", {"nodes": server_nodes})
        workers["raw-server"] = Worker("raw-server", "raw-server",
                                       {"datasets": raw_sets, "hwm": hwm})
        workers["kernel-server"] = Worker("kernel-server", "kernel-server",
                                          {"datasets": raw_sets})
        addresses = workers["node-server"].next(300)["addresses"]
        raw_address = workers["raw-server"].next(300)["address"]
        kernel_address = workers["kernel-server"].next(300)["address"]
        for spec in client_nodes:
            spec["address"] = addresses[spec["server"]]
        log("starting clients")
        workers["node-client"] = Worker("node-client", "node-client",
                                        {"nodes": client_nodes, "memcpy": memcpy})
        workers["raw-client"] = Worker("raw-client", "raw-client",
                                       {"datasets": raw_sets, "hwm": hwm, "address": raw_address})
        workers["kernel-client"] = Worker("kernel-client", "kernel-client",
                                          {"datasets": raw_sets, "address": kernel_address})
        workers["mem-node"] = Worker("mem-node", "node-client",
                                     {"nodes": [n for n in client_nodes if n["id"] == seed.name]})
        workers["mem-raw"] = Worker("mem-raw", "raw-client", {
            "datasets": [d for d in raw_sets if d["name"] == seed.name], "hwm": hwm,
            "address": raw_address})
        for name in ("node-client", "raw-client", "kernel-client", "mem-node", "mem-raw"):
            workers[name].next(300)
        rows = _bench_rows(plan, workers, cases, blocks, curve_ok, skipped)
        server_stats = {"node-server": workers["node-server"].ask({"op": "stats"}, 60),
                        "raw-server": workers["raw-server"].ask({"op": "stats"}, 60)}
    except BenchError as exc:
        errors.append(str(exc))
    finally:
        for w in workers.values():
            w.close_stdin()
        for name, w in workers.items():
            rc = w.stop(30)
            if rc not in (0, None) and not errors:
                errors.append(f"{name} exited with {rc}: {w.stderr_tail()}")
    elapsed = time.perf_counter() - t_start

    rows_failed = [r for r in rows if r.error or not r.verified]
    ok = not errors and not rows_failed and bool(rows)
    result = {
        "version": 1, "mode": "quick" if quick else "full", "ok": ok, "errors": errors,
        "skipped": skipped, "seconds": elapsed, "machine": machine_info(),
        "baseline": BASELINE_KIND, "plan": dataclasses.asdict(plan), "server_stats": server_stats,
        "cases": [dataclasses.asdict(r) for r in rows],
    }
    print(f"p2pkv bench ({result['mode']}, {elapsed:.0f} s) -- baseline: {BASELINE_KIND}",
          file=out)
    lines = spread_lines(rows)
    lines += [f"skipped: {s}" for s in skipped]
    lines += [f"error: {e}" for e in errors]
    lines += [f"failed: {r.case} {r.metric}: {r.error or 'bytes not verified'}"
              for r in rows_failed]
    if plot_path is not None and rows:
        from p2pkv.bench.plot import plot_rows

        try:
            cpus = os.cpu_count() or "?"
            result["plot"] = plot_rows(rows, plot_path, title=(
                f"p2pkv bench ({result['mode']}), {cpus} CPUs, one run"))
            lines.append(f"plot: {plot_path}")
        except ValueError as exc:
            lines.append(f"plot: not drawn: {exc}")
    return report(rows, lines, result, ok, out, json_path)

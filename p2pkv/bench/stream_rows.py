"""The data stream's rows of ``p2pkv-node bench``: the stream against the kernel's
ceiling for every layout (``tcp-data-v1``), and several streams against one
(``tcp-streams-v1``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from p2pkv.bench.data import (
    DATA_CHANNEL_PREFIX,
    KERNEL_CPU_TARGETS,
    KERNEL_KIND,
    KERNEL_TARGETS,
    MULTI_PREFIX,
    MULTI_STREAMS,
    NOSUM_CASE,
    BenchError,
    BulkCase,
)
from p2pkv.bench.pairs import bulk_pair, rounds_for, spread
from p2pkv.bench.report import Row, error_row, ratio_of
from p2pkv.bench.worker import Worker

__all__ = ["data_channel_rows", "multi_stream_rows"]


def data_channel_rows(bulk_bytes: int, workers: dict[str, Worker],
                      cases: Sequence[BulkCase], blocks: dict[str, int]) -> list[Row]:
    """The data channel (tcp-data-v1: plain TCP beside ZeroMQ, sendmsg from the pool,
    recvmsg_into the slots, checksums on) against the kernel's ceiling, every layout;
    then, for the seed V1 layout, the same with checksums off (what the checksum costs
    on this path); then the receiver's CPU per GB against the ceiling's receiver, every
    layout, measured in the same rounds."""
    rows: list[Row] = []
    cpu_rows: list[Row] = []
    kernel, node = workers["kernel-client"], workers["node-client"]
    kernel_pids = (workers["kernel-server"].pid, kernel.pid)
    node_pids = (workers["node-server"].pid, node.pid)
    runs = [(case, f"{DATA_CHANNEL_PREFIX}{case.name}", True) for case in cases]
    runs += [(c, f"{DATA_CHANNEL_PREFIX}nosum-{c.name}", False) for c in cases
             if c.name == NOSUM_CASE]
    for case, client_id, checksums in runs:
        nbytes = blocks[case.name] * case.bytes_per_block
        rounds = rounds_for(bulk_bytes, nbytes)
        target_ratio = KERNEL_TARGETS.get(case.name, 0.9)
        off = "" if checksums else ", checksums off"
        name = f"bulk {case.label} on the data channel{off} vs kernel"
        target = f">= {target_ratio:.1f}x kernel" if checksums else "(info)"
        try:
            res = bulk_pair(name, rounds, nbytes, (kernel, case.name), (node, client_id),
                            pids_a=kernel_pids, pids_b=node_pids)
        except BenchError as exc:
            rows.append(error_row(name, "fetch GB/s", target, exc))
            continue
        ratio = ratio_of(res["b_gbps"], res["a_gbps"])
        rows.append(Row(
            name, "fetch GB/s", res["b_gbps"], res["a_gbps"], ratio, target,
            (ratio is not None and ratio >= target_ratio) if checksums else None,
            res["a_verified"] and res["b_verified"], baseline_kind=KERNEL_KIND,
            details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                     "data_path": "tcp-data (tcp-data-v1)", "checksums": checksums,
                     "value": "median of rounds", "spread": spread(res),
                     "node_round_gbps": res["b_round_gbps"],
                     "kernel_round_gbps": res["a_round_gbps"],
                     "kernel_verified": res["a_verified"],
                     "node_verified": res["b_verified"],
                     "node_cpu_s_per_gb": res["b_cpu_s_per_gb"],
                     "node_receiver_cpu_s_per_gb": res["b_rx_cpu_s_per_gb"],
                     "kernel_cpu_s_per_gb": res["a_cpu_s_per_gb"],
                     "kernel_receiver_cpu_s_per_gb": res["a_rx_cpu_s_per_gb"]}))
        if checksums:
            cpu_rows.append(_receiver_cpu_row(case, res))
    return rows + cpu_rows


def _receiver_cpu_row(case: BulkCase, res: dict[str, Any]) -> Row:
    """The data stream's receiver CPU per GB against the kernel ceiling's receiver."""
    limit = KERNEL_CPU_TARGETS.get(case.name, 1.3)
    node_rx, kernel_rx = res["b_rx_cpu_s_per_gb"], res["a_rx_cpu_s_per_gb"]
    ratio = ratio_of(node_rx, kernel_rx)
    return Row(
        f"receiver CPU on the data channel, {case.label}, vs kernel", "CPU s per GB",
        node_rx, kernel_rx, ratio, f"<= {limit:.1f}x kernel",
        ratio is not None and ratio <= limit, res["a_verified"] and res["b_verified"],
        baseline_kind=KERNEL_KIND,
        details={"note": "all threads of the fetching process, over the timed rounds; "
                         "checksums on (the kernel ceiling hashes nothing)",
                 "node_sender_and_receiver": res["b_cpu_s_per_gb"],
                 "kernel_sender_and_receiver": res["a_cpu_s_per_gb"]})


def multi_stream_rows(bulk_bytes: int, workers: dict[str, Worker],
                      cases: Sequence[BulkCase], blocks: dict[str, int]) -> list[Row]:
    """Several data streams per peer (tcp-streams-v1) against one, on loopback, where no
    flow is capped: N streams must be no slower than one (a capped link, where they are
    faster, is ``tests/test_streams.py``'s)."""
    node = workers["node-client"]
    pids = (workers["node-server"].pid, node.pid)
    rows: list[Row] = []
    for case in [c for c in cases if c.name == NOSUM_CASE]:
        nbytes = blocks[case.name] * case.bytes_per_block
        rounds = rounds_for(bulk_bytes, nbytes)
        name = f"bulk {case.label} on {MULTI_STREAMS} data streams vs 1"
        try:
            res = bulk_pair(name, rounds, nbytes, (node, f"{DATA_CHANNEL_PREFIX}{case.name}"),
                            (node, f"{MULTI_PREFIX}{case.name}"), pids_a=pids, pids_b=pids)
        except BenchError as exc:
            rows.append(error_row(name, "fetch GB/s", ">= 1.0x one stream", exc))
            continue
        ratio = ratio_of(res["b_gbps"], res["a_gbps"])
        rows.append(Row(
            name, "fetch GB/s", res["b_gbps"], res["a_gbps"], ratio, ">= 1.0x one stream",
            ratio is not None and ratio >= 1.0, res["a_verified"] and res["b_verified"],
            baseline_kind="p2pkv on one data stream",
            details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                     "streams": MULTI_STREAMS, "value": "median of rounds",
                     "spread": spread(res), "streams_round_gbps": res["b_round_gbps"],
                     "one_stream_round_gbps": res["a_round_gbps"],
                     "node_receiver_cpu_s_per_gb": res["b_rx_cpu_s_per_gb"],
                     "one_stream_receiver_cpu_s_per_gb": res["a_rx_cpu_s_per_gb"]}))
    return rows

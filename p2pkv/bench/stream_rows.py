"""The data stream's rows of ``p2pkv-node bench``: the stream against the kernel's
ceiling for every layout (``tcp-data-v1``), several streams against one
(``tcp-streams-v1``), and blocks READ one-sided out of the holder's pool through NIXL
(``nixl-v1``) against the stream of the same case.

The NIXL rows take two transports of UCX, each a row per case: TCP on loopback
(``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=lo``: the transport RDMA verbs replace on a real
fabric; UCX emulates the READ with messages the holder's exporter thread answers), and
UCX's own choice between two processes of one host (``UCX_TLS`` unset: CMA,
``process_vm_readv``, no holder CPU per READ). A node's transport is its spec's
``ucx_env``, in force while the node (and with it its NIXL agents) is made. Each (case,
transport) has a pair of worker processes of its own, a holder and a reader with one
node each, started for its row and stopped after it: every node NIXL is on keeps an
exporter thread polling its agent, so none lives beside the other rows' nodes, and the
holder's CPU (its whole process) is that row's. The baseline is the stream the
data-channel rows measure (``node-server`` to ``node-client``). Where NIXL cannot be
used, the NIXL rows are left out and the run says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
    node_spec,
)
from p2pkv.bench.pairs import bulk_pair, log, rounds_for, spread
from p2pkv.bench.report import Row, error_row, ratio_of
from p2pkv.bench.worker import Worker
from p2pkv.nixl import unavailable_reason

__all__ = ["NIXL_CASES", "NIXL_TRANSPORTS", "NixlTransport", "data_channel_rows",
           "multi_stream_rows", "nixl_rows"]


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


NIXL_CASES = ("seed-v2", "llama3-8b-v2")
"""The cases (of ``BULK_CASES``) READ through NIXL."""
_NIXL_PREFIX = "nixl-"
"""Node ids of the NIXL rows: this prefix, the transport's key, the case's name."""


@dataclass(frozen=True)
class NixlTransport:
    """One UCX transport of the NIXL rows."""

    key: str
    #: The row's name without the case's label.
    title: str
    #: What the row's details say moved the bytes.
    transport: str
    #: The environment both nodes are made in (None: unset).
    ucx_env: dict[str, str | None]


NIXL_TRANSPORTS: tuple[NixlTransport, ...] = (
    NixlTransport("tcp", "NIXL read over UCX TCP", "UCX tcp on loopback",
                  {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}),
    NixlTransport("cma", "NIXL read, same host (UCX default: CMA)", "UCX same-host (cma)",
                  {"UCX_TLS": None, "UCX_NET_DEVICES": None}),
)

_NIXL_TARGET = "(info)"


def nixl_row_name(t: NixlTransport, case: BulkCase) -> str:
    return f"{t.title} {case.label}"


def nixl_rows(bulk_bytes: int, workers: dict[str, Worker], cases: Sequence[BulkCase],
              blocks: dict[str, int], skipped: list[str], *, quick: bool = False
              ) -> list[Row]:
    """Every NIXL row (``quick``: the first case's, per transport), or none where NIXL
    cannot be used here (``skipped`` then says why). The workers started go into
    ``workers`` (so that the run reports how they exited) and are stopped as soon as
    their row is measured."""
    why = unavailable_reason()
    if why is not None:
        skipped.append(f"NIXL rows: {why}")
        return []
    rows: list[Row] = []
    for t in NIXL_TRANSPORTS:
        for case in [c for c in cases if c.name in NIXL_CASES[:1 if quick else None]]:
            rows.append(_nixl_row(bulk_bytes, workers, case, blocks[case.name], t))
    return rows


def _nixl_row(bulk_bytes: int, workers: dict[str, Worker], case: BulkCase, nblocks: int,
              t: NixlTransport) -> Row:
    name, node_id = nixl_row_name(t, case), f"{_NIXL_PREFIX}{t.key}-{case.name}"
    nbytes = nblocks * case.bytes_per_block
    rounds = rounds_for(bulk_bytes, nbytes)
    spec = node_spec(node_id, case, nblocks, nixl="on", ucx_env=t.ucx_env)
    try:
        log(f"{name}: starting its holder and reader")
        server = workers[f"{node_id}-server"] = Worker(f"{node_id}-server", "node-server",
                                                       {"nodes": [spec]})
        address = server.next(300)["addresses"][node_id]
        reader = workers[f"{node_id}-client"] = Worker(
            f"{node_id}-client", "node-client",
            {"nodes": [{**spec, "server": node_id, "address": address}]})
        reader.next(300)
        stream = workers["node-client"]
        res = bulk_pair(name, rounds, nbytes, (stream, f"{DATA_CHANNEL_PREFIX}{case.name}"),
                        (reader, node_id), pids_a=(workers["node-server"].pid, stream.pid),
                        pids_b=(server.pid, reader.pid))
    except BenchError as exc:
        return error_row(name, "fetch GB/s", _NIXL_TARGET, exc)
    finally:
        for role in ("client", "server"):
            if f"{node_id}-{role}" in workers:
                workers[f"{node_id}-{role}"].stop(30)
    return Row(
        name, "fetch GB/s", res["b_gbps"], res["a_gbps"], ratio_of(res["b_gbps"], res["a_gbps"]),
        _NIXL_TARGET, None, res["a_verified"] and res["b_verified"],
        baseline_kind="p2pkv, data stream (tcp-data-v1) of the same case",
        details={"rounds": rounds, "bytes_per_side": res["b_bytes"],
                 "data_path": "nixl (nixl-v1)", "transport": t.transport,
                 "ucx_env": t.ucx_env, "checksums": True, "value": "median of rounds",
                 "spread": spread(res), "nixl_round_gbps": res["b_round_gbps"],
                 "stream_round_gbps": res["a_round_gbps"],
                 "nixl_verified": res["b_verified"], "stream_verified": res["a_verified"],
                 **_cpu(res, "b", "nixl"), **_cpu(res, "a", "stream"),
                 "note": "holder: the serving process, all threads, over each timed "
                         "round's whole command (NIXL: its exporter thread polls its agent "
                         "every 0.5 ms); reader: the fetching process, all threads, over "
                         "each timed fetch"})


def _cpu(res: dict[str, Any], side: str, label: str) -> dict[str, float | None]:
    """The holder's and the reader's CPU seconds per GB of one side of ``bulk_pair``."""
    both, reader = res[f"{side}_cpu_s_per_gb"], res[f"{side}_rx_cpu_s_per_gb"]
    # both - reader is the serving process's share (max: the float rounding of a zero).
    holder = None if both is None or reader is None else max(0.0, both - reader)
    return {f"{label}_holder_cpu_s_per_gb": holder, f"{label}_reader_cpu_s_per_gb": reader}

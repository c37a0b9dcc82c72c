"""Fetch rounds of one bench layout between two fresh processes, for A/B runs and profiles.

    python tools/fetch_rounds.py CASE ROUNDS {shm,data,tcp} [--mib 256] [--threads N]
                                 [--python-copy] [--python-scatter] [--no-checksums]

CASE is a bench case (``seed-v1``, ``small-16k``, ``shm-seed-v2``, ...). A producer
process holds ``--mib`` MiB of the case's blocks; this process is the consumer, and
fetches them all back ``ROUNDS`` times after one warm-up round (the bench's
``fetch_round``: every block discarded first, 64 MiB per fetch, two in flight). It prints
one JSON line: the median GB/s and the median consumer CPU s/GB (all its threads).
``--python-copy`` runs the same-host copy in Python even where ``p2pkv._fastcopy`` was
built, and ``--python-scatter`` receives a data stream with the Python ``Scatter``
(no hashing as blocks land); ``--threads`` sets ``shm_copy_threads``. Run it under
``py-spy record`` to see where the consumer's time goes; alternate two settings in one
sitting to compare them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from typing import Any

from p2pkv import checksum
from p2pkv.bench.data import BULK_CASES, SHM_CASES, BulkCase, Dataset
from p2pkv.bench.node_roles import ClientNode, chunk_keys, fetch_round, make_node
from p2pkv.bench.run import node_spec
from p2pkv.transport import datachannel


def case_of(name: str) -> BulkCase:
    for case in (*BULK_CASES, *SHM_CASES):
        if case.name == name:
            return case
    raise SystemExit(f"no bench case {name!r}: "
                     f"{', '.join(c.name for c in (*BULK_CASES, *SHM_CASES))}")


def producer(spec: dict[str, Any], ready: Any, stop: Any) -> None:
    ds = Dataset(spec["dataset"], spec["segments"], spec["blocks"])
    node = make_node({**spec, "data_channel": True}, pool_blocks=ds.blocks)
    try:
        for i, key in enumerate(ds.keys):
            node.put(key, ds.block(i))
        ready.put(node.address)
        stop.wait(600)
    finally:
        node.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case")
    ap.add_argument("rounds", type=int)
    ap.add_argument("path", choices=("shm", "data", "tcp"))
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--python-copy", action="store_true")
    ap.add_argument("--python-scatter", action="store_true")
    ap.add_argument("--no-checksums", action="store_true")
    args = ap.parse_args()
    if args.python_copy:
        checksum._native_copy = None
        checksum.NATIVE = False
    if args.python_scatter:
        datachannel.NATIVE_SCATTER = False
    case = case_of(args.case)
    blocks = (args.mib << 20) // case.bytes_per_block
    extra: dict[str, Any] = {"shm": True} if args.path == "shm" else (
        {"data_channel": True} if args.path == "data" else {})
    spec = node_spec(case.name, case, blocks, shm_copy_threads=args.threads, **extra)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=producer, args=(spec, ready, stop))
    proc.start()
    try:
        address = ready.get(timeout=300)
        node = make_node(spec, pool_blocks=blocks, checksums=not args.no_checksums)
        try:
            peer = node.connect(address, timeout=30)
            if peer.data_path != {"shm": "shm", "data": "tcp-data", "tcp": "tcp"}[args.path]:
                raise SystemExit(f"blocks move by {peer.data_path}: {peer.data_path_detail}")
            ds = Dataset(spec["dataset"], spec["segments"], blocks)
            client = ClientNode(node, peer, ds, address, chunk_keys(ds.bpb))
            fetch_round(client)  # warm-up: first touch of the receiving pages
            gbps, cpu = [], []
            for _ in range(args.rounds):
                seconds, moved, cpu_s = fetch_round(client)
                gbps.append(moved / seconds / 1e9)
                cpu.append(cpu_s / (moved / 1e9))
        finally:
            node.close()
    finally:
        stop.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    print(json.dumps({"case": case.name, "path": args.path, "threads": args.threads,
                      "scatter": "native" if datachannel.NATIVE_SCATTER else "python",
                      "copy": "python" if args.python_copy or not checksum.NATIVE
                      else checksum.NATIVE_VARIANT,
                      "gbps": round(statistics.median(gbps), 3),
                      "cpu_s_per_gb": round(statistics.median(cpu), 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

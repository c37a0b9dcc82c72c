#!/usr/bin/env python3
"""Live fuzzer for a p2pkv node (outside CI): the hostile-input test, for minutes.

Starts a serving node in this process, connects a well-behaved peer that keeps doing
lookups and byte-exact fetches in a background thread, and throws Hypothesis-generated
examples (``tests/fuzzkit.py``: raw frames, and handshaken sessions of random/valid
messages) at the node over raw DEALER sockets, batch after batch, until ``--seconds``
have passed. Every reply is decoded and checked (see ``tests/fuzzkit.py``); a failing
example is shrunk by Hypothesis and printed. Ends with a summary.

Usage::

    .venv/bin/python tools/fuzz_node.py --seconds 300 [--geometry small|seed] [--batch 500]

Exit status: 0 when nothing went wrong, 1 when an example failed or the good peer saw
an error.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzzkit import Exerciser, examples
from hypothesis import HealthCheck, Phase, given, settings
from nodeproc import content, keys_for, make_node
from rawpeer import GoodPeer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to fuzz")
    parser.add_argument("--batch", type=int, default=500, help="examples per batch")
    parser.add_argument("--geometry", default="small", choices=["small", "seed"])
    parser.add_argument("--blocks", type=int, default=8, help="blocks the node serves")
    args = parser.parse_args(argv)

    spec = {"layout": "v2", "geometry": args.geometry, "blocks": args.blocks}
    server = make_node(spec)
    client = make_node({**spec, "blocks": 2})
    keys = keys_for(args.blocks)
    for k in keys:
        server.put(k, content(k, server.layout.bytes_per_block))
    good = GoodPeer(client, server.address, keys, pause=0.05)
    exerciser = Exerciser(server)
    failure: BaseException | None = None
    batches = 0
    t0 = time.monotonic()

    @settings(max_examples=args.batch, deadline=None, database=None,
              phases=[Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(examples(keys))
    def batch(example: object) -> None:
        exerciser.run(example)  # type: ignore[arg-type]

    try:
        while time.monotonic() - t0 < args.seconds:
            try:
                batch()
            except BaseException as exc:  # the shrunk failing example is printed above
                failure = exc
                break
            batches += 1
            done = sum(v for k, v in exerciser.stats.items() if k.startswith("example:"))
            print(f"[{time.monotonic() - t0:7.1f}s] {done} examples, good peer "
                  f"{good.rounds} rounds, {len(good.errors)} errors", flush=True)
    finally:
        rounds = good.stop()
        alive = server._thread.is_alive()
        stats = server.stats()
        exerciser.close()
        client.close(timeout=2.0)
        server.close(timeout=2.0)

    print("\n=== fuzz_node summary ===")
    print(f"seconds: {time.monotonic() - t0:.1f}  batches: {batches}")
    for key, value in sorted(exerciser.stats.items()):
        print(f"  {key:<20} {value}")
    print(f"node: IO thread alive={alive} protocol_violations={stats.protocol_violations} "
          f"handshakes_accepted={stats.handshakes_accepted} "
          f"lookups_served={stats.lookups_served} blocks_sent={stats.blocks_sent}")
    print(f"good peer: {rounds} rounds, {len(good.errors)} errors")
    for err in good.errors[:10]:
        print(f"  ! {err}")
    if failure is not None:
        print(f"FAILED: {type(failure).__name__}: {failure}"[:2000])
    ok = failure is None and not good.errors and alive and rounds > 0
    print("RESULT:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

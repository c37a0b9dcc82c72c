"""``p2pkv-node bench``: p2pkv measured side by side with raw pyzmq, in one run.

Every case is measured against a baseline taken in the same invocation, and the
baseline and the case alternate round by round (ABBA order) so that drift of a noisy
machine hits both. Compare the *ratios*; absolute numbers move from run to run.

Processes (all on 127.0.0.1, all started with :mod:`subprocess`, every wait bounded,
every child killed in a ``finally`` block):

* ``node-server``: one p2pkv :class:`~p2pkv.node.Node` per dataset, holding the blocks.
* ``node-client``: the matching fetching nodes (plus lookup and handshake loops).
* ``raw-server`` / ``raw-client``: the baseline. A bound ROUTER streams the *same frames*
  the node sends (blocks batched up to 1 MiB per message, ``copy=False`` for frames of
  at least 64 KiB, a plain copying send below) to a connected DEALER that
  ``recv_into``-s preallocated buffers. One request per round; no flow control beyond
  the high-water mark; no send tracking.
* ``mem-*``: fresh receiving processes whose peak RSS is read after moving 4 GiB.

Each worker speaks JSON lines: the parent writes one command per line on its stdin and
reads one reply per line from its stdout; closing stdin stops it (``p2pkv.workers``).
Workers are run as ``python -m p2pkv.bench ROLE SPEC_JSON``.

Block content is deterministic and position dependent (a random pattern XOR a
per-key salt), so a misplaced segment, a block landing in the wrong slot or a
stale slot is detected; every dataset is verified after the timed section.

Modules: ``data`` (cases, datasets, shared measuring helpers), ``node_roles`` and
``raw_roles`` (the worker processes), ``worker`` (roles by name, the parent's handle on
a worker), ``run`` (the comparison run), ``pairs`` (one case against its baseline,
round by round), ``soak``, ``report`` (rows, table, JSON). The node's own batching and
zero-copy threshold come from ``p2pkv.protocol.flow`` and ``p2pkv.runtime.tuning``, so
the baseline sends the same frames the node does.
"""

from __future__ import annotations

from p2pkv.bench.data import BASELINE_KIND
from p2pkv.bench.report import Row
from p2pkv.bench.run import run_bench
from p2pkv.bench.soak import run_soak
from p2pkv.bench.worker import main_worker

__all__ = ["BASELINE_KIND", "Row", "main_worker", "run_bench", "run_soak"]

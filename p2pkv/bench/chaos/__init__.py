"""``p2pkv-node chaos``: a bounded fault-injection run with figures.

Modules: ``proxy`` (a TCP relay that flips bits or stalls), ``holders`` (the ``serve``
processes and the resources watched for leaks), ``faults`` (the fault kinds), ``netns``
(the partition's namespaces, link and relays), ``run`` (consumers, schedule, figures).
See docs/reliability.md for what it shows.
"""

from __future__ import annotations

from p2pkv.bench.chaos.run import run_chaos

__all__ = ["run_chaos"]

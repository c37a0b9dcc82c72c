"""pending-v1's timing rules (SPEC §19), once for every side that keeps pending keys: a
node's own (:mod:`p2pkv.runtime.pending`), the vLLM tier's before its node is up, and
the Redis directory's (:mod:`p2pkv.cluster.pending`, whose script is given these
constants).

An announced estimate is kept at least :data:`MIN_ESTIMATE` (the announcement outlives
its answer's round trip) and at most what a ``due`` can say; a key stops being reported
pending once overdue by its estimate, and at least :data:`MIN_OVERDUE` (rule 4).

No IO (pure).
"""

from __future__ import annotations

import math
from typing import Final

from p2pkv.protocol.codes import MAX_DUE_MS

__all__ = ["MAX_ESTIMATE", "MIN_ESTIMATE", "MIN_OVERDUE", "estimate", "lease_end"]

#: The shortest estimate kept (seconds).
MIN_ESTIMATE: Final = 0.05
#: The longest (seconds): the most a ``due`` says, in milliseconds.
MAX_ESTIMATE: Final = MAX_DUE_MS / 1000
#: A key overdue by its estimate, and at least this (seconds), is forgotten. An engine
#: cannot renew an estimate in the middle of a forward pass, and one prefill can be a
#: single pass of seconds that a rate measured on other prompts underestimates.
MIN_OVERDUE: Final = 10.0


def estimate(seconds: float) -> float:
    """An estimate as it is kept: within [:data:`MIN_ESTIMATE`, :data:`MAX_ESTIMATE`]
    (NaN: the least)."""
    value = float(seconds)
    if math.isnan(value):
        return MIN_ESTIMATE
    return min(max(value, MIN_ESTIMATE), MAX_ESTIMATE)


def lease_end(now: float, seconds: float) -> float:
    """When a key announced at ``now`` as due in ``seconds`` stops being reported pending
    unless it is announced again: once overdue by its estimate, and at least
    :data:`MIN_OVERDUE` (SPEC §19 rule 4)."""
    return now + seconds + max(seconds, MIN_OVERDUE)

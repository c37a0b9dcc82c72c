"""The load policy of a :class:`~p2pkv.integrations.vllm.P2PKVTier` (see
:mod:`p2pkv.integrations.vllm.loadpolicy`): fed by the tier's own hooks, applied to its
lookups, counted in its metrics and written to its log.

- the **lookup thread** asks :meth:`TierLoads.advise` for each step's batch of one
  request: the keys past the part worth loading are answered MISS, so vLLM recomputes
  them instead of waiting for a load that would take longer;
- the node's **IO thread** reports each completed fetch (its bytes and seconds) through
  :meth:`TierLoads.fetched`: the bandwidth estimate of that peer;
- the **scheduler thread** reports when requests are first scheduled, the chunks they
  stored and when they finished: the prefill rate of this engine.

Thread-safe: every method takes the lock the tier shares with it (the same lock guards
the tier's metrics, which the ``count`` callback increments).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import ScheduleEndContext

from p2pkv.integrations.vllm.loadpolicy import LOAD_PROBE, Advice, LoadPolicy, LoadPolicyConfig
from p2pkv.integrations.vllm.metrics import Metrics
from p2pkv.integrations.vllm.peers import Count
from p2pkv.node import FetchResult

__all__ = ["DIRECTORY", "UNMEASURED_PREFILL_RATE", "TierLoads"]

log = logging.getLogger("vllm.p2pkv")

#: Seconds between two info lines about decisions of one kind.
LOG_EVERY = 60.0
#: The bandwidth estimate of loads through the cluster directory (striped over holders).
DIRECTORY = "directory"
#: Tokens/s an engine announces its prefills at (pending-v1) until it measured its own.
UNMEASURED_PREFILL_RATE = 1000.0


class TierLoads:
    """The tier's :class:`~p2pkv.integrations.vllm.loadpolicy.LoadPolicy` behind the
    tier's lock."""

    def __init__(self, config: LoadPolicyConfig, *, chunk_bytes: int, chunk_tokens: int,
                 lock: threading.Lock, count: Count) -> None:
        self.policy = LoadPolicy(config, chunk_bytes=chunk_bytes, chunk_tokens=chunk_tokens)
        self._lock = lock
        self._count = count
        self._logged: dict[str, float] = {}

    def advise(self, req_id: str, keys: Sequence[bytes], found: Sequence[bool],
               holders: Sequence[str | None]) -> list[bool]:
        """Lookup thread: ``found`` with the held keys not worth loading turned to misses.
        ``holders[i]`` is the peer (or :data:`DIRECTORY`) that said it holds ``keys[i]``."""
        held = [h if f else None for f, h in zip(found, holders, strict=True)]
        with self._lock:
            self.policy.meter.asked(req_id, keys)
            advice = self.policy.advise(held, time.monotonic())
            if advice.reason is None:
                return list(found)
            self._count(Metrics.LOAD_DECISIONS, 1, (advice.reason,))
            if advice.skipped:
                self._count(Metrics.LOAD_SKIPPED, advice.skipped, (advice.skip_reason,))
            now = time.monotonic()
            # Each kind of decision at most once a minute at info (the rest at debug).
            fresh = now - self._logged.get(advice.reason, -LOG_EVERY) >= LOG_EVERY
            if fresh:
                self._logged[advice.reason] = now
        level = logging.INFO if fresh else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "p2pkv tier: load policy: %s", self._explain(advice))
        answer = list(found)
        for i in range(advice.load, advice.held):
            answer[i] = False
        return answer

    def _explain(self, advice: Advice) -> str:
        peers = ", ".join(advice.peers)
        cfg = self.policy.config
        what = (f"{advice.held} chunk(s) ({advice.held * self.policy.chunk_tokens} tokens, "
                f"{advice.held * self.policy.chunk_bytes / 1e6:.1f} MB) held by {peers}")
        if advice.load_seconds is None or advice.recompute_seconds is None:
            return f"{advice.reason}: loading {advice.load} of {what}"
        estimate = (f"load ~{advice.load_seconds:.3f} s, recompute ~"
                    f"{advice.recompute_seconds:.3f} s (loads must be {cfg.min_speedup:g}x "
                    f"faster)")
        if advice.reason == LOAD_PROBE:
            return (f"probe: loading {advice.load} of {what} to measure the link again "
                    f"(estimate older than {cfg.probe_interval:g} s: {estimate})")
        verdict = "recomputing" if advice.load == 0 else f"loading {advice.load} of"
        return f"{advice.reason}: {verdict} {what}: {estimate}"

    def compute_seconds(self, chunks: int) -> float:
        """Scheduler thread: for a prefill of ``chunks`` chunks starting now, when it is
        expected to be stored (seconds from now), at this engine's measured prefill rate
        (:data:`UNMEASURED_PREFILL_RATE` until it has one). Every chunk is given the
        end of the prefill: a prompt that fits one step is stored after it, all at once."""
        tokens = chunks * self.policy.chunk_tokens
        with self._lock:
            rate = self.policy.prefill_rate(tokens) or UNMEASURED_PREFILL_RATE
        return tokens / rate

    def wait_budget(self, chunks: int, due: float) -> float | None:
        """Lookup thread: whether to wait ``due`` seconds for ``chunks`` chunks a peer is
        computing and then load them (None: compute them here), and until how many
        seconds from now waiting pays (see
        :meth:`~p2pkv.integrations.vllm.loadpolicy.LoadPolicy.wait_budget`). Counted in
        the load decisions."""
        with self._lock:
            reason, budget = self.policy.wait_budget(chunks, due, time.monotonic())
            self._count(Metrics.LOAD_DECISIONS, 1, (reason,))
        return budget

    def fetched(self, peer: str, result: FetchResult) -> None:
        """IO thread: a fetch from ``peer`` completed."""
        with self._lock:
            self.policy.fetched(peer, result.nbytes, result.seconds, time.monotonic())

    def scheduled(self, context: ScheduleEndContext) -> None:
        """Scheduler thread: a step's scheduling ended."""
        with self._lock:
            now = time.monotonic()
            self.policy.meter.scheduled(context.new_req_ids, context.preempted_req_ids, now)
            self.policy.steps.ended(now)

    def idle_step(self) -> None:
        """Scheduler thread: the step that just ended scheduled nothing."""
        with self._lock:
            self.policy.steps.idle()

    def stored(self, req_id: str, keys: Collection[bytes]) -> None:
        with self._lock:
            self.policy.meter.stored(req_id, keys, time.monotonic())

    def finished(self, req_id: str) -> None:
        with self._lock:
            self.policy.finished(req_id, time.monotonic())

    def describe(self) -> dict[str, Any]:
        """For the tier's ``stats()``: configuration, estimates, decisions."""
        with self._lock:
            return self.policy.describe(time.monotonic())

    def gauges(self, stats: OffloadingConnectorStats) -> None:
        """The estimates as gauges of one metrics interval."""
        with self._lock:
            bandwidth = {p: r.value for p, r in self.policy.bandwidth.items()}
            prefill = {str(1 << b): r.value for b, r in self.policy.prefill.items()}
        for peer, value in bandwidth.items():
            stats.set_gauge(Metrics.PEER_BANDWIDTH, value, (peer,))
        for tokens, value in prefill.items():
            stats.set_gauge(Metrics.PREFILL_RATE, value, (tokens,))

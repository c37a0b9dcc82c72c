"""The Prometheus metrics :class:`~p2pkv.integrations.vllm.P2PKVTier` adds to vLLM's own
output: their names and their definitions (``build_metric_definitions``); and the time
its request hooks take (:class:`HookTimes`, in the metrics, ``stats()`` and the
shutdown log)."""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from p2pkv.node import KeyOutcome

__all__ = ["HookTimes", "Metrics", "load_failure_reason", "metric_definitions"]

#: ``reason`` of a chunk the tier had nowhere to load from (no connected peer holds it).
NO_HOLDER = "no_holder"
#: ``reason`` of a chunk asked while the tier has no node (its identity is not known).
TIER_DISABLED = "tier_disabled"


class Metrics:
    """Names of the Prometheus metrics the tier adds to vLLM's own output."""

    LOOKUP_KEYS = "vllm:p2pkv_lookup_keys"
    LOOKUP_HITS = "vllm:p2pkv_lookup_hits"
    LOADED_BLOCKS = "vllm:p2pkv_loaded_blocks"
    LOADED_BYTES = "vllm:p2pkv_loaded_bytes"
    LOAD_FAILURES = "vllm:p2pkv_load_failures"
    STORED_BLOCKS = "vllm:p2pkv_stored_blocks"
    STORED_BYTES = "vllm:p2pkv_stored_bytes"
    HANDSHAKES_REFUSED = "vllm:p2pkv_handshakes_refused"
    PEERS = "vllm:p2pkv_peers"
    DIRECTORY_LOOKUPS = "vllm:p2pkv_directory_lookups"
    DIRECTORY_HITS = "vllm:p2pkv_directory_hits"
    DIRECTORY_STALE = "vllm:p2pkv_directory_stale_entries"
    DIRECTORY_FAILOVERS = "vllm:p2pkv_directory_failovers"
    DIRECTORY_ERRORS = "vllm:p2pkv_directory_errors"
    DIRECTORY_REGISTERED = "vllm:p2pkv_directory_registered"
    DIRECTORY_PENDING = "vllm:p2pkv_directory_pending_keys"
    LOAD_DECISIONS = "vllm:p2pkv_load_decisions"
    LOAD_SKIPPED = "vllm:p2pkv_load_skipped_blocks"
    PEER_BANDWIDTH = "vllm:p2pkv_peer_bandwidth_bytes_per_second"
    PREFILL_RATE = "vllm:p2pkv_prefill_tokens_per_second"
    ADAPTER_UNSHARED = "vllm:p2pkv_adapter_unshared_blocks"
    LOOKUP_STEPS = "vllm:p2pkv_lookup_steps"
    PENDING_ANNOUNCED = "vllm:p2pkv_pending_announced_blocks"
    PENDING_DROPPED = "vllm:p2pkv_pending_dropped_blocks"
    LOOKUP_WAIT_SECONDS = "vllm:p2pkv_lookup_wait_seconds"
    IDLE_PAUSE_SECONDS = "vllm:p2pkv_idle_pause_seconds"
    HOOK_CALLS = "vllm:p2pkv_request_hook_calls"
    HOOK_SECONDS = "vllm:p2pkv_request_hook_seconds"
    HOOK_MAX_SECONDS = "vllm:p2pkv_request_hook_max_seconds"


def load_failure_reason(cause: KeyOutcome | BaseException) -> str:
    """The ``reason`` label of ``vllm:p2pkv_load_failures`` for one failed chunk.

    Every value the label takes: ``missing`` and ``failed`` (the per-key
    :class:`~p2pkv.node.KeyOutcome` the fetch reported), the class name of the error that
    failed a whole fetch (``PeerTimeout``, ``PeerGone``, ...), :data:`NO_HOLDER` and
    :data:`TIER_DISABLED`.
    """
    if isinstance(cause, KeyOutcome):
        return cause.value
    return type(cause).__name__


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric of :class:`Metrics` with its help text and labels."""
    return {**_peer_metrics(), **_tier_metrics()}


def _peer_metrics() -> dict[str, OffloadingMetricMetadata]:
    """Lookups, loads, stores and handshakes with peers."""
    return {
        Metrics.LOOKUP_KEYS: OffloadingCounterMetadata(
            "Chunk keys this engine asked p2pkv peers about."),
        Metrics.LOOKUP_HITS: OffloadingCounterMetadata(
            "Chunk keys a p2pkv peer said it holds."),
        Metrics.LOADED_BLOCKS: OffloadingCounterMetadata(
            "Chunks fetched from p2pkv peers into the primary region, verified."),
        Metrics.LOADED_BYTES: OffloadingCounterMetadata(
            "Bytes fetched from p2pkv peers into the primary region."),
        Metrics.LOAD_FAILURES: OffloadingCounterMetadata(
            "Chunks a load could not bring (vLLM recomputes them), by reason.",
            labelnames=("reason",)),
        Metrics.STORED_BLOCKS: OffloadingCounterMetadata(
            "Chunks copied into this engine's p2pkv pool to serve to peers."),
        Metrics.STORED_BYTES: OffloadingCounterMetadata(
            "Bytes copied into this engine's p2pkv pool."),
        Metrics.HANDSHAKES_REFUSED: OffloadingCounterMetadata(
            "p2pkv handshakes refused: outbound by differing field, inbound (peers "
            "this engine refused) by reason.", labelnames=("side", "reason")),
        Metrics.PEERS: OffloadingGaugeMetadata("Compatible p2pkv peers connected."),
    }


def _tier_metrics() -> dict[str, OffloadingMetricMetadata]:
    """The directory, pending-v1, the load policy, the lookups' steps and hooks."""
    return {
        Metrics.DIRECTORY_LOOKUPS: OffloadingCounterMetadata(
            "Prefix lookups answered by the cluster directory (or its peer fallback)."),
        Metrics.DIRECTORY_HITS: OffloadingCounterMetadata(
            "Chunk keys found in the prefixes the directory answered."),
        Metrics.DIRECTORY_STALE: OffloadingCounterMetadata(
            "Chunks a listed holder no longer had (a stale directory entry)."),
        Metrics.DIRECTORY_FAILOVERS: OffloadingCounterMetadata(
            "Chunks fetched again from another holder after one died, refused or missed."),
        Metrics.DIRECTORY_ERRORS: OffloadingCounterMetadata(
            "Directory calls that failed (lookups then fell back to the static peers)."),
        Metrics.DIRECTORY_REGISTERED: OffloadingGaugeMetadata(
            "1 while this engine is registered in the cluster directory."),
        Metrics.DIRECTORY_PENDING: OffloadingCounterMetadata(
            "Chunks being computed (pending-v1) written to the directory, by change: "
            "announced (renewals included), withdrawn, dropped (queue full, or not "
            "registered at the time).", labelnames=("change",)),
        Metrics.LOAD_DECISIONS: OffloadingCounterMetadata(
            "Load-or-recompute decisions of the load policy (one per lookup with a hit), "
            "by reason: pays, no_estimate, probe, policy_off, below_floor, "
            "slower_than_recompute; and for chunks a peer is computing (pending-v1): "
            "pending_pays, pending_no_estimate, pending_policy_off (waited for), "
            "pending_slower_than_recompute (computed here).", labelnames=("reason",)),
        Metrics.LOAD_SKIPPED: OffloadingCounterMetadata(
            "Chunks a peer held that the load policy answered MISS (vLLM recomputed "
            "them), by reason: below_floor, slower_than_recompute.",
            labelnames=("reason",)),
        Metrics.PEER_BANDWIDTH: OffloadingGaugeMetadata(
            "The load policy's bandwidth estimate of each peer (bytes/s of completed "
            "fetches; peer \"directory\": striped loads through the directory).",
            labelnames=("peer",)),
        Metrics.PREFILL_RATE: OffloadingGaugeMetadata(
            "The load policy's prefill-rate estimate of this engine (tokens/s), by the "
            "prompt-length band it was measured on (lower bound, in tokens).",
            labelnames=("tokens",)),
        Metrics.ADAPTER_UNSHARED: OffloadingCounterMetadata(
            "Chunks of requests under a LoRA adapter that were not shared, by reason: "
            "adapter_mismatch (looked up: a peer holds the prompt under an adapter of the "
            "same name and path with other content; recomputed here), adapter_unknown "
            "(stored: kept from peers, the tier did not see the request's adapter), "
            "adapter_unreadable (stored: kept from peers, its files cannot be hashed).",
            labelnames=("reason",)),
        Metrics.LOOKUP_STEPS: OffloadingCounterMetadata(
            "Scheduler steps in which a request was looked up, by outcome: ready (every "
            "key answered at once, from the ask made when the request arrived), waited "
            "(answered after the scheduler waited, within lookup_wait), deferred (a key "
            "answered RETRY: vLLM skipped the request for the step), pending (a key "
            "answered RETRY because a peer or this engine is computing it).",
            labelnames=("outcome",)),
        Metrics.PENDING_ANNOUNCED: OffloadingCounterMetadata(
            "Chunks this engine announced as being computed (pending-v1) when it "
            "scheduled their request, or, for a request scheduled before the tier's "
            "node ran, when the node started."),
        Metrics.PENDING_DROPPED: OffloadingCounterMetadata(
            "Chunks of requests scheduled before the tier's node ran that were never "
            "announced (pending-v1): more waited for the start than the tier keeps "
            "(1,024 requests, 32,768 chunks; the oldest request went first)."),
        Metrics.LOOKUP_WAIT_SECONDS: OffloadingCounterMetadata(
            "Seconds the scheduler thread waited for lookups (at most lookup_wait a step)."),
        Metrics.IDLE_PAUSE_SECONDS: OffloadingCounterMetadata(
            "Seconds the scheduler thread slept in steps that scheduled nothing while "
            "requests waited for a lookup or for chunks being computed (at most "
            "lookup_wait a step; under P2PKVConnector only)."),
        Metrics.HOOK_CALLS: OffloadingCounterMetadata(
            "Calls of the tier's request hooks, by hook: begin_request (from "
            "P2PKVConnector, outside vLLM's locks) and on_new_request (vLLM 0.33 holds "
            "its offloading manager's lock through it).", labelnames=("hook",)),
        Metrics.HOOK_SECONDS: OffloadingCounterMetadata(
            "Seconds spent in the tier's request hooks, by hook.", labelnames=("hook",)),
        Metrics.HOOK_MAX_SECONDS: OffloadingGaugeMetadata(
            "The longest single call of each request hook so far, in seconds.",
            labelnames=("hook",)),
    }


class HookTimes:
    """How long the tier's request hooks ran, per hook: calls, total and longest, for
    the metrics, ``stats()`` and the shutdown log (vLLM 0.33 runs ``on_new_request`` under its
    offloading manager's lock). Called on the scheduler thread; read from any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: dict[str, list[float]] = {}  # hook -> [calls, total s, max s]
        self._reported: dict[str, tuple[float, float]] = {}  # hook -> (calls, total s)

    def add(self, hook: str, seconds: float) -> None:
        with self._lock:
            t = self._times.setdefault(hook, [0, 0.0, 0.0])
            t[0] += 1
            t[1] += seconds
            t[2] = max(t[2], seconds)

    def report(self, stats: Any) -> None:
        """Add what changed since the last report to vLLM's ``OffloadingConnectorStats``."""
        with self._lock:
            for hook, (n, total, longest) in self._times.items():
                calls, seconds = self._reported.get(hook, (0, 0.0))
                if n > calls:
                    stats.increase_counter(Metrics.HOOK_CALLS, int(n - calls), (hook,))
                    stats.increase_counter(Metrics.HOOK_SECONDS, total - seconds, (hook,))
                self._reported[hook] = (n, total)
                stats.set_gauge(Metrics.HOOK_MAX_SECONDS, longest, (hook,))

    def describe(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {hook: {"calls": int(n), "mean_us": total / n * 1e6 if n else 0.0,
                           "max_us": longest * 1e6}
                    for hook, (n, total, longest) in self._times.items()}

    def describe_text(self) -> str:
        return "; ".join(f"{hook} {d['calls']} calls, mean {d['mean_us']:.1f} us, max "
                         f"{d['max_us']:.1f} us" for hook, d in self.describe().items()) \
            or "no requests"

"""p2pkv as a secondary tier of vLLM's offloading connector.

``P2PKVTier`` runs in vLLM's engine-core (scheduler) process. It owns one p2pkv
:class:`~p2pkv.node.Node` that serves the chunks this engine stored to compatible peers,
and fetches chunks other engines stored straight into vLLM's primary (CPU) region. It is
built by :class:`~p2pkv.integrations.vllm.P2PKVConnector` (``connector.py``), which
hands it the engine's ``VllmConfig`` and each request's LoRA adapter and block hashes.

Threads and what each may touch:

- the **scheduler thread** calls every ``SecondaryTierManager`` method; none blocks
  beyond ``lookup_wait`` per step (a lookup whose answer has not come back by then
  answers RETRY, loads and stores only submit work);
- the **lookup threads** (``lookups.py``) ask every connected peer about a request's
  keys at once, with one deadline: all of its prompt's keys when it arrives, keys met
  later at the end of the step; the load policy (``loads.py``) then answers MISS for
  held chunks whose load would take longer than recomputing them;
- the **store thread** copies stored chunks out of the primary region into the node's
  pool (the region's slots are reused as soon as the store job is reported);
- the node's **IO thread** lands fetched chunks in the primary region with ``recv_into``
  (no intermediate copy) and completes the load futures.

The loads and stores themselves (the jobs, their futures, what they report) are
``transfers.py``'s; what a lookup answers is ``asking.py``'s; this module holds the tier
vLLM calls.

Nothing is ever loaded that was not verified: a refused, dead, slow or corrupt source
fails only its keys (reported through ``successful_keys``), vLLM recomputes them, and the
lookups answer them MISS from then on, so the scheduler does not retry a doomed load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from p2pkv.cluster import Cluster
from p2pkv.identity import RunConfig
from p2pkv.integrations.vllm.adapters import (
    ADAPTER_UNKNOWN,
    RequestAdapters,
    first_chunk,
    first_chunk_tokens,
)
from p2pkv.integrations.vllm.asking import TierAsking
from p2pkv.integrations.vllm.computing import ANNOUNCED, DROPPED, Computing
from p2pkv.integrations.vllm.connector import building
from p2pkv.integrations.vllm.identity import TierIdentity, run_config_from_spec
from p2pkv.integrations.vllm.loads import TierLoads
from p2pkv.integrations.vllm.lookups import RequestLookups
from p2pkv.integrations.vllm.metrics import HookTimes, Metrics, metric_definitions
from p2pkv.integrations.vllm.options import (
    CONNECTOR_KEYS,
    TIER_DEFAULTS,
    TIER_OPTIONS,
    load_policy_config,
    tier_node_config,
    tier_settings,
)
from p2pkv.integrations.vllm.peers import Peers
from p2pkv.integrations.vllm.starter import TierNode
from p2pkv.integrations.vllm.transfers import TierTransfers
from p2pkv.layout import EngineRowLayout
from p2pkv.node import Node

# Under "vllm." so that vLLM's own log handler prints the tier's lines with the engine's.
log = logging.getLogger("vllm.p2pkv")

__all__ = ["TIER_DEFAULTS", "TIER_OPTIONS", "Metrics", "P2PKVTier"]

class P2PKVTier(SecondaryTierManager):
    """A secondary tier whose chunks live in other engines' p2pkv nodes.

    Built by :class:`~p2pkv.integrations.vllm.P2PKVConnector` (or directly, under
    ``set_current_vllm_config``). Tier config
    (``kv_connector_extra_config["secondary_tiers"]`` entry)::

        {"type": "P2PKVTier", "module_path": "p2pkv.integrations.vllm",
         "listen": "tcp://0.0.0.0:5601", "peers": ["tcp://hostB:5601"],
         "pool_blocks": 4096, "lookup_timeout": 1.0, "fetch_timeout": 30.0}

    ``pool_blocks`` defaults to the primary region's chunk count.
    """

    medium: ClassVar[Medium] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview,
                 tier_type: str, backpressure_detector: Any = None,
                 **params: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type,
                         backpressure_detector=backpressure_detector)
        self.locality = Locality.REMOTE
        settings, peers, waits = tier_settings(params)
        self._declared = {name: settings[name] for name in
                          ("kv_memory_layout", "model_revision", "model_overrides")}
        self.run_config: RunConfig = run_config_from_spec(
            offloading_spec, parallel_agnostic=settings["parallel_agnostic"])
        # Derived from the engine now; the weights digest follows off this thread, and
        # until it is known the node does not start: nothing is shared under an
        # identity that is not yet known.
        self.identity = TierIdentity(offloading_spec, self._declared)
        self._identity_timeout = waits.identity
        self._waits = waits
        self._drain_grace = waits.drain_grace
        self.layout = EngineRowLayout.of_bytes(self.block_size_bytes)
        self._fetch_timeout = float(settings["fetch_timeout"])
        # The 2-D region as bytes: chunk c is rows[c * row : (c + 1) * row].
        self._rows = primary_kv_view.cast("B")
        self._lock = threading.Lock()
        self._peers = Peers(peers, reconnect=waits.reconnect,
                            refused_retry=waits.refused_retry,
                            lookup_timeout=float(settings["lookup_timeout"]),
                            lock=self._lock, count=self._count)
        # pending-v1: the chunks this engine computes, announced to peers, the directory
        # and its own later requests until stored; before the node runs, once it starts.
        self._computing = Computing(
            lambda: self._run.node, self._lock, directory=lambda: self._run.directory,
            coming=lambda: not self._run.settled(),
            count=lambda event, n: self._count(_COMPUTING_METRICS[event], n, ()))
        self._run = TierNode(
            self.identity, self.run_config, self.layout, tier_node_config(settings),
            pool_blocks=int(params.get("pool_blocks") or len(primary_kv_view)),
            peers=self._peers, identity_timeout=self._identity_timeout,
            directory=settings["directory"], directory_options={
                "peers": peers, "ttl": float(settings["directory_ttl"]),
                "lookup_timeout": float(settings["lookup_timeout"]),
                "fetch_timeout": self._fetch_timeout, "advertise": settings["advertise"]},
            on_start=self._computing.started)
        # Asked on the lookup threads once requests come (self._asking is made below).
        self._lookups = RequestLookups(
            lambda req_id, keys, first: self._asking.ask(req_id, keys, first),
            wait=waits.lookup_wait, pending_limit=waits.pending_wait)
        #: Per KV-cache group: its index and the block hashes behind one chunk key.
        self._chunk_hashes = _chunk_hashes(offloading_spec)
        self._policy = TierLoads(load_policy_config(params),
                                 chunk_bytes=self.block_size_bytes,
                                 chunk_tokens=_chunk_tokens(offloading_spec),
                                 lock=self._lock, count=self._count)
        self._stats = OffloadingConnectorStats()
        self._inbound_refusals: dict[str, int] = {}
        # Requests under a LoRA adapter are shared under keys salted with the adapter's
        # content digest (adapters.py); the request's first chunk is also kept under its
        # name-and-path key, so that a consumer can tell a rolling update from a miss.
        self._adapters = RequestAdapters(
            lora_enabled=self.identity.lora_enabled,
            count=lambda reason, n: self._counted(Metrics.ADAPTER_UNSHARED, n, (reason,)))
        self._asking = TierAsking(self._run, self._peers, self._adapters, self._policy,
                                  self._computing, pending_wait=waits.pending_wait,
                                  lock=self._lock, count=self._count)
        _join_connector(self)
        self._first_chunk_tokens = first_chunk_tokens(offloading_spec)
        self._hooks = HookTimes()
        self._transfers = TierTransfers(
            self._run, self._rows, row=self.block_size_bytes, peers=self._peers,
            policy=self._policy, adapters=self._adapters, lock=self._lock,
            count=self._count, fetch_timeout=self._fetch_timeout,
            identity_timeout=self._identity_timeout, drain_grace=self._drain_grace,
            first_chunk_tokens=self._first_chunk_tokens)
        log.info("p2pkv tier: fingerprint %s, %d-byte chunks, peers %s; identity derived "
                 "so far: %s", self.run_config.fingerprint, self.block_size_bytes,
                 list(peers) or "none", self.identity.describe())
        # The node starts as soon as it can (the engine core seeds its block hashing
        # right after building this tier), not on the first request: that request would
        # pay the start on the scheduler thread and find no peer connected yet.
        self._run.start_early(self._identity_timeout)

    # ------------------------------------------------------------------ identity, node

    @property
    def fingerprint(self) -> str:
        return self.run_config.fingerprint

    @property
    def node(self) -> Node | None:
        """The node, once started (after the engine initialised its block hashing)."""
        return self._run.node

    @property
    def cluster(self) -> Cluster | None:
        """The cluster the node registers in (the ``directory`` option), once the node
        started; None without a directory."""
        directory = self._run.directory
        return None if directory is None else directory.cluster

    def _ensure_node(self, wait: float = 0.0) -> Node | None:
        return self._run.ensure(wait)

    def _count(self, name: str, n: int, labels: tuple[str, ...]) -> None:
        """Increment one of this tier's metrics (the caller holds the lock)."""
        self._stats.increase_counter(name, n, labels)

    def _counted(self, name: str, n: int, labels: tuple[str, ...]) -> None:
        with self._lock:
            self._count(name, n, labels)

    # ------------------------------------------------------------------ SecondaryTierManager

    def begin_request(self, req_id: str, lora_request: Any,
                      block_hashes: Sequence[bytes] = ()) -> None:
        """A new request, the ``LoRARequest`` it runs under (None: the base model) and
        its prompt's block hashes, from :class:`~p2pkv.integrations.vllm.P2PKVConnector`
        before vLLM starts it: every chunk key of the prompt is asked now, so that the
        scheduler's first lookup can be answered (see :mod:`.lookups`)."""
        started = time.perf_counter()
        node = self._ensure_node()  # a start under way is waited for, outside vLLM's locks
        self._run.request_arrived()
        self._adapters.begin(req_id, lora_request)
        # A request whose adapter digest is still being computed is asked later, as
        # the scheduler meets its keys (until then its lookups answer RETRY); before the
        # node runs, its prompt is only kept (what it computes is announced at the start).
        if block_hashes and not self._adapters.pending(req_id):
            for group, per_chunk in self._chunk_hashes:
                self._lookups.begin(req_id, [
                    make_offload_key(h, group)
                    for h in block_hashes[per_chunk - 1::per_chunk]], ask=node is not None)
        self._hooks.add("begin_request", time.perf_counter() - started)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # vLLM 0.33 calls this under its offloading manager's lock: nothing slow here
        # (the node starts when the tier is built; under P2PKVConnector, begin_request
        # already waited for a start under way and did the adapter's stat and hash,
        # outside the lock).
        started = time.perf_counter()
        self._ensure_node()
        self._hooks.add("on_new_request", time.perf_counter() - started)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._ensure_node() is None:
            # Kept: what the request computes is announced when the node starts.
            self._lookups.missed(req_context.req_id, key)
            return LookupResult.MISS
        if self._adapters.pending(req_context.req_id):
            return LookupResult.RETRY  # its adapter's digest is being computed
        found = self._lookups.lookup(
            req_context.req_id, key,
            lambda: first_chunk(key, req_context, self._first_chunk_tokens))
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._transfers.load(job_metadata)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._computing.stored(job_metadata.req_context.req_id, job_metadata.keys)
        self._transfers.store(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        for result, failed in self._transfers.finished():
            results.append(result)
            if failed:
                # Never promise these keys again in this request's lookups: vLLM
                # recomputes them instead of retrying a load that just failed.
                self._lookups.mark_miss(failed)
        return results

    def has_pending_work(self) -> bool:
        return self._transfers.pending()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._computing.finished(req_context.req_id)
        self._lookups.finished(req_context.req_id)
        self._policy.finished(req_context.req_id)
        self._adapters.finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for req_id in context.preempted_req_ids:
            self._computing.withdraw(req_id)
        for req_id in context.new_req_ids:
            self._announce(req_id)
        self._lookups.flush()
        self._policy.scheduled(context)
        self._run.maintain()

    def scheduled_nothing(self) -> None:
        """The scheduler step that just ended scheduled no token and left no transfer
        under way (from :class:`~p2pkv.integrations.vllm.P2PKVConnector`): every request
        waits. When some wait on this tier's lookups, the scheduler thread sleeps until
        their answers may have changed, at most ``lookup_wait``
        (:meth:`RequestLookups.pause`); vLLM's loop would spin instead."""
        self._policy.idle_step()
        self._lookups.pause()

    def drain_jobs(self) -> None:
        """Wait until no load or store touches the primary region; bounded by
        ``fetch_timeout`` and ``drain_grace`` (see :meth:`TierTransfers.drain`)."""
        self._transfers.drain()

    def shutdown(self) -> None:
        if self._run.closed:
            return
        self._run.closed = True
        self.drain_jobs()
        self._transfers.close()
        self._adapters.shutdown()
        self._computing.close()
        self._lookups.shutdown()
        self._run.close()
        log.info("p2pkv tier: time in the request hooks: %s", self._hooks.describe_text())

    # ------------------------------------------------------------------ requests

    def _announce(self, req_id: str) -> None:
        """Request ``req_id`` was scheduled for the first time: the chunks it looked up
        and nobody held are computed here now (see :mod:`.computing`)."""
        keys = self._lookups.computing(req_id)
        if not keys or self._adapters.pending(req_id):
            return
        shared = self._adapters.keys(req_id, keys)
        if shared.keys is not None:
            self._computing.announce(req_id, keys, shared.keys,
                                     self._policy.compute_seconds(len(keys)))

    # ------------------------------------------------------------------ observability

    def stats(self) -> dict[str, Any]:
        """A snapshot for logs and tests: peers, refusals by field, node counters."""
        peers, refusals = self._peers.report()
        return {
            "fingerprint": self.fingerprint,
            "address": self._run.node.address if self._run.node else None,
            "disabled": self._run.failed,
            "key_hash": self._run.key_hash.algo if self._run.key_hash else None,
            "extension": self._run.extension.to_wire() if self._run.extension else None,
            "identity": self.identity.describe(),
            "peers": peers,
            "handshakes_refused": refusals,
            "directory": self._run.directory.describe() if self._run.directory else None,
            "node": self._run.node.stats() if self._run.node else None,
            "load_policy": self._policy.describe(),
            "adapters": self._adapters.describe(),
            "computing": self._computing.describe(),
            "hooks": self._hooks.describe(),
        }

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        inbound = dict(self._run.node.stats().handshakes_refused) if self._run.node else {}
        connected = self._peers.connected()
        with self._lock:
            stats, self._stats = self._stats, OffloadingConnectorStats()
            for reason, count in inbound.items():
                delta = count - self._inbound_refusals.get(reason, 0)
                if delta > 0:
                    stats.increase_counter(Metrics.HANDSHAKES_REFUSED, delta,
                                           ("inbound", reason))
            self._inbound_refusals = inbound
        stats.set_gauge(Metrics.PEERS, connected)
        self._hooks.report(stats)
        lookups = self._lookups.take_counts()
        for outcome, steps in lookups.steps.items():
            stats.increase_counter(Metrics.LOOKUP_STEPS, steps, (outcome,))
        if lookups.wait_seconds:
            stats.increase_counter(Metrics.LOOKUP_WAIT_SECONDS, lookups.wait_seconds)
        if lookups.pause_seconds:
            stats.increase_counter(Metrics.IDLE_PAUSE_SECONDS, lookups.pause_seconds)
        self._policy.gauges(stats)
        if self._run.directory is not None:
            for (name, labels), delta in self._run.directory.deltas().items():
                stats.increase_counter(name, delta, labels)
            stats.set_gauge(Metrics.DIRECTORY_REGISTERED, int(self._run.directory.registered()))
        return stats


#: The metric each of Computing's counts goes to.
_COMPUTING_METRICS = {ANNOUNCED: Metrics.PENDING_ANNOUNCED, DROPPED: Metrics.PENDING_DROPPED}

def _chunk_hashes(spec: OffloadingSpec) -> tuple[tuple[int, int], ...]:
    """Per KV-cache group: its index, and how many block hashes one chunk key covers
    (chunk key i is the group's index appended to block hash ``(i + 1) * n - 1``, as
    vLLM's offloading scheduler makes it)."""
    per_hash = spec.tokens_per_hash
    return tuple((g.group_id, g.tokens_per_block * spec.blocks_per_chunk // per_hash)
                 for g in spec.config.groups
                 if g.tokens_per_block * spec.blocks_per_chunk >= per_hash > 0)


def _chunk_tokens(spec: OffloadingSpec) -> int:
    """Prompt tokens behind one offload key: a chunk of ``blocks_per_chunk`` blocks, one
    key per KV-cache group."""
    groups = spec.tokens_per_block
    return max(1, max(groups) * spec.blocks_per_chunk // len(groups)) if groups else 1


def _join_connector(tier: P2PKVTier) -> None:
    """P2PKVConnector hands ``tier`` each request's adapter; the plain
    OffloadingConnector cannot, and the tier never guesses (it says so under LoRA)."""
    connector = building()
    if connector is not None:
        connector.tiers.append(tier)
    elif tier.identity.lora_enabled:
        log.warning("p2pkv tier: LoRA is enabled, and the tier runs under vLLM's plain "
                    "OffloadingConnector, which does not say which adapter a request "
                    "runs under: the chunks of every request under an adapter are "
                    "neither shared nor looked up (counted in %s{reason=\"%s\"}). "
                    "Load P2PKVConnector (%s) to share them.", Metrics.ADAPTER_UNSHARED,
                    ADAPTER_UNKNOWN, CONNECTOR_KEYS)

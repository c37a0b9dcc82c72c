"""p2pkv as a secondary tier of vLLM's offloading connector.

``P2PKVTier`` runs in vLLM's engine-core (scheduler) process. It owns one p2pkv
:class:`~p2pkv.node.Node` that serves the chunks this engine stored to compatible peers,
and fetches chunks other engines stored straight into vLLM's primary (CPU) region.

Threads and what each may touch:

- the **scheduler thread** calls every ``SecondaryTierManager`` method; none blocks
  (lookups answer RETRY until the background lookup has an answer, loads and stores
  only submit work);
- the **lookup thread** (vLLM's ``AsyncLookupManager``) asks every connected peer about
  one step's keys at once, with one deadline, and records which peer holds each key;
  the load policy (``loads.py``) then answers MISS for held chunks whose load would take
  longer than recomputing them;
- the **store thread** copies stored chunks out of the primary region into the node's
  pool (the region's slots are reused as soon as the store job is reported);
- the node's **IO thread** lands fetched chunks in the primary region with ``recv_into``
  (no intermediate copy) and completes the load futures.

Nothing is ever loaded that was not verified: a refused, dead, slow or corrupt source
fails only its keys (reported through ``successful_keys``), vLLM recomputes them, and the
lookup cache marks them as misses so the scheduler does not retry a doomed load.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
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
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from p2pkv.cluster import PrefixFetch
from p2pkv.errors import P2PKVError, PeerGone
from p2pkv.identity import RunConfig
from p2pkv.integrations.vllm.adapters import RequestAdapter, RequestAdapters
from p2pkv.integrations.vllm.identity import TierIdentity, run_config_from_spec
from p2pkv.integrations.vllm.loads import DIRECTORY, TierLoads
from p2pkv.integrations.vllm.metrics import (
    NO_HOLDER,
    TIER_DISABLED,
    Metrics,
    load_failure_reason,
    metric_definitions,
)
from p2pkv.integrations.vllm.options import (
    TIER_DEFAULTS,
    TIER_OPTIONS,
    load_policy_config,
    tier_node_config,
    tier_settings,
)
from p2pkv.integrations.vllm.peers import Peers
from p2pkv.integrations.vllm.starter import TierNode
from p2pkv.layout import EngineRowLayout
from p2pkv.node import FetchResult, KeyOutcome, Node, PeerHandle

# Under "vllm." so that vLLM's own log handler prints the tier's lines with the engine's.
log = logging.getLogger("vllm.p2pkv")

__all__ = ["TIER_DEFAULTS", "TIER_OPTIONS", "Metrics", "P2PKVTier"]

@dataclass
class _LoadJob:
    job_id: int
    #: The keys fetched (salted for a request under an adapter, see adapters.py) ...
    keys: list[bytes]
    pending: int
    #: ... and vLLM's own key of each, which the job's result names.
    engine_keys: list[OffloadKey] = field(default_factory=list)
    landed: set[bytes] = field(default_factory=set)
    #: Failed chunks by ``vllm:p2pkv_load_failures`` reason (see load_failure_reason).
    failures: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    started: float = field(default_factory=time.perf_counter)

    def settle(self, n: int, result: FetchResult | None, exc: BaseException | None,
               missing: int) -> bool:
        """Account ``n`` chunks: by their per-key outcomes (``result``, plus ``missing``
        more keys past it), or all failed by ``exc``. True once every fetch settled."""
        failures = self.failures
        if result is not None:
            for key, outcome in zip(result.keys, result.outcomes, strict=True):
                if outcome is KeyOutcome.LANDED:
                    self.landed.add(key)
                else:
                    reason = load_failure_reason(outcome)
                    failures[reason] = failures.get(reason, 0) + 1
            if missing:
                reason = load_failure_reason(KeyOutcome.MISSING)
                failures[reason] = failures.get(reason, 0) + missing
            self.nbytes += result.nbytes
        elif exc is not None:
            reason = load_failure_reason(exc)
            failures[reason] = failures.get(reason, 0) + n
        if n:
            self.pending -= 1
        return self.pending <= 0

    def report(self, row: int) -> tuple[JobResult, list[OffloadKey]]:
        """The job's result for vLLM, and the keys (vLLM's) that did not land."""
        engine = self.engine_keys or self.keys
        ok = [e for e, k in zip(engine, self.keys, strict=True) if k in self.landed]
        failed = [e for e, k in zip(engine, self.keys, strict=True) if k not in self.landed]
        return JobResult(job_id=self.job_id, success=not failed,
                         successful_keys=tuple(ok) if failed else None,
                         transfer_time=time.perf_counter() - self.started,
                         transfer_bytes=len(ok) * row), failed


class _PeerLookup(AsyncLookupManager):
    """The tier's lookups: each step's keys of one request, asked on vLLM's lookup
    thread of every connected peer (see :meth:`Peers.ask`) or of the directory, under
    the keys the request's adapter shares them under; the load policy then keeps only
    the hits worth loading (see :class:`TierLoads`)."""

    def __init__(self, tier: P2PKVTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        node = tier._run.node
        if node is None or not keys:
            return [False] * len(keys)
        shared = tier._adapters.keys(req_context.req_id, keys)
        if shared.keys is None:  # counted once, where its chunks are kept from peers
            return [False] * len(keys)
        found, holders = self._ask(node, shared.keys)
        # A miss on a prompt's first chunk: does a peer hold it under another version
        # of this adapter (its name-and-path key)? Then say so; nothing is loaded.
        if shared.name_keys and not found[0] and \
                _first_chunk(keys[0], req_context, tier._first_chunk_tokens) and \
                self._ask(node, shared.name_keys[:1])[0][0]:
            tier._adapters.mismatch(str(shared.adapter), len(keys))
        return tier._policy.advise(req_context.req_id, keys, found, holders)

    def _ask(self, node: Node, keys: list[bytes]) -> tuple[list[bool], list[str | None]]:
        """Which of ``keys`` a peer (or the directory) holds, and who."""
        tier = self._tier
        if tier._run.directory is not None:
            found = tier._run.directory.ask(keys)
            with tier._lock:
                tier._count(Metrics.LOOKUP_KEYS, len(keys), ())
                tier._count(Metrics.LOOKUP_HITS, sum(found), ())
            return list(found), [DIRECTORY] * len(keys)
        return list(tier._peers.ask(node, keys)), list(tier._peers.route(keys)[1])


class P2PKVTier(SecondaryTierManager):
    """A secondary tier whose chunks live in other engines' p2pkv nodes.

    Tier config (``kv_connector_extra_config["secondary_tiers"]`` entry)::

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
        self._run = TierNode(
            self.identity, self.run_config, self.layout, tier_node_config(settings),
            pool_blocks=int(params.get("pool_blocks") or len(primary_kv_view)),
            peers=self._peers, identity_timeout=self._identity_timeout,
            directory=settings["directory"], directory_options={
                "peers": peers, "ttl": float(settings["directory_ttl"]),
                "lookup_timeout": float(settings["lookup_timeout"]),
                "fetch_timeout": self._fetch_timeout, "advertise": settings["advertise"]})
        self._lookup = _PeerLookup(self, tier_type)
        self._policy = TierLoads(load_policy_config(params),
                                 chunk_bytes=self.block_size_bytes,
                                 chunk_tokens=_chunk_tokens(offloading_spec),
                                 lock=self._lock, count=self._count)
        self._finished: collections.deque[tuple[JobResult, list[OffloadKey]]] = \
            collections.deque()
        self._loads: dict[int, _LoadJob] = {}
        self._outstanding: set[Future[Any]] = set()
        self._stores = concurrent.futures.ThreadPoolExecutor(1, "p2pkv-vllm-store")
        self._stats = OffloadingConnectorStats()
        self._inbound_refusals: dict[str, int] = {}
        # Requests under a LoRA adapter are shared under keys salted with the adapter's
        # content digest (adapters.py); the request's first chunk is also kept under its
        # name-and-path key, so that a consumer can tell a rolling update from a miss.
        self._adapters = RequestAdapters(
            lora_enabled=self.identity.lora_enabled,
            count=lambda reason, n: self._counted(Metrics.ADAPTER_UNSHARED, n, (reason,)))
        self._first_chunk_tokens = _first_chunk_tokens(offloading_spec)
        log.info("p2pkv tier: fingerprint %s, %d-byte chunks, peers %s; identity derived "
                 "so far: %s", self.run_config.fingerprint, self.block_size_bytes,
                 list(peers) or "none", self.identity.describe())

    # ------------------------------------------------------------------ identity, node

    @property
    def fingerprint(self) -> str:
        return self.run_config.fingerprint

    @property
    def node(self) -> Node | None:
        """The node, once started (after the engine initialised its block hashing)."""
        return self._run.node

    def _ensure_node(self, wait: float = 0.0) -> Node | None:
        return self._run.ensure(wait)

    def _maintain(self) -> None:
        self._run.maintain()

    def _count(self, name: str, n: int, labels: tuple[str, ...]) -> None:
        """Increment one of this tier's metrics (the caller holds the lock)."""
        self._stats.increase_counter(name, n, labels)

    def _counted(self, name: str, n: int, labels: tuple[str, ...]) -> None:
        with self._lock:
            self._count(name, n, labels)

    # ------------------------------------------------------------------ SecondaryTierManager

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._ensure_node()
        self._adapters.begin(req_context.req_id)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._ensure_node() is None:
            return LookupResult.MISS
        if self._adapters.pending(req_context.req_id):
            return LookupResult.RETRY  # its adapter's digest is being computed
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_load(self, job_metadata: TransferJob) -> None:
        node = self._ensure_node()
        engine_keys, chunk_ids = _job_chunks(job_metadata, "load")
        shared = self._adapters.keys(job_metadata.req_context.req_id, engine_keys)
        keys = shared.keys if shared.keys is not None else list(engine_keys)
        by_peer: dict[str, list[tuple[bytes, int]]] = {}
        job = _LoadJob(job_metadata.job_id, keys, pending=0, engine_keys=engine_keys)
        if node is None or shared.keys is None:
            reason = TIER_DISABLED if node is None else str(shared.reason)
            job.failures[reason] = len(keys)
            self._load_done(job, 0, None, None)
            return
        if self._run.directory is not None:
            self._load_through_directory(job, chunk_ids)
            return
        handles, holders = self._peers.route(keys)
        with self._lock:
            for key, cid, address in zip(keys, chunk_ids, holders, strict=True):
                if address is None:
                    job.failures[NO_HOLDER] = job.failures.get(NO_HOLDER, 0) + 1
                    continue
                by_peer.setdefault(address, []).append((key, int(cid)))
            job.pending = len(by_peer)
            self._loads[job.job_id] = job
        row = self.block_size_bytes
        for address, items in by_peer.items():
            handle = handles[address]
            dests = [[self._rows[cid * row:(cid + 1) * row]] for _, cid in items]
            try:
                fut = node.fetch_into_async(handle, [k for k, _ in items], dests,
                                            timeout=self._fetch_timeout)
            except P2PKVError as exc:
                self._peers.lost(handle, exc)
                self._load_done(job, len(items), None, exc)
                continue
            with self._lock:
                self._outstanding.add(fut)
            fut.add_done_callback(functools.partial(self._fetched, job, len(items), handle))
        if not by_peer:
            self._load_done(job, 0, None, None)

    def _load_through_directory(self, job: _LoadJob, chunk_ids: list[int]) -> None:
        """One striped, failing-over prefix fetch for the whole job (see directory.py)."""
        assert self._run.directory is not None
        row = self.block_size_bytes
        dests = [[self._rows[cid * row:(cid + 1) * row]] for cid in chunk_ids]
        with self._lock:
            job.pending = 1
            self._loads[job.job_id] = job
        try:
            fut = self._run.directory.load(job.keys, dests)
        except P2PKVError as exc:
            self._load_done(job, len(job.keys), None, exc)
            return
        with self._lock:
            self._outstanding.add(fut)
        fut.add_done_callback(functools.partial(self._prefix_fetched, job))

    def _prefix_fetched(self, job: _LoadJob, fut: Future[PrefixFetch]) -> None:
        with self._lock:
            self._outstanding.discard(fut)
        try:
            result = fut.result().result
        except BaseException as exc:
            self._load_done(job, len(job.keys), None, exc)
            return
        self._policy.fetched(DIRECTORY, result)
        # Keys past the available prefix: nobody compatible holds them any more.
        self._load_done(job, len(job.keys), result, None,
                        missing=len(job.keys) - len(result.keys))

    def _fetched(self, job: _LoadJob, n: int, handle: PeerHandle,
                 fut: Future[FetchResult]) -> None:
        with self._lock:
            self._outstanding.discard(fut)
        try:
            result = fut.result()
        except BaseException as exc:
            if isinstance(exc, PeerGone):
                self._peers.lost(handle, exc)
            self._load_done(job, n, None, exc)
            return
        self._policy.fetched(handle.address, result)
        self._load_done(job, n, result, None)

    def _load_done(self, job: _LoadJob, n: int, result: FetchResult | None,
                   exc: BaseException | None, *, missing: int = 0) -> None:
        """Settle ``n`` chunks of ``job`` (see :meth:`_LoadJob.settle`); once all are
        settled, count them and report the job."""
        if exc is not None:
            log.warning("p2pkv tier: load job %d: %d chunk(s) failed: %s", job.job_id, n, exc)
        with self._lock:
            if not job.settle(n, result, exc, missing):
                return
            self._loads.pop(job.job_id, None)
            row = self.block_size_bytes
            finished, failed = job.report(row)
            loaded = len(job.keys) - len(failed)
            self._stats.increase_counter(Metrics.LOADED_BLOCKS, loaded)
            self._stats.increase_counter(Metrics.LOADED_BYTES, loaded * row)
            for kind, count in job.failures.items():
                self._stats.increase_counter(Metrics.LOAD_FAILURES, count, (kind,))
            self._finished.append((finished, failed))

    def submit_store(self, job_metadata: TransferJob) -> None:
        node = self._ensure_node()
        keys, chunk_ids = _job_chunks(job_metadata, "store")
        if node is None and not (self.identity.pending and self._run.failed is None
                                 and not self._run.closed):
            with self._lock:
                self._finished.append((JobResult(job_id=job_metadata.job_id, success=False,
                                                 transfer_bytes=0), []))
            return
        self._policy.stored(job_metadata.req_context.req_id, keys)
        # The request may finish before the store thread gets to it: its adapter is
        # taken now.
        adapter = self._adapters.state(job_metadata.req_context.req_id)
        fut = self._stores.submit(self._store, node, job_metadata, adapter, keys, chunk_ids)
        with self._lock:
            self._outstanding.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: Future[Any]) -> None:
        with self._lock:
            self._outstanding.discard(fut)

    def _store(self, node: Node | None, job: TransferJob, adapter: RequestAdapter,
               engine_keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        """Store thread: copy the chunks out of the primary region into the pool, under
        the keys their adapter shares them under (first waiting, bounded, for the
        identity when the node has not started yet, and for the adapter's digest)."""
        job_id = job.job_id
        started = time.perf_counter()
        row = self.block_size_bytes
        stored = 0
        failed = 0
        # Waits in short slices, so that a shutdown never waits for a digest.
        deadline = time.monotonic() + self._identity_timeout
        while (node is None and not self._run.closed and self._run.failed is None
               and time.monotonic() < deadline):
            node = self._ensure_node(wait=min(0.5, max(0.0, deadline - time.monotonic())))
        if node is None:
            log.warning("p2pkv tier: store job %d dropped: the identity is not known (%s)",
                        job_id, self._run.failed or "weights digest still being computed")
            with self._lock:
                self._finished.append((JobResult(job_id=job_id, success=False,
                                                 transfer_bytes=0), []))
            return
        shared = self._adapters.shared(adapter, engine_keys, wait=self._identity_timeout,
                                       req_id=job.req_context.req_id)
        keys = shared.keys if shared.keys is not None else []
        if shared.keys is None:  # kept from peers: its adapter is not known
            self._adapters.count(str(shared.reason), len(engine_keys))
        for i, (key, cid) in enumerate(zip(keys, chunk_ids, strict=True) if keys else ()):
            chunk = self._rows[cid * row:(cid + 1) * row]
            try:
                if node.put(key, chunk):
                    stored += 1
                if shared.name_keys and _first_chunk(engine_keys[i], job.req_context,
                                                     self._first_chunk_tokens):
                    node.put(shared.name_keys[i], chunk)
            except (P2PKVError, ValueError) as exc:
                failed += 1
                log.warning("p2pkv tier: cannot keep chunk %s: %s", key.hex()[:16], exc)
        with self._lock:
            self._stats.increase_counter(Metrics.STORED_BLOCKS, stored)
            self._stats.increase_counter(Metrics.STORED_BYTES, stored * row)
            self._finished.append((JobResult(
                job_id=job_id, success=failed == 0, transfer_time=time.perf_counter() - started,
                transfer_bytes=stored * row), []))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        with self._lock:
            while self._finished:
                result, failed = self._finished.popleft()
                results.append(result)
                if failed:
                    # Never promise these keys again in this request's lookups: vLLM
                    # recomputes them instead of retrying a load that just failed.
                    self._lookup.mark_miss(failed)
        return results

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._outstanding or self._loads or self._finished)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)
        self._policy.finished(req_context.req_id)
        self._adapters.finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()
        self._policy.scheduled(context)
        self._maintain()

    def drain_jobs(self) -> None:
        """Wait until no load or store touches the primary region. Loads are bounded by
        ``fetch_timeout`` (the node fails them at their deadline), stores by a copy;
        ``drain_grace`` more is allowed for them to report."""
        deadline = time.monotonic() + self._fetch_timeout + self._drain_grace
        while True:
            with self._lock:
                pending = set(self._outstanding)
            if not pending:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.error("p2pkv tier: %d transfer(s) still running after the fetch deadline",
                          len(pending))
                return
            concurrent.futures.wait(pending, timeout=remaining)

    def shutdown(self) -> None:
        if self._run.closed:
            return
        self._run.closed = True
        self.drain_jobs()
        self._stores.shutdown(wait=True)
        self._adapters.shutdown()
        self._lookup.shutdown()
        self._run.close()

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
        self._policy.gauges(stats)
        if self._run.directory is not None:
            for name, delta in self._run.directory.deltas().items():
                stats.increase_counter(name, delta)
            stats.set_gauge(Metrics.DIRECTORY_REGISTERED, int(self._run.directory.registered()))
        return stats


def _chunk_tokens(spec: OffloadingSpec) -> int:
    """Prompt tokens behind one offload key: a chunk of ``blocks_per_chunk`` blocks, one
    key per KV-cache group."""
    groups = spec.tokens_per_block
    return max(1, max(groups) * spec.blocks_per_chunk // len(groups)) if groups else 1


def _first_chunk_tokens(spec: OffloadingSpec) -> int:
    """Tokens up to the end of a request's first offload chunk (the longest of its
    groups' chunks): a key whose position is at most this is a first chunk."""
    groups = spec.tokens_per_block
    return max(groups) * spec.blocks_per_chunk if groups else 1


def _first_chunk(key: OffloadKey, req_context: ReqContext, tokens: int) -> bool:
    """True for the offload key of a request's first chunk (of its group): its end
    position, as the scheduler recorded it, is at most ``tokens``."""
    position = req_context.get_offload_key_position(key)
    return position is not None and position <= tokens


def _job_chunks(job: TransferJob, what: str) -> tuple[list[OffloadKey], list[int]]:
    """A job's keys and the primary-region chunk of each (they must pair up)."""
    keys = list(job.keys)
    chunk_ids = np.asarray(job.chunk_ids).tolist()
    if len(keys) != len(chunk_ids):
        raise ValueError(f"{what} job {job.job_id}: {len(keys)} keys for "
                         f"{len(chunk_ids)} chunks")
    return keys, chunk_ids

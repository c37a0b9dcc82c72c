"""The transfer jobs of a :class:`~p2pkv.integrations.vllm.P2PKVTier`: loads into vLLM's
primary region and stores out of it.

- A **load** job fetches its chunks straight into the region's rows (``recv_into``: no
  intermediate copy): one fetch per peer that holds some of them, or, with a directory,
  one striped, failing-over prefix fetch for the whole job. The node's IO thread settles
  each fetch; once all are settled the job is counted and reported, and the keys that
  did not land are named so that vLLM recomputes them.
- A **store** job copies its chunks out of the region into the node's pool on the store
  thread, under the keys the request's adapter shares them under (see ``adapters.py``),
  first waiting, bounded, for the identity when the node has not started yet.

Every future still in flight is kept, so that :meth:`TierTransfers.drain` waits for
whatever still touches the region; finished jobs queue until vLLM collects them.
Thread-safe: the state is guarded by the lock the tier shares with its other parts (it
also guards the tier's metrics, which the ``count`` callback increments).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from p2pkv.cluster import PrefixFetch
from p2pkv.errors import P2PKVError, PeerGone
from p2pkv.integrations.vllm.adapters import RequestAdapter, RequestAdapters, first_chunk
from p2pkv.integrations.vllm.loads import DIRECTORY, TierLoads
from p2pkv.integrations.vllm.metrics import (
    NO_HOLDER,
    TIER_DISABLED,
    Metrics,
    load_failure_reason,
)
from p2pkv.integrations.vllm.peers import Count, Peers
from p2pkv.integrations.vllm.starter import TierNode
from p2pkv.node import FetchResult, KeyOutcome, Node, PeerHandle

log = logging.getLogger("vllm.p2pkv")

__all__ = ["LoadJob", "TierTransfers"]


@dataclass
class LoadJob:
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


class TierTransfers:
    """The loads and stores of one tier, over its primary region ``rows`` (chunk ``c``
    is ``rows[c * row : (c + 1) * row]``)."""

    def __init__(self, run: TierNode, rows: memoryview, *, row: int, peers: Peers,
                 policy: TierLoads, adapters: RequestAdapters, lock: threading.Lock,
                 count: Count, fetch_timeout: float, identity_timeout: float,
                 drain_grace: float, first_chunk_tokens: int) -> None:
        self._run = run
        self._rows = rows
        self._row = row
        self._peers = peers
        self._policy = policy
        self._adapters = adapters
        self._lock = lock
        self._count = count
        self._fetch_timeout = fetch_timeout
        self._identity_timeout = identity_timeout
        self._drain_grace = drain_grace
        self._first_chunk_tokens = first_chunk_tokens
        self._finished: collections.deque[tuple[JobResult, list[OffloadKey]]] = \
            collections.deque()
        self._loads: dict[int, LoadJob] = {}
        self._outstanding: set[Future[Any]] = set()
        self._stores = concurrent.futures.ThreadPoolExecutor(1, "p2pkv-vllm-store")

    # ------------------------------------------------------------------ loads

    def load(self, job_metadata: TransferJob) -> None:
        """Start a load job (scheduler thread; it only submits fetches)."""
        node = self._run.ensure()
        engine_keys, chunk_ids = _job_chunks(job_metadata, "load")
        shared = self._adapters.keys(job_metadata.req_context.req_id, engine_keys)
        keys = shared.keys if shared.keys is not None else list(engine_keys)
        by_peer: dict[str, list[tuple[bytes, int]]] = {}
        job = LoadJob(job_metadata.job_id, keys, pending=0, engine_keys=engine_keys)
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
        row = self._row
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

    def _load_through_directory(self, job: LoadJob, chunk_ids: list[int]) -> None:
        """One striped, failing-over prefix fetch for the whole job (see directory.py)."""
        assert self._run.directory is not None
        row = self._row
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

    def _prefix_fetched(self, job: LoadJob, fut: Future[PrefixFetch]) -> None:
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

    def _fetched(self, job: LoadJob, n: int, handle: PeerHandle,
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

    def _load_done(self, job: LoadJob, n: int, result: FetchResult | None,
                   exc: BaseException | None, *, missing: int = 0) -> None:
        """Settle ``n`` chunks of ``job`` (see :meth:`LoadJob.settle`); once all are
        settled, count them and report the job."""
        if exc is not None:
            log.warning("p2pkv tier: load job %d: %d chunk(s) failed: %s", job.job_id, n, exc)
        with self._lock:
            if not job.settle(n, result, exc, missing):
                return
            self._loads.pop(job.job_id, None)
            row = self._row
            finished, failed = job.report(row)
            loaded = len(job.keys) - len(failed)
            self._count(Metrics.LOADED_BLOCKS, loaded, ())
            self._count(Metrics.LOADED_BYTES, loaded * row, ())
            for kind, count in job.failures.items():
                self._count(Metrics.LOAD_FAILURES, count, (kind,))
            self._finished.append((finished, failed))

    # ------------------------------------------------------------------ stores

    def store(self, job_metadata: TransferJob) -> None:
        """Start a store job (scheduler thread; the copy runs on the store thread)."""
        node = self._run.ensure()
        keys, chunk_ids = _job_chunks(job_metadata, "store")
        if node is None and not (self._run.identity.pending and self._run.failed is None
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
        row = self._row
        stored = 0
        failed = 0
        # Waits in short slices, so that a shutdown never waits for a digest.
        deadline = time.monotonic() + self._identity_timeout
        while (node is None and not self._run.closed and self._run.failed is None
               and time.monotonic() < deadline):
            node = self._run.ensure(wait=min(0.5, max(0.0, deadline - time.monotonic())))
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
                if shared.name_keys and first_chunk(engine_keys[i], job.req_context,
                                                    self._first_chunk_tokens):
                    node.put(shared.name_keys[i], chunk)
            except (P2PKVError, ValueError) as exc:
                failed += 1
                log.warning("p2pkv tier: cannot keep chunk %s: %s", key.hex()[:16], exc)
        with self._lock:
            self._count(Metrics.STORED_BLOCKS, stored, ())
            self._count(Metrics.STORED_BYTES, stored * row, ())
            self._finished.append((JobResult(
                job_id=job_id, success=failed == 0, transfer_time=time.perf_counter() - started,
                transfer_bytes=stored * row), []))

    # ------------------------------------------------------------------ both

    def finished(self) -> list[tuple[JobResult, list[OffloadKey]]]:
        """The jobs finished since the last call, each with the keys (vLLM's) it failed
        to load."""
        with self._lock:
            done = list(self._finished)
            self._finished.clear()
        return done

    def pending(self) -> bool:
        """Whether a job is in flight or finished and not collected yet."""
        with self._lock:
            return bool(self._outstanding or self._loads or self._finished)

    def drain(self) -> None:
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

    def close(self) -> None:
        """Stop the store thread, after the copies it was given (call :meth:`drain`
        first)."""
        self._stores.shutdown(wait=True)


def _job_chunks(job: TransferJob, what: str) -> tuple[list[OffloadKey], list[int]]:
    """A job's keys and the primary-region chunk of each (they must pair up)."""
    keys = list(job.keys)
    chunk_ids = np.asarray(job.chunk_ids).tolist()
    if len(keys) != len(chunk_ids):
        raise ValueError(f"{what} job {job.job_id}: {len(keys)} keys for "
                         f"{len(chunk_ids)} chunks")
    return keys, chunk_ids

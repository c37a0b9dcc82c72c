"""One striped, failing-over prefix fetch (the work of :meth:`Cluster.fetch_prefix`).

Keys go to the least loaded holder that lists them (a holder in slow start counts as
busier, one in quarantine is not asked), one fetch per holder, all in parallel; a
holder that dies, refuses or answers MISSING is replaced by another holder of the key
until none is left or the deadline passes. Failures and successes feed the consumer's
:class:`~p2pkv.cluster.health.HolderHealth`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future

from p2pkv.cluster.health import HolderHealth
from p2pkv.cluster.peers import PeerPool
from p2pkv.cluster.records import Holder, PrefixFetch, PrefixLookup
from p2pkv.errors import PeerGone, PeerTimeout, ProtocolError
from p2pkv.node import FetchResult, KeyOutcome, Node, PeerHandle
from p2pkv.runtime.tuning import WAIT_GRACE

__all__ = ["PrefixJob"]

log = logging.getLogger("p2pkv.cluster")



class PrefixJob:
    """One :meth:`Cluster.fetch_prefix`: assigns keys to holders, reassigns on failure."""

    def __init__(self, node: Node, pool: PeerPool, health: HolderHealth, found: PrefixLookup,
                 destinations: Sequence[Sequence[memoryview]] | None,
                 deadline: float) -> None:
        self.pool = pool
        self.health = health
        self.node = node
        self.found = found
        self.keys = found.prefix
        self.destinations = destinations
        self.deadline = deadline
        n = len(self.keys)
        self.outcomes: list[KeyOutcome | None] = [None] * n
        self.errors: dict[int, str] = {}
        self.sources: list[Holder | None] = [None] * n
        self.tried: list[set[Holder]] = [set() for _ in range(n)]
        self.said_missing: list[int] = [0] * n
        self.dead: set[Holder] = set()
        self.load: collections.Counter[Holder] = collections.Counter()
        self.stale = 0
        self.failovers = 0
        self.blocks = 0
        self.nbytes = 0
        self.active: dict[Future[FetchResult], tuple[Holder, list[int]]] = {}

    def run(self) -> PrefixFetch:
        t0 = time.monotonic()
        pending = list(range(len(self.keys)))
        while pending or self.active:
            if pending:
                self._assign(pending)
                pending = []
            if not self.active:
                continue
            # The node fails every sub-fetch by the deadline; the grace only guards a bug.
            timeout = max(0.0, self.deadline - time.monotonic()) + WAIT_GRACE
            done, _ = concurrent.futures.wait(
                list(self.active), timeout=timeout,
                return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:  # pragma: no cover - the node fails its futures by their deadline
                for holder, idx in self.active.values():
                    for i in idx:
                        self.outcomes[i] = KeyOutcome.FAILED
                        self.errors[i] = f"{_who(holder)}: no answer by the deadline"
                self.active.clear()
                break
            for fut in done:
                pending.extend(self._settle(fut))
            pending.sort()
        for i, o in enumerate(self.outcomes):
            if o is None:  # pragma: no cover - every key is settled above
                self.outcomes[i] = KeyOutcome.FAILED
                self.errors.setdefault(i, "not fetched")
        result = FetchResult(
            keys=self.keys, outcomes=tuple(o or KeyOutcome.FAILED for o in self.outcomes),
            errors={i: e for i, e in self.errors.items()
                    if self.outcomes[i] is KeyOutcome.FAILED},
            blocks=self.blocks, nbytes=self.nbytes, seconds=time.monotonic() - t0)
        return PrefixFetch(lookup=self.found, result=result, sources=tuple(self.sources),
                           stale=self.stale, failovers=self.failovers)

    def _assign(self, pending: list[int]) -> None:
        groups: dict[Holder, list[int]] = {}
        expired = time.monotonic() >= self.deadline
        health = self.health
        choices = [(i, [h for h in self.found.holders[i]
                        if h not in self.tried[i] and h not in self.dead
                        and not health.quarantined(h.address, h.node_id)])
                   for i in pending]
        # Keys with the fewest holders first, then each key to its least loaded holder:
        # the flexible keys even out what the constrained ones left.
        choices.sort(key=lambda item: len(item[1]))
        for i, candidates in choices:
            if expired or not candidates:
                self._give_up(i, expired)
                continue
            # Least loaded for its share: a holder in slow start counts as busier.
            holder = min(candidates, key=lambda h: (self.load[h] + 1)
                         / health.weight(h.address, h.node_id))
            self.load[holder] += 1
            if self.tried[i]:
                self.failovers += 1
            groups.setdefault(holder, []).append(i)
        for idx in groups.values():
            idx.sort()
        limit = self.node.config.max_keys_per_request
        for holder, idx in groups.items():
            for start in range(0, len(idx), limit):
                chunk = idx[start:start + limit]
                self.active[self._fetch_from(holder, chunk)] = (holder, chunk)

    def _give_up(self, i: int, expired: bool) -> None:
        listed = len(self.found.holders[i])
        if self.said_missing[i] == listed:
            self.outcomes[i] = KeyOutcome.MISSING
            return
        self.outcomes[i] = KeyOutcome.FAILED
        if expired:
            self.errors[i] = "deadline passed before another holder could be asked"
        else:
            self.errors.setdefault(i, "every holder failed or refused")

    def _fetch_from(self, holder: Holder, idx: list[int]) -> Future[FetchResult]:
        out: Future[FetchResult] = Future()
        keys = [self.keys[i] for i in idx]
        dests = (None if self.destinations is None
                 else [self.destinations[i] for i in idx])
        remaining = max(0.001, self.deadline - time.monotonic())
        handle_future = self.pool.handle_async(
            holder.address, timeout=min(remaining, self.node.config.handshake_timeout))

        def on_handle(f: Future[PeerHandle]) -> None:
            # Runs on the node's IO thread (or here, when already connected): only
            # queues the fetch, never waits.
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            left = self.deadline - time.monotonic()
            if left <= 0:
                out.set_exception(PeerTimeout("deadline passed while connecting"))
                return
            try:
                inner = (self.node.fetch_async(f.result(), keys, timeout=left) if dests is None
                         else self.node.fetch_into_async(f.result(), keys, dests, timeout=left))
            except Exception as exc2:
                out.set_exception(exc2)
                return
            inner.add_done_callback(lambda g: _relay(g, out))

        handle_future.add_done_callback(on_handle)
        return out

    def _settle(self, fut: Future[FetchResult]) -> list[int]:
        holder, idx = self.active.pop(fut)
        self.load[holder] -= len(idx)
        retry: list[int] = []
        exc = fut.exception()
        if exc is not None:
            self.dead.add(holder)
            if self.health.failed(holder.address, type(exc).__name__, holder.node_id):
                log.warning("holder %s quarantined after repeated failures (%s: %s)",
                            _who(holder), type(exc).__name__, exc)
            if isinstance(exc, (PeerGone, ProtocolError)):
                self.pool.drop(holder.address)
            log.info("holder %s failed (%s: %s); failing over %d key(s)", _who(holder),
                     type(exc).__name__, exc, len(idx))
            for i in idx:
                self.tried[i].add(holder)
                self.errors[i] = f"{_who(holder)}: {type(exc).__name__}: {exc}"
                retry.append(i)
            return retry
        result = fut.result()
        self.blocks += result.blocks
        self.nbytes += result.nbytes
        # Blocks that failed (a checksum, a write) count against the holder; a stale
        # entry (MISSING) does not.
        if KeyOutcome.FAILED in result.outcomes:
            if self.health.failed(holder.address, "failed blocks", holder.node_id):
                log.warning("holder %s quarantined after repeated failures (failed "
                            "blocks)", _who(holder))
        elif KeyOutcome.LANDED in result.outcomes:
            self.health.succeeded(holder.address)
        for j, i in enumerate(idx):
            outcome = result.outcomes[j]
            if outcome is KeyOutcome.LANDED:
                self.outcomes[i] = KeyOutcome.LANDED
                self.sources[i] = holder
                continue
            self.tried[i].add(holder)
            if outcome is KeyOutcome.MISSING:
                self.stale += 1
                self.said_missing[i] += 1
                self.errors[i] = f"{_who(holder)}: missing (stale directory entry)"
            else:
                self.errors[i] = f"{_who(holder)}: {result.errors.get(j, 'failed')}"
            retry.append(i)
        return retry


def _who(holder: Holder) -> str:
    return f"{holder.node_id} at {holder.address}"


def _relay(src: Future[FetchResult], dst: Future[FetchResult]) -> None:
    exc = src.exception()
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(src.result())

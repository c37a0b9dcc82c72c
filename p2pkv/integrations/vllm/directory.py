"""The tier's cluster directory: which engine holds a chunk, asked of Redis.

With ``"directory": "redis://HOST:PORT/DB"`` in the tier entry, a
:class:`~p2pkv.integrations.vllm.P2PKVTier` registers its node in the directory (under its
identity partition: fingerprint plus identity-extension digest, so incompatible engines
never see each other's chunks), announces the chunks it stores as they are committed and
evicted, answers a step's lookups with one Redis round trip (the longest prefix some
compatible engine holds), and loads through :meth:`~p2pkv.cluster.Cluster.fetch_prefix`:
striped across holders, failing over to another holder when one dies, refuses or no
longer has a chunk. The static ``peers`` stay the fallback when Redis is unreachable.

``pending-v1`` goes through the directory too: the chunks this engine computes are
announced there (:meth:`DirectorySource.announce_pending`, queued for the registration's
thread, never written on the scheduler thread), and a lookup's answer says which chunks
after the held prefix another engine is computing, and when it expects to store them
(:mod:`p2pkv.cluster.pending`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from p2pkv.cluster import Cluster, ClusterConfig, PrefixFetch
from p2pkv.integrations.vllm.metrics import Metrics
from p2pkv.node import Node

__all__ = ["DirectorySource"]

#: ClusterStats counters reported as vLLM metrics (cumulative -> per-interval deltas),
#: with their labels.
_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookups": (Metrics.DIRECTORY_LOOKUPS, ()),
    "hits": (Metrics.DIRECTORY_HITS, ()),
    "stale_entries": (Metrics.DIRECTORY_STALE, ()),
    "failovers": (Metrics.DIRECTORY_FAILOVERS, ()),
    "directory_errors": (Metrics.DIRECTORY_ERRORS, ()),
    "pending_announced": (Metrics.DIRECTORY_PENDING, ("announced",)),
    "pending_withdrawn": (Metrics.DIRECTORY_PENDING, ("withdrawn",)),
    "pending_dropped": (Metrics.DIRECTORY_PENDING, ("dropped",)),
}


class DirectorySource:
    """Lookups and loads of one tier through a :class:`~p2pkv.cluster.Cluster`."""

    def __init__(self, node: Node, url: str, *, peers: Sequence[str], extension: str,
                 ttl: float, lookup_timeout: float, fetch_timeout: float,
                 advertise: str | None) -> None:
        self.cluster = Cluster(
            node, directory=url, peers=peers, extension=extension, advertise=advertise,
            config=ClusterConfig(ttl=ttl, lookup_timeout=lookup_timeout,
                                 fetch_timeout=fetch_timeout))
        self._fetch_timeout = fetch_timeout
        self._lock = threading.Lock()
        self._reported = dict.fromkeys(_COUNTERS, 0)

    def ask(self, keys: list[bytes]) -> tuple[list[bool], list[float]]:
        """Lookup thread: the leading keys some compatible engine holds, and per key the
        seconds until another engine computing it expects to hold it (0.0: nobody)."""
        found = self.cluster.lookup_prefix(keys)
        return ([i < found.length for i in range(len(keys))],
                list(found.due) if found.due else [0.0] * len(keys))

    def announce_pending(self, keys: Sequence[bytes], seconds: Sequence[float]) -> None:
        """This engine computes ``keys``: queued for the directory (never blocks)."""
        self.cluster.announce_pending(keys, seconds)

    def withdraw_pending(self, keys: Sequence[bytes]) -> None:
        """This engine no longer computes ``keys`` (never blocks)."""
        self.cluster.withdraw_pending(keys)

    def load(self, keys: Sequence[bytes],
             destinations: Sequence[Sequence[memoryview]]) -> Future[PrefixFetch]:
        """Fetch ``keys`` into ``destinations`` (one row each) on a cluster worker."""
        return self.cluster.fetch_prefix_async(keys, destinations,
                                               timeout=self._fetch_timeout)

    def deltas(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """Counter increments since the last call, by metric name and labels."""
        stats = self.cluster.stats()
        out: dict[tuple[str, tuple[str, ...]], int] = {}
        with self._lock:
            for field, metric in _COUNTERS.items():
                value = int(getattr(stats, field))
                if value > self._reported[field]:
                    out[metric] = value - self._reported[field]
                self._reported[field] = value
        return out

    def registered(self) -> bool:
        return self.cluster.member is not None

    def describe(self) -> dict[str, Any]:
        stats = self.cluster.stats()
        return {"backend": stats.backend, "partition": stats.partition,
                "registered": stats.registered, "address": self.cluster.address}

    def close(self) -> None:
        self.cluster.close()


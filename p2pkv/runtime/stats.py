"""The node's counters: thread-safe, written by the IO thread, read by ``Node.stats()``."""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from p2pkv.runtime.tuning import LATENCY_BUCKETS

__all__ = ["Counters", "CountersSnapshot"]


@dataclass(frozen=True)
class CountersSnapshot:
    counts: dict[str, int]
    refusals: dict[str, int]
    #: Cumulative (upper bound in seconds, count) pairs of fetch latency, +inf last.
    latency_buckets: tuple[tuple[float, int], ...]
    latency_sum: float

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)


class Counters:
    """Named event counts, refusals by reason, and the fetch latency histogram."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._refusals: collections.Counter[str] = collections.Counter()
        self._latency = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def refused(self, reasons: Iterable[str]) -> None:
        """One refused handshake, counted once under each of its reason kinds."""
        with self._lock:
            for reason in reasons:
                self._refusals[reason] += 1

    def fetch_finished(self, seconds: float) -> None:
        with self._lock:
            self._latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self._latency_sum += seconds

    def snapshot(self) -> CountersSnapshot:
        with self._lock:
            return CountersSnapshot(
                counts=dict(self._counts), refusals=dict(self._refusals),
                latency_buckets=tuple(zip(LATENCY_BUCKETS, itertools.accumulate(self._latency),
                                          strict=True)),
                latency_sum=self._latency_sum)

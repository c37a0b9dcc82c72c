"""The node's counters: thread-safe, written by the IO thread, read by ``Node.stats()``."""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2pkv import protocol as proto
from p2pkv.runtime.tuning import LATENCY_BUCKETS

__all__ = ["Counters", "CountersSnapshot"]

log = logging.getLogger("p2pkv.node")


@dataclass(frozen=True)
class CountersSnapshot:
    counts: dict[str, int]
    refusals: dict[str, int]
    #: Lenient acceptances by identity-extension field only one side declared.
    undeclared: dict[str, int]
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
        self._undeclared: collections.Counter[str] = collections.Counter()
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

    def undeclared(self, who: str, warnings: Sequence[proto.Reason]) -> None:
        """Identity fields only one side declared, let through by the lenient policy:
        counted by field name (without the ``ext.`` prefix) and logged once."""
        if not warnings:
            return
        with self._lock:
            for reason in warnings:
                self._undeclared[reason.field.removeprefix("ext.")] += 1
        log.warning("accepted %s under identity_policy=lenient although only one side "
                    "declares: %s", who, "; ".join(r.describe() for r in warnings))

    def fetch_finished(self, seconds: float) -> None:
        with self._lock:
            self._latency[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self._latency_sum += seconds

    def snapshot(self) -> CountersSnapshot:
        with self._lock:
            return CountersSnapshot(
                counts=dict(self._counts), refusals=dict(self._refusals),
                undeclared=dict(self._undeclared),
                latency_buckets=tuple(zip(LATENCY_BUCKETS, itertools.accumulate(self._latency),
                                          strict=True)),
                latency_sum=self._latency_sum)

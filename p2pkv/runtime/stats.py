"""The node's counters: thread-safe, written by the IO thread, read by ``Node.stats()``.

What is counted is named by :class:`Count` and :class:`ShmFallback` (typed, so a typo
is a mypy error rather than a counter that stays at zero).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from p2pkv import protocol as proto
from p2pkv.runtime.public import PathStats
from p2pkv.runtime.tuning import LATENCY_BUCKETS

__all__ = ["RECEIVED", "SENT", "Count", "Counters", "CountersSnapshot", "ShmFallback",
           "path_stats"]

#: Every data path's kind (the keys of ``NodeStats.paths``; see p2pkv.runtime.paths).
PATH_KINDS = ("zmq", "packed", "shm", "stream", "nixl")

SENT = "sent"
RECEIVED = "received"

log = logging.getLogger("p2pkv.node")


class Count(Enum):
    """An event the node counts (most become a field of ``NodeStats``)."""

    HANDSHAKES_ACCEPTED = "handshakes_accepted"
    LOOKUPS_SERVED = "lookups_served"
    LOOKUP_KEYS_SERVED = "lookup_keys_served"
    LOOKUP_HITS_SERVED = "lookup_hits_served"
    BLOCKS_SENT = "blocks_sent"
    BYTES_SENT = "bytes_sent"
    BLOCKS_RECEIVED = "blocks_received"
    BYTES_RECEIVED = "bytes_received"
    CHECKSUM_FAILURES = "checksum_failures"
    PROTOCOL_VIOLATIONS = "protocol_violations"
    SHM_ATTACHED = "shm_attached"
    SHM_ATTACH_REFUSED = "shm_attach_refused"
    FETCHES_DECLINED_DRAINING = "fetches_declined_draining"
    DATA_STREAMS_BOUND = "data_streams_bound"
    DATA_STREAMS_REFUSED = "data_streams_refused"
    DATA_STREAMS_OPENED = "data_streams_opened"
    DATA_FALLBACKS = "data_fallbacks"
    DATA_PINS_REFUSED = "data_pins_refused"
    DATA_RECORDS_REFUSED = "data_records_refused"


class ShmFallback(Enum):
    """Why an outbound connection to a peer that offers ``shm-v1`` stays on TCP (the
    values are the keys of ``NodeStats.shm_fallbacks``)."""

    NO_SEGMENT = "no_segment"
    CANNOT_MAP = "cannot_map"
    REFUSED = "refused"


@dataclass(frozen=True)
class CountersSnapshot:
    counts: dict[Count, int]
    #: Connections left on TCP, by :class:`ShmFallback` value.
    shm_fallbacks: dict[str, int]
    refusals: dict[str, int]
    #: Lenient acceptances by identity-extension field only one side declared.
    undeclared: dict[str, int]
    #: Cumulative (upper bound in seconds, count) pairs of fetch latency, +inf last.
    latency_buckets: tuple[tuple[float, int], ...]
    latency_sum: float
    #: Blocks and bytes moved, by (path kind, SENT or RECEIVED), see
    #: :meth:`Counters.moved`; and (kind, "stalled"): (peers cut, 0).
    paths: dict[tuple[str, str], tuple[int, int]]

    def __getitem__(self, count: Count) -> int:
        return self.counts.get(count, 0)

    def fields(self, names: Iterable[str]) -> dict[str, int]:
        """Every count whose name is one of ``names`` (the fields of ``NodeStats``), by
        name: a counter that has a field shows up in ``stats()`` without more wiring."""
        wanted = set(names)
        return {c.value: self[c] for c in Count if c.value in wanted}


class Counters:
    """Event counts, refusals by reason, and the fetch latency histogram."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[Count] = collections.Counter()
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._refusals: collections.Counter[str] = collections.Counter()
        self._undeclared: collections.Counter[str] = collections.Counter()
        self._latency = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0
        self._paths: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def add(self, count: Count, n: int = 1) -> None:
        with self._lock:
            self._counts[count] += n

    def moved(self, kind: str, direction: str, blocks: int, nbytes: int) -> None:
        """``blocks`` (``nbytes`` of them) went ``direction`` (SENT or RECEIVED) on a
        data path of ``kind`` (``p2pkv.runtime.paths.frames.KINDS``): every path counts the same
        way, and the totals (``blocks_sent``, ``blocks_received``) are counted apart."""
        if blocks:
            with self._lock:
                self._paths[(kind, direction, "blocks")] += blocks
                self._paths[(kind, direction, "bytes")] += nbytes

    def stalled(self, kind: str) -> None:
        """A peer was cut at the send deadline for taking nothing on a path of ``kind``."""
        with self._lock:
            self._paths[(kind, "stalled", "blocks")] += 1

    def fell_back(self, why: ShmFallback) -> None:
        """One outbound connection stays on TCP although the peer offers ``shm-v1``."""
        with self._lock:
            self._fallbacks[why.value] += 1

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
                counts=dict(self._counts), shm_fallbacks=dict(self._fallbacks),
                refusals=dict(self._refusals),
                undeclared=dict(self._undeclared),
                latency_buckets=tuple(zip(LATENCY_BUCKETS, itertools.accumulate(self._latency),
                                          strict=True)),
                latency_sum=self._latency_sum,
                paths={(kind, direction): (self._paths[(kind, direction, "blocks")],
                                           self._paths[(kind, direction, "bytes")])
                       for kind, direction, what in list(self._paths) if what == "blocks"})


def path_stats(paths: dict[tuple[str, str], tuple[int, int]]) -> dict[str, PathStats]:
    """``NodeStats.paths``: one :class:`~p2pkv.runtime.public.PathStats` per kind."""
    def get(kind: str, what: str) -> tuple[int, int]:
        return paths.get((kind, what), (0, 0))

    return {kind: PathStats(
        blocks_sent=get(kind, SENT)[0], bytes_sent=get(kind, SENT)[1],
        blocks_received=get(kind, RECEIVED)[0], bytes_received=get(kind, RECEIVED)[1],
        readers_stalled=get(kind, "stalled")[0]) for kind in PATH_KINDS}

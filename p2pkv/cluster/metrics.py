"""Prometheus metrics of the cluster layer (read from :meth:`Cluster.stats` at scrape)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["ClusterCollector"]


class ClusterCollector:
    """A ``prometheus_client`` collector over one :class:`~p2pkv.cluster.Cluster`."""

    def __init__(self, cluster: Any) -> None:
        self._cluster = cluster

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._cluster.stats()
        for name, value, doc in (
            ("p2pkv_directory_lookups", s.lookups, "Prefix lookups asked of the directory"),
            ("p2pkv_directory_lookup_keys", s.lookup_keys, "Keys in prefix lookups"),
            ("p2pkv_directory_hits", s.hits, "Keys found in the longest available prefix"),
            ("p2pkv_directory_stale_entries", s.stale_entries,
             "Keys a listed holder answered MISSING (stale directory entries met)"),
            ("p2pkv_directory_failovers", s.failovers,
             "Keys fetched again from another holder"),
            ("p2pkv_directory_errors", s.directory_errors, "Directory calls that failed"),
            ("p2pkv_directory_registrations", s.registrations, "Registrations in Redis"),
            ("p2pkv_directory_registrations_lost", s.registrations_lost,
             "Registrations lost (Redis unreachable or restarted, TTL passed)"),
            ("p2pkv_directory_quarantines", s.quarantines,
             "Holders put in quarantine after repeated failures"),
            ("p2pkv_directory_quarantine_reports", s.quarantine_reports,
             "Times this node published its quarantine verdicts to the directory"),
            ("p2pkv_directory_claims_lost", s.claims_lost,
             "Claims of this node Redis lost (a failover); the node published them again"),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        announced = CounterMetricFamily("p2pkv_directory_announced_blocks",
                                        "Block keys announced to the directory, by change",
                                        labels=["change"])
        announced.add_metric(["stored"], s.announced_stored)
        announced.add_metric(["removed"], s.announced_removed)
        yield announced
        pending = CounterMetricFamily(
            "p2pkv_directory_pending_keys",
            "Pending keys (pending-v1) written to the directory, by change: announced "
            "(renewals included), withdrawn, dropped (queue full or not registered)",
            labels=["change"])
        pending.add_metric(["announced"], s.pending_announced)
        pending.add_metric(["withdrawn"], s.pending_withdrawn)
        pending.add_metric(["dropped"], s.pending_dropped)
        yield pending
        registered = GaugeMetricFamily("p2pkv_directory_registered",
                                       "1 while registered in the directory",
                                       labels=["backend"])
        registered.add_metric([s.backend], 1.0 if s.registered else 0.0)
        yield registered
        yield GaugeMetricFamily("p2pkv_directory_quarantined",
                                "Holders in quarantine now (left out of lookups and fetches)",
                                value=len(s.quarantined))

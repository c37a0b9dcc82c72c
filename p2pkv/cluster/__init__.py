"""The cluster layer: which compatible node holds the longest prefix of a request.

``Cluster(node, directory=None | "redis://HOST:PORT/DB", peers=[...])`` gives
:meth:`~Cluster.lookup_prefix` (how many leading keys are available, and from whom)
and :meth:`~Cluster.fetch_prefix` (fetch them, striped across holders, failing over).
See :mod:`p2pkv.cluster.cluster` for the backends and ``docs/cluster.md`` for the
numbers.
"""

from __future__ import annotations

from p2pkv.cluster.cluster import Cluster, ClusterConfig, ClusterStats
from p2pkv.cluster.records import (
    DirectoryError,
    Holder,
    NodeRecord,
    PrefixFetch,
    PrefixLookup,
    QuarantineReport,
    advertised_address,
    longest_prefix,
    partition_key,
)
from p2pkv.cluster.redis_directory import (
    DirectoryView,
    Member,
    MemberView,
    RedisDirectory,
)
from p2pkv.cluster.registration import RedisRegistration

__all__ = [
    "Cluster",
    "ClusterConfig",
    "ClusterStats",
    "DirectoryError",
    "DirectoryView",
    "Holder",
    "Member",
    "MemberView",
    "NodeRecord",
    "PrefixFetch",
    "PrefixLookup",
    "QuarantineReport",
    "RedisDirectory",
    "RedisRegistration",
    "advertised_address",
    "longest_prefix",
    "partition_key",
]

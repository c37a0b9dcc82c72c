"""The cluster layer: find the longest prefix anyone compatible holds, and fetch it.

A :class:`Cluster` sits above one :class:`~p2pkv.node.Node` and uses only its public
API. Two directory backends answer "who holds these keys":

* **static** (the default, no server): a list of peer addresses. A lookup fans out to
  every peer in parallel under one deadline; peers that refuse the handshake or do not
  answer in time are left out (and named in ``PrefixLookup.errors``).
* **redis** (``directory="redis://HOST:PORT/DB"``): the node registers itself with a
  TTL its heartbeat renews and publishes the keys its store commits and evicts, in
  batches, and the keys it is computing (:meth:`Cluster.announce_pending`); a lookup is
  one round trip to Redis, and says which keys after the prefix another member is
  computing and when it expects to hold them. Entries are partitioned by identity
  (fingerprint plus identity-extension digest). While Redis is unreachable the node
  keeps serving, lookups fall back to a fan-out over the peers it is connected to, and
  it registers again (republishing its block set) once Redis is back.

Either way the handshake stays the authority: a holder the directory names is still
refused when its identity differs, and a stale entry only costs a ``MISSING`` answer,
after which :meth:`Cluster.fetch_prefix` asks another holder.

Threading: every public method is thread-safe. ``fetch_prefix`` blocks its caller;
``fetch_prefix_async`` runs it on a small pool of worker threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from p2pkv.cluster.fanout import ask_peers, merged
from p2pkv.cluster.health import HealthConfig, HolderHealth
from p2pkv.cluster.peers import PeerPool
from p2pkv.cluster.records import (
    DirectoryError,
    Holder,
    NodeRecord,
    PrefixFetch,
    PrefixLookup,
    advertised_address,
    longest_prefix,
    partition_key,
)
from p2pkv.cluster.redis_directory import (
    Member,
    RedisDirectory,
    validate_redis_url,
)
from p2pkv.cluster.registration import RedisRegistration
from p2pkv.cluster.striping import PrefixJob
from p2pkv.errors import ConfigError, PeerGone
from p2pkv.keys import check_keys
from p2pkv.node import Node
from p2pkv.protocol.codes import MAX_KEY_LEN
from p2pkv.protocol.options import option, seconds
from p2pkv.transport import validate_address

__all__ = ["Cluster", "ClusterConfig", "ClusterStats"]

log = logging.getLogger("p2pkv.cluster")

#: ClusterStats.backend by the directory URL's kind.
_BACKENDS = {"redis": "redis", "sentinel": "redis-sentinel", "cluster": "redis-cluster"}


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster-layer settings; times in seconds.

    ``ttl``: how long a Redis registration lives without a heartbeat (a node that dies
    without deregistering disappears after it). ``heartbeat``: renewal period (default
    ``ttl / 3``). ``announce_interval``: how often committed and evicted keys are
    published (in batches). ``redis_timeout``: socket timeout of every Redis call.
    ``refusal_backoff``: how long a peer that refused the handshake is not asked again.
    ``lookup_timeout``/``fetch_timeout``: defaults of the calls (None: the node's).
    """

    ttl: float = option("directory_ttl").default
    heartbeat: float | None = None
    announce_interval: float = 0.05
    redis_timeout: float = 1.0
    namespace: str = "p2pkv"
    refusal_backoff: float = option("refused_retry_interval").default
    lookup_timeout: float | None = None
    fetch_timeout: float | None = None
    fetch_workers: int = 4
    #: Quarantine of failing holders and slow start of new ones (p2pkv.cluster.health).
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        required = ("ttl", "announce_interval", "redis_timeout", "refusal_backoff")
        for name in (*required, "heartbeat", "lookup_timeout", "fetch_timeout"):
            value = getattr(self, name)
            if value is not None or name in required:  # None: the node's or the TTL's
                object.__setattr__(self, name, seconds(value, name))
        if self.heartbeat is not None and self.heartbeat >= self.ttl:
            raise ConfigError(f"heartbeat ({self.heartbeat}) must be shorter than ttl "
                              f"({self.ttl})")
        if type(self.fetch_workers) is not int or self.fetch_workers < 1:
            raise ConfigError(f"fetch_workers must be a positive int, got {self.fetch_workers!r}")


@dataclass(frozen=True)
class ClusterStats:
    """A snapshot of the cluster layer's counters.

    ``lookups``/``lookup_keys``: prefix lookups and keys asked; ``hits``: keys found in
    the prefixes; ``directory_errors``: Redis calls that failed (each lookup among them
    fell back to the connected peers); ``stale_entries``: keys a listed holder answered
    MISSING; ``failovers``: keys fetched again from another holder; ``registered``:
    whether the node is registered in Redis now (always False for static).
    ``backend``: the deployment, ``"static"``, ``"redis"`` (one server),
    ``"redis-sentinel"`` or ``"redis-cluster"``.
    """

    backend: str
    partition: str
    registered: bool
    member: int | None
    lookups: int
    lookup_keys: int
    hits: int
    directory_errors: int
    fetches: int
    fetched_blocks: int
    stale_entries: int
    failovers: int
    registrations: int
    registrations_lost: int
    announced_stored: int
    announced_removed: int
    swept_members: int
    #: Holders put in quarantine so far, and the holders in quarantine now (address:
    #: seconds left, after how many quarantines in a row, the last failure).
    quarantines: int = 0
    quarantined: dict[str, tuple[float, int, str]] = field(default_factory=dict)
    #: Times the quarantine verdicts were published to the directory (they change).
    quarantine_reports: int = 0
    #: Claims of this node that Redis no longer counted (lost in a failover; each time,
    #: the node registered again and republished its blocks).
    claims_lost: int = 0
    #: Pending keys (pending-v1) written to the directory: announced (renewals
    #: included), withdrawn, and dropped (queue full, or not registered at the time).
    pending_announced: int = 0
    pending_withdrawn: int = 0
    pending_dropped: int = 0


class Cluster:
    """Longest-prefix lookups and striped, failing-over fetches over a directory.

    ``directory``: None or ``"static"`` for the peer list, or a ``redis://`` URL.
    ``peers``: addresses to fan out to (static) and to fall back on (redis).
    ``extension``: the node's identity-extension digest (empty: none); it joins the
    fingerprint in the partition key, so nodes whose extensions differ never see each
    other's blocks. Lifecycle: construct (registers and starts announcing at once, in
    the background) → use → :meth:`close` (withdraws the node's claims; does not close
    the node).
    """

    def __init__(self, node: Node, *, directory: str | None = None,
                 peers: Sequence[str] = (), extension: str = "",
                 config: ClusterConfig | None = None, advertise: str | None = None) -> None:
        self.node = node
        #: The address registered for this node: ``advertise``, or the node's own with a
        #: wildcard host (``tcp://0.0.0.0:P``) replaced by this host's address.
        if advertise is not None:
            validate_address(advertise, what="advertise")
        self.address = advertise or advertised_address(node.address)
        self.config = config or ClusterConfig()
        try:
            self.partition = partition_key(node.fingerprint, extension)
        except ValueError as exc:
            raise ConfigError(f"identity extension: {exc}") from exc
        self.extension = extension
        self._peers = tuple(dict.fromkeys(peers))
        self._pool = PeerPool(node, refusal_backoff=self.config.refusal_backoff)
        self.health = HolderHealth(self.config.health)
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.directory: RedisDirectory | None = None
        self._registration: RedisRegistration | None = None
        if directory is None or directory == "static":
            self.backend = "static"
        else:
            validate_redis_url(directory)
            self.directory = RedisDirectory(directory, namespace=self.config.namespace,
                                            socket_timeout=self.config.redis_timeout)
            self.backend = _BACKENDS[self.directory.kind]
            self._registration = RedisRegistration(
                self.directory,
                lambda: NodeRecord.for_node(node, extension=extension, address=self.address),
                node.store.stored_keys, ttl=self.config.ttl, heartbeat=self.config.heartbeat,
                announce_interval=self.config.announce_interval, on_event=self._count,
                reports=lambda: self.health.reports())
            # Listen first, then let the registration snapshot the store: nothing is missed.
            node.store.add_listener(self._registration.changed)
            self._registration.start()
        for address in self._peers:  # connect in the background; lookups wait if needed
            self._pool.handle_async(address)

    # -- lifecycle ------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, deregister: bool = True) -> None:
        """Stop announcing and (``deregister``) withdraw this node's claims. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._registration is not None:
            self.node.store.remove_listener(self._registration.changed)
            self._registration.close(deregister=deregister)
        if self.directory is not None:
            self.directory.close()

    @property
    def member(self) -> Member | None:
        """This node's current Redis registration (None: static, or not registered now)."""
        return self._registration.member if self._registration is not None else None

    def wait_registered(self, timeout: float) -> bool:
        """Wait until the node is registered in Redis (True) or ``timeout`` passes; False
        at once without a Redis directory (a static cluster never registers)."""
        if self._registration is None:
            return False
        return self._registration.wait_member(timeout) is not None

    def flush(self) -> None:
        """Publish the queued store changes now instead of at the next interval."""
        if self._registration is not None:
            self._registration.flush()

    # -- pending keys (pending-v1) --------------------------------------------------

    def announce_pending(self, keys: Sequence[bytes], seconds: Sequence[float]) -> None:
        """This node computes ``keys[i]`` and expects to hold it in ``seconds[i]``
        seconds: other members' lookups report it pending (``PrefixLookup.due``) until
        it is withdrawn, stored (its claim withdraws it) or overdue by its estimate and
        at least ``MIN_OVERDUE``. Never blocks: queued for the registration's thread
        (dropped, and counted, while unregistered or when the queue is full). Without
        a Redis directory it does nothing: the node answers static peers itself
        (:meth:`~p2pkv.node.Node.announce_pending`)."""
        keys = _check_keys(keys)
        if len(keys) != len(seconds):
            raise ValueError(f"announce_pending: {len(keys)} keys but {len(seconds)} "
                             f"estimates")
        if self._registration is not None:
            self._registration.announce_pending(keys, seconds)

    def withdraw_pending(self, keys: Sequence[bytes]) -> None:
        """This node no longer computes ``keys`` (never blocks; see
        :meth:`announce_pending`)."""
        keys = _check_keys(keys)
        if self._registration is not None:
            self._registration.withdraw_pending(keys)

    # -- lookups --------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes], *,
                      timeout: float | None = None) -> PrefixLookup:
        """How many leading ``keys`` some compatible node holds, and who holds each.

        One round trip to Redis, or one parallel fan-out to the peers, bounded by
        ``timeout`` (default: the node's ``lookup_timeout``). Never raises for an
        unreachable directory or peer: those are named in ``errors``.
        """
        keys = _check_keys(keys)
        t0 = time.monotonic()
        budget = timeout or self.config.lookup_timeout or self.node.config.lookup_timeout
        deadline = t0 + budget
        errors: dict[str, str] = {}
        holders: list[tuple[Holder, ...]] | None = None
        due: list[float] = []
        source = "peers"
        if self.directory is not None:
            try:
                holders, due = self.directory.lookup_pending(self.partition, keys,
                                                             exclude=self.member)
                # A claim of this node's under an older registration (not yet expired)
                # is not a holder either.
                me = (self.node.address, self.address)
                holders = [tuple(h for h in found if h.address not in me) for found in holders]
                source = "redis"
            except DirectoryError as exc:
                self._count("directory_errors", 1)
                errors["directory"] = str(exc)
        if holders is None:
            addresses = list(self._peers)
            if self.directory is not None:
                addresses += [h.address for h in self._pool.connected()]
            holders, due = self._fan_out(list(dict.fromkeys(addresses)), keys, deadline,
                                         errors)
        # A holder in quarantine is no holder: a hit it would fail is a miss now.
        holders = [tuple(h for h in found
                         if not self.health.quarantined(h.address, h.node_id))
                   for found in holders]
        length = longest_prefix(holders)
        due = [0.0 if i < length else d for i, d in enumerate(due)]
        result = PrefixLookup(keys=keys, length=length, holders=tuple(holders[:length]),
                              source=source, seconds=time.monotonic() - t0, errors=errors,
                              due=tuple(due) if any(due) else ())
        with self._lock:
            self._counters["lookups"] += 1
            self._counters["lookup_keys"] += len(keys)
            self._counters["hits"] += length
        return result

    def _fan_out(self, addresses: list[str], keys: tuple[bytes, ...], deadline: float,
                 errors: dict[str, str]) -> tuple[list[tuple[Holder, ...]], list[float]]:
        """Each peer's holders of ``keys`` and, for a key none holds, the soonest a peer
        computing it expects to hold it (pending-v1; 0.0: nobody), as the directory
        answers them: a lookup that falls back here still sees what peers compute."""
        if not keys or not addresses:
            return [()] * len(keys), [0.0] * len(keys)
        remaining = max(0.001, deadline - time.monotonic())
        asked = ask_peers(self.node, {
            self._pool.handle_async(a, timeout=remaining): a
            for a in addresses if a not in (self.node.address, self.address)}, keys, deadline)
        for address, _, exc in asked.failed:
            errors[address] = f"{type(exc).__name__}: {exc}"
        for address, handle, _ in asked.lost():
            self._pool.drop(address, handle)
        per_key, due = merged(asked.answers, len(keys))
        return [tuple(Holder(a.handle.remote_node_id, a.address) for a in found)
                for found in per_key], due

    # -- fetches --------------------------------------------------------------------

    def fetch_prefix_async(self, keys: Sequence[bytes],
                           destinations: Sequence[Sequence[memoryview]] | None = None, *,
                           timeout: float | None = None,
                           lookup: PrefixLookup | None = None) -> Future[PrefixFetch]:
        """:meth:`fetch_prefix` on a worker thread."""
        with self._lock:
            if self._closed:
                raise PeerGone("cluster is closed")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self.config.fetch_workers, thread_name_prefix="p2pkv-cluster")
            executor = self._executor
        return executor.submit(self.fetch_prefix, keys, destinations, timeout=timeout,
                               lookup=lookup)

    def fetch_prefix(self, keys: Sequence[bytes],
                     destinations: Sequence[Sequence[memoryview]] | None = None, *,
                     timeout: float | None = None,
                     lookup: PrefixLookup | None = None) -> PrefixFetch:
        """Fetch the longest available prefix of ``keys``, striped across its holders.

        Keys go to the least loaded holder that lists them, one fetch per holder, all in
        parallel. A holder that dies, refuses the handshake or answers MISSING for a key
        (a stale entry) is replaced by another holder of that key, until none is left or
        ``timeout`` (default: the node's ``fetch_timeout``, lookup included) passes.
        Per-key outcomes are those of :meth:`~p2pkv.node.Node.fetch`: MISSING when every
        listed holder said so, FAILED (with the reason) otherwise.

        ``destinations`` (one list of segment buffers per key of ``keys``, as for
        :meth:`~p2pkv.node.Node.fetch_into`) lands blocks in caller-owned memory instead
        of the node's store. ``lookup`` reuses an earlier :meth:`lookup_prefix` of the
        same keys.
        """
        keys = _check_keys(keys)
        if destinations is not None and len(destinations) != len(keys):
            raise ValueError(f"destinations has {len(destinations)} entries for "
                             f"{len(keys)} keys")
        if lookup is not None and lookup.keys != keys:
            raise ValueError("lookup was made for other keys")
        t0 = time.monotonic()
        budget = timeout or self.config.fetch_timeout or self.node.config.fetch_timeout
        deadline = t0 + budget
        found = lookup if lookup is not None else self.lookup_prefix(
            keys, timeout=min(budget, self.config.lookup_timeout
                              or self.node.config.lookup_timeout))
        job = PrefixJob(self.node, self._pool, self.health, found, destinations, deadline)
        outcome = job.run()
        with self._lock:
            self._counters["fetches"] += 1
            self._counters["fetched_blocks"] += outcome.result.blocks
            self._counters["stale_entries"] += outcome.stale
            self._counters["failovers"] += outcome.failovers
        return outcome

    # -- stats ----------------------------------------------------------------------

    def _count(self, what: str, n: int) -> None:
        with self._lock:
            self._counters[what] += n

    def stats(self) -> ClusterStats:
        member = self.member
        # The same verdicts the registration publishes (p2pkv.cluster.verdicts).
        quarantined = {r.address: (r.expires_in, r.times, r.reason)
                       for r in self.health.reports()}
        with self._lock:
            c = self._counters
            return ClusterStats(
                backend=self.backend, partition=self.partition,
                registered=member is not None,
                member=member.number if member is not None else None,
                lookups=c["lookups"], lookup_keys=c["lookup_keys"], hits=c["hits"],
                directory_errors=c["directory_errors"], fetches=c["fetches"],
                fetched_blocks=c["fetched_blocks"], stale_entries=c["stale_entries"],
                failovers=c["failovers"], registrations=c["registered"],
                registrations_lost=c["lost"], announced_stored=c["stored"],
                announced_removed=c["removed"], swept_members=c["swept"],
                quarantines=self.health.quarantines, quarantined=quarantined,
                quarantine_reports=c["quarantine_reports"], claims_lost=c["claims_lost"],
                pending_announced=c["pending_announced"],
                pending_withdrawn=c["pending_withdrawn"],
                pending_dropped=c["pending_dropped"],
            )


def _check_keys(keys: Sequence[bytes]) -> tuple[bytes, ...]:
    if isinstance(keys, (bytes, bytearray, str)):  # type: ignore[unreachable]
        raise ValueError("keys must be a sequence of bytes keys, not a single key")
    return check_keys(keys, MAX_KEY_LEN)


def describe(stats: ClusterStats) -> dict[str, Any]:
    """``stats`` as a JSON-ready dict (for ``serve --json`` and tools)."""
    return dict(stats.__dict__)

"""Keeping one node registered in the Redis directory, with its block set published.

The data model and the scripts are in :mod:`p2pkv.cluster.redis_directory`; this module
is the node's side: register, heartbeat, announce in batches, sweep, recover.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from p2pkv.cluster.pending import estimate
from p2pkv.cluster.records import DirectoryError, NodeRecord, QuarantineReport
from p2pkv.cluster.redis_directory import ANNOUNCE_BATCH, Member, RedisDirectory
from p2pkv.errors import ConfigError
from p2pkv.protocol.pending import lease_end
from p2pkv.runtime.tuning import STOP_WAIT_S

__all__ = ["MAX_PENDING_QUEUE", "PendingQueue", "RedisRegistration"]

log = logging.getLogger("p2pkv.cluster")

#: Pending announcements and withdrawals queued at most (keys), and pending keys of this
#: registration remembered at most (to withdraw them at close, or once stored).
MAX_PENDING_QUEUE = 1 << 16


class RedisRegistration:
    """Keeps one node registered and its block set published, on its own thread.

    Registers ``record()`` under a fresh token and publishes every key of
    ``stored_keys()``; then renews the registration every ``heartbeat`` seconds, sends
    the changes heard by :meth:`changed` (the store listener) in batches every
    ``announce_interval`` seconds, and sweeps dead tokens out of the partition. When
    Redis is unreachable or the registration is lost, it forgets the queued changes and
    tries again every ``retry_interval`` seconds; a new registration republishes the
    whole block set, so no stale claim survives. The node itself never notices: it keeps
    serving its peers. At every heartbeat it also compares its claims as Redis counts
    them with what its announcements added: fewer means a failover lost some (writes not
    yet replicated, or a shard that came back empty), and it registers again, so that
    lost claims cost misses for one heartbeat, not until the node restarts.

    ``reports`` (when given) says which holders the node keeps in quarantine now; the
    thread publishes them with the registration whenever they change, checked every
    ``announce_interval`` (:mod:`p2pkv.cluster.verdicts`).

    :meth:`announce_pending` and :meth:`withdraw_pending` queue the keys the node is
    computing (:mod:`p2pkv.cluster.pending`); the thread writes them at its next turn,
    after the claims it publishes in that turn. The queue holds at most
    :data:`MAX_PENDING_QUEUE` keys (past it new keys are dropped and counted: an entry
    is an optimisation), and a key this registration announced pending is withdrawn
    with its claim once it is stored, and at :meth:`close`.
    """

    def __init__(self, directory: RedisDirectory, record: Callable[[], NodeRecord],
                 stored_keys: Callable[[], list[bytes]], *, ttl: float,
                 heartbeat: float | None = None, announce_interval: float = 0.05,
                 retry_interval: float | None = None,
                 on_event: Callable[[str, int], None] | None = None,
                 reports: Callable[[], list[QuarantineReport]] | None = None) -> None:
        if ttl <= 0:
            raise ConfigError(f"directory ttl must be positive, got {ttl!r}")
        self.directory = directory
        self._record = record
        self._stored_keys = stored_keys
        self.ttl = ttl
        self.heartbeat_interval = heartbeat if heartbeat is not None else ttl / 3
        if not 0 < self.heartbeat_interval < ttl:
            raise ConfigError(f"directory heartbeat must be in (0, ttl={ttl}), got "
                              f"{self.heartbeat_interval!r}")
        self.announce_interval = announce_interval
        self.retry_interval = (retry_interval if retry_interval is not None
                               else min(1.0, self.heartbeat_interval))
        self._on_event = on_event or (lambda _what, _n: None)
        self._reports = reports
        #: What this registration's announcements added, by sub-partition.
        self._expected: collections.Counter[int] = collections.Counter()
        #: What the current registration published: address -> (times, reason, node
        #: id, when its quarantine ends on this clock).
        self._reported: dict[str, tuple[int, str, str, float]] = {}
        self._lock = threading.Lock()
        self._pending: dict[bytes, bool] = {}
        self._computing = PendingQueue()
        self._collecting = False
        self._flush_now = False
        self._member: Member | None = None
        #: Notified (under ``_lock``) when a registration completes or the thread stops.
        self._registered = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sweep: tuple[list[bytes], int] | None = None
        self._next_sweep_check = 0.0
        self._outage_logged = False
        self._thread = threading.Thread(target=self._run, name="p2pkv-directory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def member(self) -> Member | None:
        """The current registration, None while unregistered."""
        with self._lock:
            return self._member

    def wait_member(self, timeout: float) -> Member | None:
        """Wait until this node is registered (its block set published), at most
        ``timeout`` seconds; the registration, or None (not within ``timeout``, or
        closed)."""
        with self._registered:
            self._registered.wait_for(
                lambda: self._member is not None or self._stop.is_set(), timeout)
            return self._member

    def changed(self, key: bytes, visible: bool) -> None:
        """Store listener: queue one change (runs under the store's lock: O(1))."""
        with self._lock:
            if self._collecting:
                self._pending[key] = visible
                if len(self._pending) >= ANNOUNCE_BATCH and not self._flush_now:
                    self._flush_now = True
                    self._wake.set()

    def announce_pending(self, keys: Sequence[bytes], seconds: Sequence[float]) -> int:
        """Queue ``keys[i]`` as computed here, due in ``seconds[i]`` seconds (any thread;
        never blocks). Returns how many were dropped: all while unregistered, those
        past :data:`MAX_PENDING_QUEUE`."""
        return self._queue_pending(keys, seconds)

    def withdraw_pending(self, keys: Sequence[bytes]) -> None:
        """Queue the withdrawal of ``keys`` (any thread; never blocks)."""
        self._queue_pending(keys, None)

    def _queue_pending(self, keys: Sequence[bytes], seconds: Sequence[float] | None) -> int:
        dropped = len(keys) if self.member is None else self._computing.put(keys, seconds)
        self._wake.set()
        if dropped:
            self._on_event("pending_dropped", dropped)
        return dropped

    def flush(self) -> None:
        """Ask the thread to publish queued changes now (it does so within a turn)."""
        with self._lock:
            self._flush_now = True
        self._wake.set()

    def close(self, timeout: float = STOP_WAIT_S, *, deregister: bool = True) -> None:
        """Stop the thread; with ``deregister``, withdraw this node's claims."""
        self._stop.set()
        self._wake.set()
        with self._registered:
            self._registered.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        member = self.member
        if deregister and member is not None:
            try:
                self.directory.deregister(member, self._stored_keys(),
                                          self._computing.written_keys())
            except DirectoryError as exc:
                log.warning("could not deregister from the directory: %s", exc)
        with self._lock:
            self._member = None
            self._collecting = False

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        next_heartbeat = 0.0
        next_publish = 0.0
        while not self._stop.is_set():
            # Cleared before the flags are read: a wake-up after this is never lost.
            self._wake.clear()
            now = time.monotonic()
            try:
                if self.member is None:
                    self._register()
                    now = time.monotonic()
                    next_heartbeat = now + self.heartbeat_interval
                    next_publish = now + self.announce_interval
                elif now >= next_heartbeat:
                    member = self.member
                    assert member is not None
                    if not self.directory.heartbeat(member, self.ttl):
                        self._lost("registration expired")
                        continue
                    if not self._claims_intact(member):
                        continue
                    next_heartbeat = now + self.heartbeat_interval
                with self._lock:
                    flush, self._flush_now = self._flush_now, False
                if flush or now >= next_publish:
                    self._publish()
                    self._report()
                    next_publish = time.monotonic() + self.announce_interval
                self._publish_pending()
                self._sweep_step()
                if self._outage_logged:
                    log.warning("directory %s reachable again", self.directory.url)
                    self._outage_logged = False
                wait = max(0.0, min(next_publish, next_heartbeat) - time.monotonic())
                if self._sweep is not None:
                    wait = 0.0
            except DirectoryError as exc:
                if not self._outage_logged:
                    log.warning("%s; serving on, retrying every %.1fs", exc, self.retry_interval)
                    self._outage_logged = True
                self._lost("directory unreachable")
                wait = self.retry_interval
            except Exception:  # pragma: no cover - a bug must not stop the heartbeat
                log.exception("directory thread error")
                self._lost("internal error")
                wait = self.retry_interval
            self._wake.wait(wait)

    def _lost(self, why: str) -> None:
        with self._lock:
            had = self._member is not None
            self._member = None
            self._collecting = False
            self._pending.clear()
            self._computing.clear()
            self._sweep = None
            self._reported = {}
        if had:
            log.warning("directory registration lost (%s); registering again", why)
            self._on_event("lost", 1)

    def _register(self) -> None:
        # Collect from here on; the snapshot taken after this covers everything before.
        with self._lock:
            self._collecting = True
            self._pending.clear()
        record = self._record()
        held = self._stored_keys()
        member = self.directory.register(record, self.ttl)
        self._expected = collections.Counter()
        if not self.directory.announce(member, held, counts=self._expected):
            raise DirectoryError("registration vanished while publishing the block set")
        # Registered only once the block set is out: whoever waits for the registration
        # can look the blocks up.
        with self._lock:
            self._member = member
            self._reported = {}  # a fresh token has no verdicts yet
            self._registered.notify_all()
        log.info("registered in directory %s as member %d of partition %s (%d blocks)",
                 self.directory.url, member.number, member.partition, len(held))
        self._on_event("registered", 1)
        self._on_event("stored", len(held))

    def _publish(self) -> None:
        member = self.member
        if member is None:
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        stored = [k for k, visible in pending.items() if visible]
        removed = [k for k, visible in pending.items() if not visible]
        if not self.directory.announce(member, stored, removed, counts=self._expected):
            self._lost("registration expired")
            return
        self._on_event("stored", len(stored))
        self._on_event("removed", len(removed))
        self._computing.stored(stored)

    def _publish_pending(self) -> None:
        """Write the queued pending announcements and withdrawals (one script per batch)."""
        member = self.member
        taken = self._computing.take() if member is not None else None
        if member is None or taken is None:
            return
        announced, withdrawn = taken
        if not self.directory.pending.write(member, announced, withdrawn):
            self._lost("registration expired")
            return
        self._computing.written(announced, withdrawn)
        self._on_event("pending_announced", len(announced))
        self._on_event("pending_withdrawn", len(withdrawn))

    def _claims_intact(self, member: Member) -> bool:
        """Whether Redis still counts every claim this registration made; when not, the
        registration is dropped (the next turn registers again and republishes)."""
        want = {s: n for s, n in self._expected.items() if n}
        if not want:
            return True
        found = self.directory.claim_counts(member, sorted(want))
        lost = sum(max(0, n - found.get(s, 0)) for s, n in want.items())
        if not lost and all(found.get(s, 0) == n for s, n in want.items()):
            return True
        log.warning("directory %s counts %d claim(s) of this node fewer than it announced "
                    "(lost in a failover?); publishing its blocks again", self.directory.url,
                    lost)
        self._on_event("claims_lost", lost)
        self._lost("claims lost")
        return False

    def _report(self) -> None:
        """Publish the quarantine verdicts when they differ from the published ones (a
        holder in or out, another count or reason, an end moved by more than 0.5 s)."""
        member = self.member
        if member is None or self._reports is None:
            return
        reports = self._reports()
        now = time.monotonic()
        wanted = {r.address: (r.times, r.reason, r.node_id, now + r.expires_in)
                  for r in reports}
        old = self._reported
        if wanted.keys() == old.keys() and all(
                wanted[a][:3] == old[a][:3] and abs(wanted[a][3] - old[a][3]) <= 0.5
                for a in wanted):
            return
        if not self.directory.verdicts.publish(member, reports):
            self._lost("registration expired")
            return
        with self._lock:
            self._reported = wanted
        self._on_event("quarantine_reports", 1)

    def _sweep_step(self) -> None:
        member = self.member
        if member is None:
            return
        if self._sweep is None:
            now = time.monotonic()
            if now < self._next_sweep_check:
                return
            self._next_sweep_check = now + self.heartbeat_interval
            dead = self.directory.dead_tokens(member.partition)
            if not dead:
                return
            self._sweep = (dead, 0)
        dead, cursor = self._sweep
        nxt = self.directory.sweep_step(member, dead, cursor)
        if nxt is None or nxt == 0:
            self._sweep = None
            if nxt == 0:
                log.info("swept %d dead member(s) out of partition %s", len(dead),
                         member.partition)
                self._on_event("swept", len(dead))
        else:
            self._sweep = (dead, nxt)


class PendingQueue:
    """The pending keys (pending-v1) of one registration: queued by any thread (bounded,
    O(keys) under its own lock), taken by the registration's thread; and those it wrote
    (their leases not ended), to withdraw once stored and at deregistration."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: key -> when due (monotonic), None to withdraw it.
        self._queue: dict[bytes, float | None] = {}
        #: key -> when the lease of the entry written for it ends (monotonic).
        self._written: dict[bytes, float] = {}

    def put(self, keys: Sequence[bytes], seconds: Sequence[float] | None) -> int:
        """Queue ``keys`` (``seconds`` None: withdrawals); how many were dropped."""
        now = time.monotonic()
        dropped = 0
        with self._lock:
            queue = self._queue
            for i, key in enumerate(keys):
                if key in queue or len(queue) < MAX_PENDING_QUEUE:
                    queue[key] = None if seconds is None else now + estimate(seconds[i])
                else:
                    dropped += 1
        return dropped

    def stored(self, keys: Sequence[bytes]) -> None:
        """Their claims went out: the entries written for them are withdrawn next."""
        with self._lock:
            if self._written:
                for key in keys:
                    if key in self._written and key not in self._queue:
                        self._queue[key] = None

    def take(self) -> tuple[list[tuple[bytes, float]], list[bytes]] | None:
        """What to write now: (key, seconds until due) pairs and withdrawn keys."""
        with self._lock:
            if not self._queue:
                return None
            queue, self._queue = self._queue, {}
        now = time.monotonic()
        return ([(k, max(0.0, due - now)) for k, due in queue.items() if due is not None],
                [k for k, due in queue.items() if due is None])

    def written(self, announced: Sequence[tuple[bytes, float]],
                withdrawn: Sequence[bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            mine = self._written
            for key in withdrawn:
                mine.pop(key, None)
            for key, s in announced:
                mine.pop(key, None)  # a renewal: the newest go last
                mine[key] = lease_end(now, s)
            if len(mine) > MAX_PENDING_QUEUE:  # forget the ended leases, then the oldest
                for key in [k for k, end in mine.items() if end <= now]:
                    del mine[key]
                while len(mine) > MAX_PENDING_QUEUE:
                    del mine[next(iter(mine))]

    def written_keys(self) -> list[bytes]:
        """The keys of the entries written whose leases have not ended."""
        now = time.monotonic()
        with self._lock:
            return [k for k, end in self._written.items() if end > now]

    def clear(self) -> None:
        """The registration is gone: its entries with it."""
        with self._lock:
            self._queue.clear()
            self._written.clear()

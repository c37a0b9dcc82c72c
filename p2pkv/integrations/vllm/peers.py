"""The peers of a :class:`~p2pkv.integrations.vllm.P2PKVTier`: connections to the
configured addresses, kept up, and lookups fanned out to all of them with one deadline.

Thread-safe: the connections are the pool's (its own lock); the holders, refusal counts
and what was said take the lock the tier shares with it (the same lock guards the tier's
metrics, which the ``count`` callback increments). No connection is asked for while that
lock is held: a future that is already done runs the pool's listener at once, on the
asking thread, and the listener takes the lock too.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any

from p2pkv.cluster.fanout import ask_peers, merged
from p2pkv.cluster.peers import PeerPool, PeerState
from p2pkv.errors import P2PKVError, PeerIncompatible
from p2pkv.integrations.vllm.metrics import Metrics
from p2pkv.node import Node, PeerHandle

__all__ = ["Peers"]

log = logging.getLogger("vllm.p2pkv")

#: Holder entries kept for keys answered but not loaded yet.
_MAX_HOLDERS = 1 << 20

#: Increments one of the tier's metrics (name, amount, label values); called with the
#: shared lock held.
Count = Callable[[str, int, tuple[str, ...]], None]


class Peers:
    """The tier's configured peers: kept connected through a
    :class:`~p2pkv.cluster.peers.PeerPool` (the same one :class:`~p2pkv.cluster.Cluster`
    uses, with the tier's reconnect interval and refusal back-off), and asked."""

    def __init__(self, addresses: Sequence[str], *, reconnect: float, refused_retry: float,
                 lookup_timeout: float, lock: threading.Lock, count: Count) -> None:
        self._addresses = tuple(dict.fromkeys(addresses))
        self._reconnect = reconnect
        #: After a refusal the configuration of one side must change: try again rarely.
        self._refused_retry = refused_retry
        self._lookup_timeout = lookup_timeout
        self._lock = lock
        self._count = count
        #: Made with the node (:meth:`maintain`'s first call).
        self._pool: PeerPool | None = None
        #: Which peer said it holds a key, for keys answered but not loaded yet.
        self._holders: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._refusals: collections.Counter[str] = collections.Counter()
        #: The refusing fields last reported per address, and the last error said.
        self._refused: dict[str, tuple[str, ...]] = {}
        self._said: dict[str, str] = {}

    # ------------------------------------------------------------------ connections

    def maintain(self, node: Node, *, starting: bool = False) -> None:
        """Start a connection to every peer that has none and is due for an attempt.
        ``starting``: engines of a cluster start together, so a peer never reached yet
        (and not refused) is tried again now, not after ``reconnect_interval``."""
        with self._lock:
            if self._pool is None:
                self._pool = PeerPool(node, refusal_backoff=self._refused_retry,
                                      retry_interval=self._reconnect, listener=self._settled)
            pool = self._pool
        for address in self._addresses:
            pool.handle_async(address, eager=starting)

    def _settled(self, address: str, handle: PeerHandle | None,
                 exc: BaseException | None) -> None:
        """The pool's listener: say what changed, count refusals by field."""
        with self._lock:
            if handle is not None:
                self._refused.pop(address, None)
                self._said.pop(address, None)
                log.info("p2pkv tier: connected to %s (%s), chunks by %s (%s)", address,
                         handle.remote_node_id, handle.data_path, handle.data_path_detail)
            elif isinstance(exc, PeerIncompatible):
                fields = tuple(r.field for r in exc.reasons)
                if fields != self._refused.get(address):
                    for f in fields:
                        self._refusals[f] += 1
                        self._count(Metrics.HANDSHAKES_REFUSED, 1, ("outbound", f))
                    log.error("p2pkv tier: peer %s refused, nothing will be shared with it:\n%s",
                              address, _refusal_text(exc))
                self._refused[address] = fields
            elif isinstance(exc, (P2PKVError, OSError, CancelledError)):
                if self._said.get(address) != str(exc):
                    log.warning("p2pkv tier: cannot reach peer %s: %s", address, exc)
                self._said[address] = str(exc)
            elif exc is not None:  # this tier's bug, not the peer's: said as one
                log.error("p2pkv tier: internal error connecting to %s", address,
                          exc_info=exc)

    def lost(self, handle: PeerHandle, exc: BaseException) -> None:
        """The connection behind ``handle`` failed: reconnect after the interval."""
        pool = self._pool
        if pool is None:
            return
        for address, live in pool.by_address(every=True).items():
            if live is handle:
                log.warning("p2pkv tier: lost peer %s: %s", address, exc)
                pool.drop(address, handle, why=exc)

    # ------------------------------------------------------------------ lookups

    def ask(self, node: Node, keys: list[bytes]) -> tuple[list[bool], list[float]]:
        """Runs on the lookup thread: one lookup per connected peer, in parallel, one
        deadline for all. Silence, errors and refusals are misses. Per key: whether a
        peer holds it, and for a key none holds, the soonest a peer computing it expects
        to (seconds from now; 0.0: nobody is computing it, ``pending-v1``)."""
        deadline = time.monotonic() + self._lookup_timeout
        pool = self._pool
        if pool is None:
            return [False] * len(keys), [0.0] * len(keys)
        # A peer still shaking hands is asked once it is up, by then.
        peers = {fut: a for a in self._addresses
                 if (fut := pool.state(a).future) is not None}
        asked = ask_peers(node, peers, keys, deadline)
        for address, handle, exc in asked.lost():
            pool.drop(address, handle, why=exc)
        for address, _, exc in asked.failed:
            log.debug("p2pkv tier: lookup at %s failed: %s", address, exc)
        per_key, due = merged(asked.answers, len(keys))
        found = [bool(h) for h in per_key]
        holders = {keys[i]: h[0].address for i, h in enumerate(per_key) if h}
        with self._lock:
            for key, address in holders.items():
                self._holders[key] = address
                self._holders.move_to_end(key)
            while len(self._holders) > _MAX_HOLDERS:
                self._holders.popitem(last=False)
            self._count(Metrics.LOOKUP_KEYS, len(keys), ())
            self._count(Metrics.LOOKUP_HITS, sum(found), ())
        return found, due

    def route(self, keys: Sequence[bytes]) -> tuple[dict[str, PeerHandle], list[str | None]]:
        """The connected peers by address, and for each key the connected peer that said
        it holds it (``None`` when none did, or that peer is gone)."""
        handles = self._pool.by_address() if self._pool is not None else {}
        with self._lock:
            where = [self._holders.get(key) for key in keys]
        return handles, [a if a in handles else None for a in where]

    # ------------------------------------------------------------------ observability

    def all_connected(self) -> bool:
        return self.connected() == len(self._addresses)

    def connected(self) -> int:
        return len(self._pool.by_address()) if self._pool is not None else 0

    def report(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        """Each peer's state, and outbound refusals counted by differing field."""
        pool = self._pool
        live = pool.by_address() if pool is not None else {}
        states = {a: pool.state(a) if pool is not None else PeerState()
                  for a in self._addresses}
        with self._lock:
            peers = {a: {"connected": a in live, "refused": list(self._refused.get(a, ())),
                         "last_error": None if a in live or s.failure is None
                         else str(s.failure)}
                     for a, s in states.items()}
            return peers, dict(self._refusals)


def _refusal_text(exc: PeerIncompatible) -> str:
    return "\n".join(f"  {r.field}: local {r.ours!r} remote {r.theirs!r}: {r.meaning}"
                     for r in exc.reasons)


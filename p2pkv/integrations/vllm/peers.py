"""The peers of a :class:`~p2pkv.integrations.vllm.P2PKVTier`: connections to the
configured addresses, kept up, and lookups fanned out to all of them with one deadline.

Thread-safe: every method takes the lock the tier shares with it (the same lock guards
the tier's metrics, which the ``count`` callback increments), and no future's callback is
registered while that lock is held: a future that is already done runs its callback at
once, on the registering thread, and that callback takes the lock too.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

from p2pkv.cluster.fanout import ask_peers, merged
from p2pkv.errors import P2PKVError, PeerIncompatible
from p2pkv.integrations.vllm.metrics import Metrics
from p2pkv.node import Node, PeerHandle

__all__ = ["Peer", "Peers"]

log = logging.getLogger("vllm.p2pkv")

#: Holder entries kept for keys answered but not loaded yet.
_MAX_HOLDERS = 1 << 20

#: Increments one of the tier's metrics (name, amount, label values); called with the
#: shared lock held.
Count = Callable[[str, int, tuple[str, ...]], None]


@dataclass
class Peer:
    """One configured peer address and the state of the connection to it."""

    address: str
    handle: PeerHandle | None = None
    connecting: Future[PeerHandle] | None = None
    next_attempt: float = 0.0
    last_error: str | None = None
    refused: tuple[str, ...] = ()
    #: Whether a connection to it ever came up.
    seen: bool = False


class Peers:
    """The tier's configured peers: connect, reconnect, forget, and ask them."""

    def __init__(self, addresses: Sequence[str], *, reconnect: float, refused_retry: float,
                 lookup_timeout: float, lock: threading.Lock, count: Count) -> None:
        self._reconnect = reconnect
        #: After a refusal the configuration of one side must change: try again rarely.
        self._refused_retry = refused_retry
        self._lookup_timeout = lookup_timeout
        self._lock = lock
        self._count = count
        self._peers = {a: Peer(a) for a in addresses}
        #: Which peer said it holds a key, for keys answered but not loaded yet.
        self._holders: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._refusals: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ connections

    def maintain(self, node: Node, *, starting: bool = False) -> None:
        """Start a connection to every peer that has none and is due for an attempt.
        ``starting``: engines of a cluster start together, so a peer never reached yet
        (and not refused) is tried again now, not after ``reconnect_interval``."""
        now = time.monotonic()
        started: list[tuple[Peer, Future[PeerHandle]]] = []
        with self._lock:
            due = [p for p in self._peers.values()
                   if p.handle is None and p.connecting is None and (
                       now >= p.next_attempt or (starting and not p.seen and not p.refused))]
            for peer in due:
                try:
                    fut = node.connect_async(peer.address)
                except P2PKVError as exc:
                    peer.last_error = str(exc)
                    peer.next_attempt = now + self._reconnect
                    continue
                peer.connecting = fut
                started.append((peer, fut))
        for peer, fut in started:
            fut.add_done_callback(functools.partial(self._connected, peer))

    def _connected(self, peer: Peer, fut: Future[PeerHandle]) -> None:
        now = time.monotonic()
        with self._lock:
            peer.connecting = None
            try:
                peer.handle = fut.result()
            except PeerIncompatible as exc:
                peer.next_attempt = now + self._refused_retry
                fields = tuple(r.field for r in exc.reasons)
                if fields != peer.refused:
                    for f in fields:
                        self._refusals[f] += 1
                        self._count(Metrics.HANDSHAKES_REFUSED, 1, ("outbound", f))
                    log.error("p2pkv tier: peer %s refused, nothing will be shared with it:\n%s",
                              peer.address, _refusal_text(exc))
                peer.refused = fields
                peer.last_error = str(exc)
                return
            except (P2PKVError, OSError, CancelledError) as exc:
                peer.next_attempt = now + self._reconnect
                if peer.last_error != str(exc):
                    log.warning("p2pkv tier: cannot reach peer %s: %s", peer.address, exc)
                peer.last_error = str(exc)
                return
            except Exception as exc:  # this tier's bug, not the peer's: said as one
                peer.next_attempt = now + self._reconnect
                log.exception("p2pkv tier: internal error connecting to %s", peer.address)
                peer.last_error = f"internal error: {exc!r}"
                return
            peer.refused = ()
            peer.last_error = None
            peer.seen = True
            log.info("p2pkv tier: connected to %s (%s)", peer.address, peer.handle.remote_node_id)

    def lost(self, handle: PeerHandle, exc: BaseException) -> None:
        """The connection behind ``handle`` failed: reconnect after the interval."""
        with self._lock:
            for peer in self._peers.values():
                if peer.handle is handle:
                    peer.handle = None
                    peer.next_attempt = time.monotonic() + self._reconnect
                    peer.last_error = str(exc)
                    log.warning("p2pkv tier: lost peer %s: %s", peer.address, exc)

    # ------------------------------------------------------------------ lookups

    def ask(self, node: Node, keys: list[bytes]) -> tuple[list[bool], list[float]]:
        """Runs on the lookup thread: one lookup per connected peer, in parallel, one
        deadline for all. Silence, errors and refusals are misses. Per key: whether a
        peer holds it, and for a key none holds, the soonest a peer computing it expects
        to (seconds from now; 0.0: nobody is computing it, ``pending-v1``)."""
        deadline = time.monotonic() + self._lookup_timeout
        with self._lock:  # a peer still shaking hands is asked once it is up, by then
            peers = {p.connecting if p.connecting else _done(p.handle): p.address
                     for p in self._peers.values() if p.connecting or p.handle}
        asked = ask_peers(node, peers, keys, deadline)
        for _, handle, exc in asked.lost():
            self.lost(handle, exc)
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
        with self._lock:
            handles = {p.address: p.handle for p in self._peers.values() if p.handle}
            where = [self._holders.get(key) for key in keys]
        return handles, [a if a in handles else None for a in where]

    # ------------------------------------------------------------------ observability

    def all_connected(self) -> bool:
        with self._lock:
            return all(p.handle is not None for p in self._peers.values())

    def connected(self) -> int:
        with self._lock:
            return sum(1 for p in self._peers.values() if p.handle is not None)

    def report(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        """Each peer's state, and outbound refusals counted by differing field."""
        with self._lock:
            peers = {a: {"connected": p.handle is not None, "refused": list(p.refused),
                         "last_error": p.last_error} for a, p in self._peers.items()}
            return peers, dict(self._refusals)


def _refusal_text(exc: PeerIncompatible) -> str:
    return "\n".join(f"  {r.field}: local {r.ours!r} remote {r.theirs!r}: {r.meaning}"
                     for r in exc.reasons)


def _done(handle: PeerHandle | None) -> Future[PeerHandle]:
    """A connected peer as the fan-out takes it: a future already done."""
    fut: Future[PeerHandle] = Future()
    fut.set_result(handle)  # type: ignore[arg-type]
    return fut

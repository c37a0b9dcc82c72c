"""Connections to peers, made on demand and shared by lookups and fetches: the one way
both :class:`~p2pkv.cluster.Cluster` and the vLLM tier's static peers reach a peer.

A :class:`PeerPool` hands out a future :class:`~p2pkv.node.PeerHandle` per address:
an existing live connection, the handshake already in flight, or a new one. After a
failed attempt the address is not tried again before its back-off ends, and until then
its future fails at once with the failure that started it:

* a peer that refused the handshake: ``refusal_backoff`` seconds (its identity will not
  have changed in the meantime; ``refused_retry_interval``);
* a peer that was unreachable, or whose connection died (:meth:`PeerPool.drop`):
  ``retry_interval`` seconds (0, the default: the next call tries again).

``eager=True`` skips the second back-off for an address never reached yet: engines of a
cluster start together, so a peer not up a moment ago is tried again at once.

``listener`` (optional) hears every attempt's end, ``(address, handle, failure)``, on the
thread that ended it (the node's IO thread, or the caller's), outside this pool's lock.

Threading: thread-safe. Future callbacks registered here run on the node's IO thread
and only update this pool's tables (and call the listener).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

from p2pkv.errors import PeerGone, PeerIncompatible, PeerTimeout
from p2pkv.node import Node, PeerHandle
from p2pkv.protocol.options import option

log = logging.getLogger("p2pkv.cluster")

__all__ = ["PeerPool", "PeerState"]

#: Hears the end of an attempt: the address, its connection or why there is none.
Listener = Callable[[str, "PeerHandle | None", "BaseException | None"], None]


@dataclass
class PeerState:
    """What the pool knows of one address."""

    future: Future[PeerHandle] | None = None
    #: Not tried again before this (``time.monotonic()``) after ``failure``.
    retry_at: float = 0.0
    failure: BaseException | None = None
    #: Whether a connection to it ever came up.
    seen: bool = False

    @property
    def refused(self) -> PeerIncompatible | None:
        return self.failure if isinstance(self.failure, PeerIncompatible) else None


class PeerPool:
    def __init__(self, node: Node, *,
                 refusal_backoff: float = option("refused_retry_interval").default,
                 retry_interval: float = 0.0, listener: Listener | None = None) -> None:
        self._node = node
        self._refusal_backoff = refusal_backoff
        self._retry_interval = retry_interval
        self._listener = listener
        self._lock = threading.Lock()
        self._peers: dict[str, PeerState] = {}

    def handle_async(self, address: str, *, timeout: float | None = None,
                     eager: bool = False) -> Future[PeerHandle]:
        """A future handle for ``address``; never raises (errors land in the future)."""
        with self._lock:
            state = self._peers.setdefault(address, PeerState())
            fut = state.future
            if fut is not None and (not fut.done() or fut.exception() is None):
                return fut
            waived = eager and not state.seen and state.refused is None
            if state.failure is not None and time.monotonic() < state.retry_at and not waived:
                done: Future[PeerHandle] = Future()
                done.set_exception(state.failure)
                return done
            try:
                fut = self._node.connect_async(address, timeout=timeout)
            except Exception as exc:  # a bad address or one outside the allowlist
                self._failed(state, exc)
                fut = Future()
                fut.set_exception(exc)
                return fut
            state.future = fut
        fut.add_done_callback(lambda f: self._settled(address, f))
        return fut

    def _failed(self, state: PeerState, exc: BaseException) -> None:
        backoff = (self._refusal_backoff if isinstance(exc, PeerIncompatible)
                   else self._retry_interval)
        state.failure = exc
        state.retry_at = time.monotonic() + backoff

    def _settled(self, address: str, fut: Future[PeerHandle]) -> None:
        try:
            handle: PeerHandle | None = fut.result()
            exc: BaseException | None = None
        except (Exception, CancelledError) as failure:
            handle, exc = None, failure
        with self._lock:
            state = self._peers.setdefault(address, PeerState())
            if state.future is fut:
                if exc is None:
                    state.failure, state.seen = None, True
                else:
                    state.future = None
                    self._failed(state, exc)
        if self._listener is not None:
            self._listener(address, handle, exc)

    def connected(self) -> list[PeerHandle]:
        """The live connections this pool made, for a fan-out over current peers."""
        return list(self.by_address().values())

    def by_address(self, *, every: bool = False) -> dict[str, PeerHandle]:
        """The live connections this pool made, by address (``every``: also those that
        died and were not dropped yet)."""
        live = {h.peer_id for h in self._node.peers()}
        with self._lock:
            futures = {a: s.future for a, s in self._peers.items() if s.future is not None}
        out = {}
        for address, fut in futures.items():
            if fut.done() and fut.exception() is None:
                handle = fut.result()
                if every or handle.peer_id in live:
                    out[address] = handle
        return out

    def drop(self, address: str, handle: Any = None, *,
             why: BaseException | None = None) -> None:
        """Forget the connection to ``address`` (it died); it is made again on a later
        call, after ``retry_interval``. ``why``: the failure, reported until then.

        With ``handle``, only when the pool still holds that very connection, so a
        late report about an old connection does not drop a new one.
        """
        with self._lock:
            state = self._peers.get(address)
            fut = state.future if state is not None else None
            if state is None or fut is None or not fut.done():
                return
            if handle is not None and (fut.exception() is not None or fut.result() != handle):
                return
            state.future = None
            self._failed(state, why or PeerGone(f"the connection to {address} was dropped"))
        if fut.exception() is None:
            # Already gone, or the node is closing: nothing to undo.
            try:
                self._node.disconnect(fut.result())
            except PeerGone:
                pass
            except PeerTimeout as exc:  # the IO thread did not answer: say so, go on
                log.warning("cluster: disconnecting from %s: %s", address, exc)

    def state(self, address: str) -> PeerState:
        """A copy of what the pool knows of ``address`` (a blank one if nothing)."""
        with self._lock:
            state = self._peers.get(address)
            return PeerState() if state is None else PeerState(
                state.future, state.retry_at, state.failure, state.seen)

    def refused(self) -> dict[str, PeerIncompatible]:
        """Addresses that refused the handshake recently, with the refusal."""
        now = time.monotonic()
        with self._lock:
            return {a: s.refused for a, s in self._peers.items()
                    if s.refused is not None and s.retry_at > now}


"""Connections to holders, made on demand and shared by lookups and fetches.

A :class:`PeerPool` hands out a future :class:`~p2pkv.node.PeerHandle` per address:
an existing live connection, the handshake already in flight, or a new one. A peer
that refused the handshake is not asked again before ``refusal_backoff`` seconds (its
identity will not have changed in the meantime); one that was unreachable is retried
on the next call. A connection that turned out dead (``PeerGone``) is dropped with
:meth:`PeerPool.drop` and made again on the next call.

Threading: thread-safe. Future callbacks registered here run on the node's IO thread
and only update this pool's tables.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from p2pkv.errors import PeerGone, PeerIncompatible, PeerTimeout
from p2pkv.node import Node, PeerHandle
from p2pkv.protocol.options import option

log = logging.getLogger("p2pkv.cluster")

__all__ = ["PeerPool"]


class PeerPool:
    def __init__(self, node: Node, *,
                 refusal_backoff: float = option("refused_retry_interval").default) -> None:
        self._node = node
        self._refusal_backoff = refusal_backoff
        self._lock = threading.Lock()
        self._futures: dict[str, Future[PeerHandle]] = {}
        self._refused: dict[str, tuple[float, PeerIncompatible]] = {}

    def handle_async(self, address: str, *, timeout: float | None = None) -> Future[PeerHandle]:
        """A future handle for ``address``; never raises (errors land in the future)."""
        with self._lock:
            fut = self._futures.get(address)
            if fut is not None and (not fut.done() or fut.exception() is None):
                return fut
            refused = self._refused.get(address)
            if refused is not None and time.monotonic() < refused[0]:
                done: Future[PeerHandle] = Future()
                done.set_exception(refused[1])
                return done
            try:
                fut = self._node.connect_async(address, timeout=timeout)
            except Exception as exc:  # a bad address or one outside the allowlist
                fut = Future()
                fut.set_exception(exc)
                return fut
            self._futures[address] = fut
        fut.add_done_callback(lambda f: self._settled(address, f))
        return fut

    def _settled(self, address: str, fut: Future[PeerHandle]) -> None:
        exc = fut.exception()
        if exc is None:
            return
        with self._lock:
            if self._futures.get(address) is fut:
                del self._futures[address]
            if isinstance(exc, PeerIncompatible):
                self._refused[address] = (time.monotonic() + self._refusal_backoff, exc)

    def connected(self) -> list[PeerHandle]:
        """The live connections this pool made, for a fan-out over current peers."""
        live = {h.peer_id for h in self._node.peers()}
        with self._lock:
            futures = list(self._futures.values())
        out = []
        for fut in futures:
            if fut.done() and fut.exception() is None:
                handle = fut.result()
                if handle.peer_id in live:
                    out.append(handle)
        return out

    def drop(self, address: str, handle: Any = None) -> None:
        """Forget the connection to ``address`` (it died); the next call reconnects.

        With ``handle``, only when the pool still holds that very connection, so a
        late report about an old connection does not drop a new one.
        """
        with self._lock:
            fut = self._futures.get(address)
            if fut is None or not fut.done():
                return
            if handle is not None and (fut.exception() is not None or fut.result() != handle):
                return
            del self._futures[address]
        if fut.exception() is None:
            # Already gone, or the node is closing: nothing to undo.
            try:
                self._node.disconnect(fut.result())
            except PeerGone:
                pass
            except PeerTimeout as exc:  # the IO thread did not answer: say so, go on
                log.warning("cluster: disconnecting from %s: %s", address, exc)

    def refused(self) -> dict[str, PeerIncompatible]:
        """Addresses that refused the handshake recently, with the refusal."""
        now = time.monotonic()
        with self._lock:
            return {a: exc for a, (until, exc) in self._refused.items() if until > now}

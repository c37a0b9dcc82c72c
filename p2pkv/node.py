"""The p2pkv node: the public facade (API, futures, blocking waits, lifecycle).

A :class:`Node` serves its block store to compatible peers and fetches from them. This
module is what users call; the work happens in :mod:`p2pkv.runtime`:

* ``runtime.connections.wiring``: puts the runtime together (sockets, counters, both
  sides).
* ``runtime.reactor``: the one IO thread (poller, wake-up, command queue, deadlines).
  Every ZeroMQ socket lives on it; the public methods here are thread-safe because each
  only queues a command for it and returns a :class:`concurrent.futures.Future`
  (``*_async``) or waits on one with a deadline (the blocking forms).
* ``runtime.connections``: ``outbound`` / ``inbound``, a connection this node opens
  (requests, futures, typed errors) and a peer connected to its ROUTER (handshake
  enforcement, lookup answers, fetch jobs), each owning its state; ``client`` /
  ``server`` keep them and drive them from the IO loop.
* ``runtime.paths``: the data path of each connection (ZeroMQ frames, packed frames,
  shared memory, the data stream): the fetching half chosen once, when the connection is
  ready, the serving half for each fetch as it arrives. Blocks go out from the pool
  without a copy where the path allows and stay pinned until they left; they land
  straight into their destination slot, verified before they become visible.
  ``protocol.flow`` decides the credit (one budget per peer, see ``protocol/SPEC.md``,
  "Flow control") and the batching.

The block store is shared with the engine threads and has its own lock.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import ConfigError, LocalLimitExceeded, PeerGone, PeerTimeout
from p2pkv.identity import IdentityExtension, RunConfig
from p2pkv.keys import MAX_KEY_LEN, check_keys
from p2pkv.layout import Layout
from p2pkv.protocol.options import MAX_SECONDS, Seconds
from p2pkv.runtime.config import NodeConfig
from p2pkv.runtime.connections.wiring import wire
from p2pkv.runtime.paths.nixl_client import nixl_caps, nixl_stats, start_nixl
from p2pkv.runtime.paths.receiver import check_destinations
from p2pkv.runtime.pending import LookupAnswer
from p2pkv.runtime.public import FetchResult, KeyOutcome, NodeStats, PeerHandle
from p2pkv.runtime.state import FetchTicket
from p2pkv.runtime.stats import path_stats
from p2pkv.runtime.tuning import WAIT_GRACE
from p2pkv.shm import ShmUnavailable
from p2pkv.store import BlockStore
from p2pkv.store.pool import BlockPool
from p2pkv.transport import validate_address

__all__ = [
    "FetchResult",
    "KeyOutcome",
    "LookupAnswer",
    "Node",
    "NodeConfig",
    "NodeStats",
    "PeerHandle",
]

log = logging.getLogger("p2pkv.node")
# A library logs; the application decides where it goes (and the node is the first
# module that logs anything worth routing).
logging.getLogger("p2pkv").addHandler(logging.NullHandler())

_T = TypeVar("_T")


def _seconds(timeout: float | None, default: float) -> float:
    """A call's ``timeout``: None is the configured default, 0 is zero (not the
    default), a negative or non-number is a ValueError."""
    if timeout is None:
        return default
    try:
        return Seconds(least_ok=True).check(timeout)
    except ValueError:
        raise ValueError(f"timeout must be a number of seconds >= 0 (at most {MAX_SECONDS:g}) "
                         f"or None, got {timeout!r}") from None


class Node:
    """A p2pkv node: serves its block store to compatible peers and fetches from them.

    Lifecycle: construct (binds and starts the IO thread) → use → :meth:`close` (or use
    as a context manager). All public methods are thread-safe. Callbacks added to the
    returned futures run on the IO thread: keep them short, and do not block in them on
    another of this node's futures.
    """

    def __init__(
        self,
        run_config: RunConfig,
        layout: Layout,
        *,
        pool_blocks: int | None = None,
        pool_bytes: int | None = None,
        config: NodeConfig | None = None,
        store: BlockStore | None = None,
        extension: IdentityExtension | None = None,
    ) -> None:
        if not isinstance(run_config, RunConfig):
            raise ConfigError(f"run_config must be a RunConfig, got {type(run_config).__name__}")
        if extension is not None and not isinstance(extension, IdentityExtension):
            raise ConfigError(f"extension must be an IdentityExtension, got "
                              f"{type(extension).__name__}")
        self.extension = extension or IdentityExtension()
        self.config = config or NodeConfig()
        self.run_config = run_config
        self.layout = layout
        #: Why the pool is private although ``NodeConfig.shm`` asked for shared memory.
        self.shm_unavailable: str | None = None
        self._own_pool: BlockPool | None = None
        if store is None:
            if (pool_blocks is None) == (pool_bytes is None):
                raise ConfigError("give exactly one of pool_blocks or pool_bytes")
            pool, self.shm_unavailable = _make_pool(layout, pool_blocks, pool_bytes,
                                                    shared=self.config.shm)
            self._own_pool = pool
            store = BlockStore(pool)
        elif tuple(store.pool.segment_sizes) != tuple(layout.segment_sizes):
            raise ConfigError(
                f"the store's pool holds segments {list(store.pool.segment_sizes)}, the "
                f"layout needs {list(layout.segment_sizes)}")
        self.store = store
        self.node_id = self.config.node_id or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self._segments = tuple(layout.segment_sizes)
        self._bpb = layout.bytes_per_block
        limits = proto.Limits(
            max_keys=self.config.max_keys_per_request,
            max_in_flight=self.config.max_inflight_requests,
        )
        window = proto.window_blocks(self.config.window_bytes, self._bpb)
        try:  # the NIXL agents (nixl-v1, SPEC §20), and whether the node uses them, why
            self._nixl, self.nixl_state = start_nixl(self.config, store.pool, self.node_id)
        except BaseException:
            if self._own_pool is not None:
                self._own_pool.close()
            raise
        self.hello = proto.Hello(
            node=self.node_id,
            minor=proto.PROTOCOL_MINOR,
            rc=run_config.get_run_config(),
            fp=run_config.fingerprint,
            geo=proto.Geometry(bpb=self._bpb, seg=self._segments),
            khash=proto.KeyHash(algo=self.config.key_hash_algo, seed=self.config.key_hash_seed),
            caps=nixl_caps(self.config.capabilities, self._nixl),
            limits=limits.advertised(window=window),
            ext=None if self.extension.is_empty else self.extension,
        )
        # Fetch futures -> their tickets, for abort(); entries go with their futures.
        self._tickets: weakref.WeakKeyDictionary[Future[FetchResult], FetchTicket] = (
            weakref.WeakKeyDictionary())
        self._tickets_lock = threading.Lock()
        try:
            self._rt = wire(self.config, self.hello, store, self, limits=limits,
                            window=window, nixl=self._nixl)
        except BaseException:  # the agents go with the node that failed to start
            if self._nixl is not None:
                self._nixl.close()
            raise
        self.address = self._rt.address
        self._reactor, self._client, self._server = (self._rt.reactor, self._rt.client,
                                                     self._rt.server)
        self._thread = self._reactor.thread
        self._reactor.start(on_exit=self._release)
        log.info("node %s listening on %s fingerprint=%s layout=%s bytes/block=%d segments=%d",
                 self.node_id, self.address, run_config.fingerprint, layout.name, self._bpb,
                 len(self._segments))

    # ------------------------------------------------------------------ public API

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fingerprint(self) -> str:
        return self.run_config.fingerprint

    def connect_async(self, address: str, *, timeout: float | None = None) -> Future[PeerHandle]:
        validate_address(address, what="peer address")
        allow = self.config.connect_allowlist
        if allow is not None and address not in allow:
            raise ConfigError(f"peer address {address!r} is not in the connect allowlist")
        fut: Future[PeerHandle] = Future()
        deadline = time.monotonic() + _seconds(timeout, self.config.handshake_timeout)
        self._reactor.submit(fut, lambda: self._client.connect(address, fut, deadline))
        return fut

    def connect(self, address: str, *, timeout: float | None = None) -> PeerHandle:
        """Connect and handshake. Raises :class:`PeerIncompatible` (with the diff) when
        either side refuses, :class:`TransportHandshakeFailed` when ZeroMQ's security
        handshake fails (CurveZMQ required, key not accepted, no answer),
        :class:`PeerTimeout` when no answer comes in time (``timeout=0``: at once,
        nothing is attempted)."""
        t = _seconds(timeout, self.config.handshake_timeout)
        return self._wait(self.connect_async(address, timeout=t), t)

    def lookup_async(self, peer: PeerHandle, keys: Sequence[bytes], *,
                     timeout: float | None = None) -> Future[list[bool]]:
        keys = self._check_keys(keys)
        fut: Future[list[bool]] = Future()
        if not keys:
            fut.set_result([])
            return fut
        deadline = time.monotonic() + _seconds(timeout, self.config.lookup_timeout)
        self._reactor.submit(fut, lambda: self._client.lookup(peer.peer_id, keys, fut, deadline))
        return fut

    def lookup(self, peer: PeerHandle, keys: Sequence[bytes], *,
               timeout: float | None = None) -> list[bool]:
        """Which of ``keys`` the peer holds, in order (``timeout=0``: PeerTimeout at
        once for a non-empty ``keys``, nothing is sent)."""
        t = _seconds(timeout, self.config.lookup_timeout)
        return self._wait(self.lookup_async(peer, keys, timeout=t), t)

    def lookup_pending_async(self, peer: PeerHandle, keys: Sequence[bytes], *,
                             timeout: float | None = None) -> Future[LookupAnswer]:
        """:meth:`lookup_async`, answered with the peer's whole answer: which of
        ``keys`` it holds and, for those it is computing, in how many seconds it expects
        to hold them (``pending-v1``; a peer without it reports nothing pending)."""
        keys = self._check_keys(keys)
        fut: Future[LookupAnswer] = Future()
        if not keys:
            fut.set_result(LookupAnswer((), ()))
            return fut
        deadline = time.monotonic() + _seconds(timeout, self.config.lookup_timeout)
        self._reactor.submit(fut, lambda: self._client.lookup(
            peer.peer_id, keys, fut, deadline, whole=True))
        return fut

    def announce_pending(self, keys: Sequence[bytes], seconds: Sequence[float]) -> None:
        """This node is computing the blocks of ``keys`` and expects to hold ``keys[i]``
        in ``seconds[i]`` seconds: peers that look them up are told so (``pending-v1``,
        SPEC §19) until they are stored, withdrawn, or overdue by their own estimate.
        Announce only what a computation that waits on no peer produces (§19 rule 4)."""
        self._rt.inbound.pending.announce(self._check_keys(keys), seconds)

    def withdraw_pending(self, keys: Sequence[bytes]) -> None:
        """The computation of ``keys`` stopped: they are no longer reported pending."""
        self._rt.inbound.pending.withdraw(self._check_keys(keys))

    def fetch_async(self, peer: PeerHandle, keys: Sequence[bytes], *,
                    timeout: float | None = None) -> Future[FetchResult]:
        return self._fetch_async(peer, self._check_keys(keys), None, timeout)

    def fetch(self, peer: PeerHandle, keys: Sequence[bytes], *,
              timeout: float | None = None) -> FetchResult:
        """Fetch blocks from ``peer`` into the local store; per-key outcome in the result.

        Keys already held locally are not fetched again (reported as stored); a key
        named more than once is fetched once, and each of its positions gets its
        outcome. ``timeout=0``: only those; anything to fetch from the peer is
        PeerTimeout at once, nothing is sent.
        """
        t = _seconds(timeout, self.config.fetch_timeout)
        return self._wait(self.fetch_async(peer, keys, timeout=t), t)

    def fetch_into(self, peer: PeerHandle, keys: Sequence[bytes],
                   destinations: Sequence[Sequence[memoryview]], *,
                   timeout: float | None = None) -> FetchResult:
        """Fetch blocks straight into caller-owned buffers (one writable buffer per
        segment per key, e.g. views of an engine's pinned staging tensors). Nothing is
        written to the local store. A failed key's buffers may hold partial data.
        ``timeout=0``: PeerTimeout at once, nothing is sent or written."""
        t = _seconds(timeout, self.config.fetch_timeout)
        return self._wait(self.fetch_into_async(peer, keys, destinations, timeout=t), t)

    def fetch_into_async(self, peer: PeerHandle, keys: Sequence[bytes],
                         destinations: Sequence[Sequence[memoryview]], *,
                         timeout: float | None = None) -> Future[FetchResult]:
        keys = self._check_keys(keys)
        checked = check_destinations(destinations, len(keys), self._segments)
        return self._fetch_async(peer, keys, checked, timeout)

    def abort(self, future: Future[FetchResult], *, timeout: float | None = None) -> bool:
        """Stop a fetch started with ``fetch_async``/``fetch_into_async``.

        Same as ``future.cancel()`` (the peer is sent ``abort``; nothing more is written
        into the fetch's buffers or the store once this returns; the keys can be fetched
        again), and then waits up to ``timeout`` (default ``abort_timeout``) for the
        peer to confirm that it stopped (``abort_ack``) or for the connection to end
        (a peer that does not confirm within ``abort_timeout`` is disconnected).
        Returns False when the fetch had already finished (nothing to stop).
        """
        if not future.cancel():
            return False
        with self._tickets_lock:
            ticket = self._tickets.get(future)
        t = _seconds(timeout, self.config.abort_timeout)
        if ticket is not None and not ticket.stopped.wait(t + WAIT_GRACE):
            raise PeerTimeout(f"the peer did not confirm the abort within {t:.1f}s")
        return True

    def disconnect(self, peer: PeerHandle) -> None:
        """Say bye to a peer and fail anything still waiting on it."""
        fut: Future[None] = Future()
        self._reactor.submit(fut, lambda: self._client.disconnect(peer.peer_id, fut))
        self._wait(fut, self.config.close_timeout)

    def put(self, key: bytes, data: Any) -> bool:
        """Store one block locally (bytes-like of ``bytes_per_block`` or one buffer per
        segment). Returns False when the key was already present."""
        return self.store.put(key, data)

    def lookup_local(self, keys: Sequence[bytes]) -> list[bool]:
        return self.store.lookup(list(keys))

    def get(self, key: bytes) -> bytes | None:
        """A copy of a local block's bytes (for tools and tests)."""
        return self.store.get(key)

    def peers(self) -> list[PeerHandle]:
        return self._client.handles()

    def stats(self) -> NodeStats:
        c = self._rt.counters.snapshot()
        handles = self._client.handles()
        return NodeStats(
            **c.fields(f.name for f in dataclasses.fields(NodeStats)),
            address=self.address, node_id=self.node_id, fingerprint=self.fingerprint,
            peers_out=len(handles), peers_in=self._server.ready_peers(),
            handshakes_refused=c.refusals, store=self.store.stats(),
            fetch_latency_buckets=c.latency_buckets, fetch_latency_sum=c.latency_sum,
            identity_undeclared=c.undeclared,
            shm_segment=None if (offer := self._rt.shm_sender.offer) is None else offer.name,
            shm_unavailable=self.shm_unavailable,
            shm_peers_out=sum(1 for h in handles if h.data_path == "shm"),
            shm_peers_in=self._rt.shm_sender.attached_peers(),
            shm_fallbacks=c.shm_fallbacks, shm_pinned=self._rt.shm_sender.pinned(),
            draining=self._rt.inbound.draining.is_set(),
            data_port=None if self._rt.data_listener is None else self._rt.data_listener.port,
            data_peers_out=sum(1 for h in handles if h.data_path == "tcp-data"),
            data_peers_in=self._server.stream_peers(), paths=path_stats(c.paths),
            nixl=self.nixl_state, **nixl_stats(self._nixl, handles))

    def drain(self, timeout: float | None = None) -> None:
        """Leave gracefully (after ``Cluster.close``): new fetches are declined with
        UNAVAILABLE and lookups miss, fetches being sent get ``timeout`` (default
        ``drain_timeout``) to finish, then the node closes as :meth:`close` does."""
        deadline = time.monotonic() + _seconds(timeout, self.config.drain_timeout)
        self._rt.inbound.draining.set()
        self._server.wait_sent(deadline)
        self.close(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float | None = None) -> None:
        """Graceful close: in-flight work gets up to ``timeout`` (default
        ``close_timeout``) to finish, then fails with :class:`PeerGone`; peers are told
        bye; sockets and the IO thread are released. Idempotent."""
        reactor = self._reactor
        if reactor.closed.is_set():
            return
        t = _seconds(timeout, self.config.close_timeout)
        # From here on every call fails with PeerGone; what was queued before either
        # runs or fails, so every future a caller holds completes.
        reactor.begin_close(time.monotonic() + t)
        if threading.current_thread() is reactor.thread:
            return  # called from a future's callback: the loop ends once this returns
        reactor.thread.join(t + self.config.close_grace)
        if reactor.thread.is_alive():  # pragma: no cover - the loop always exits by deadline
            log.error("IO thread did not stop within %.1fs", t + self.config.close_grace)
        reactor.closed.set()

    # ------------------------------------------------------------------ API helpers

    def _check_keys(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """The public boundary's one check of a request's keys; inside, they are trusted."""
        if isinstance(keys, (bytes, bytearray, str)):  # type: ignore[unreachable]
            raise ValueError("keys must be a sequence of bytes keys, not a single key")
        out = tuple(keys)
        limit = self.config.max_keys_per_request
        if len(out) > limit:
            raise LocalLimitExceeded(f"{len(out)} keys exceed max_keys_per_request={limit}; "
                                     "split the request", limit="max_keys_per_request",
                                     allowed=limit, requested=len(out))
        return check_keys(out, MAX_KEY_LEN)

    def _fetch_async(self, peer: PeerHandle, checked: tuple[bytes, ...],
                     destinations: Sequence[Sequence[memoryview]] | None,
                     timeout: float | None) -> Future[FetchResult]:
        """``checked``: keys that passed :meth:`_check_keys` (the public methods check)."""
        fut: Future[FetchResult] = Future()
        if not checked:
            fut.set_result(FetchResult((), (), {}, 0, 0, 0.0))
            return fut
        deadline = time.monotonic() + _seconds(timeout, self.config.fetch_timeout)
        ticket = FetchTicket()
        self._reactor.submit(fut, lambda: self._client.fetch(peer.peer_id, checked, destinations,
                                                             fut, deadline, ticket))
        with self._tickets_lock:
            self._tickets[fut] = ticket
        fut.add_done_callback(lambda f: self._fetch_done(f, ticket))
        return fut

    def _fetch_done(self, fut: Future[FetchResult], ticket: FetchTicket) -> None:
        """Runs where the future completed: in the caller's thread for ``cancel()``."""
        if not fut.cancelled():
            return
        # Before cancel() returns: no landing into this fetch's buffers is in progress
        # (the ticket's lock), and none starts after (the flag).
        ticket.cancel()
        try:
            self._reactor.submit(Future(), lambda: self._client.abort_fetch(ticket))
        except PeerGone:
            ticket.stopped.set()  # the node is closing: its peers are told bye

    @staticmethod
    def _wait(fut: Future[_T], timeout: float) -> _T:
        try:
            return fut.result(timeout + WAIT_GRACE)
        except PeerTimeout:
            raise
        except concurrent.futures.TimeoutError as exc:
            # The IO thread enforces the real deadline; this only guards against a
            # wedged IO thread, so the caller is never left waiting forever.
            fut.cancel()
            raise PeerTimeout(f"no answer within {timeout:.1f}s") from exc

    def _release(self) -> None:
        """IO thread, last: stop the authenticator and release the ZeroMQ context."""
        if self._rt.auth is not None:
            try:
                self._rt.auth.stop()
            except zmq.ZMQError as exc:  # its pipe or socket already gone: it stops anyway
                log.warning("node %s: stopping the CURVE authenticator: %s", self.node_id, exc)
        self._rt.ctx.term()
        if self._nixl is not None:
            self._nixl.close()  # the importer was the IO thread's; the pool is still there
        if self._own_pool is not None:
            self._own_pool.close()  # the segment's name goes; mapped memory stays valid
        log.info("node %s closed", self.node_id)


def _make_pool(layout: Layout, pool_blocks: int | None, pool_bytes: int | None, *,
               shared: bool) -> tuple[BlockPool, str | None]:
    """A node's own pool: in shared memory when ``shared`` asks for it and a segment can
    be made; otherwise private, with why it is not shared."""
    why = None
    while True:
        try:
            if pool_blocks is not None:
                return BlockPool(layout, pool_blocks, shared=shared), why
            return BlockPool.for_bytes(layout, pool_bytes or 0, shared=shared), why
        except ValueError as exc:
            raise ConfigError(f"pool: {exc}") from exc
        except ShmUnavailable as exc:
            why = str(exc)
            log.warning("pool stays private (no shared memory): %s", exc)
            shared = False

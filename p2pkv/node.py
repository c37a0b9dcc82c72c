"""The p2pkv node: a ZeroMQ ROUTER that serves KV blocks, and DEALERs that fetch them.

Threading model
---------------
A :class:`Node` owns one background IO thread. Every ZeroMQ socket (the ROUTER it serves
on, one DEALER per peer it connected to, their monitors) lives on that thread and is
touched by no other. Engine threads call the public methods, which are thread-safe: each
queues a command for the IO thread and returns a :class:`concurrent.futures.Future`
(``*_async``) or waits on one with a deadline (the blocking helpers). The block store is
shared and has its own lock.

Data path
---------
The serving side sends each block's segments straight from the pool with
``copy=False``; the slot stays pinned in the store until ZeroMQ's tracker says it let go.
The fetching side reads a block header, then ``recv_into`` each segment directly into
the destination slot: payload bytes are never copied in Python. A fetch carries a
credit window (in blocks); the receiver returns credits as blocks land, so no ZeroMQ
queue ever reaches its high-water mark and a lookup during a bulk fetch waits behind
at most one window of data (see ``protocol/SPEC.md``, "Flow control").
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import enum
import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from p2pkv import protocol as proto
from p2pkv.errors import (
    ConfigError,
    P2PKVError,
    PeerGone,
    PeerIncompatible,
    PeerTimeout,
    ProtocolError,
    StoreFullError,
    TransferFailed,
)
from p2pkv.identity import IDENTITY_POLICIES, FieldDiff, IdentityExtension, RunConfig, diff
from p2pkv.keys import KEY_HASH_ALGORITHM, keys_well_formed
from p2pkv.layout import Layout
from p2pkv.pool import BlockPool
from p2pkv.protocol.codes import (
    MAX_BLOCKS_PER_MESSAGE,
    MAX_HEAD_BYTES,
    MAX_KEY_HASH_ALGO_LEN,
    MAX_KEY_LEN,
    OUTCOME_FAILED,
    OUTCOME_MISSING,
    OUTCOME_SENT,
)
from p2pkv.store import (
    BlockReader,
    BlockStore,
    BlockWriter,
    ChecksumMismatch,
    StoreError,
    StoreStats,
)
from p2pkv.transport import (
    CurveKeys,
    Wakeup,
    bound_address,
    make_dealer,
    make_router,
    monitor_events,
    validate_address,
)

__all__ = [
    "FetchResult",
    "KeyOutcome",
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

# Small blocks share one message up to this many payload bytes (fewer headers, fewer
# syscalls); large blocks always travel one per message.
_BATCH_BYTES = 1 << 20
# Messages handled per socket per loop turn, so one busy peer cannot starve the others.
_READ_BUDGET = 256
# Poll tick while sent blocks wait for ZeroMQ to release them.
_REAP_TICK_MS = 10
# How often the IO loop checks deadlines while it is busy (it always checks when idle).
_DEADLINE_CHECK_S = 0.005
# Block bytes received per connection per loop turn before commands get a turn.
_READ_BURST_BYTES = 4 << 20
# Grace added to a blocking helper's wait beyond the IO thread's own deadline, so the
# typed timeout from the IO thread wins over a bare concurrent.futures timeout.
_WAIT_GRACE = 1.0
# Upper bounds (seconds) of the fetch latency histogram.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, float("inf"))
# How long a failed pre-handshake send waits for the monitor to explain it.
_MONITOR_GRACE_MS = 100
# Sink for payload frames that have nowhere to go (aborted fetch, failed slot).
_SCRATCH = bytearray(0)
# Segments at least this large are sent zero-copy (tracked); smaller ones are cheaper to
# copy into libzmq than to track.
_ZERO_COPY_MIN = 65536
_DONE_STATES = frozenset({proto.State.CLOSED, proto.State.ERROR, proto.State.REFUSED})


class KeyOutcome(enum.Enum):
    """What happened to one key of a fetch."""

    STORED = "stored"  #: all bytes landed (and verified) and the block is visible
    MISSING = "missing"  #: the peer does not hold the block
    FAILED = "failed"  #: the transfer of this block failed (see ``FetchResult.errors``)


@dataclass(frozen=True)
class FetchResult:
    """Per-key outcome of a fetch, in the order the keys were given."""

    keys: tuple[bytes, ...]
    outcomes: tuple[KeyOutcome, ...]
    errors: dict[int, str]
    blocks: int
    nbytes: int
    seconds: float

    @property
    def stored(self) -> list[bytes]:
        return [k for k, o in zip(self.keys, self.outcomes, strict=True) if o is KeyOutcome.STORED]

    @property
    def missing(self) -> list[bytes]:
        return [k for k, o in zip(self.keys, self.outcomes, strict=True) if o is KeyOutcome.MISSING]

    @property
    def failed(self) -> list[bytes]:
        return [k for k, o in zip(self.keys, self.outcomes, strict=True) if o is KeyOutcome.FAILED]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class NodeConfig:
    """Everything about a node that is not its KV identity. Times are seconds."""

    listen: str = "tcp://127.0.0.1:0"
    node_id: str | None = None
    key_hash_seed: int = 0
    #: Name of the block-key hash, compared at the handshake. Keys an engine hashes
    #: itself (for example vLLM's block hashes) are carried opaquely under their own name.
    key_hash_algo: str = KEY_HASH_ALGORITHM
    checksums: bool = True
    window_bytes: int = 16 << 20
    handshake_timeout: float = 5.0
    lookup_timeout: float = 5.0
    fetch_timeout: float = 60.0
    fetch_idle_timeout: float = 10.0
    abort_timeout: float = 2.0
    close_timeout: float = 5.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    max_peers: int = 256
    max_keys_per_request: int = 16384
    max_inflight_requests: int = 64
    curve: CurveKeys | None = None
    connect_allowlist: frozenset[str] | None = None
    #: "strict": an identity-extension field only one side declares refuses the peer;
    #: "lenient": it is accepted with a warning, counted in stats().identity_undeclared.
    identity_policy: str = "strict"

    def __post_init__(self) -> None:
        validate_address(self.listen, what="listen")
        if self.identity_policy not in IDENTITY_POLICIES:
            raise ConfigError(f"identity_policy must be one of {', '.join(IDENTITY_POLICIES)}, "
                              f"got {self.identity_policy!r}")
        positive = (
            "handshake_timeout", "lookup_timeout", "fetch_timeout", "fetch_idle_timeout",
            "abort_timeout", "close_timeout", "heartbeat_interval", "heartbeat_timeout",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("window_bytes", "max_peers", "max_keys_per_request",
                     "max_inflight_requests"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if type(self.key_hash_seed) is not int or not 0 <= self.key_hash_seed < 2**64:
            raise ConfigError(f"key_hash_seed must be an int in [0, 2**64), got "
                              f"{self.key_hash_seed!r}")
        if (not isinstance(self.key_hash_algo, str)
                or not 1 <= len(self.key_hash_algo) <= MAX_KEY_HASH_ALGO_LEN):
            raise ConfigError(f"key_hash_algo must be a name of 1..{MAX_KEY_HASH_ALGO_LEN} "
                              f"characters, got {self.key_hash_algo!r}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must be longer than heartbeat_interval")


@dataclass(frozen=True)
class PeerHandle:
    """A live, compatible connection to a remote node (returned by :meth:`Node.connect`)."""

    peer_id: int
    address: str
    remote_node_id: str
    remote_run_config: dict[str, Any]
    remote_fingerprint: str
    capabilities: frozenset[str]
    _node: Node = field(repr=False, compare=False)
    #: The peer's identity extension (empty for a peer that declares none, or speaks 1.0).
    remote_extension: IdentityExtension = field(default_factory=IdentityExtension)

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> list[bool]:
        return self._node.lookup(self, keys, timeout=timeout)

    def fetch(self, keys: Sequence[bytes], timeout: float | None = None) -> FetchResult:
        return self._node.fetch(self, keys, timeout=timeout)

    def close(self) -> None:
        self._node.disconnect(self)


@dataclass(frozen=True)
class NodeStats:
    """A snapshot of the node's counters."""

    address: str
    node_id: str
    fingerprint: str
    peers_out: int
    peers_in: int
    handshakes_accepted: int
    handshakes_refused: dict[str, int]
    lookups_served: int
    lookup_keys_served: int
    lookup_hits_served: int
    blocks_sent: int
    bytes_sent: int
    blocks_received: int
    bytes_received: int
    checksum_failures: int
    protocol_violations: int
    store: StoreStats
    #: Cumulative (upper bound in seconds, count) pairs of fetch latency, +inf last.
    fetch_latency_buckets: tuple[tuple[float, int], ...]
    fetch_latency_sum: float
    #: Handshakes accepted under identity_policy="lenient" although only one side
    #: declared this identity-extension field, by field name.
    identity_undeclared: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- IO state


@dataclass(eq=False)
class _Receiving:
    """A fetch this node issued: where each block lands, and what happened to it."""

    req: int
    keys: tuple[bytes, ...]
    future: Future[FetchResult]
    destinations: Sequence[Sequence[memoryview]] | None
    granted: int  # blocks of credit granted so far (the initial window included)
    started: float
    deadline: float
    outcomes: list[KeyOutcome | None]
    index_map: list[int]
    errors: dict[int, str] = field(default_factory=dict)
    arrived: int = 0  # blocks whose frames arrived (landed, failed or dropped)
    blocks: int = 0
    nbytes: int = 0

    @property
    def outstanding(self) -> int:
        return self.granted - self.arrived

    @property
    def ungranted(self) -> int:
        return len(self.index_map) - self.granted


@dataclass(eq=False)
class _Outbound:
    peer_id: int
    address: str
    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    session: proto.Session
    connect_future: Future[PeerHandle]
    handshake_deadline: float
    handle: PeerHandle | None = None
    lookups: dict[int, tuple[Future[list[bool]], float]] = field(default_factory=dict)
    fetches: dict[int, _Receiving] = field(default_factory=dict)
    received_blocks: int = 0
    closed: bool = False


@dataclass(eq=False)
class _Sending:
    """A fetch this node serves: which keys are left and how much credit it has."""

    req: int
    keys: tuple[bytes, ...]
    outcomes: list[int]
    next_index: int = 0


@dataclass(eq=False)
class _Inbound:
    rid: bytes
    session: proto.Session
    jobs: collections.OrderedDict[int, _Sending] = field(default_factory=collections.OrderedDict)
    closed: bool = False


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
        if store is None:
            if (pool_blocks is None) == (pool_bytes is None):
                raise ConfigError("give exactly one of pool_blocks or pool_bytes")
            try:
                pool = (BlockPool(layout, pool_blocks) if pool_blocks is not None
                        else BlockPool.for_bytes(layout, pool_bytes or 0))
            except ValueError as exc:
                raise ConfigError(f"pool: {exc}") from exc
            store = BlockStore(pool)
        elif tuple(store.pool.segment_sizes) != tuple(layout.segment_sizes):
            raise ConfigError(
                f"the store's pool holds segments {list(store.pool.segment_sizes)}, the "
                f"layout needs {list(layout.segment_sizes)}")
        self.store = store
        self.node_id = self.config.node_id or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self._segments = tuple(layout.segment_sizes)
        self._bpb = layout.bytes_per_block
        self._window = max(2, self.config.window_bytes // self._bpb)
        caps = [proto.CAP_CHECKSUM_XXH3_64] if self.config.checksums else []
        self._deadlines = proto.Deadlines(
            handshake=self.config.handshake_timeout,
            lookup=self.config.lookup_timeout,
            fetch_idle=self.config.fetch_idle_timeout,
            abort=self.config.abort_timeout,
            heartbeat_interval=self.config.heartbeat_interval,
            heartbeat_timeout=self.config.heartbeat_timeout,
        )
        self._limits = proto.Limits(
            max_keys=self.config.max_keys_per_request,
            max_in_flight=self.config.max_inflight_requests,
        )
        self.hello = proto.Hello(
            node=self.node_id,
            minor=proto.PROTOCOL_MINOR,
            rc=run_config.get_run_config(),
            fp=run_config.fingerprint,
            geo=proto.Geometry(bpb=self._bpb, seg=self._segments),
            khash=proto.KeyHash(algo=self.config.key_hash_algo, seed=self.config.key_hash_seed),
            caps=tuple(caps),
            limits=self._limits.advertised(window=self._window),
            ext=None if self.extension.is_empty else self.extension,
        )
        # libzmq drops any frame above this before Python sees it.
        self._max_message = max(max(self._segments), MAX_HEAD_BYTES)

        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: Any = None
        try:
            if self.config.curve is not None:
                # The authenticator must run before the socket binds so that no
                # connection slips through unauthenticated.
                self._auth = _start_authenticator(self._ctx, self.config.curve)
            self._router = make_router(self._ctx, self.config.listen,
                                       max_message_bytes=self._max_message,
                                       curve=self.config.curve)
        except BaseException:
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise
        self.address = bound_address(self._router)

        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = Wakeup()
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wakeup.fileno(), zmq.POLLIN)
        self._outbound: dict[int, _Outbound] = {}
        self._by_socket: dict[zmq.Socket[bytes], _Outbound] = {}
        self._by_monitor: dict[zmq.Socket[bytes], _Outbound] = {}
        self._inbound: dict[bytes, _Inbound] = {}
        self._peer_ids = itertools.count(1)
        # (tracker, readers) in send order; readers are released once libzmq let go.
        self._inflight_sends: collections.deque[
            tuple[zmq.MessageTracker, list[BlockReader]]] = collections.deque()
        self._closing = False
        self._next_deadline_check = 0.0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._refusals: collections.Counter[str] = collections.Counter()
        self._undeclared: collections.Counter[str] = collections.Counter()
        self._latency = [0] * len(_LATENCY_BUCKETS)
        self._latency_sum = 0.0
        self._thread = threading.Thread(target=self._run, name=f"p2pkv-io-{self.address}",
                                        daemon=True)
        self._thread.start()
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
        deadline = time.monotonic() + (timeout or self.config.handshake_timeout)
        self._submit(fut, lambda: self._cmd_connect(address, fut, deadline))
        return fut

    def connect(self, address: str, *, timeout: float | None = None) -> PeerHandle:
        """Connect and handshake. Raises :class:`PeerIncompatible` (with the diff) when
        either side refuses, :class:`PeerTimeout` when no answer comes in time."""
        t = timeout or self.config.handshake_timeout
        return self._wait(self.connect_async(address, timeout=t), t)

    def lookup_async(self, peer: PeerHandle, keys: Sequence[bytes], *,
                     timeout: float | None = None) -> Future[list[bool]]:
        keys = self._check_keys(keys)
        fut: Future[list[bool]] = Future()
        if not keys:
            fut.set_result([])
            return fut
        deadline = time.monotonic() + (timeout or self.config.lookup_timeout)
        self._submit(fut, lambda: self._cmd_lookup(peer.peer_id, keys, fut, deadline))
        return fut

    def lookup(self, peer: PeerHandle, keys: Sequence[bytes], *,
               timeout: float | None = None) -> list[bool]:
        """Which of ``keys`` the peer holds, in order."""
        t = timeout or self.config.lookup_timeout
        return self._wait(self.lookup_async(peer, keys, timeout=t), t)

    def fetch_async(self, peer: PeerHandle, keys: Sequence[bytes], *,
                    timeout: float | None = None) -> Future[FetchResult]:
        return self._fetch_async(peer, keys, None, timeout)

    def fetch(self, peer: PeerHandle, keys: Sequence[bytes], *,
              timeout: float | None = None) -> FetchResult:
        """Fetch blocks from ``peer`` into the local store; per-key outcome in the result.

        Keys already held locally are not fetched again (reported as stored).
        """
        t = timeout or self.config.fetch_timeout
        return self._wait(self.fetch_async(peer, keys, timeout=t), t)

    def fetch_into(self, peer: PeerHandle, keys: Sequence[bytes],
                   destinations: Sequence[Sequence[memoryview]], *,
                   timeout: float | None = None) -> FetchResult:
        """Fetch blocks straight into caller-owned buffers (one writable buffer per
        segment per key, e.g. views of an engine's pinned staging tensors). Nothing is
        written to the local store. A failed key's buffers may hold partial data."""
        t = timeout or self.config.fetch_timeout
        return self._wait(self.fetch_into_async(peer, keys, destinations, timeout=t), t)

    def fetch_into_async(self, peer: PeerHandle, keys: Sequence[bytes],
                         destinations: Sequence[Sequence[memoryview]], *,
                         timeout: float | None = None) -> Future[FetchResult]:
        keys = self._check_keys(keys)
        if len(destinations) != len(keys):
            raise ValueError(f"destinations has {len(destinations)} entries for {len(keys)} keys")
        checked: list[list[memoryview]] = []
        for i, bufs in enumerate(destinations):
            if len(bufs) != len(self._segments):
                raise ValueError(f"destinations[{i}] has {len(bufs)} buffers, the layout has "
                                 f"{len(self._segments)} segments")
            views = []
            for j, buf in enumerate(bufs):
                view = memoryview(buf).cast("B")
                if view.readonly or view.nbytes != self._segments[j]:
                    raise ValueError(f"destinations[{i}][{j}] must be a writable buffer of "
                                     f"{self._segments[j]} bytes, got {view.nbytes} "
                                     f"({'read-only' if view.readonly else 'writable'})")
                views.append(view)
            checked.append(views)
        return self._fetch_async(peer, keys, checked, timeout)

    def disconnect(self, peer: PeerHandle) -> None:
        """Say bye to a peer and fail anything still waiting on it."""
        fut: Future[None] = Future()
        self._submit(fut, lambda: self._cmd_disconnect(peer.peer_id, fut))
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
        with self._lock:
            return [c.handle for c in self._outbound.values() if c.handle and not c.closed]

    def stats(self) -> NodeStats:
        with self._lock:
            c = self._counters
            return NodeStats(
                address=self.address, node_id=self.node_id, fingerprint=self.fingerprint,
                peers_out=sum(1 for o in self._outbound.values() if o.handle and not o.closed),
                peers_in=sum(1 for i in self._inbound.values()
                             if i.session.state is proto.State.READY),
                handshakes_accepted=c["handshakes_accepted"],
                handshakes_refused=dict(self._refusals),
                lookups_served=c["lookups_served"], lookup_keys_served=c["lookup_keys_served"],
                lookup_hits_served=c["lookup_hits_served"], blocks_sent=c["blocks_sent"],
                bytes_sent=c["bytes_sent"], blocks_received=c["blocks_received"],
                bytes_received=c["bytes_received"], checksum_failures=c["checksum_failures"],
                protocol_violations=c["protocol_violations"], store=self.store.stats(),
                fetch_latency_buckets=tuple(zip(_LATENCY_BUCKETS,
                                                itertools.accumulate(self._latency),
                                                strict=True)),
                fetch_latency_sum=self._latency_sum,
                identity_undeclared=dict(self._undeclared),
            )

    def close(self, timeout: float | None = None) -> None:
        """Graceful close: in-flight work gets up to ``timeout`` (default
        ``close_timeout``) to finish, then fails with :class:`PeerGone`; peers are told
        bye; sockets and the IO thread are released. Idempotent."""
        if self._closed.is_set():
            return
        t = self.config.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + t

        def begin() -> None:
            self._closing = True
            self._close_deadline = deadline

        with contextlib.suppress(P2PKVError):
            self._submit(Future(), begin)
        if threading.current_thread() is self._thread:
            return  # called from a future's callback: the loop ends once this returns
        self._thread.join(t + 5.0)
        if self._thread.is_alive():  # pragma: no cover - the loop always exits by deadline
            log.error("IO thread did not stop within %.1fs", t + 5.0)
        self._closed.set()

    # ------------------------------------------------------------------ API helpers

    def _check_keys(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        if isinstance(keys, (bytes, bytearray, str)):  # type: ignore[unreachable]
            raise ValueError("keys must be a sequence of bytes keys, not a single key")
        out = tuple(keys)
        if len(out) > self.config.max_keys_per_request:
            raise ValueError(f"{len(out)} keys exceed max_keys_per_request="
                             f"{self.config.max_keys_per_request}; split the request")
        if keys_well_formed(out, MAX_KEY_LEN):
            return out
        for i, k in enumerate(out):
            if type(k) is not bytes or not 1 <= len(k) <= MAX_KEY_LEN:
                raise ValueError(f"keys[{i}] must be bytes of length 1..{MAX_KEY_LEN}, "
                                 f"got {k!r:.60}")
        return out

    def _fetch_async(self, peer: PeerHandle, keys: Sequence[bytes],
                     destinations: Sequence[Sequence[memoryview]] | None,
                     timeout: float | None) -> Future[FetchResult]:
        checked = self._check_keys(keys)
        fut: Future[FetchResult] = Future()
        if not checked:
            fut.set_result(FetchResult((), (), {}, 0, 0, 0.0))
            return fut
        deadline = time.monotonic() + (timeout or self.config.fetch_timeout)
        self._submit(fut, lambda: self._cmd_fetch(peer.peer_id, checked, destinations, fut,
                                                  deadline))
        return fut

    def _submit(self, fut: Future[Any], command: Callable[[], None]) -> None:
        if self._closing or self._closed.is_set():
            raise PeerGone("node is closed")

        def guarded() -> None:
            try:
                command()
            except Exception as exc:  # report on the future, never kill the IO thread
                if not isinstance(exc, (P2PKVError, ValueError)):
                    log.exception("command failed")
                if not fut.done():
                    fut.set_exception(exc)

        self._commands.put(guarded)
        self._wakeup.notify()

    @staticmethod
    def _wait(fut: Future[_T], timeout: float) -> _T:
        try:
            return fut.result(timeout + _WAIT_GRACE)
        except PeerTimeout:
            raise
        except concurrent.futures.TimeoutError as exc:
            # The IO thread enforces the real deadline; this only guards against a
            # wedged IO thread, so the caller is never left waiting forever.
            fut.cancel()
            raise PeerTimeout(f"no answer within {timeout:.1f}s") from exc

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # ------------------------------------------------------------------ IO thread

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug; make it loud, fail every waiter
            log.exception("IO thread crashed")
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            if self._closing and (self._idle() or now >= self._close_deadline):
                return
            timeout_ms = self._poll_timeout(now)
            ready = dict(self._poller.poll(timeout_ms))
            now = time.monotonic()
            if self._wakeup.fileno() in ready:
                self._wakeup.drain()
            self._run_commands()
            if self._router in ready:
                self._read_router(now)
            for sock in list(ready):
                if isinstance(sock, int):
                    continue
                conn = self._by_socket.get(sock)
                if conn is not None and not conn.closed:
                    try:
                        self._read_dealer(conn, now)
                    except Exception as exc:
                        # A bug must cost one connection, never the node.
                        log.exception("internal error on connection to %s", conn.address)
                        self._drop_outbound(conn, P2PKVError(f"internal error: {exc!r}"))
                mon = self._by_monitor.get(sock)
                if mon is not None and not mon.closed:
                    self._read_monitor(mon, now)
            self._pump(now)
            self._reap_sends()
            now = time.monotonic()
            # Deadlines are coarse (heartbeats, request timeouts); checking them on
            # every message would cost more than the messages themselves.
            if now >= self._next_deadline_check:
                self._next_deadline_check = now + _DEADLINE_CHECK_S
                self._check_deadlines(now)

    def _idle(self) -> bool:
        busy_out = any(c.lookups or c.fetches for c in self._outbound.values() if not c.closed)
        busy_in = any(i.jobs for i in self._inbound.values() if not i.closed)
        return not busy_out and not busy_in and not self._inflight_sends

    def _poll_timeout(self, now: float) -> int:
        if any(j.next_index < len(j.keys) and i.session.window_left(j.req) > 0
               for i in self._inbound.values() for j in i.jobs.values()):
            return 0
        if self._inflight_sends:
            # Sent blocks stay pinned until reaped. Any arriving message (credit) wakes
            # the loop anyway; this slower tick only bounds how long the last ones wait,
            # without spinning a core that the receiving side may need.
            return _REAP_TICK_MS
        nxt: float | None = None
        for c in self._outbound.values():
            d = c.session.next_deadline()
            if d is not None:
                nxt = d if nxt is None else min(nxt, d)
            for r in c.fetches.values():
                nxt = r.deadline if nxt is None else min(nxt, r.deadline)
        for i in self._inbound.values():
            d = i.session.next_deadline()
            if d is not None:
                nxt = d if nxt is None else min(nxt, d)
        wait = 0.1 if nxt is None else max(0.0, min(0.1, nxt - now))
        return int(wait * 1000) + 1

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    # -- outbound (this node fetches) ------------------------------------------------

    def _cmd_connect(self, address: str, fut: Future[PeerHandle], deadline: float) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if sum(1 for c in self._outbound.values() if not c.closed) >= self.config.max_peers:
            fut.set_exception(P2PKVError(f"peer limit reached (max_peers={self.config.max_peers})"))
            return
        sock, monitor = make_dealer(self._ctx, address, max_message_bytes=self._max_message,
                                    curve=self.config.curve)
        now = time.monotonic()
        session = proto.Session(proto.Role.CLIENT, self.hello, deadlines=self._deadlines,
                                limits=self._limits, now=now,
                                identity_policy=self.config.identity_policy)
        conn = _Outbound(next(self._peer_ids), address, sock, monitor, session, fut, deadline)
        with self._lock:
            self._outbound[conn.peer_id] = conn
        self._by_socket[sock] = conn
        self._by_monitor[monitor] = conn
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        self._send_out(conn, session.start(now))

    def _cmd_lookup(self, peer_id: int, keys: tuple[bytes, ...], fut: Future[list[bool]],
                    deadline: float) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        conn = self._ready_conn(peer_id)
        msg = conn.session.lookup(keys, time.monotonic())
        conn.lookups[msg.req] = (fut, deadline)
        self._send_out(conn, [msg])

    def _cmd_fetch(self, peer_id: int, keys: tuple[bytes, ...],
                   destinations: Sequence[Sequence[memoryview]] | None,
                   fut: Future[FetchResult], deadline: float) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        conn = self._ready_conn(peer_id)
        now = time.monotonic()
        outcomes: list[KeyOutcome | None] = [None] * len(keys)
        wanted: list[int] = []
        if destinations is None:
            for i, present in enumerate(self.store.lookup(list(keys))):
                if present:
                    outcomes[i] = KeyOutcome.STORED
                else:
                    wanted.append(i)
        else:
            wanted = list(range(len(keys)))
        if not wanted:
            fut.set_result(FetchResult(keys, tuple(o or KeyOutcome.STORED for o in outcomes),
                                       {}, 0, 0, 0.0))
            return
        # One credit budget per peer, shared by all its fetches: it bounds the data
        # queued towards this node, and so how long a lookup answer can wait behind it.
        free = self._window - sum(r.outstanding for r in conn.fetches.values())
        window = max(1, min(free, len(wanted)))
        msg = conn.session.fetch(tuple(keys[i] for i in wanted), window, now)
        recv = _Receiving(msg.req, keys, fut, destinations, window, now, deadline, outcomes,
                          wanted)
        conn.fetches[msg.req] = recv
        self._send_out(conn, [msg])

    def _cmd_disconnect(self, peer_id: int, fut: Future[None]) -> None:
        conn = self._outbound.get(peer_id)
        if conn is not None and not conn.closed:
            self._send_out(conn, conn.session.close(proto.Code.NORMAL_CLOSE, "disconnect").replies)
            self._drop_outbound(conn, PeerGone(f"disconnected from {conn.address}"))
        fut.set_result(None)

    def _ready_conn(self, peer_id: int) -> _Outbound:
        conn = self._outbound.get(peer_id)
        if conn is None or conn.closed:
            raise PeerGone(f"peer {peer_id} is not connected (closed, dead or never connected)")
        if conn.session.state is not proto.State.READY:
            raise PeerGone(f"peer {conn.address} is not ready (state {conn.session.state.name})")
        return conn

    def _send_out(self, conn: _Outbound, messages: Iterable[proto.Message]) -> None:
        for msg in messages:
            try:
                conn.sock.send_multipart(proto.encode(msg), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                # Before the p2pkv handshake a send fails when ZeroMQ's own (CURVE/NULL)
                # handshake already failed and tore the pipe down; the monitor says
                # which, so give it a moment to report.
                if (conn.handle is None and not conn.closed
                        and conn.monitor.poll(_MONITOR_GRACE_MS)):
                    self._read_monitor(conn, time.monotonic())
                self._drop_outbound(conn, PeerGone(f"cannot send to {conn.address}: {exc}"))
                return

    def _read_monitor(self, conn: _Outbound, now: float) -> None:
        events = monitor_events(conn.monitor)
        if not events:
            return
        auth_failed = any(e in (zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL) for e in events)
        if auth_failed:
            self._drop_outbound(conn, PeerIncompatible(
                f"{conn.address} rejected the ZeroMQ security handshake (CURVE keys or "
                "plaintext/encrypted mismatch)"))
        elif any(e in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) for e in events):
            if conn.handle is None:
                self._drop_outbound(conn, PeerGone(
                    f"could not connect to {conn.address} (refused, or closed during the "
                    "handshake)"))
            else:
                self._drop_outbound(conn, PeerGone(f"connection to {conn.address} was lost"))

    def _read_dealer(self, conn: _Outbound, now: float) -> None:
        sock = conn.sock
        start = conn.received_blocks
        for _ in range(_READ_BUDGET):
            if conn.closed:
                return
            # Leave a burst of bulk data after a few MiB so that queued commands (a
            # lookup issued meanwhile) and other peers get their turn.
            if (conn.received_blocks - start) * self._bpb >= _READ_BURST_BYTES:
                return
            try:
                head = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self._drop_outbound(conn, PeerGone(f"receive from {conn.address} failed: {exc}"))
                return
            try:
                msg = proto.decode_head(head, segments=self._segments)
            except ProtocolError as exc:
                _drain(sock)
                self._handle_out_events(conn, conn.session.receive_malformed(exc, now), now)
                continue
            if type(msg) is proto.Block:
                out = conn.session.receive(msg, now)
                arrived = [e for e in out.events if type(e) is proto.BlockArrived]
                if arrived:
                    self._land_blocks(conn, msg, now)
                else:
                    _drain(sock)  # discarded (aborted fetch) or a violation
                self._handle_out_events(conn, out, now)
                continue
            if sock.getsockopt(zmq.RCVMORE):
                _drain(sock)
                bad = ProtocolError(proto.Code.FRAME_COUNT,
                                    f"{msg.TAG} must not carry payload frames")
                self._handle_out_events(conn, conn.session.receive_malformed(bad, now), now)
                continue
            self._handle_out_events(conn, conn.session.receive(msg, now), now)

    def _land_blocks(self, conn: _Outbound, msg: proto.Block, now: float) -> None:
        """recv_into each payload frame of a block message directly into its slot.

        The session has already checked the header (known fetch, fresh indices, within
        the granted window, checksum presence as negotiated).
        """
        recv = conn.fetches.get(msg.req)
        sock = conn.sock
        segments = self._segments
        nseg = len(segments)
        landed = 0
        for n, idx in enumerate(msg.idx):
            views: Sequence[memoryview] | None = None
            writer: BlockWriter | None = None
            key_index = -1
            if recv is not None and idx < len(recv.index_map):
                key_index = recv.index_map[idx]
                if recv.destinations is not None:
                    views = recv.destinations[key_index]
                else:
                    try:
                        writer = self.store.begin_write(recv.keys[key_index])
                    except (StoreError, StoreFullError) as exc:
                        recv.errors[key_index] = f"no slot in the local pool: {exc}"
                    else:
                        if writer is None:
                            recv.errors[key_index] = (
                                "the block was being written by another fetch at the time")
                        else:
                            views = writer.views
            # libzmq delivers a multipart message whole, so one "more frames?" check
            # per block suffices: a message that ends early shows up as a frame of the
            # wrong size, as nothing left to read, or as surplus frames at the end —
            # each a violation that closes the connection.
            ok = bool(sock.getsockopt(zmq.RCVMORE))
            if ok:
                try:
                    for s in range(nseg):
                        if views is not None:
                            if sock.recv_into(views[s], flags=zmq.NOBLOCK) != segments[s]:
                                ok = False
                        else:
                            sock.recv_into(_SCRATCH, flags=zmq.NOBLOCK)
                except zmq.Again:
                    if writer is not None:
                        writer.abort()
                    bad = ProtocolError(proto.Code.FRAME_COUNT,
                                        "block message carries fewer frames than announced")
                    self._handle_out_events(conn, conn.session.receive_malformed(bad, now),
                                            now)
                    return
            if recv is None or key_index < 0:
                if writer is not None:
                    writer.abort()
                continue
            recv.arrived += 1
            if not ok:
                if writer is not None:
                    writer.abort()
                recv.outcomes[key_index] = KeyOutcome.FAILED
                recv.errors[key_index] = "payload frames do not match the block geometry"
                continue
            if views is None:
                if self.store.contains(recv.keys[key_index]):
                    # Another fetch stored the same block meanwhile: it is here.
                    recv.outcomes[key_index] = KeyOutcome.STORED
                    recv.errors.pop(key_index, None)
                else:
                    recv.outcomes[key_index] = KeyOutcome.FAILED
                continue
            expected = msg.sums[n]
            if writer is not None:
                try:
                    writer.commit(expected_checksum=expected)
                except ChecksumMismatch as exc:
                    self._count("checksum_failures")
                    recv.outcomes[key_index] = KeyOutcome.FAILED
                    recv.errors[key_index] = f"block dropped: {exc}"
                    continue
            elif expected is not None and proto.block_checksum(views) != expected:
                self._count("checksum_failures")
                recv.outcomes[key_index] = KeyOutcome.FAILED
                recv.errors[key_index] = "block dropped: checksum mismatch"
                continue
            recv.outcomes[key_index] = KeyOutcome.STORED
            recv.blocks += 1
            recv.nbytes += self._bpb
            landed += 1
        if sock.getsockopt(zmq.RCVMORE):
            _drain(sock)
            bad = ProtocolError(proto.Code.FRAME_COUNT,
                                "block message carries more frames than announced")
            self._handle_out_events(conn, conn.session.receive_malformed(bad, now), now)
            return
        conn.received_blocks += len(msg.idx)
        self._count("blocks_received", landed)
        self._count("bytes_received", landed * self._bpb)
        self._refill_credit(conn, now)

    def _refill_credit(self, conn: _Outbound, now: float) -> None:
        """Grant credit so the peer's outstanding blocks return to the window budget.

        Credit goes out in batches (at least half the budget, or whatever a starved
        fetch needs), which keeps the pipe full with few credit messages; it is split
        evenly over the fetches that still have blocks to be granted.
        """
        fetches = [r for r in conn.fetches.values() if r.ungranted > 0]
        if not fetches:
            return
        free = self._window - sum(r.outstanding for r in conn.fetches.values())
        starved = any(r.outstanding == 0 for r in fetches)
        if free <= 0 or (free * 2 < self._window and free < 64 and not starved):
            return
        share = -(-free // len(fetches))
        for r in fetches:
            n = min(share, r.ungranted, free)
            if n <= 0:
                continue
            try:
                credit = conn.session.credit(r.req, n, now)
            except (ProtocolError, ValueError):
                continue  # the fetch is aborting; it needs no more credit
            r.granted += n
            free -= n
            self._send_out(conn, [credit])
            if conn.closed:
                return

    def _handle_out_events(self, conn: _Outbound, out: proto.Output, now: float) -> None:
        self._send_out(conn, out.replies)
        for ev in out.events:
            kind = type(ev)
            if kind is proto.BlockArrived or kind is proto.BlockDiscarded:
                continue
            if kind is proto.HandshakeAccepted:
                assert isinstance(ev, proto.HandshakeAccepted)
                remote = ev.remote
                handle = PeerHandle(conn.peer_id, conn.address, remote.node, dict(remote.rc),
                                    remote.fp, frozenset(ev.capabilities), self,
                                    remote.ext or IdentityExtension())
                conn.handle = handle
                self._note_undeclared(conn.address, ev.warnings)
                log.info("connected to %s (%s), capabilities %s", conn.address, remote.node,
                         sorted(ev.capabilities))
                if not conn.connect_future.done():
                    conn.connect_future.set_result(handle)
            elif isinstance(ev, proto.HandshakeRefused):
                exc = self._incompatible(conn.address, ev)
                log.warning("%s", exc)
                self._drop_outbound(conn, exc)
                return
            elif isinstance(ev, proto.LookupAnswered):
                pending = conn.lookups.pop(ev.req, None)
                if pending is not None and not pending[0].done():
                    pending[0].set_result(list(ev.hits))
            elif isinstance(ev, proto.FetchFinished):
                recv = conn.fetches.pop(ev.req, None)
                if recv is not None:
                    self._finish_fetch(recv, ev.outcomes, now)
                    self._refill_credit(conn, now)  # its budget goes to the others
            elif isinstance(ev, proto.RequestFailed):
                self._fail_request(conn, ev.req, _request_error(conn.address, ev))
            elif isinstance(ev, proto.RequestTimedOut):
                self._fail_request(conn, ev.req, PeerTimeout(
                    f"{conn.address} made no progress on request {ev.req} ({ev.kind}) "
                    "within its deadline"))
            elif isinstance(ev, proto.PeerClosed):
                self._drop_outbound(conn, PeerGone(
                    f"{conn.address} closed the connection: {ev.msg} "
                    f"[{proto.code_name(ev.code)}]") if ev.code != proto.Code.TIMEOUT
                    else PeerTimeout(f"{conn.address}: {ev.msg}"))
                return
            elif isinstance(ev, proto.ProtocolViolated):
                self._count("protocol_violations")
                log.warning("protocol violation by %s: %s", conn.address, ev.msg)
                self._drop_outbound(conn, ProtocolError(ev.code, ev.msg))
                return

    def _note_undeclared(self, who: str, warnings: Sequence[proto.Reason]) -> None:
        """Identity fields only one side declared, let through by the lenient policy."""
        if not warnings:
            return
        with self._lock:
            for reason in warnings:
                self._undeclared[reason.field.removeprefix("ext.")] += 1
        log.warning("accepted %s under identity_policy=lenient although only one side "
                    "declares: %s", who, "; ".join(r.describe() for r in warnings))

    def _incompatible(self, address: str, ev: proto.HandshakeRefused) -> PeerIncompatible:
        who = f"{address} refused this node" if ev.by_remote else f"this node refused {address}"
        reasons = list(ev.reasons)
        lines = [f"{who}: {len(reasons)} difference(s)"]
        lines += [f"  - {r.describe()}" for r in reasons]
        remote = ev.remote
        if ev.by_remote and isinstance(remote, proto.Refuse):
            # The peer's reasons are phrased from its side; when it told us who it is,
            # decide again from ours so "local"/"remote" and the meanings read right.
            mine = _own_view(self.hello, remote)
            if mine:
                reasons = mine
                lines = [f"{who}: {len(reasons)} difference(s)"]
                lines += [f"  - {r.describe()}" for r in reasons]
        remote_info: dict[str, Any] = {}
        field_diff: list[FieldDiff] = []
        if remote is not None:
            remote_info = {"node": remote.node, "fp": remote.fp, "rc": remote.rc,
                           "ext": remote.ext.to_wire() if remote.ext is not None else {}}
            if isinstance(remote.rc, dict):
                field_diff = diff(self.hello.rc, remote.rc)
        exc = PeerIncompatible("\n".join(lines), reasons=reasons, diff=field_diff)
        exc.remote = remote_info
        return exc

    def _finish_fetch(self, recv: _Receiving, wire: Sequence[int], now: float) -> None:
        for pos, key_index in enumerate(recv.index_map):
            if recv.outcomes[key_index] is not None:
                continue
            code = wire[pos] if pos < len(wire) else OUTCOME_FAILED
            if code == OUTCOME_MISSING:
                recv.outcomes[key_index] = KeyOutcome.MISSING
            else:
                recv.outcomes[key_index] = KeyOutcome.FAILED
                recv.errors.setdefault(key_index, "peer reported the block as sent but it "
                                       "never arrived" if code == OUTCOME_SENT
                                       else "peer failed to send the block")
        seconds = now - recv.started
        result = FetchResult(recv.keys, tuple(o or KeyOutcome.FAILED for o in recv.outcomes),
                             dict(recv.errors), recv.blocks, recv.nbytes, seconds)
        with self._lock:
            self._latency[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1
            self._latency_sum += seconds
        if not recv.future.done():
            recv.future.set_result(result)

    def _fail_request(self, conn: _Outbound, req: int, exc: P2PKVError) -> None:
        pending = conn.lookups.pop(req, None)
        if pending is not None and not pending[0].done():
            pending[0].set_exception(exc)
        recv = conn.fetches.pop(req, None)
        if recv is not None and not recv.future.done():
            recv.future.set_exception(exc)

    def _drop_outbound(self, conn: _Outbound, exc: P2PKVError) -> None:
        if conn.closed:
            return
        conn.closed = True
        log.info("connection to %s closed: %s", conn.address, exc)
        if not conn.connect_future.done():
            conn.connect_future.set_exception(exc)
        for fut, _ in conn.lookups.values():
            if not fut.done():
                fut.set_exception(exc)
        for recv in conn.fetches.values():
            if not recv.future.done():
                recv.future.set_exception(exc)
        conn.lookups.clear()
        conn.fetches.clear()
        for sock in (conn.sock, conn.monitor):
            with contextlib.suppress(KeyError, zmq.ZMQError):
                self._poller.unregister(sock)
        self._by_socket.pop(conn.sock, None)
        self._by_monitor.pop(conn.monitor, None)
        with contextlib.suppress(zmq.ZMQError):
            conn.sock.disable_monitor()
        conn.monitor.close(0)
        conn.sock.close(0)
        with self._lock:
            self._outbound.pop(conn.peer_id, None)

    # -- inbound (this node serves) --------------------------------------------------

    def _read_router(self, now: float) -> None:
        sock = self._router
        for _ in range(_READ_BUDGET):
            try:
                rid = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not sock.getsockopt(zmq.RCVMORE):
                continue  # an empty message carries nothing to answer
            head = sock.recv(zmq.NOBLOCK)
            # Peers send the server no payload frames; count and drop any one by one
            # rather than hold them all (libzmq bounds each frame, not their number).
            extra = 0
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv(zmq.NOBLOCK, copy=False)
                extra += 1
            peer = self._inbound.get(rid)
            if peer is None:
                if len(self._inbound) >= self.config.max_peers:
                    log.warning("peer limit reached (max_peers=%d); turning %s away",
                                self.config.max_peers, rid.hex())
                    self._send_in(rid, [proto.Bye(proto.Code.UNAVAILABLE,
                                                  f"peer limit reached ({self.config.max_peers})")])
                    continue
                session = proto.Session(proto.Role.SERVER, self.hello, deadlines=self._deadlines,
                                        limits=self._limits, now=now,
                                        identity_policy=self.config.identity_policy)
                session.start(now)
                peer = _Inbound(rid, session)
                self._inbound[rid] = peer
            try:
                try:
                    msg = proto.decode_head(head, extra)
                except ProtocolError as exc:
                    out = peer.session.receive_malformed(exc, now)
                else:
                    out = peer.session.receive(msg, now)
                self._handle_in_events(peer, out, now)
            except Exception:
                # A bug must cost one peer, never the node.
                log.exception("internal error serving peer %s; dropping it", rid.hex())
                self._drop_inbound(peer)

    def _handle_in_events(self, peer: _Inbound, out: proto.Output, now: float) -> None:
        # Handshake verdicts are counted before the answer goes out, so that a peer that
        # has its answer can already see it in this node's stats.
        for ev in out.events:
            if isinstance(ev, proto.HandshakeAccepted):
                self._count("handshakes_accepted")
                log.info("accepted peer %s (%s)", ev.remote.node, peer.rid.hex())
                self._note_undeclared(f"peer {peer.rid.hex()}", ev.warnings)
            elif isinstance(ev, proto.HandshakeRefused):
                with self._lock:
                    # One count per reason kind per refused handshake (every differing
                    # run-config field carries the fingerprint code).
                    for code in {int(reason.code) for reason in ev.reasons} or {ev.code}:
                        self._refusals[_reason_name(code)] += 1
                log.warning("refused peer %s: %s", peer.rid.hex(),
                            "; ".join(r.describe() for r in ev.reasons))
        if out.replies and not self._send_in(peer.rid, out.replies):
            return
        for ev in out.events:
            if isinstance(ev, proto.HandshakeRefused):
                self._drop_inbound(peer)
                return
            if isinstance(ev, proto.LookupRequested):
                hits = self.store.lookup(list(ev.keys))
                self._count("lookups_served")
                self._count("lookup_keys_served", len(ev.keys))
                self._count("lookup_hits_served", sum(hits))
                self._send_in(peer.rid, [peer.session.answer_lookup(ev.req, hits)])
            elif isinstance(ev, proto.FetchRequested):
                peer.jobs[ev.req] = _Sending(ev.req, tuple(ev.keys),
                                             [OUTCOME_FAILED] * len(ev.keys))
            elif isinstance(ev, proto.AbortRequested):
                peer.jobs.pop(ev.req, None)
                self._send_in(peer.rid, [peer.session.abort_ack(ev.req)])
            elif isinstance(ev, (proto.PeerClosed, proto.ProtocolViolated)):
                if isinstance(ev, proto.ProtocolViolated):
                    self._count("protocol_violations")
                    log.warning("protocol violation by peer %s, closed: %s [%s]",
                                peer.rid.hex(), ev.msg, proto.code_name(ev.code))
                else:
                    log.info("peer %s closed: %s", peer.rid.hex(), ev.msg)
                self._drop_inbound(peer)
                return

    def _send_in(self, rid: bytes, messages: Iterable[proto.Message]) -> bool:
        for msg in messages:
            try:
                self._router.send_multipart([rid, *proto.encode(msg)], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                # ROUTER_MANDATORY: the peer is gone (EHOSTUNREACH) or not reading (EAGAIN).
                log.info("peer %s unreachable (%s); dropping its state", rid.hex(), exc)
                peer = self._inbound.get(rid)
                if peer is not None:
                    self._drop_inbound(peer)
                return False
        return True

    def _drop_inbound(self, peer: _Inbound) -> None:
        peer.closed = True
        peer.jobs.clear()
        self._inbound.pop(peer.rid, None)

    def _pump(self, now: float) -> None:
        """Send blocks for every served fetch that has credit, round robin by peer."""
        for peer in list(self._inbound.values()):
            for job in list(peer.jobs.values()):
                if peer.closed:
                    break
                try:
                    self._pump_job(peer, job)
                except (ProtocolError, ValueError, zmq.ZMQError) as exc:
                    # One peer's trouble must never stop the node serving the others.
                    log.warning("dropping peer %s while serving request %d: %s",
                                peer.rid.hex(), job.req, exc)
                    self._drop_inbound(peer)

    def _pump_job(self, peer: _Inbound, job: _Sending) -> None:
        sock = self._router
        session = peer.session
        n = len(job.keys)
        batch_limit = max(1, min(MAX_BLOCKS_PER_MESSAGE, _BATCH_BYTES // self._bpb))
        checksums = session.checksums
        credit = session.window_left(job.req)
        while credit > 0 and job.next_index < n:
            # Pin the next candidates in one store call; a missing key uses no credit,
            # so a batch may come out smaller than the credit and the loop goes on.
            start = job.next_index
            stop = min(n, start + min(credit, batch_limit))
            job.next_index = stop
            idx: list[int] = []
            readers: list[BlockReader] = []
            for i, reader in zip(range(start, stop),
                                 self.store.acquire_read_many(job.keys[start:stop]),
                                 strict=True):
                if reader is None:
                    job.outcomes[i] = OUTCOME_MISSING
                else:
                    idx.append(i)
                    readers.append(reader)
            credit -= len(idx)
            if not idx:
                continue
            sums = [r.checksum for r in readers] if checksums else None
            head = proto.encode_head(session.block(job.req, idx, sums))
            try:
                sock.send(peer.rid, zmq.SNDMORE | zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self.store.release_many(readers)
                log.info("peer %s unreachable while sending (%s); dropping it",
                         peer.rid.hex(), exc)
                self._drop_inbound(peer)
                return
            # ROUTER accepts the rest of a multipart once its first frame went through.
            sock.send(head, zmq.SNDMORE)
            # Which frame is the last one sent without copying: only it is tracked.
            # libzmq frees the frames of a connection in the order it sends them, so
            # when the last zero-copy frame is released every earlier one is too, and
            # one tracker can unpin all the blocks of the message.
            frames = [view for reader in readers for view in reader.views]
            last_zero_copy = -1
            for f, view in enumerate(frames):
                if view.nbytes >= _ZERO_COPY_MIN:
                    last_zero_copy = f
            final = len(frames) - 1
            tracker: zmq.MessageTracker | None = None
            for f, view in enumerate(frames):
                flags = 0 if f == final else zmq.SNDMORE
                if f == last_zero_copy:
                    tracker = sock.send(view, flags, copy=False, track=True)
                elif view.nbytes >= _ZERO_COPY_MIN:
                    sock.send(view, flags, copy=False)
                else:
                    sock.send(view, flags, copy=True)
            if tracker is None:
                self.store.release_many(readers)  # every segment was copied into libzmq
            else:
                self._inflight_sends.append((tracker, readers))
            for i in idx:
                job.outcomes[i] = OUTCOME_SENT
            self._count("blocks_sent", len(idx))
            self._count("bytes_sent", len(idx) * self._bpb)
        if job.next_index >= n:
            peer.jobs.pop(job.req, None)
            self._send_in(peer.rid, [session.fetch_done(job.req, job.outcomes)])

    def _reap_sends(self) -> None:
        q = self._inflight_sends
        while q and q[0][0].done:
            self.store.release_many(q.popleft()[1])

    # -- deadlines and shutdown --------------------------------------------------------

    def _check_deadlines(self, now: float) -> None:
        for conn in list(self._outbound.values()):
            if conn.closed:
                continue
            if conn.handle is None and now >= conn.handshake_deadline:
                self._drop_outbound(conn, PeerTimeout(
                    f"no handshake answer from {conn.address} within the deadline"))
                continue
            for req, recv in list(conn.fetches.items()):
                if now >= recv.deadline:
                    conn.fetches.pop(req, None)
                    with contextlib.suppress(ProtocolError):
                        self._send_out(conn, [conn.session.abort(req, now)])
                    if not recv.future.done():
                        recv.future.set_exception(PeerTimeout(
                            f"fetch of {len(recv.keys)} blocks from {conn.address} did not "
                            "finish within its deadline"))
            for req, (fut, deadline) in list(conn.lookups.items()):
                if now >= deadline:
                    conn.lookups.pop(req, None)
                    if not fut.done():
                        fut.set_exception(PeerTimeout(
                            f"lookup on {conn.address} not answered within its deadline"))
            if not conn.closed:
                self._handle_out_events(conn, conn.session.poll(now), now)
        for peer in list(self._inbound.values()):
            out = peer.session.poll(now)
            if out.events or out.replies:
                self._handle_in_events(peer, out, now)
            if peer.session.state in _DONE_STATES:
                self._drop_inbound(peer)

    def _shutdown(self) -> None:
        gone = PeerGone("node closed")
        for conn in list(self._outbound.values()):
            if not conn.closed:
                bye = conn.session.close(proto.Code.SHUTDOWN, "node closing")
                self._send_out(conn, bye.replies)
            self._drop_outbound(conn, gone)
        for peer in list(self._inbound.values()):
            if peer.session.state is proto.State.READY:
                self._send_in(peer.rid, peer.session.close(proto.Code.SHUTDOWN,
                                                          "node closing").replies)
            self._drop_inbound(peer)
        while True:
            try:
                self._commands.get_nowait()
            except queue.Empty:
                break
        # Whatever ZeroMQ still holds is dropped with LINGER 0; unpin it.
        while self._inflight_sends:
            self.store.release_many(self._inflight_sends.popleft()[1])
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
        self._router.close(0)
        self._wakeup.close()
        self._ctx.term()
        self._closing = True
        self._closed.set()
        log.info("node %s closed", self.node_id)


def _drain(sock: zmq.Socket[bytes]) -> None:
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK)


def _request_error(address: str, ev: proto.RequestFailed) -> P2PKVError:
    """The typed error for a request the session failed, chosen by its code."""
    text = f"{address}: request {ev.req} failed: {ev.msg} [{proto.code_name(ev.code)}]"
    code = int(ev.code)
    if code in (proto.Code.PEER_TIMEOUT, proto.Code.TIMEOUT):
        return PeerTimeout(text)
    if 100 <= code < 200:
        return PeerIncompatible(text)
    if 300 <= code < 400:
        return PeerGone(text)
    if code in (proto.Code.OUT_OF_BOUNDS, proto.Code.TOO_MANY_IN_FLIGHT, proto.Code.UNAVAILABLE):
        # The peer turned this request down; the connection stays up.
        return TransferFailed(text)
    return ProtocolError(code, text)


def _own_view(local: proto.Hello, refuse: proto.Refuse) -> list[proto.Reason]:
    return list(proto.restate(local, refuse))


def _reason_name(code: int) -> str:
    try:
        return proto.Code(code).name.lower()
    except ValueError:
        return f"code_{code}"



def _start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], curve: CurveKeys) -> Any:
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("p2pkv.auth"))
    auth.start()
    if curve.authorized_clients is None:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    else:
        auth.configure_curve_callback(domain="*", credentials_provider=_KeySet(
            curve.authorized_clients))
    return auth


class _KeySet:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        # pyzmq hands over the client's public key Z85-encoded, the form of key files.
        return key in self._keys

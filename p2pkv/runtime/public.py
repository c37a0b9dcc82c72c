"""The node's public value types: peer handles, results, statistics.

They live below the runtime's paths and connections so that every layer can use them;
``p2pkv.node`` (and ``p2pkv``) re-export them, which is where users import them from.
The node's configuration, :class:`~p2pkv.runtime.config.NodeConfig`, is in
:mod:`p2pkv.runtime.config` (it imports no torch; this module does, for the store's
statistics).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from p2pkv.identity import IdentityExtension
from p2pkv.store import StoreStats

__all__ = [
    "FetchResult",
    "KeyOutcome",
    "NodeStats",
    "PeerHandle",
    "PeerOwner",
]


class KeyOutcome(enum.Enum):
    """What happened to one key of a fetch.

    ``LANDED`` says where the bytes are by the call that asked for them: in the node's
    store for :meth:`~p2pkv.node.Node.fetch` (fetched now, or already held), in the
    caller's buffers for :meth:`~p2pkv.node.Node.fetch_into` (the store is not touched).
    ``STORED`` is the former name of ``LANDED``, kept as an alias (the same member).
    """

    LANDED = "landed"  #: all bytes landed where the call asked, verified
    STORED = "landed"  #: alias of LANDED (its former name)
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
    def landed(self) -> list[bytes]:
        """The keys whose blocks landed (in the store, or in the caller's buffers)."""
        return self._keys_with(KeyOutcome.LANDED)

    @property
    def stored(self) -> list[bytes]:
        """Alias of :attr:`landed` (its former name)."""
        return self.landed

    @property
    def missing(self) -> list[bytes]:
        return self._keys_with(KeyOutcome.MISSING)

    @property
    def failed(self) -> list[bytes]:
        return self._keys_with(KeyOutcome.FAILED)

    def _keys_with(self, outcome: KeyOutcome) -> list[bytes]:
        if outcome not in self.outcomes:
            return []  # the common case of an outcome no key has, with no step per key
        if self.outcomes.count(outcome) == len(self.outcomes):
            return list(self.keys)
        return [k for k, o in zip(self.keys, self.outcomes, strict=True) if o is outcome]

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class PeerOwner(Protocol):
    """What a :class:`PeerHandle` calls back into: the node that made it."""

    def lookup(self, peer: PeerHandle, keys: Sequence[bytes], *,
               timeout: float | None = None) -> list[bool]: ...

    def fetch(self, peer: PeerHandle, keys: Sequence[bytes], *,
              timeout: float | None = None) -> FetchResult: ...

    def disconnect(self, peer: PeerHandle) -> None: ...


@dataclass(frozen=True)
class PeerHandle:
    """A live, compatible connection to a remote node (returned by ``Node.connect``)."""

    peer_id: int
    address: str
    remote_node_id: str
    remote_run_config: dict[str, Any]
    remote_fingerprint: str
    capabilities: frozenset[str]
    _node: PeerOwner = field(repr=False, compare=False)
    #: The peer's identity extension (empty for a peer that declares none, or speaks 1.0).
    remote_extension: IdentityExtension = field(default_factory=IdentityExtension)
    #: How fetched blocks move: "shm" (copied from the peer's shared pool), "nixl" (READ
    #: one-sided from the peer's pool through NIXL, nixl-v1), "tcp-data" (on a plain TCP
    #: stream beside the ZeroMQ connection, tcp-data-v1) or "tcp" (in ZeroMQ messages).
    data_path: str = "tcp"
    #: Why: the segment or stream used, or the reasons neither is.
    data_path_detail: str = ""

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> list[bool]:
        return self._node.lookup(self, keys, timeout=timeout)

    def fetch(self, keys: Sequence[bytes], timeout: float | None = None) -> FetchResult:
        return self._node.fetch(self, keys, timeout=timeout)

    def close(self) -> None:
        self._node.disconnect(self)


@dataclass(frozen=True)
class PathStats:
    """What one data path moved (``NodeStats.paths``: the same shape for every path)."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    #: Peers this node cut at the send deadline for taking nothing on this path.
    readers_stalled: int = 0


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
    #: This node's shared-memory segment (None: the pool is private).
    shm_segment: str | None = None
    #: Why the pool is private although NodeConfig.shm asked for shared memory.
    shm_unavailable: str | None = None
    #: Connections this node opened that move blocks through shared memory.
    shm_peers_out: int = 0
    #: Peers whose shared-memory proof this node accepted (connected now).
    shm_peers_in: int = 0
    #: Connections that negotiated shm-v1 but stayed on TCP, by reason
    #: (no_segment, cannot_map, refused).
    shm_fallbacks: dict[str, int] = field(default_factory=dict)
    #: Blocks pinned for same-host peers that have not released them yet.
    shm_pinned: int = 0
    #: Whether this node uses NIXL (nixl-v1): "on", or "off" and why.
    nixl: str = "off"
    #: Connections this node opened whose blocks are READ through NIXL.
    nixl_peers_out: int = 0
    #: NIXL reads that failed (deadline, disconnect) and the staging areas retired
    #: until such a read ends (a late READ must not write where a later block lands).
    nixl_read_failures: int = 0
    nixl_retired: int = 0
    #: Fetches declined (UNAVAILABLE) while the node drained; True once it drains.
    fetches_declined_draining: int = 0
    draining: bool = False
    #: The port this node accepts data streams on (None: it offers no data channel).
    data_port: int | None = None
    #: Connections this node opened whose blocks move on a data stream, and peers
    #: whose data stream this node serves (connected now).
    data_peers_out: int = 0
    data_peers_in: int = 0
    #: Streams this node's data port closed unbound (bad preface or token, or silent).
    data_streams_refused: int = 0
    #: Connections that negotiated tcp-data-v1 but stayed on ZeroMQ.
    data_fallbacks: int = 0
    #: Encrypted data streams (tcp-data-tls-v1) this node would not open because the
    #: data port's certificate was not the one the welcome pinned (also fallbacks).
    data_pins_refused: int = 0
    #: Sealed data streams (tcp-data-aead-v1) ended because a record failed its tag, or
    #: the stream ended inside one: bytes changed, replayed, dropped or cut on the way,
    #: or sealed with other keys. Each ended its session and landed nothing of it.
    data_records_refused: int = 0
    #: What each data path moved, by kind: "zmq" (frames), "packed" (packed-v1),
    #: "shm" (shm-v1), "stream" (tcp-data-v1) and "nixl" (nixl-v1); every kind is present.
    paths: dict[str, PathStats] = field(default_factory=dict)

    def _path(self, kind: str) -> PathStats:
        return self.paths.get(kind) or PathStats()

    # Views of ``paths`` under the names they had before it.

    @property
    def blocks_sent_shm(self) -> int:
        """Blocks moved through shared memory (also counted in ``blocks_sent``)."""
        return self._path("shm").blocks_sent

    @property
    def blocks_received_shm(self) -> int:
        return self._path("shm").blocks_received

    @property
    def blocks_sent_stream(self) -> int:
        """Blocks moved on data streams (also counted in ``blocks_sent``)."""
        return self._path("stream").blocks_sent

    @property
    def blocks_received_stream(self) -> int:
        return self._path("stream").blocks_received

    @property
    def data_streams_stalled(self) -> int:
        """Served peers whose data stream took no bytes for ``send_timeout`` while
        blocks waited (their sessions ended, their blocks released)."""
        return self._path("stream").readers_stalled

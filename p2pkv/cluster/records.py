"""What a cluster directory knows, as plain values: partitions, node records, holders.

Pure: no IO, no Redis, no sockets. Both directory backends and the ``cluster`` command
speak in these types.

Partition. Directory entries are partitioned by identity: the run-config fingerprint
plus the digest of the node's identity extension (the empty string when it has none).
Nodes of different partitions never see each other's blocks in the directory. The
handshake stays the authority: a directory can be stale, or lie, and a holder it names
is still refused at the handshake when the two identities differ.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2pkv.errors import P2PKVError

if TYPE_CHECKING:
    from p2pkv.node import FetchResult

__all__ = [
    "CLAIMS_LUA",
    "STRIP_DEAD_LUA",
    "DirectoryError",
    "DirectoryView",
    "Holder",
    "Lua",
    "Member",
    "MemberView",
    "NodeRecord",
    "PrefixFetch",
    "PrefixLookup",
    "QuarantineReport",
    "longest_prefix",
    "parse_holders",
    "partition_key",
]

_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
# An identity-extension digest: hex or another token without the characters that
# separate the parts of a partition key or of a Redis Cluster hash tag.
_EXTENSION = re.compile(r"[0-9A-Za-z_.-]{0,128}")
_MAX_RECORD_BYTES = 1 << 20


class DirectoryError(P2PKVError):
    """A directory could not be used: unreachable, or it holds something malformed."""


def partition_key(fingerprint: str, extension: str = "") -> str:
    """The partition of an identity: ``FINGERPRINT`` or ``FINGERPRINT+EXTENSION``.

    ``extension`` is the identity-extension digest, empty when the node has none (so
    nodes without an extension keep the partition they had before extensions existed).
    """
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise ValueError(f"fingerprint must be 16 lowercase hex digits, got {fingerprint!r}")
    if not isinstance(extension, str) or not _EXTENSION.fullmatch(extension):
        raise ValueError("identity-extension digest must be up to 128 characters of "
                         f"[0-9A-Za-z_.-], got {extension!r}")
    return f"{fingerprint}+{extension}" if extension else fingerprint


@dataclass(frozen=True)
class Holder:
    """A node that a directory says holds a block: its id and the address it serves on."""

    node_id: str
    address: str


@dataclass(frozen=True)
class NodeRecord:
    """What a node registers in a directory about itself.

    Everything the ``cluster`` command needs to group nodes by identity and to explain
    why two groups would refuse each other: the greeting fields of the handshake
    (run config, fingerprint, geometry, key hash, capabilities, protocol version), plus
    the identity-extension digest, rank and pool size.
    """

    node_id: str
    address: str
    fingerprint: str
    extension: str
    rank: int
    capabilities: tuple[str, ...]
    pool_blocks: int
    run_config: dict[str, Any] = field(compare=False)
    bytes_per_block: int
    segments: tuple[int, ...]
    key_hash_algo: str
    key_hash_seed: int
    protocol: tuple[int, int]

    def __post_init__(self) -> None:
        partition_key(self.fingerprint, self.extension)
        for name in ("node_id", "address", "key_hash_algo"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 4096:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        for name in ("rank", "pool_blocks", "bytes_per_block", "key_hash_seed"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not isinstance(self.run_config, dict):
            raise ValueError(f"run_config must be a dict, got {type(self.run_config).__name__}")
        if (not isinstance(self.segments, tuple)
                or not all(type(s) is int and s > 0 for s in self.segments)):
            raise ValueError(f"segments must be positive ints, got {self.segments!r}")
        if (not isinstance(self.capabilities, tuple)
                or not all(isinstance(c, str) for c in self.capabilities)):
            raise ValueError(f"capabilities must be strings, got {self.capabilities!r}")
        if (not isinstance(self.protocol, tuple) or len(self.protocol) != 2
                or not all(type(v) is int for v in self.protocol)):
            raise ValueError(f"protocol must be (major, minor), got {self.protocol!r}")

    @property
    def partition(self) -> str:
        return partition_key(self.fingerprint, self.extension)

    @property
    def holder(self) -> Holder:
        return Holder(self.node_id, self.address)

    @classmethod
    def for_node(cls, node: Any, *, extension: str = "",
                 address: str | None = None) -> NodeRecord:
        """The record of a live :class:`~p2pkv.node.Node` (its greeting, rank, pool);
        ``address`` is the one other nodes dial (default: the node's own)."""
        hello = node.hello
        return cls(
            node_id=node.node_id, address=address or node.address, fingerprint=hello.fp,
            extension=extension, rank=node.run_config.rank, capabilities=tuple(hello.caps),
            pool_blocks=node.store.capacity, run_config=dict(hello.rc),
            bytes_per_block=hello.geo.bpb, segments=tuple(hello.geo.seg),
            key_hash_algo=hello.khash.algo, key_hash_seed=hello.khash.seed,
            protocol=(hello.v, hello.minor),
        )

    def greeting(self) -> Any:
        """The ``hello`` this node sends at a handshake (for :func:`p2pkv.protocol.decide`)."""
        from p2pkv import protocol as proto

        return proto.Hello(
            node=self.node_id, minor=self.protocol[1], rc=dict(self.run_config),
            fp=self.fingerprint, geo=proto.Geometry(self.bytes_per_block, self.segments),
            khash=proto.KeyHash(self.key_hash_algo, self.key_hash_seed),
            caps=self.capabilities, v=self.protocol[0],
        )

    def to_json(self) -> str:
        return json.dumps({
            "node_id": self.node_id, "address": self.address, "fingerprint": self.fingerprint,
            "extension": self.extension, "rank": self.rank,
            "capabilities": list(self.capabilities), "pool_blocks": self.pool_blocks,
            "run_config": self.run_config, "bytes_per_block": self.bytes_per_block,
            "segments": list(self.segments), "key_hash_algo": self.key_hash_algo,
            "key_hash_seed": self.key_hash_seed, "protocol": list(self.protocol),
        }, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> NodeRecord:
        """Parse a record; :class:`DirectoryError` names what is wrong with a bad one."""
        if len(data) > _MAX_RECORD_BYTES:
            raise DirectoryError(f"node record of {len(data)} bytes is too large")
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            return cls(
                node_id=obj["node_id"], address=obj["address"],
                fingerprint=obj["fingerprint"], extension=obj["extension"],
                rank=obj["rank"], capabilities=tuple(obj["capabilities"]),
                pool_blocks=obj["pool_blocks"], run_config=obj["run_config"],
                bytes_per_block=obj["bytes_per_block"], segments=tuple(obj["segments"]),
                key_hash_algo=obj["key_hash_algo"], key_hash_seed=obj["key_hash_seed"],
                protocol=tuple(obj["protocol"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise DirectoryError(f"malformed node record: {exc!s}") from None


@dataclass(frozen=True)
class Member:
    """One registration of a node: its partition, the token its claims carry and the
    nonce that proves the token is still this registration's."""

    partition: str
    token: bytes
    nonce: bytes = field(default=b"", repr=False)

    @property
    def number(self) -> int:
        return int.from_bytes(self.token, "big")


@dataclass(frozen=True)
class QuarantineReport:
    """A holder one consumer keeps in quarantine: its address, the node id it had when
    it last failed (empty when unknown), the last failure, after how many quarantines
    in a row, and the seconds left."""

    address: str
    node_id: str
    reason: str
    times: int
    expires_in: float


@dataclass(frozen=True)
class MemberView:
    """A registered node as the ``cluster`` command shows it. ``reports``: the holders
    this member keeps in quarantine now (published by it, only while it is alive)."""

    member: int
    record: NodeRecord | None
    error: str | None
    blocks: int
    alive: bool
    expires_in: float  # seconds; negative once expired
    reports: tuple[QuarantineReport, ...] = ()


@dataclass(frozen=True)
class DirectoryView:
    """Every partition of a directory with its members."""

    partitions: dict[str, list[MemberView]] = field(default_factory=dict)


def longest_prefix(holders: Sequence[Sequence[Holder]]) -> int:
    """How many leading keys have at least one holder."""
    for i, found in enumerate(holders):
        if not found:
            return i
    return len(holders)


@dataclass(frozen=True)
class PrefixLookup:
    """The answer of :meth:`~p2pkv.cluster.Cluster.lookup_prefix`.

    ``length`` leading keys of ``keys`` are available; ``holders[i]`` lists who holds
    ``keys[i]`` for each of them (never this node itself). ``source`` says who answered:
    ``"redis"``, ``"peers"`` (the static fan-out, or the fallback while Redis is
    unreachable). ``errors`` maps a peer address or ``"directory"`` to why it did not
    answer; a lookup never raises for an unreachable holder or directory.

    ``due`` (``pending-v1``): one entry per key of ``keys``, the seconds until another
    live member expects to hold it (it is computing it now), 0.0 for the keys of the
    prefix and for keys nobody announced; empty when no key is pending. Through Redis
    it comes from the directory's entries (:mod:`p2pkv.cluster.pending`); from the
    fan-out (static, or the fallback) from the peers' own answers, the soonest of them.
    """

    keys: tuple[bytes, ...]
    length: int
    holders: tuple[tuple[Holder, ...], ...]
    source: str
    seconds: float
    errors: dict[str, str] = field(default_factory=dict)
    due: tuple[float, ...] = ()

    @property
    def prefix(self) -> tuple[bytes, ...]:
        return self.keys[: self.length]

    @property
    def nodes(self) -> list[Holder]:
        """Every distinct holder of the prefix, in order of first appearance."""
        return list(dict.fromkeys(h for found in self.holders for h in found))


@dataclass(frozen=True)
class PrefixFetch:
    """The answer of :meth:`~p2pkv.cluster.Cluster.fetch_prefix`.

    ``result`` has one outcome per key of the prefix (``lookup.prefix``), as
    :meth:`~p2pkv.node.Node.fetch` reports them; ``sources[i]`` is the holder that
    supplied key ``i`` (None when it was not stored). ``stale`` counts keys a holder
    answered MISSING although the directory listed it; ``failovers`` counts keys
    fetched again from another holder after a holder died, refused or missed.
    """

    lookup: PrefixLookup
    result: FetchResult
    sources: tuple[Holder | None, ...]
    stale: int
    failovers: int

    @property
    def complete(self) -> int:
        """How many leading keys of the prefix were stored (usable by an engine)."""
        n = 0
        for source in self.sources:
            if source is None:
                break
            n += 1
        return n


_WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def advertised_address(listen: str, host: str | None = None) -> str:
    """The address other nodes dial for a node bound to ``listen``.

    A wildcard host (``0.0.0.0``, ``*``, ``::``) is where the node listens, not where it
    can be reached: it becomes ``host`` (default: this machine's address as its hostname
    resolves). Any other address is returned unchanged.
    """
    import socket

    rest = listen[len("tcp://"):] if listen.startswith("tcp://") else listen
    bound, sep, port = rest.rpartition(":")
    if not sep or bound not in _WILDCARD_HOSTS:
        return listen
    if host is None:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


CLAIMS_LUA = """
for i = first, first + nadd - 1 do
  local k = ARGV[i]
  local v = redis.call('HGET', KEYS[1], k)
  if not v then
    redis.call('HSET', KEYS[1], k, me)
    delta = delta + 1
  else
    local found = false
    for p = 1, #v, 4 do
      if string.sub(v, p, p + 3) == me then found = true break end
    end
    if not found then
      redis.call('HSET', KEYS[1], k, v .. me)
      delta = delta + 1
    end
  end
end
for i = first + nadd, #ARGV do
  local k = ARGV[i]
  local v = redis.call('HGET', KEYS[1], k)
  if v then
    local rest = ''
    for p = 1, #v, 4 do
      local t = string.sub(v, p, p + 3)
      if t ~= me then rest = rest .. t end
    end
    if #rest ~= #v then
      delta = delta - 1
      if rest == '' then
        redis.call('HDEL', KEYS[1], k)
      else
        redis.call('HSET', KEYS[1], k, rest)
      end
    end
  end
end
"""
"""Lua that edits block entries (``KEYS[1]``, a hash of key -> the holders' 4-byte tokens
back to back) for the token ``me``: adds it to ``ARGV[first .. first + nadd - 1]``, takes
it off every later ``ARGV`` key, and counts the change in ``delta``. Shared by the
directory's announce scripts (one Redis, and each sub-partition of a cluster)."""


STRIP_DEAD_LUA = """
local fields = res[2]
for i = 1, #fields, 2 do
  local k, v = fields[i], fields[i + 1]
  local rest = ''
  for p = 1, #v, 4 do
    local t = string.sub(v, p, p + 3)
    if not dead[t] then rest = rest .. t end
  end
  if #rest ~= #v then
    if rest == '' then redis.call('HDEL', KEYS[1], k) else redis.call('HSET', KEYS[1], k, rest) end
  end
end
"""
"""Lua that takes the tokens in the table ``dead`` off the block entries of one HSCAN
step (``res``, over ``KEYS[1]``), deleting entries left empty. Shared by the sweep of one
Redis and of each cluster sub-partition."""


class Lua:
    """A Lua script run by ``EVALSHA``, loaded again where a server does not know it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


def parse_holders(flat: Sequence[Any]) -> dict[bytes, Holder]:
    """``{token: Holder}`` from a script's ``{token, "node_id LF address", ...}``."""
    holders: dict[bytes, Holder] = {}
    for i in range(0, len(flat), 2):
        node_id, _, address = bytes(flat[i + 1]).decode().partition("\n")
        holders[bytes(flat[i])] = Holder(node_id, address)
    return holders

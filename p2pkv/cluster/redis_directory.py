"""The Redis directory backend: who holds which block, per identity partition.

Data model (``NS`` is the namespace, ``P`` a partition, see
:func:`~p2pkv.cluster.records.partition_key`; ``{P}`` is a Redis Cluster hash tag, so
every key of one partition lives on one shard)::

    NS:seq                  INCR counter: one member token per registration
    NS:partitions           SET of partitions (for the ``cluster`` command)
    NS:{P}:blocks           HASH block key -> holder tokens, 4 bytes each, concatenated
    NS:{P}:live             ZSET token -> expiry (ms, Redis server clock); renewed by heartbeat
    NS:{P}:nodes            HASH token -> node record (JSON)
    NS:{P}:addr             HASH token -> "node_id LF address" (what a lookup returns)
    NS:{P}:count            HASH token -> blocks announced
    NS:{P}:owner            HASH token -> random nonce of the registration that owns it
    NS:{P}:sweep            STRING lock of the member that sweeps dead tokens out

A registration gets a fresh token, so a node that lost its registration (its TTL ran
out, Redis restarted) never revives old claims: it registers again and republishes
its block set. Heartbeats and claims carry the registration's random nonce as well:
after a restart without persistence the counter starts over, and a node that has not
noticed yet must not renew (or claim blocks under) a token now given to another node.
A token whose expiry passed is dead: lookups skip it at once, announces for it are
refused, and a live member of the partition sweeps its entries out of the blocks hash
(``HSCAN``, a bounded batch per step) and then deletes its records.

Every operation is one Lua script call (one round trip): a lookup of any number of keys
(stopping at the first key with no live holder), a batch of announcements, a heartbeat.
Times come from the Redis server clock, so node clocks need not agree.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pkv.cluster.records import DirectoryError, Holder, NodeRecord
from p2pkv.errors import ConfigError

__all__ = [
    "DirectoryView",
    "Member",
    "MemberView",
    "RedisDirectory",
    "validate_redis_url",
]

log = logging.getLogger("p2pkv.cluster")

_TOKEN_BYTES = 4
# Keys per HMGET inside the lookup script (Lua's unpack has a stack limit near 8000).
_LOOKUP_CHUNK = 1000
# Keys per announce script call: bounds how long one call holds the Redis thread.
ANNOUNCE_BATCH = 5000

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: live, nodes, addr, count, owner. ARGV: token, ttl_ms, record, addr, nonce.
_REGISTER = _NOW + """
local now = now_ms()
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
redis.call('HSET', KEYS[4], ARGV[1], 0)
redis.call('HSET', KEYS[5], ARGV[1], ARGV[5])
return now
"""

# KEYS: live, owner. ARGV: token, ttl_ms, nonce. 1 renewed, 0 the registration is gone,
# expired or owned by another registration.
_HEARTBEAT = _NOW + """
local now = now_ms()
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not s or tonumber(s) < now then return 0 end
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[3] then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS: blocks, live, addr. ARGV: own token (never returned as a holder), keys...
# Returns {holders of each key of the longest prefix with a live holder (tokens
# concatenated), {token, addr, token, addr, ...} of the tokens in them}.
_LOOKUP = _NOW + """
local now = now_ms()
local me = ARGV[1]
local alive = {}
local out = {}
local addrs = {}
local n = #ARGV
local i = 2
while i <= n do
  local j = math.min(i + CHUNK - 1, n)
  local vals = redis.call('HMGET', KEYS[1], unpack(ARGV, i, j))
  for k = 1, #vals do
    local v = vals[k]
    local live = ''
    if v then
      for p = 1, #v, 4 do
        local t = string.sub(v, p, p + 3)
        local a = alive[t]
        if a == nil then
          local exp = redis.call('ZSCORE', KEYS[2], t)
          a = (exp ~= false) and tonumber(exp) >= now and t ~= me
          if a then
            local addr = redis.call('HGET', KEYS[3], t)
            if addr then
              addrs[#addrs + 1] = t
              addrs[#addrs + 1] = addr
            else
              a = false
            end
          end
          alive[t] = a
        end
        if a then live = live .. t end
      end
    end
    if live == '' then return {out, addrs} end
    out[#out + 1] = live
  end
  i = j + 1
end
return {out, addrs}
""".replace("CHUNK", str(_LOOKUP_CHUNK))

# KEYS: blocks, live, count, owner. ARGV: token, nonce, number of stored keys, stored
# keys..., removed keys... Returns the change of the token's block count, or -1
# (nothing changed) when the token is not live or not this registration's: the caller
# must register again.
_ANNOUNCE = _NOW + """
local me = ARGV[1]
if redis.call('HGET', KEYS[4], me) ~= ARGV[2] then return -1 end
local nadd = tonumber(ARGV[3])
local delta = 0
if nadd > 0 then
  local s = redis.call('ZSCORE', KEYS[2], me)
  if not s or tonumber(s) < now_ms() then return -1 end
end
for i = 4, 3 + nadd do
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
for i = 4 + nadd, #ARGV do
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
if delta ~= 0 and redis.call('HEXISTS', KEYS[3], me) == 1 then
  redis.call('HINCRBY', KEYS[3], me, delta)
end
return delta
"""

# KEYS: blocks, live, nodes, addr, count, sweep lock, owner. ARGV: own token, cursor, count,
# dead tokens... One HSCAN step that strips the dead tokens from the entries it visits;
# at the end of the pass the dead tokens' records go too. Returns the next cursor, or
# "" when another member holds the sweep lock.
_SWEEP = _NOW + """
local lock = redis.call('GET', KEYS[6])
if lock and lock ~= ARGV[1] then return '' end
redis.call('SET', KEYS[6], ARGV[1], 'PX', 30000)
local dead = {}
for i = 4, #ARGV do dead[ARGV[i]] = true end
local res = redis.call('HSCAN', KEYS[1], ARGV[2], 'COUNT', tonumber(ARGV[3]))
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
if res[1] == '0' then
  local now = now_ms()
  for i = 4, #ARGV do
    local t = ARGV[i]
    local s = redis.call('ZSCORE', KEYS[2], t)
    if (not s) or tonumber(s) < now then
      redis.call('ZREM', KEYS[2], t)
      redis.call('HDEL', KEYS[3], t)
      redis.call('HDEL', KEYS[4], t)
      redis.call('HDEL', KEYS[5], t)
      redis.call('HDEL', KEYS[7], t)
    end
  end
  redis.call('DEL', KEYS[6])
end
return res[1]
"""


def validate_redis_url(url: str) -> str:
    """``url`` if it names a Redis server (``redis://``, ``rediss://``, ``unix://``)."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"--directory: expected redis://HOST:PORT/DB, rediss://... or "
                          f"unix://PATH, got {url!r}")
    return url


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
class MemberView:
    """A registered node as the ``cluster`` command shows it."""

    member: int
    record: NodeRecord | None
    error: str | None
    blocks: int
    alive: bool
    expires_in: float  # seconds; negative once expired


@dataclass(frozen=True)
class DirectoryView:
    """Every partition of a directory with its members."""

    partitions: dict[str, list[MemberView]] = field(default_factory=dict)


class RedisDirectory:
    """A connection to one Redis directory (thread-safe; one connection pool).

    ``url`` is ``redis://HOST:PORT/DB`` (or ``rediss://``/``unix://``). Every call
    raises :class:`~p2pkv.cluster.records.DirectoryError` when Redis cannot be reached
    within ``socket_timeout`` seconds or answers garbage; none retries by itself.
    """

    def __init__(self, url: str, *, namespace: str = "p2pkv",
                 socket_timeout: float = 1.0) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ConfigError("--directory redis://... needs the Redis client: "
                              "pip install 'p2pkv[cluster]'") from exc
        validate_redis_url(url)
        if not namespace or any(c in namespace for c in "{} "):
            raise ConfigError(f"directory namespace must be non-empty without braces or "
                              f"blanks, got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self._redis: Any = redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
                retry=Retry(NoBackoff(), 0), health_check_interval=0)
        except ValueError as exc:
            raise ConfigError(f"--directory: {exc}") from exc
        self._register = self._redis.register_script(_REGISTER)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._lookup = self._redis.register_script(_LOOKUP)
        self._announce = self._redis.register_script(_ANNOUNCE)
        self._sweep = self._redis.register_script(_SWEEP)

    # -- keys ---------------------------------------------------------------------

    def _key(self, partition: str, what: str) -> str:
        return f"{self.namespace}:{{{partition}}}:{what}"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self._errors as exc:
            raise DirectoryError(f"redis directory {self.url}: {what}: {exc}") from exc

    # -- membership ---------------------------------------------------------------

    def register(self, record: NodeRecord, ttl: float) -> Member:
        """Register ``record`` for ``ttl`` seconds under a fresh token (announce nothing)."""
        p = record.partition

        def run() -> Member:
            number = int(self._redis.incr(f"{self.namespace}:seq")) % (1 << 32) or 1
            token = number.to_bytes(_TOKEN_BYTES, "big")
            nonce = os.urandom(16)
            self._register(
                keys=[self._key(p, "live"), self._key(p, "nodes"), self._key(p, "addr"),
                      self._key(p, "count"), self._key(p, "owner")],
                args=[token, int(ttl * 1000), record.to_json(),
                      f"{record.node_id}\n{record.address}", nonce])
            self._redis.sadd(f"{self.namespace}:partitions", p)
            return Member(p, token, nonce)

        member: Member = self._call("register", run)
        return member

    def heartbeat(self, member: Member, ttl: float) -> bool:
        """Renew the registration; False when it is gone (expired, Redis restarted)."""
        def run() -> bool:
            pipe = self._redis.pipeline(transaction=False)
            self._heartbeat(keys=[self._key(member.partition, "live"),
                                  self._key(member.partition, "owner")],
                            args=[member.token, int(ttl * 1000), member.nonce], client=pipe)
            # Listed again each time: a sweep may have dropped an emptied partition.
            pipe.sadd(f"{self.namespace}:partitions", member.partition)
            renewed, _ = pipe.execute()
            return bool(renewed)

        alive: bool = self._call("heartbeat", run)
        return alive

    def announce(self, member: Member, stored: Sequence[bytes],
                 removed: Sequence[bytes] = ()) -> bool:
        """Claim ``stored`` and withdraw ``removed`` (idempotent). False when the
        registration is gone (nothing was claimed; register again and republish)."""
        p = member.partition
        keys = [self._key(p, "blocks"), self._key(p, "live"), self._key(p, "count"),
                self._key(p, "owner")]
        stored, removed = list(stored), list(removed)
        while stored or removed:
            add, stored = stored[:ANNOUNCE_BATCH], stored[ANNOUNCE_BATCH:]
            room = ANNOUNCE_BATCH - len(add)
            rem, removed = removed[:room], removed[room:]
            result = self._call("announce", lambda a=add, r=rem: self._announce(  # type: ignore[misc]
                keys=keys, args=[member.token, member.nonce, len(a), *a, *r]))
            if int(result) == -1:
                return False
        return True

    def deregister(self, member: Member, held: Sequence[bytes]) -> None:
        """Withdraw ``held`` and the registration. Whatever a crash or a race leaves
        behind is swept by the partition's live members once the token is dead."""
        if not self.announce(member, (), held):
            return  # the token is no longer ours: nothing of it to withdraw
        p = member.partition

        def run() -> None:
            count = self._redis.hget(self._key(p, "count"), member.token)
            if count is not None and int(count) == 0:
                pipe = self._redis.pipeline(transaction=True)
                pipe.zrem(self._key(p, "live"), member.token)
                for what in ("nodes", "addr", "count", "owner"):
                    pipe.hdel(self._key(p, what), member.token)
                pipe.execute()
            else:  # leave it dead (score 0) for a sweep to clean up
                self._redis.zadd(self._key(p, "live"), {member.token: 0})

        self._call("deregister", run)

    def dead_tokens(self, partition: str) -> list[bytes]:
        """Tokens of ``partition`` whose registration expired."""
        def run() -> list[bytes]:
            sec, usec = self._redis.time()
            now = sec * 1000 + usec // 1000
            return [bytes(t) for t in self._redis.zrangebyscore(
                self._key(partition, "live"), "-inf", f"({now}")]

        tokens: list[bytes] = self._call("dead tokens", run)
        return tokens

    def sweep_step(self, member: Member, dead: Sequence[bytes], cursor: int,
                   count: int = 1000) -> int | None:
        """One step of sweeping ``dead`` tokens out of the partition.

        Returns the next cursor (0: the pass is over and their records are gone), or
        None when another member is sweeping.
        """
        p = member.partition
        result = self._call("sweep", lambda: self._sweep(
            keys=[self._key(p, "blocks"), self._key(p, "live"), self._key(p, "nodes"),
                  self._key(p, "addr"), self._key(p, "count"), self._key(p, "sweep"),
                  self._key(p, "owner")],
            args=[member.token, cursor, count, *dead]))
        if result in (b"", ""):
            return None
        return int(result)

    # -- queries ------------------------------------------------------------------

    def lookup(self, partition: str, keys: Sequence[bytes],
               exclude: Member | None = None) -> list[tuple[Holder, ...]]:
        """The live holders of each key of the longest prefix of ``keys`` that has
        one (one round trip). ``exclude`` (this node's own registration) is never listed.
        """
        if not keys:
            return []
        me = exclude.token if exclude is not None else b""
        reply = self._call("lookup", lambda: self._lookup(
            keys=[self._key(partition, "blocks"), self._key(partition, "live"),
                  self._key(partition, "addr")], args=[me, *keys]))
        try:
            packed, flat = reply
            holders: dict[bytes, Holder] = {}
            for i in range(0, len(flat), 2):
                node_id, _, address = bytes(flat[i + 1]).decode().partition("\n")
                holders[bytes(flat[i])] = Holder(node_id, address)
            return [tuple(holders[bytes(v[p:p + _TOKEN_BYTES])]
                          for p in range(0, len(v), _TOKEN_BYTES)) for v in packed]
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise DirectoryError(f"redis directory {self.url}: malformed lookup reply "
                                 f"({exc!r})") from None

    def view(self) -> DirectoryView:
        """Every partition, its members, their block counts and liveness (for tools)."""
        def run() -> DirectoryView:
            sec, usec = self._redis.time()
            now = sec * 1000 + usec // 1000
            out: dict[str, list[MemberView]] = {}
            for raw in sorted(self._redis.smembers(f"{self.namespace}:partitions")):
                p = bytes(raw).decode()
                pipe = self._redis.pipeline(transaction=False)
                pipe.hgetall(self._key(p, "nodes"))
                pipe.zrange(self._key(p, "live"), 0, -1, withscores=True)
                pipe.hgetall(self._key(p, "count"))
                nodes, live, counts = pipe.execute()
                expiry = {bytes(t): float(s) for t, s in live}
                members = []
                for token in sorted(set(nodes) | set(expiry)):
                    token = bytes(token)
                    record, error = None, None
                    try:
                        record = NodeRecord.from_json(nodes[token]) if token in nodes else None
                    except DirectoryError as exc:
                        error = str(exc)
                    if record is None and error is None:
                        error = "no node record"
                    exp = expiry.get(token, 0.0)
                    members.append(MemberView(
                        member=int.from_bytes(token, "big"), record=record, error=error,
                        blocks=int(counts.get(token, 0)), alive=exp >= now,
                        expires_in=(exp - now) / 1000.0))
                if members:
                    out[p] = members
            return DirectoryView(out)

        view: DirectoryView = self._call("view", run)
        return view

    @property
    def client(self) -> Any:
        """The underlying ``redis.Redis`` client (for tools and the benchmark)."""
        return self._redis

    def memory(self) -> int:
        """Redis ``used_memory`` in bytes (for the benchmark)."""
        return int(self._call("info", lambda: self._redis.info("memory"))["used_memory"])

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except self._errors:
            return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._redis.close()

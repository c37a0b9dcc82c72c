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
    NS:{P}:quarantine       HASH token -> the holders that member keeps in quarantine
                            (:mod:`p2pkv.cluster.verdicts`)
    NS:{P}:pending          HASH block key -> the members computing it, when due, their
    NS:{P}:pendexp          leases; ZSET block key -> its latest lease end
                            (:mod:`p2pkv.cluster.pending`)

A registration gets a fresh token, so a node that lost its registration (its TTL ran
out, Redis restarted) never revives old claims: it registers again and republishes
its block set. Heartbeats and claims carry the registration's random nonce as well:
after a restart without persistence the counter starts over, and a node that has not
noticed yet must not renew (or claim blocks under) a token now given to another node.
A token whose expiry passed is dead: lookups skip it at once, announces for it are
refused, and a live member of the partition sweeps its entries out of the blocks hash
(``HSCAN``, a bounded batch per step) and then deletes its records.

Every operation is one Lua script call (one round trip): a lookup of any number of keys
(stopping at the first key with no live holder; :meth:`RedisDirectory.lookup_pending`
also reads the pending entries of the keys after that), a batch of announcements, a
heartbeat.
Times come from the Redis server clock, so node clocks need not agree. Scripts run by
``EVALSHA`` (loaded again when a server answers ``NOSCRIPT``, e.g. after a failover).

On a Redis Cluster (``redis+cluster://``) the membership keys stay as above, in the one
slot of ``{P}``, and the blocks hash is split into sub-partitions, each with its own hash
tag: see :mod:`p2pkv.cluster.sharded`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from p2pkv.cluster.pending import DUES_LUA, PendingEntries, parse_dues
from p2pkv.cluster.records import (
    CLAIMS_LUA,
    STRIP_DEAD_LUA,
    DirectoryError,
    DirectoryView,
    Holder,
    Lua,
    Member,
    MemberView,
    NodeRecord,
    QuarantineReport,
    parse_holders,
)
from p2pkv.cluster.redis_client import KeySpace, RedisConnection
from p2pkv.cluster.redis_urls import validate_redis_url
from p2pkv.cluster.sharded import Subpartitions
from p2pkv.cluster.verdicts import Verdicts, parse_reports

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
# Returns -1 (and changes nothing) when the token is still in use: a counter that went
# back (a restart, a failover that lost writes) never hands out a live member's token.
_REGISTER = _NOW + """
if redis.call('HEXISTS', KEYS[5], ARGV[1]) == 1 then return -1 end
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

# KEYS: blocks, live, addr, pending. ARGV: own token (never returned as a holder, nor
# as a pending key's announcer), "1" to read the pending entries, keys...
# Returns {holders of each key of the longest prefix with a live holder (tokens
# concatenated), {token, addr, token, addr, ...} of the tokens in them, the dues (ms) of
# the keys after that prefix (see p2pkv.cluster.pending; empty: none pending)}.
_LOOKUP = _NOW + """
local now = now_ms()
local me = ARGV[1]
local alive = {}
local out = {}
local addrs = {}
local function live_owner(t)
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
  return a
end
""" + DUES_LUA + """
local n = #ARGV
local i = 3
local ended = false
while i <= n and not ended do
  local j = math.min(i + CHUNK - 1, n)
  local vals = redis.call('HMGET', KEYS[1], unpack(ARGV, i, j))
  for k = 1, #vals do
    local v = vals[k]
    local live = ''
    if v then
      for p = 1, #v, 4 do
        local t = string.sub(v, p, p + 3)
        if live_owner(t) then live = live .. t end
      end
    end
    if live == '' then
      ended = true
      break
    end
    out[#out + 1] = live
  end
  i = j + 1
end
if ARGV[2] ~= '1' then return {out, addrs, {}} end
return {out, addrs, dues(KEYS[4], 3 + #out, n, live_owner)}
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
local first = 4
""" + CLAIMS_LUA + """if delta ~= 0 and redis.call('HEXISTS', KEYS[3], me) == 1 then
  redis.call('HINCRBY', KEYS[3], me, delta)
end
return delta
"""

# KEYS: blocks, live, nodes, addr, count, sweep lock, owner, quarantine. ARGV: own token,
# cursor, count,
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
""" + STRIP_DEAD_LUA + """if res[1] == '0' then
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
      redis.call('HDEL', KEYS[8], t)
    end
  end
  redis.call('DEL', KEYS[6])
end
return res[1]
"""


# KEYS: live (its slot: the partition's server). Returns that server's clock in ms.
_CLOCK = _NOW + """
return now_ms()
"""


class RedisDirectory:
    """A connection to one Redis directory (thread-safe; one connection pool).

    ``url`` is any form of :mod:`p2pkv.cluster.redis_urls`: one server (``redis://``,
    ``rediss://``, ``unix://``), a Redis Cluster (``redis+cluster://``) or the primary a
    Sentinel set names (``redis+sentinel://``). Nothing connects before the first call.
    Every call raises :class:`~p2pkv.cluster.records.DirectoryError` when Redis cannot be
    reached within ``socket_timeout`` seconds (a cluster client asks once more after
    refreshing its topology), refuses the credentials or answers garbage; none retries
    by itself beyond that.
    """

    def __init__(self, url: str, *, namespace: str = "p2pkv",
                 socket_timeout: float = 1.0) -> None:
        #: The connection every script of the directory runs on (Subpartitions' and
        #: Verdicts' too).
        self.redis = RedisConnection(url, socket_timeout)
        #: The names of its keys (Subpartitions', Verdicts' and PendingEntries' too).
        self.keys = KeySpace(namespace)
        self.url = self.redis.url
        self.kind = self.redis.kind
        self.namespace = namespace
        self._register = Lua(_REGISTER)
        self._heartbeat = Lua(_HEARTBEAT)
        self._lookup = Lua(_LOOKUP)
        self._announce = Lua(_ANNOUNCE)
        self._sweep = Lua(_SWEEP)
        self._clock = Lua(_CLOCK)
        #: On a Redis Cluster (``kind == "cluster"``), its sharded block keys; else None.
        self.shards: Subpartitions | None = None
        if self.kind == "cluster":
            self.shards = Subpartitions(self, self.redis.subpartitions)
        #: Publishes the holders a member keeps in quarantine (the registration's).
        self.verdicts = Verdicts(self)
        #: Writes the keys a member is computing now (the registration's).
        self.pending = PendingEntries(self.redis, self.keys)

    def _key(self, partition: str, what: str) -> str:
        return self.keys.key(partition, what)

    # -- membership ---------------------------------------------------------------

    def register(self, record: NodeRecord, ttl: float) -> Member:
        """Register ``record`` for ``ttl`` seconds under a fresh token (announce nothing)."""
        p = record.partition

        def run() -> Member:
            nonce = os.urandom(16)
            for _ in range(16):
                number = int(self.redis.client.incr(self.keys.shared("seq"))) % (1 << 32) or 1
                token = number.to_bytes(_TOKEN_BYTES, "big")
                taken = self.redis.eval(self._register, keys=[
                    self._key(p, "live"), self._key(p, "nodes"), self._key(p, "addr"),
                    self._key(p, "count"), self._key(p, "owner")], args=[
                    token, int(ttl * 1000), record.to_json(),
                    f"{record.node_id}\n{record.address}", nonce])
                if int(taken) != -1:
                    break
            else:
                raise DirectoryError(f"redis directory {self.url}: register: 16 tokens in "
                                     f"a row were in use (is {self.namespace}:seq reset?)")
            self.redis.client.sadd(self.keys.shared("partitions"), p)
            return Member(p, token, nonce)

        member: Member = self.redis.call("register", run)
        return member

    def heartbeat(self, member: Member, ttl: float) -> bool:
        """Renew the registration; False when it is gone (expired, Redis restarted)."""
        def run() -> bool:
            renewed = self.redis.eval(self._heartbeat, keys=[
                self._key(member.partition, "live"), self._key(member.partition, "owner")],
                args=[member.token, int(ttl * 1000), member.nonce])
            # Listed again each time: a sweep may have dropped an emptied partition.
            self.redis.client.sadd(self.keys.shared("partitions"), member.partition)
            return bool(renewed)

        alive: bool = self.redis.call("heartbeat", run)
        return alive

    def announce(self, member: Member, stored: Sequence[bytes],
                 removed: Sequence[bytes] = (), *, counts: Counter[int] | None = None) -> bool:
        """Claim ``stored`` and withdraw ``removed`` (idempotent). False when the
        registration is gone (nothing was claimed; register again and republish).
        ``counts`` adds the change of the member's claims, by sub-partition (0 on one
        Redis): what :meth:`claim_counts` must then find."""
        if self.shards is not None:
            ok: bool = self.shards.announce(member, stored, removed, counts)
            return ok
        p = member.partition
        keys = [self._key(p, "blocks"), self._key(p, "live"), self._key(p, "count"),
                self._key(p, "owner")]
        stored, removed = list(stored), list(removed)
        while stored or removed:
            add, stored = stored[:ANNOUNCE_BATCH], stored[ANNOUNCE_BATCH:]
            room = ANNOUNCE_BATCH - len(add)
            rem, removed = removed[:room], removed[room:]
            result = self.redis.call("announce", lambda a=add, r=rem: self.redis.eval(  # type: ignore[misc]
                self._announce, keys=keys, args=[member.token, member.nonce, len(a), *a, *r]))
            if int(result) == -1:
                return False
            if counts is not None:
                counts[0] += int(result)
        return True

    def claim_counts(self, member: Member, subs: Sequence[int] = (0,)) -> dict[int, int]:
        """The claims of ``member`` as the servers count them, by sub-partition (of
        ``subs``; one Redis has only 0). Fewer than its announcements added: claims were
        lost (a failover), and the member must publish its blocks again."""
        if self.shards is not None:
            found: dict[int, int] = self.shards.claim_counts(member, subs)
            return found
        n = self.redis.call("claim counts", lambda: self.redis.client.hget(
            self._key(member.partition, "count"), member.token))
        return {0: int(n or 0)}

    def announce_pending(self, member: Member, keys: Sequence[bytes],
                         seconds: Sequence[float]) -> bool:
        """``member`` computes ``keys[i]``, due in ``seconds[i]`` seconds (see
        :mod:`p2pkv.cluster.pending`). False when the registration is gone."""
        return self.pending.write(member, list(zip(keys, seconds, strict=True)))

    def withdraw_pending(self, member: Member, keys: Sequence[bytes]) -> bool:
        """``member`` no longer computes ``keys``. False when the registration is gone."""
        return self.pending.write(member, (), keys)

    def deregister(self, member: Member, held: Sequence[bytes],
                   pending: Sequence[bytes] = ()) -> None:
        """Withdraw ``held``, the ``pending`` keys and the registration. Whatever a crash
        or a race leaves behind is swept by the partition's live members once the token
        is dead (a pending entry ends with its lease)."""
        if pending and not self.pending.write(member, (), pending):
            return  # the token is no longer ours: nothing of it to withdraw
        if not self.announce(member, (), held):
            return
        p = member.partition

        def run() -> None:
            count = self.redis.client.hget(self._key(p, "count"), member.token)
            if count is not None and int(count) == 0:
                pipe = self.redis.client.pipeline(transaction=True)
                pipe.zrem(self._key(p, "live"), member.token)
                for what in ("nodes", "addr", "count", "owner", "quarantine"):
                    pipe.hdel(self._key(p, what), member.token)
                pipe.execute()
            else:  # leave it dead (score 0) for a sweep to clean up
                self.redis.client.zadd(self._key(p, "live"), {member.token: 0})
                self.redis.client.hdel(self._key(p, "quarantine"), member.token)

        self.redis.call("deregister", run)

    def dead_tokens(self, partition: str) -> list[bytes]:
        """Tokens of ``partition`` whose registration expired."""
        def run() -> list[bytes]:
            now = self.server_time_ms(partition)
            return [bytes(t) for t in self.redis.client.zrangebyscore(
                self._key(partition, "live"), "-inf", f"({now}")]

        tokens: list[bytes] = self.redis.call("dead tokens", run)
        return tokens

    def sweep_step(self, member: Member, dead: Sequence[bytes], cursor: int,
                   count: int = 1000) -> int | None:
        """One step of sweeping ``dead`` tokens out of the partition.

        Returns the next cursor (0: the pass is over and their records are gone), or
        None when another member is sweeping.
        """
        if self.shards is not None:
            step: int | None = self.shards.sweep_step(member, dead, cursor, count)
            return step
        p = member.partition
        result = self.redis.call("sweep", lambda: self.redis.eval(
            self._sweep, keys=[self._key(p, "blocks"), self._key(p, "live"), self._key(p, "nodes"),
                  self._key(p, "addr"), self._key(p, "count"), self._key(p, "sweep"),
                  self._key(p, "owner"), self._key(p, "quarantine")],
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
        return self._lookup_holders(partition, keys, exclude, pending=False)[0]

    def lookup_pending(self, partition: str, keys: Sequence[bytes],
                       exclude: Member | None = None
                       ) -> tuple[list[tuple[Holder, ...]], list[float]]:
        """:meth:`lookup`, and per key of ``keys`` the seconds until a live member other
        than ``exclude`` expects to hold it (the earliest such member's estimate; 0.0
        for the keys of the prefix and keys nobody announced). In the same round trip
        (on a Redis Cluster: the same pipeline)."""
        return self._lookup_holders(partition, keys, exclude, pending=True)

    def _lookup_holders(self, partition: str, keys: Sequence[bytes], exclude: Member | None,
                        *, pending: bool) -> tuple[list[tuple[Holder, ...]], list[float]]:
        if not keys:
            return [], []
        me = exclude.token if exclude is not None else b""
        if self.shards is not None:
            found: tuple[list[tuple[Holder, ...]], list[float]] = self.shards.lookup(
                partition, keys, me, pending=pending)
            return found
        reply = self.redis.call("lookup", lambda: self.redis.eval(
            self._lookup, keys=[self._key(partition, "blocks"), self._key(partition, "live"),
                                self._key(partition, "addr"), self._key(partition, "pending")],
            args=[me, "1" if pending else "0", *keys]))
        try:
            packed, flat, after = reply
            holders = parse_holders(flat)
            out = [tuple(holders[bytes(v[p:p + _TOKEN_BYTES])]
                         for p in range(0, len(v), _TOKEN_BYTES)) for v in packed]
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise DirectoryError(f"redis directory {self.url}: malformed lookup reply "
                                 f"({exc!r})") from None
        due = [0.0] * len(out) + parse_dues(after, len(keys) - len(out), self.url)
        return out, due

    def server_time_ms(self, partition: str) -> int:
        """The clock (ms) of the server that holds ``partition``'s liveness."""
        return int(self.redis.eval(self._clock, keys=[self._key(partition, "live")], args=[]))

    def view(self) -> DirectoryView:
        """Every partition, its members, their block counts and liveness (for tools)."""
        def run() -> DirectoryView:
            out: dict[str, list[MemberView]] = {}
            for raw in sorted(self.redis.client.smembers(self.keys.shared("partitions"))):
                p = bytes(raw).decode()
                now = self.server_time_ms(p)
                pipe = self.redis.client.pipeline(transaction=False)
                pipe.hgetall(self._key(p, "nodes"))
                pipe.zrange(self._key(p, "live"), 0, -1, withscores=True)
                pipe.hgetall(self._key(p, "count"))
                pipe.hgetall(self._key(p, "quarantine"))
                nodes, live, counts, verdicts = pipe.execute()
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
                    reports: tuple[QuarantineReport, ...] = ()
                    if exp >= now and token in verdicts:  # a dead reporter's are void
                        try:
                            reports = parse_reports(verdicts[token], int(now))
                        except DirectoryError as exc:
                            error = error or str(exc)
                    members.append(MemberView(
                        member=int.from_bytes(token, "big"), record=record, error=error,
                        blocks=int(counts.get(token, 0)), alive=exp >= now,
                        expires_in=(exp - now) / 1000.0, reports=reports))
                if members:
                    out[p] = members
            return DirectoryView(out)

        view: DirectoryView = self.redis.call("view", run)
        return view

    @property
    def client(self) -> Any:
        """The underlying redis-py client (``redis.Redis`` or ``RedisCluster``; for tools
        and the benchmark)."""
        return self.redis.client

    def memory(self) -> int:
        """Redis ``used_memory`` in bytes, summed over a cluster's masters (benchmark)."""
        return self.redis.memory()

    def ping(self) -> bool:
        return self.redis.ping()

    def close(self) -> None:
        self.redis.close()

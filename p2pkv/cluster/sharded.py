"""One partition's block keys over every master of a Redis Cluster.

On one Redis a partition's blocks hash is one key. On a Redis Cluster one hash tag is
one slot, so one identity (one model behind every worker, the common case) would load
one master. Here the blocks hash is split into ``S`` sub-partitions by a hash of the
block key (CRC-32), each with its own hash tag::

    NS:{P}:...              membership and liveness, as on one Redis (one slot)
    NS:{P/s.j}:blocks       HASH block key -> holder tokens, for keys with crc32 % S == s
    NS:{P/s.j}:count        HASH token -> its claims in that sub-partition

``j`` is the smallest number that puts sub-partition ``s`` in the ``s``-th of ``S``
equal bands of the 16,384 slots: ``redis-cli --cluster create`` gives each of M masters
one contiguous range, so with S a multiple of M every master holds S / M sub-partitions
and the same share of the keys and of the lookups.

A lookup sends one ``EVALSHA`` per sub-partition it needs (the values of its keys, up to
the first one nobody claims), all pipelined (every shard at once), then one script on
the membership slot that says which of the tokens found are live, with their addresses.
The merge gives the same longest-prefix answer as the single-Redis script. The pending
entries (:mod:`p2pkv.cluster.pending`) are not split: they stay on the membership slot,
where a lookup that wants them reads them with one more script in the first pipeline
(and liveness on the same server), so it takes no extra round trip. An
announcement checks the registration (owner nonce, liveness) on the membership slot,
then claims in each sub-partition; a registration that expires between the two can
leave claims of a dead token behind, which lookups skip (dead) and the sweep removes.
Liveness keeps its guarantee: it is read from one slot, on that server's clock.

A sub-partition's count changes in the script that changes its claims, so a failover
that loses claims (asynchronous replication, or a shard that lost its data) loses their
count too: a holder that compares the counts with what its announcements added
(:meth:`Subpartitions.claim_counts`) finds out, and publishes its blocks again.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

from p2pkv.cluster.pending import LOOKUP_LUA, parse_dues
from p2pkv.cluster.records import (
    CLAIMS_LUA,
    STRIP_DEAD_LUA,
    DirectoryError,
    Holder,
    Lua,
    Member,
    parse_holders,
)
from p2pkv.cluster.redis_client import DirectoryParts

__all__ = ["Subpartitions", "subpartition_of"]

_TOKEN_BYTES = 4
_SLOTS = 16384
_CHUNK = 1000
ANNOUNCE_BATCH = 5000

# KEYS: one sub-partition's blocks. ARGV: block keys. Their values in order, up to the
# first key that nobody claims (the longest prefix cannot reach past it).
_SUB_LOOKUP = """
local out = {}
local n = #ARGV
local i = 1
while i <= n do
  local j = math.min(i + CHUNK - 1, n)
  local vals = redis.call('HMGET', KEYS[1], unpack(ARGV, i, j))
  for k = 1, #vals do
    if not vals[k] then return out end
    out[#out + 1] = vals[k]
  end
  i = j + 1
end
return out
""".replace("CHUNK", str(_CHUNK))

# KEYS: live, addr. ARGV: own token, tokens... {token, addr, ...} of the live ones.
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 2, #ARGV do
  local tok = ARGV[i]
  if tok ~= ARGV[1] then
    local exp = redis.call('ZSCORE', KEYS[1], tok)
    if exp and tonumber(exp) >= now then
      local addr = redis.call('HGET', KEYS[2], tok)
      if addr then
        out[#out + 1] = tok
        out[#out + 1] = addr
      end
    end
  end
end
return out
"""

# KEYS: live, owner. ARGV: token, nonce, 1 when claims follow (the token must be live).
_CHECK = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '1' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if not s or tonumber(s) < now then return 0 end
end
return 1
"""

# KEYS: one sub-partition's blocks, its counts. ARGV: token, number of stored keys,
# stored..., removed... Returns the change of the token's block count there.
_SUB_ANNOUNCE = """
local me = ARGV[1]
local nadd = tonumber(ARGV[2])
local delta = 0
local first = 3
""" + CLAIMS_LUA + """if delta ~= 0 and redis.call('HINCRBY', KEYS[2], me, delta) <= 0 then
  redis.call('HDEL', KEYS[2], me)
end
return delta
"""

# KEYS: count. ARGV: token, delta.
_COUNT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[1], tonumber(ARGV[2]))
end
return 1
"""

# KEYS: sweep lock. ARGV: token. 1 when this member holds the lock (taken or renewed).
_LOCK = """
local lock = redis.call('GET', KEYS[1])
if lock and lock ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', 30000)
return 1
"""

# KEYS: one sub-partition's blocks, its counts. ARGV: cursor, count, dead tokens...
# One HSCAN step stripping the dead tokens from the entries it visits (their counts go
# at the end of the pass); returns the next cursor.
_SUB_SWEEP = """
local dead = {}
for i = 3, #ARGV do dead[ARGV[i]] = true end
local res = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', tonumber(ARGV[2]))
""" + STRIP_DEAD_LUA + """if res[1] == '0' then
  for i = 3, #ARGV do redis.call('HDEL', KEYS[2], ARGV[i]) end
end
return res[1]
"""

# KEYS: live, nodes, addr, count, owner, sweep lock, quarantine. ARGV: dead tokens... The
# end of a pass: the records of the tokens still dead go (their quarantine verdicts
# too), and the lock.
_SWEEP_END = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, #ARGV do
  local tok = ARGV[i]
  local s = redis.call('ZSCORE', KEYS[1], tok)
  if (not s) or tonumber(s) < now then
    redis.call('ZREM', KEYS[1], tok)
    for k = 2, 5 do redis.call('HDEL', KEYS[k], tok) end
    redis.call('HDEL', KEYS[7], tok)
  end
end
redis.call('DEL', KEYS[6])
return 1
"""


def subpartition_of(key: bytes, count: int) -> int:
    """The sub-partition of a block key (the same on every node)."""
    return zlib.crc32(key) % count


def _band_tag(partition: str, s: int, count: int) -> str:
    from redis.crc import key_slot

    lo, hi = s * _SLOTS // count, (s + 1) * _SLOTS // count
    j = 0
    while True:
        tag = f"{partition}/{s}.{j}"
        if lo <= key_slot(tag.encode()) < hi:
            return tag
        j += 1


class Subpartitions:
    """The sharded block keys of a :class:`~p2pkv.cluster.RedisDirectory` on a cluster.

    Used by the directory itself (its ``lookup``, ``announce`` and ``sweep_step`` come
    here when ``kind == "cluster"``); thread-safe as the directory is.
    """

    def __init__(self, directory: DirectoryParts, count: int) -> None:
        self.directory = directory
        self.count = count
        self._tags: dict[str, tuple[str, ...]] = {}
        self._sub_lookup = Lua(_SUB_LOOKUP)
        self._live = Lua(_LIVE)
        self._check = Lua(_CHECK)
        self._sub_announce = Lua(_SUB_ANNOUNCE)
        self._count = Lua(_COUNT)
        self._lock = Lua(_LOCK)
        self._sub_sweep = Lua(_SUB_SWEEP)
        self._sweep_end = Lua(_SWEEP_END)
        self._pending_lookup = Lua(LOOKUP_LUA)

    def blocks_key(self, partition: str, s: int, what: str = "blocks") -> str:
        """The blocks hash (or ``what`` else) of sub-partition ``s`` of ``partition``."""
        tags = self._tags.get(partition)
        if tags is None:
            tags = tuple(_band_tag(partition, i, self.count) for i in range(self.count))
            self._tags[partition] = tags
        return self.directory.keys.key(tags[s], what)

    def _group(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(zlib.crc32(k) % self.count, []).append(i)
        return groups

    # -- lookups --------------------------------------------------------------------

    def lookup(self, partition: str, keys: Sequence[bytes], me: bytes, *,
               pending: bool = False) -> tuple[list[tuple[Holder, ...]], list[float]]:
        """The holders of the longest prefix, and (``pending``) the seconds until due of
        every key after it (see :meth:`RedisDirectory.lookup_pending`)."""
        d = self.directory
        groups = sorted(self._group(keys).items())
        calls: list[tuple[Any, list[str], list[Any]]] = [
            (self._sub_lookup, [self.blocks_key(partition, s)], [keys[i] for i in idx])
            for s, idx in groups]
        if pending:
            calls.append((self._pending_lookup, [
                d.keys.key(partition, "live"), d.keys.key(partition, "addr"),
                d.keys.key(partition, "pending")], [me, *keys]))
        replies = d.redis.call("lookup", lambda: d.redis.pipelined(calls))
        dues = parse_dues(replies.pop() if pending else None, len(keys), d.url)
        values: list[bytes | None] = [None] * len(keys)
        try:
            for (_, idx), reply in zip(groups, replies, strict=True):
                for j, v in enumerate(reply):
                    values[idx[j]] = bytes(v)
        except (TypeError, ValueError, IndexError) as exc:
            raise DirectoryError(f"redis directory {d.url}: malformed lookup reply "
                                 f"({exc!r})") from None
        end = values.index(None) if None in values else len(values)
        if end == 0:
            return [], dues
        tokens = {v[p:p + _TOKEN_BYTES] for v in values[:end] if v is not None
                  for p in range(0, len(v), _TOKEN_BYTES)}
        flat = d.redis.call("lookup", lambda: d.redis.eval(
            self._live, keys=[d.keys.key(partition, "live"), d.keys.key(partition, "addr")],
            args=[me, *sorted(tokens)]))
        try:
            live = parse_holders(flat)
        except (ValueError, TypeError, IndexError, UnicodeDecodeError) as exc:
            raise DirectoryError(f"redis directory {d.url}: malformed lookup reply "
                                 f"({exc!r})") from None
        out: list[tuple[Holder, ...]] = []
        for v in values[:end]:
            assert v is not None
            found = tuple(live[t] for p in range(0, len(v), _TOKEN_BYTES)
                          if (t := v[p:p + _TOKEN_BYTES]) in live)
            if not found:
                break
            out.append(found)
        return out, [0.0] * len(out) + dues[len(out):]

    # -- announcements --------------------------------------------------------------

    def announce(self, member: Member, stored: Sequence[bytes],
                 removed: Sequence[bytes], counts: Counter[int] | None = None) -> bool:
        d = self.directory
        p = member.partition
        stored, removed = list(stored), list(removed)
        while stored or removed:
            add, stored = stored[:ANNOUNCE_BATCH], stored[ANNOUNCE_BATCH:]
            room = ANNOUNCE_BATCH - len(add)
            rem, removed = removed[:room], removed[room:]
            ok = d.redis.call("announce", lambda a=add: d.redis.eval(  # type: ignore[misc]
                self._check, keys=[d.keys.key(p, "live"), d.keys.key(p, "owner")],
                args=[member.token, member.nonce, "1" if a else "0"]))
            if not int(ok):
                return False
            adds, rems = self._group(add), self._group(rem)
            calls: list[tuple[Any, list[str], list[Any]]] = []
            subs = sorted(set(adds) | set(rems))
            for s in subs:
                a = [add[i] for i in adds.get(s, ())]
                r = [rem[i] for i in rems.get(s, ())]
                calls.append((self._sub_announce, [self.blocks_key(p, s),
                                                   self.blocks_key(p, s, "count")],
                              [member.token, len(a), *a, *r]))
            deltas = d.redis.call("announce", lambda c=calls: d.redis.pipelined(c))  # type: ignore[misc]
            if counts is not None:
                for s, x in zip(subs, deltas, strict=True):
                    counts[s] += int(x)
            delta = sum(int(x) for x in deltas)
            if delta:
                d.redis.call("announce", lambda n=delta: d.redis.eval(  # type: ignore[misc]
                    self._count, keys=[d.keys.key(p, "count")], args=[member.token, n]))
        return True

    def claim_counts(self, member: Member, subs: Sequence[int]) -> dict[int, int]:
        """The claims of ``member`` in each sub-partition of ``subs``, as the servers
        count them (one pipelined ``HGET`` per sub-partition, every shard at once)."""
        d = self.directory

        def run() -> list[Any]:
            pipe = d.redis.client.pipeline(transaction=False)
            for s in subs:
                pipe.hget(self.blocks_key(member.partition, s, "count"), member.token)
            return list(pipe.execute())

        found = d.redis.call("claim counts", run)
        return {s: int(v or 0) for s, v in zip(subs, found, strict=True)}

    # -- the sweep ------------------------------------------------------------------

    def sweep_step(self, member: Member, dead: Sequence[bytes], cursor: int,
                   count: int) -> int | None:
        """One HSCAN step of one sub-partition. ``cursor`` encodes both: the
        sub-partition is ``cursor % S``, its HSCAN cursor ``cursor // S``."""
        d = self.directory
        p = member.partition
        if not int(d.redis.call("sweep", lambda: d.redis.eval(
                self._lock, keys=[d.keys.key(p, "sweep")], args=[member.token]))):
            return None
        s, scan = cursor % self.count, cursor // self.count
        nxt = int(d.redis.call("sweep", lambda: d.redis.eval(
            self._sub_sweep, keys=[self.blocks_key(p, s), self.blocks_key(p, s, "count")],
            args=[scan, count, *dead])))
        if nxt:
            return nxt * self.count + s
        if s + 1 < self.count:
            return s + 1
        d.redis.call("sweep", lambda: d.redis.eval(self._sweep_end, keys=[
            d.keys.key(p, what) for what in ("live", "nodes", "addr", "count", "owner",
                                             "sweep", "quarantine")],
            args=list(dead)))
        return 0

"""The keys a member is computing now, in the Redis directory (``pending-v1`` through
the directory; SPEC §19 says what a static peer answers, this is the same for Redis).

A member that computes blocks nobody holds (an engine's tier) announces their keys with
the seconds until it expects to store them; a lookup of another member of the partition
then reports, for the keys from the first one nobody holds on, the seconds until the
earliest live announcer expects to hold each. Next to the registration, in the slot of
the partition's hash tag ``{P}`` (on a Redis Cluster too: one server, one clock)::

    NS:{P}:pending      HASH block key -> the entries of the members computing it,
                        32 bytes each: 4-byte token, then when due and when the lease
                        ends (ms on the server clock, 14 ASCII digits each)
    NS:{P}:pendexp      ZSET block key -> the latest lease end of its entries

An entry's lease ends at ``due + max(due, MIN_OVERDUE)`` (MIN_OVERDUE is 10 s, as a
node forgets its own pending keys, SPEC §19 rule 4); announcing the key again (a
renewal) replaces the member's entry. Lookups skip an entry whose lease ended, whose
member is not live (its registration expired or was withdrawn) or that is the asker's
own, so a dead member's entries are never reported. Every write (one script, checked as
an announcement is: owner nonce, and liveness for announcements) also deletes a bounded
batch of entries whose lease ended, and both keys expire by themselves (``PEXPIRE``)
when the longest lease in them ends, so nothing outlives its lease by much even when
nobody writes again. A member that deregisters withdraws its entries; one that stores a
key withdraws its entry with the claim (see :mod:`p2pkv.cluster.registration`).

Reading them costs the lookup no round trip: the single-Redis lookup script reads
``pending`` after the blocks (only when the hash exists), and on a Redis Cluster
:data:`LOOKUP_LUA` runs on the membership slot in the same pipeline as the
sub-partitions' lookups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from p2pkv.cluster.records import DirectoryError, Lua, Member
from p2pkv.cluster.redis_client import KeySpace, RedisConnection
from p2pkv.protocol.pending import MIN_OVERDUE, estimate

__all__ = ["DUES_LUA", "LOOKUP_LUA", "PendingEntries", "estimate", "parse_dues"]

#: Bytes of one entry: token, due, lease end.
ENTRY_BYTES = 32
#: Keys per write script call (announced and withdrawn together).
WRITE_BATCH = 2000
#: Leases that ran out deleted per write, at most.
_CLEAN = 100

DUES_LUA = """
local function dues(pkey, from, to, live_owner)
  local out = {}
  if from > to or redis.call('EXISTS', pkey) == 0 then return out end
  local any = false
  local i = from
  while i <= to do
    local j = math.min(i + 1000 - 1, to)
    local vals = redis.call('HMGET', pkey, unpack(ARGV, i, j))
    for k = 1, #vals do
      local best = 0
      local v = vals[k]
      if v then
        for p = 1, #v, 32 do
          if (tonumber(string.sub(v, p + 18, p + 31)) or 0) > now
              and live_owner(string.sub(v, p, p + 3)) then
            local d = math.max(1, (tonumber(string.sub(v, p + 4, p + 17)) or 0) - now)
            if best == 0 or d < best then best = d end
          end
        end
      end
      if best > 0 then any = true end
      out[#out + 1] = best
    end
    i = j + 1
  end
  if not any then return {} end
  return out
end
"""
"""Lua: ``dues(pending hash, first ARGV index, last ARGV index, live_owner)``, for the
block keys ``ARGV[from .. to]``, the milliseconds until the earliest entry whose lease
runs and whose token ``live_owner`` accepts is due (at least 1; 0: none), or an empty
table when no key has one. Needs ``now`` (server ms) in scope."""

# KEYS: live, addr, pending (the membership slot). ARGV: own token, block keys... The
# dues of a Redis Cluster lookup (see DUES_LUA), for every key asked.
LOOKUP_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local alive = {}
local function live_owner(tok)
  local a = alive[tok]
  if a == nil then
    local exp = redis.call('ZSCORE', KEYS[1], tok)
    a = tok ~= me and exp ~= false and tonumber(exp) >= now
        and redis.call('HEXISTS', KEYS[2], tok) == 1
    alive[tok] = a
  end
  return a
end
""" + DUES_LUA + """
return dues(KEYS[3], 2, #ARGV, live_owner)
"""

# KEYS: live, owner, pending, pendexp. ARGV: token, nonce, MIN_OVERDUE in ms, number of
# announced keys, (key, ms until due) for each, withdrawn keys... Returns -1 (nothing
# changed) when the registration is gone or not this one's (liveness is checked only
# when something is announced: a withdrawal is always allowed), 1 otherwise.
_WRITE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
if redis.call('HGET', KEYS[2], me) ~= ARGV[2] then return -1 end
local over = tonumber(ARGV[3])
local nadd = tonumber(ARGV[4])
if nadd > 0 then
  local s = redis.call('ZSCORE', KEYS[1], me)
  if not s or tonumber(s) < now then return -1 end
end
-- The entries of v whose lease runs, without those of the token drop.
local function keep(v, drop)
  local rest = ''
  local latest = 0
  for p = 1, #v, 32 do
    local e = string.sub(v, p, p + 31)
    local exp = tonumber(string.sub(e, 19, 32)) or 0
    if string.sub(e, 1, 4) ~= drop and exp > now then
      rest = rest .. e
      if exp > latest then latest = exp end
    end
  end
  return rest, latest
end
local function put(k, rest, latest)
  if rest == '' then
    redis.call('HDEL', KEYS[3], k)
    redis.call('ZREM', KEYS[4], k)
  else
    redis.call('HSET', KEYS[3], k, rest)
    redis.call('ZADD', KEYS[4], latest, k)
  end
end
local longest = 0
local first = 5
for i = first, first + 2 * nadd - 1, 2 do
  local k = ARGV[i]
  local due = tonumber(ARGV[i + 1])
  local lease = due + math.max(due, over)
  local rest, latest = keep(redis.call('HGET', KEYS[3], k) or '', me)
  rest = rest .. me .. string.format('%014d%014d', now + due, now + lease)
  put(k, rest, math.max(latest, now + lease))
  if lease > longest then longest = lease end
end
for i = first + 2 * nadd, #ARGV do
  local k = ARGV[i]
  local v = redis.call('HGET', KEYS[3], k)
  if v then
    local rest, latest = keep(v, me)
    if #rest ~= #v then put(k, rest, latest) end
  end
end
local ended = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, CLEAN)
for _, k in ipairs(ended) do
  local rest, latest = keep(redis.call('HGET', KEYS[3], k) or '', '')
  put(k, rest, latest)
end
if longest > 0 then
  for k = 3, 4 do
    if redis.call('PTTL', KEYS[k]) < longest then redis.call('PEXPIRE', KEYS[k], longest) end
  end
end
return 1
""".replace("CLEAN", str(_CLEAN))


def due_ms(seconds: float) -> int:
    """An estimate in whole milliseconds, as the write script takes it."""
    return math.ceil(estimate(seconds) * 1000)


def parse_dues(reply: Any, count: int, url: str) -> list[float]:
    """Seconds per key from a dues reply (milliseconds per key, or empty: none)."""
    if not reply:
        return [0.0] * count
    try:
        dues = [int(d) / 1000 for d in reply]
    except (TypeError, ValueError) as exc:
        raise DirectoryError(f"redis directory {url}: malformed pending reply "
                             f"({exc!r})") from None
    if len(dues) != count:
        raise DirectoryError(f"redis directory {url}: pending reply of {len(dues)} "
                             f"entries for {count} keys")
    return dues


class PendingEntries:
    """Writing a member's pending entries for a
    :class:`~p2pkv.cluster.RedisDirectory` (whose ``lookup_pending`` reads them): on its
    connection ``redis``, under its key names ``keys``."""

    def __init__(self, redis: RedisConnection, keys: KeySpace) -> None:
        self.redis = redis
        self._key = keys.key
        self._write = Lua(_WRITE)

    def keys(self, partition: str) -> list[str]:
        """The two keys of ``partition``'s pending entries (hash, lease ends)."""
        return [self._key(partition, "pending"), self._key(partition, "pendexp")]

    def write(self, member: Member, announced: Sequence[tuple[bytes, float]],
              withdrawn: Sequence[bytes] = ()) -> bool:
        """Announce ``(key, seconds until due)`` pairs and withdraw ``withdrawn`` keys of
        ``member`` (idempotent; in batches of :data:`WRITE_BATCH` keys). False when the
        registration is gone (then nothing of the batch was written)."""
        p = member.partition
        keys = [self._key(p, "live"), self._key(p, "owner"), *self.keys(p)]
        over = math.ceil(MIN_OVERDUE * 1000)
        add = [(k, due_ms(s)) for k, s in announced]
        rem = list(withdrawn)
        while add or rem:
            batch, add = add[:WRITE_BATCH], add[WRITE_BATCH:]
            room = WRITE_BATCH - len(batch)
            out, rem = rem[:room], rem[room:]
            args: list[Any] = [member.token, member.nonce, over, len(batch)]
            for k, ms in batch:
                args += [k, ms]
            args += out
            result = self.redis.call("pending", lambda a=args: self.redis.eval(  # type: ignore[misc]
                self._write, keys=keys, args=a))
            if int(result) == -1:
                return False
        return True

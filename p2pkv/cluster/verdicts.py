"""The quarantine verdicts a node publishes in the directory, so that ``p2pkv-node
cluster`` shows who keeps whom out of its holder choice.

Quarantine is each consumer's own view (:mod:`p2pkv.cluster.health`). A consumer
registered in a Redis directory publishes its current verdicts in its partition, next
to its registration (``{P}`` is the partition's hash tag: on a Redis Cluster, the slot
of its membership keys)::

    NS:{P}:quarantine   HASH reporter token -> "SERVER_MS JSON"

``JSON`` is a list of ``{"address", "node_id", "reason", "times", "left_ms"}``; each
verdict holds until ``SERVER_MS + left_ms`` on the server's clock (node clocks need not
agree). The registration thread publishes whenever the verdicts change (a holder
quarantined, a quarantine over), within one announce interval, by one script that
checks the registration as an announcement does (owner nonce, liveness); no verdicts
deletes the field. The field lives and dies with the reporter's registration:
deregistering deletes it, the sweep of a dead token deletes it with the token's
records, and the directory's view only reads the verdicts of live reporters that have
not run out, so a reporter killed with ``kill -9`` shows nothing once its TTL passed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from p2pkv.cluster.records import DirectoryError, Lua, Member, QuarantineReport
from p2pkv.cluster.redis_client import DirectoryParts

__all__ = ["MAX_REPORTS", "Verdicts", "encode_reports", "parse_reports"]

#: Verdicts one member publishes at most (the holders it quarantines; more is a bug or
#: an attack, and the view must stay readable).
MAX_REPORTS = 1000
_MAX_FIELD_BYTES = 1 << 20

# KEYS: live, owner, quarantine. ARGV: token, nonce, verdicts JSON ("": none). Returns
# -1 (and changes nothing) when the registration is gone or not this one's; 1 otherwise.
_PUBLISH = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return -1 end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[3], ARGV[1])
  return 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not s or tonumber(s) < now then return -1 end
redis.call('HSET', KEYS[3], ARGV[1], now .. ' ' .. ARGV[3])
return 1
"""


def encode_reports(reports: Sequence[QuarantineReport]) -> str:
    """The JSON a member publishes for ``reports`` (seconds left as milliseconds)."""
    return json.dumps([{"address": r.address, "node_id": r.node_id, "reason": r.reason,
                        "times": r.times, "left_ms": max(0, round(r.expires_in * 1000))}
                       for r in reports[:MAX_REPORTS]], separators=(",", ":"))


def parse_reports(value: bytes | str, now_ms: int) -> tuple[QuarantineReport, ...]:
    """The verdicts of one published field that still hold at server time ``now_ms``;
    :class:`DirectoryError` names what is wrong with a malformed one."""
    if len(value) > _MAX_FIELD_BYTES:
        raise DirectoryError(f"quarantine report of {len(value)} bytes is too large")
    try:
        text = value.decode() if isinstance(value, bytes) else value
        at, _, body = text.partition(" ")
        written = int(at)
        items = json.loads(body)
        if not isinstance(items, list):
            raise ValueError("not a JSON list")
        out = []
        for item in items[:MAX_REPORTS]:
            address, node_id, reason = item["address"], item["node_id"], item["reason"]
            times, left = item["times"], item["left_ms"]
            if not all(isinstance(v, str) and len(v) <= 4096
                       for v in (address, node_id, reason)) or not address:
                raise ValueError("address, node_id and reason must be strings")
            if type(times) is not int or type(left) is not int or times < 0 or left < 0:
                raise ValueError("times and left_ms must be non-negative ints")
            remaining = written + left - now_ms
            if remaining > 0:
                out.append(QuarantineReport(address, node_id, reason, times,
                                            remaining / 1000.0))
        return tuple(out)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise DirectoryError(f"malformed quarantine report: {exc!s}") from None


class Verdicts:
    """Publishing a member's verdicts through one :class:`RedisDirectory`."""

    def __init__(self, directory: DirectoryParts) -> None:
        self.directory = directory
        self._publish = Lua(_PUBLISH)

    def publish(self, member: Member, reports: Sequence[QuarantineReport]) -> bool:
        """Publish the holders ``member`` keeps in quarantine now (none: withdraw the
        field). False when the registration is gone: register again."""
        d = self.directory
        p = member.partition
        body = encode_reports(reports) if reports else ""
        result = d.redis.call("quarantine report", lambda: d.redis.eval(
            self._publish, keys=[d.keys.key(p, "live"), d.keys.key(p, "owner"),
                                 d.keys.key(p, "quarantine")],
            args=[member.token, member.nonce, body]))
        return int(result) != -1

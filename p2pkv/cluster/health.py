"""Which holders a consumer keeps out of its choice for a while, and how much of a fetch a
holder it has just met may take.

- **Quarantine.** A holder whose fetches fail ``after`` times in a row (blocks that fail
  their checksum, a refused handshake, a timeout, a dead or misbehaving connection) is
  left out of lookups and fetches for a backoff that doubles with each further
  quarantine, from ``base`` up to ``longest`` seconds. Its keys go to the other holders,
  or are recomputed; nobody retries a sick node in a loop. One good fetch ends the
  streak. A stale directory entry (the holder answers MISSING) is not a failure.
  Quarantine judges a node, not a port: another node at the address (a restart: a
  new node id) is not held to the old one's verdict; it starts over, slowly.
- **Slow start.** A holder this consumer has not seen before (a restarted node comes back
  under a new node id), or one just out of quarantine, takes a share of the keys that
  grows linearly from ``floor`` to a full share over ``ramp`` seconds, so a node that
  re-announces a full pool is not flooded by every consumer at once.

Pure bookkeeping with an injectable clock; thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pkv.cluster.records import QuarantineReport
from p2pkv.errors import ConfigError

__all__ = ["HealthConfig", "HolderHealth", "Quarantine"]


@dataclass(frozen=True)
class HealthConfig:
    """``after``: failures in a row that quarantine a holder; ``base``/``longest``: the
    first and the largest quarantine, in seconds; ``ramp``: the slow-start period in
    seconds (0 turns slow start off); ``floor``: the share a new holder starts with."""

    after: int = 2
    base: float = 2.0
    longest: float = 60.0
    ramp: float = 30.0
    floor: float = 0.1

    def __post_init__(self) -> None:
        if type(self.after) is not int or self.after < 1:
            raise ConfigError(f"quarantine_after must be a positive int, got {self.after!r}")
        for name in ("base", "longest"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"quarantine {name} must be a positive number of seconds, "
                                  f"got {value!r}")
        if self.longest < self.base:
            raise ConfigError(f"quarantine longest ({self.longest}) is shorter than its base "
                              f"({self.base})")
        if isinstance(self.ramp, bool) or not isinstance(self.ramp, (int, float)) \
                or self.ramp < 0:
            raise ConfigError(f"slow_start must be >= 0 seconds, got {self.ramp!r}")
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) \
                or not 0 < self.floor <= 1:
            raise ConfigError(f"slow_start_floor must be in (0, 1], got {self.floor!r}")


@dataclass(frozen=True)
class Quarantine:
    """A holder kept out of the choice: until when (clock seconds), after how many
    quarantines in a row, the last failure, and the node id it had then ("" when
    the caller did not say)."""

    until: float
    times: int
    reason: str
    node_id: str = ""


@dataclass
class _State:
    streak: int = 0
    times: int = 0
    until: float = 0.0
    reason: str = ""
    failed_node: str = ""
    #: Node ids that failed at this address (the last few): none of them lifts the
    #: quarantine by showing up again, e.g. in a directory entry that has not expired.
    failed_nodes: list[str] = field(default_factory=list)
    #: When this consumer started giving the holder keys (slow start counts from it).
    since: float | None = None
    node_ids: set[str] = field(default_factory=set)


class HolderHealth:
    """Health of the holders one consumer fetches from, by address."""

    def __init__(self, config: HealthConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or HealthConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[str, _State] = {}
        self.quarantines = 0

    def _state(self, address: str) -> _State:
        state = self._holders.get(address)
        if state is None:
            state = self._holders[address] = _State()
        return state

    def failed(self, address: str, reason: str, node_id: str = "") -> bool:
        """Count a failed fetch (of the node ``node_id`` at ``address``); True when it
        put the holder in quarantine."""
        with self._lock:
            now = self._clock()
            state = self._state(address)
            state.streak += 1
            state.reason = reason
            state.failed_node = node_id
            if node_id and node_id not in state.failed_nodes:
                state.failed_nodes = [*state.failed_nodes[-7:], node_id]
            if state.streak < self.config.after or state.until > now:
                return False
            state.times += 1
            backoff = min(self.config.longest, self.config.base * 2 ** (state.times - 1))
            state.until = now + backoff
            state.streak = 0
            state.since = None  # back in, it starts slow again
            self.quarantines += 1
            return True

    def succeeded(self, address: str) -> None:
        """A good fetch: the failure streak and the quarantine count start over."""
        with self._lock:
            state = self._state(address)
            state.streak = 0
            state.times = 0

    def quarantined(self, address: str, node_id: str = "") -> bool:
        """Whether the holder at ``address`` is in quarantine now. A ``node_id`` that
        never failed there is another node (the old one restarted): the quarantine ends,
        the count of quarantines in a row starts over, and it starts slow (see
        :meth:`weight`)."""
        with self._lock:
            state = self._holders.get(address)
            if state is None or state.until <= self._clock():
                return False
            if node_id and state.failed_nodes and node_id not in state.failed_nodes:
                state.until = 0.0
                state.streak = state.times = 0
                state.since = None
                return False
            return True

    def weight(self, address: str, node_id: str) -> float:
        """The share of keys the holder may take now, in ``[floor, 1]``."""
        ramp = self.config.ramp
        with self._lock:
            now = self._clock()
            state = self._state(address)
            if node_id not in state.node_ids:
                # Another node at this address (a restart): it starts slow.
                if state.node_ids:
                    state.since = None
                state.node_ids = {node_id}
            if state.since is None:
                state.since = now
            if ramp <= 0:
                return 1.0
            return max(self.config.floor, min(1.0, (now - state.since) / ramp))

    def reports(self) -> list[QuarantineReport]:
        """The holders in quarantine now, with the seconds each has left, by address:
        what :meth:`Cluster.stats` shows and what a registered node publishes."""
        with self._lock:
            now = self._clock()
            return [QuarantineReport(address, s.failed_node, s.reason, s.times,
                                     round(s.until - now, 3))
                    for address, s in sorted(self._holders.items()) if s.until > now]

    def snapshot(self) -> dict[str, Quarantine]:
        """The holders in quarantine now."""
        with self._lock:
            now = self._clock()
            return {address: Quarantine(s.until, s.times, s.reason, s.failed_node)
                    for address, s in self._holders.items() if s.until > now}

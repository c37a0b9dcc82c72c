"""A session's configured waits and limits (every wait has a deadline)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2pkv.errors import ConfigError
from p2pkv.protocol.codes import MAX_IN_FLIGHT, MAX_KEYS
from p2pkv.protocol.messages import AdvertisedLimits

__all__ = ["Deadlines", "Limits"]


def _check_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"deadlines.{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"deadlines.{name} must be > 0 seconds, got {value!r}")


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Every wait of the protocol, in seconds (all configurable, all > 0).

    ``fetch_idle`` is the longest a fetch may go without progress (a block arriving or
    credit granted); ``abort`` how long an ``abort`` may wait for its ``abort_ack``; a
    ``ping`` is sent after ``heartbeat_interval`` without traffic from the peer, and the
    peer is declared dead after ``heartbeat_timeout`` without traffic.
    """

    handshake: float = 5.0
    lookup: float = 5.0
    fetch_idle: float = 10.0
    abort: float = 2.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("handshake", "lookup", "fetch_idle", "abort", "heartbeat_interval",
                     "heartbeat_timeout"):
            _check_seconds(name, getattr(self, name))
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigError(
                f"deadlines.heartbeat_interval ({self.heartbeat_interval!r}) must be shorter "
                f"than deadlines.heartbeat_timeout ({self.heartbeat_timeout!r})"
            )


@dataclass(frozen=True, slots=True)
class Limits:
    """What this node accepts from one peer (and what it advertises in its greeting)."""

    max_keys: int = MAX_KEYS
    """Most keys per lookup/fetch this node serves; more get an ``error`` OUT_OF_BOUNDS."""
    max_in_flight: int = MAX_IN_FLIGHT
    """Most unfinished requests per peer; more get an ``error`` TOO_MANY_IN_FLIGHT."""

    def __post_init__(self) -> None:
        for name, hi in (("max_keys", MAX_KEYS), ("max_in_flight", 2**20)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= hi:
                raise ConfigError(f"limits.{name} must be an int in [1, {hi}], got {value!r}")

    def advertised(self, window: int | None = None) -> AdvertisedLimits:
        """The ``limits`` map for this node's greeting."""
        return AdvertisedLimits(max_keys=self.max_keys, window=window,
                                in_flight=self.max_in_flight)

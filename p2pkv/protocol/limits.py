"""A session's configured waits and limits (every wait has a deadline), checked against
the options they are (:mod:`p2pkv.protocol.options`)."""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.protocol.messages import AdvertisedLimits
from p2pkv.protocol.options import heartbeat_interval as ping_interval
from p2pkv.protocol.options import option

__all__ = ["Deadlines", "Limits"]


#: Each field of :class:`Deadlines`, the option it is (p2pkv.protocol.options).
_DEADLINE_OPTIONS = {"handshake": "handshake_timeout", "lookup": "lookup_timeout",
                     "fetch_idle": "fetch_idle_timeout", "abort": "abort_timeout",
                     "heartbeat_interval": "heartbeat_interval",
                     "heartbeat_timeout": "heartbeat_timeout"}
#: The same for :class:`Limits`.
_LIMIT_OPTIONS = {"max_keys": "max_keys_per_request", "max_in_flight": "max_inflight_requests"}


def _checked(owner: object, fields: dict[str, str], prefix: str) -> None:
    """Check (and set) each field of ``owner`` against its option, named
    ``prefix.field``."""
    by_option = {o: f for f, o in fields.items()}
    for name, opt in fields.items():
        value = option(opt).check(getattr(owner, name),
                                  spell=lambda o: f"{prefix}.{by_option[o]}")
        object.__setattr__(owner, name, value)


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Every wait of the protocol, in seconds (all configurable, all > 0).

    ``fetch_idle`` is the longest a fetch may go without progress (a block arriving or
    credit granted); ``abort`` how long an ``abort`` may wait for its ``abort_ack``; a
    ``ping`` is sent after ``heartbeat_interval`` without traffic from the peer, and the
    peer is declared dead after ``heartbeat_timeout`` without traffic.
    """

    handshake: float = option("handshake_timeout").default
    lookup: float = option("lookup_timeout").default
    fetch_idle: float = option("fetch_idle_timeout").default
    abort: float = option("abort_timeout").default
    heartbeat_interval: float = ping_interval(option("heartbeat_timeout").default)
    heartbeat_timeout: float = option("heartbeat_timeout").default

    def __post_init__(self) -> None:
        _checked(self, _DEADLINE_OPTIONS, "deadlines")
        ping_interval(self.heartbeat_timeout, self.heartbeat_interval,
                           spell=lambda o: f"deadlines.{o}")


@dataclass(frozen=True, slots=True)
class Limits:
    """What this node accepts from one peer (and what it advertises in its greeting)."""

    max_keys: int = option("max_keys_per_request").default
    """Most keys per lookup/fetch this node serves; more get an ``error`` OUT_OF_BOUNDS."""
    max_in_flight: int = option("max_inflight_requests").default
    """Most unfinished requests per peer; more get an ``error`` TOO_MANY_IN_FLIGHT."""

    def __post_init__(self) -> None:
        _checked(self, _LIMIT_OPTIONS, "limits")

    def advertised(self, window: int | None = None) -> AdvertisedLimits:
        """The ``limits`` map for this node's greeting."""
        return AdvertisedLimits(max_keys=self.max_keys, window=window,
                                in_flight=self.max_in_flight)

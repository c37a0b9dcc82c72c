"""The per-peer protocol state machine, with no IO (``protocol/SPEC.md``, "State machine").

One :class:`Session` per peer connection. It never touches a socket, a thread or a clock:
the transport feeds it decoded messages (:meth:`Session.receive`) and the current
monotonic time, and sends whatever it returns in :attr:`Output.replies`. What happened is
reported as events (frozen dataclasses named in the past tense) in :attr:`Output.events`.
Deadlines are data: :meth:`Session.poll` checks them against the ``now`` it is given and
:meth:`Session.next_deadline` says when to call it next.

Transitions are a table keyed by ``(state, message type)``, one per role. A pair missing
from the table is a protocol violation: the session answers ``refuse`` (during the
handshake) or ``bye`` with the code, and moves to ``ERROR``.

Roles are fixed per connection: the client (connecting side) sends ``hello`` and the
requests (``lookup``, ``fetch``, ``credit``, ``abort``); the server answers them.

Errors: input from the peer never raises; it becomes events and replies. Calling a method
in a state that does not allow it raises :class:`LocalProtocolError`; bad arguments raise
``ValueError``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final

from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.keys import check_keys
from p2pkv.protocol.codec import MajorVersionMismatch, decode
from p2pkv.protocol.codes import (
    CAP_CHECKSUM_XXH3_64,
    MAX_IN_FLIGHT,
    MAX_KEY_LEN,
    MAX_KEYS,
    MAX_WINDOW,
    OUTCOME_SENT,
    U64_MAX,
    Code,
)
from p2pkv.protocol.compat import decide
from p2pkv.protocol.flow import FetchCredit
from p2pkv.protocol.messages import (
    Abort,
    AbortAck,
    AdvertisedLimits,
    Block,
    Bye,
    Credit,
    Done,
    Error,
    Fetch,
    Frame,
    Greeting,
    Hello,
    Hits,
    Lookup,
    Message,
    Ping,
    Pong,
    Reason,
    Refuse,
    Welcome,
)

__all__ = [
    "TRANSITIONS",
    "AbortAcknowledged",
    "AbortRequested",
    "BlockArrived",
    "BlockDiscarded",
    "CreditGranted",
    "Deadlines",
    "ErrorReceived",
    "Event",
    "FetchFinished",
    "FetchRequested",
    "HandshakeAccepted",
    "HandshakeRefused",
    "Limits",
    "LocalProtocolError",
    "LookupAnswered",
    "LookupRequested",
    "MessageIgnored",
    "Output",
    "PeerClosed",
    "ProtocolViolated",
    "RequestFailed",
    "RequestTimedOut",
    "Role",
    "Session",
    "State",
]

_FINISHED_MEMORY: Final = 4096
"""How many finished request ids a session remembers, so late replies are not violations."""


class LocalProtocolError(ProtocolError):
    """This node asked its session for something the protocol does not allow now."""


class Role(str, Enum):
    CLIENT = "client"
    SERVER = "server"


class State(Enum):
    AWAITING_HELLO = "awaiting_hello"
    AWAITING_WELCOME = "awaiting_welcome"
    READY = "ready"
    REFUSED = "refused"
    CLOSED = "closed"
    ERROR = "error"


_HANDSHAKE_STATES: Final = frozenset({State.AWAITING_HELLO, State.AWAITING_WELCOME})
_TERMINAL_STATES: Final = frozenset({State.REFUSED, State.CLOSED, State.ERROR})


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


# ---------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Event:
    """Base class of everything a session reports."""


@dataclass(frozen=True, slots=True)
class HandshakeAccepted(Event):
    """Both sides agreed; ``capabilities`` is the negotiated set."""

    remote: Greeting
    capabilities: frozenset[str]


@dataclass(frozen=True, slots=True)
class HandshakeRefused(Event):
    """The handshake failed. ``reasons`` are seen from this node (ours = local).

    ``by_remote`` tells whether the peer refused us (``remote`` is its ``refuse``) or we
    refused it (``remote`` is its greeting, or ``None`` when it was unreadable).
    """

    reasons: tuple[Reason, ...]
    by_remote: bool
    code: int
    msg: str
    remote: Greeting | Refuse | None = None


@dataclass(frozen=True, slots=True)
class LookupRequested(Event):
    """Server: the peer asks which ``keys`` we hold; answer with :meth:`Session.answer_lookup`."""

    req: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class LookupAnswered(Event):
    """Client: one bool per key of lookup ``req``."""

    req: int
    hits: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class FetchRequested(Event):
    """Server: send the blocks of ``keys``, at most ``window`` blocks beyond credits."""

    req: int
    keys: tuple[bytes, ...]
    window: int


@dataclass(frozen=True, slots=True)
class CreditGranted(Event):
    """Server: the peer allows ``n`` more blocks of fetch ``req``."""

    req: int
    n: int


@dataclass(frozen=True, slots=True)
class BlockArrived(Event):
    """Client: blocks ``idx`` of fetch ``req`` arrived (payload frames follow the header).

    ``payload`` is empty when the transport fed the header alone (zero-copy receive).
    """

    req: int
    idx: tuple[int, ...]
    sums: tuple[int | None, ...]
    payload: tuple[Frame, ...] = field(default=(), repr=False)


@dataclass(frozen=True, slots=True)
class BlockDiscarded(Event):
    """Client: blocks of a fetch that was aborted or timed out; drain and drop their frames."""

    req: int
    idx: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FetchFinished(Event):
    """Client: fetch ``req`` is over; one outcome per key (0 sent, 1 missing, 2 failed)."""

    req: int
    outcomes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AbortRequested(Event):
    """Server: stop request ``req`` and confirm with :meth:`Session.abort_ack`."""

    req: int


@dataclass(frozen=True, slots=True)
class AbortAcknowledged(Event):
    """Client: the server stopped request ``req``; nothing more will arrive for it."""

    req: int


@dataclass(frozen=True, slots=True)
class PeerClosed(Event):
    """The connection is over: the peer said ``bye`` (``by_remote``) or we gave up on it."""

    code: int
    msg: str
    by_remote: bool


@dataclass(frozen=True, slots=True)
class ProtocolViolated(Event):
    """The peer broke the protocol; we told it (``refuse``/``bye``) and closed."""

    code: int
    msg: str


@dataclass(frozen=True, slots=True)
class RequestFailed(Event):
    """Request ``req`` ended without a result (peer ``error``, or the connection ended)."""

    req: int
    code: int
    msg: str


@dataclass(frozen=True, slots=True)
class RequestTimedOut(Event):
    """Request ``req`` passed its deadline; ``kind`` is ``"lookup"``, ``"fetch"`` or ``"abort"``.

    A timed-out fetch is aborted by the session (an ``abort`` is in the replies); blocks
    that still arrive for it are reported as :class:`BlockDiscarded`.
    """

    req: int
    kind: str


@dataclass(frozen=True, slots=True)
class ErrorReceived(Event):
    """The peer reported a non-fatal error not tied to a request (e.g. UNKNOWN_TYPE)."""

    code: int
    msg: str


@dataclass(frozen=True, slots=True)
class MessageIgnored(Event):
    """We received a message we do not know (newer minor); we answered ``error``."""

    code: int
    msg: str


@dataclass(frozen=True, slots=True)
class Output:
    """What one call produced: events to act on and messages to send, in order."""

    events: tuple[Event, ...] = ()
    replies: tuple[Message, ...] = ()


_NOTHING: Final = Output()


# ---------------------------------------------------------------------------- requests


class _Request:
    """Bookkeeping of one unfinished request (either role)."""

    __slots__ = ("aborting", "deadline", "delivered", "granted", "keys", "kind", "received")

    def __init__(self, kind: str, keys: tuple[bytes, ...], deadline: float,
                 granted: int = 0) -> None:
        self.kind = kind
        self.keys = keys
        self.deadline = deadline
        self.granted = granted  # total blocks of window granted (fetch)
        self.received = 0  # blocks sent (server) or arrived (client)
        self.delivered: set[int] = set()  # indices sent (server) or arrived (client)
        self.aborting = False


def _check_keys(keys: Sequence[bytes], limit: int) -> tuple[bytes, ...]:
    out = tuple(keys)
    if not 1 <= len(out) <= limit:
        raise ValueError(f"keys: need 1..{limit} keys, got {len(out)}")
    return check_keys(out, MAX_KEY_LEN)


# ---------------------------------------------------------------------------- session


Handler = Callable[["Session", Any, float], Output]


class Session:
    """The protocol state of one peer connection, driven by messages and time.

    Lifecycle: construct, call :meth:`start` (the client sends the ``hello`` it returns),
    feed every received message to :meth:`receive` (or raw frames to
    :meth:`receive_frames`), call :meth:`poll` when :meth:`next_deadline` passes, send
    every ``Output.replies`` message in order. Not thread-safe: one owner (the IO loop).
    """

    def __init__(
        self,
        role: Role | str,
        local_hello: Greeting,
        *,
        deadlines: Deadlines | None = None,
        limits: Limits | None = None,
        now: float,
        required_caps: Iterable[str] = (),
    ) -> None:
        self._role = Role(role)
        self._local = local_hello
        self._deadlines = deadlines if deadlines is not None else Deadlines()
        self._limits = limits if limits is not None else Limits()
        self._required = frozenset(required_caps)
        self._table = _CLIENT_TABLE if self._role is Role.CLIENT else _SERVER_TABLE
        self._state = (
            State.AWAITING_WELCOME if self._role is Role.CLIENT else State.AWAITING_HELLO
        )
        self._started = False
        self._handshake_deadline = now + self._deadlines.handshake
        self._last_rx = now
        self._last_ping = now
        self._ping_nonce = 0
        self._remote: Greeting | None = None
        self._caps: frozenset[str] = frozenset()
        self._checksums = False
        self._next_req = 1
        self._requests: dict[int, _Request] = {}
        self._finished: set[int] = set()
        self._finished_order: deque[int] = deque()
        self._close_code: int | None = None

    # ------------------------------------------------------------------ properties

    @property
    def role(self) -> Role:
        return self._role

    @property
    def state(self) -> State:
        return self._state

    @property
    def local(self) -> Greeting:
        return self._local

    @property
    def remote(self) -> Greeting | None:
        """The peer's greeting once the handshake was accepted."""
        return self._remote

    @property
    def capabilities(self) -> frozenset[str]:
        """The negotiated capabilities (empty before the handshake)."""
        return self._caps

    @property
    def checksums(self) -> bool:
        """Whether every block carries an xxh3-64 (``checksum-xxh3-64`` negotiated)."""
        return self._checksums

    @property
    def segments(self) -> tuple[int, ...] | None:
        """The negotiated segment sizes once READY (pass to ``codec.decode``)."""
        return self._local.geo.seg if self._remote is not None else None

    @property
    def is_open(self) -> bool:
        return self._state not in _TERMINAL_STATES

    @property
    def in_flight(self) -> int:
        """Unfinished requests on this connection."""
        return len(self._requests)

    def is_pending(self, req: int) -> bool:
        return req in self._requests

    def window_left(self, req: int) -> int:
        """Server: blocks of fetch ``req`` that may still be sent under the granted credit."""
        r = self._served(req, "fetch", "window_left")
        return r.granted - r.received

    def fetch_credit(self, req: int) -> FetchCredit | None:
        """Client: the credit state of running fetch ``req`` (``None`` when ``req`` is not
        a running fetch): what :class:`~p2pkv.protocol.flow.CreditBudget` decides on."""
        r = self._requests.get(req)
        if r is None or r.kind != "fetch" or self._role is not Role.CLIENT:
            return None
        return FetchCredit(req, r.granted, r.received, len(r.keys))

    # ------------------------------------------------------------------ lifecycle

    def start(self, now: float) -> list[Message]:
        """Open the connection: the client returns ``[hello]``, the server ``[]``."""
        if self._started:
            raise LocalProtocolError(Code.UNEXPECTED, "start() called twice")
        self._started = True
        self._handshake_deadline = now + self._deadlines.handshake
        self._last_rx = now
        if self._role is Role.CLIENT:
            local = self._local
            if type(local) is not Hello:
                local = Hello(local.node, local.minor, local.rc, local.fp, local.geo,
                              local.khash, local.caps, local.limits, local.v)
            return [local]
        return []

    def receive(self, msg: Message, now: float) -> Output:
        """Feed one decoded message from the peer; never raises for peer input."""
        self._last_rx = now
        handler = self._table.get((self._state, msg.TAG))
        if handler is None:
            return self._violate(
                Code.UNEXPECTED,
                f"{msg.TAG!r} is not allowed from a {self._peer_role} in state "
                f"{self._state.value}",
            )
        return handler(self, msg, now)

    def receive_frames(self, frames: Sequence[Frame], now: float) -> Output:
        """Decode and feed one multipart message (checks payload sizes once READY)."""
        try:
            msg = decode(frames, self.segments)
        except ProtocolError as exc:
            return self.receive_malformed(exc, now)
        return self.receive(msg, now)

    def receive_malformed(self, error: ProtocolError, now: float) -> Output:
        """Feed a decode failure: unknown types get an ``error``, the rest is a violation."""
        self._last_rx = now
        if self._state in (State.CLOSED, State.ERROR):
            return _NOTHING
        if error.code == Code.UNKNOWN_TYPE and self._state is State.READY:
            return Output(
                events=(MessageIgnored(error.code, error.message),),
                replies=(Error(None, Code.UNKNOWN_TYPE, error.message),),
            )
        if isinstance(error, MajorVersionMismatch) and self._state in _HANDSHAKE_STATES:
            reason = Reason(
                Code.PROTOCOL_MAJOR_MISMATCH, "protocol.major", self._local.v,
                error.remote_major,
                f"this node speaks protocol major {self._local.v}, the peer speaks "
                f"{error.remote_major}",
            )
            return self._refuse((reason,), f"refused: {error.message}", None)
        return self._violate(error.code, error.message)

    def close(self, code: int = Code.NORMAL_CLOSE, msg: str = "") -> Output:
        """End the connection: a ``bye`` to send, and a failure for each open request."""
        if self._state in _TERMINAL_STATES:
            return _NOTHING
        events = self._fail_all(code, msg or "connection closed by this node")
        self._state = State.CLOSED
        return Output(events=tuple(events), replies=(Bye(code, msg),))

    def poll(self, now: float) -> Output:
        """Check every deadline against ``now``; expired ones become events and replies."""
        state = self._state
        if state in _HANDSHAKE_STATES:
            if now >= self._handshake_deadline:
                want = "hello" if self._role is Role.SERVER else "welcome"
                text = f"no {want} within {self._deadlines.handshake:g} s"
                self._state = State.CLOSED
                return Output(events=(PeerClosed(Code.TIMEOUT, text, False),),
                              replies=(Bye(Code.TIMEOUT, text),))
            return _NOTHING
        if state is not State.READY:
            return _NOTHING
        d = self._deadlines
        if now - self._last_rx >= d.heartbeat_timeout:
            text = f"no traffic from the peer for {d.heartbeat_timeout:g} s"
            dead = self._fail_all(Code.PEER_TIMEOUT, text)
            dead.append(PeerClosed(Code.PEER_TIMEOUT, text, False))
            self._state = State.CLOSED
            return Output(events=tuple(dead), replies=(Bye(Code.PEER_TIMEOUT, text),))
        events: list[Event] = []
        replies: list[Message] = []
        if self._role is Role.CLIENT:
            for req, r in list(self._requests.items()):
                if now < r.deadline:
                    continue
                if r.aborting:
                    text = f"no abort_ack for request {req} within {d.abort:g} s"
                    events.append(RequestTimedOut(req, "abort"))
                    events.extend(self._fail_all(Code.TIMEOUT, text))
                    events.append(PeerClosed(Code.TIMEOUT, text, False))
                    self._state = State.CLOSED
                    replies.append(Bye(Code.TIMEOUT, text))
                    return Output(events=tuple(events), replies=tuple(replies))
                events.append(RequestTimedOut(req, r.kind))
                if r.kind == "fetch":
                    r.aborting = True
                    r.deadline = now + d.abort
                    replies.append(Abort(req))
                else:
                    self._finish(req)
        if now - max(self._last_rx, self._last_ping) >= d.heartbeat_interval:
            self._last_ping = now
            self._ping_nonce += 1
            replies.append(Ping(self._ping_nonce))
        if not events and not replies:
            return _NOTHING
        return Output(events=tuple(events), replies=tuple(replies))

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`poll` has something to do, or ``None`` when closed."""
        state = self._state
        if state in _HANDSHAKE_STATES:
            return self._handshake_deadline
        if state is not State.READY:
            return None
        d = self._deadlines
        soonest = min(self._last_rx + d.heartbeat_timeout,
                      max(self._last_rx, self._last_ping) + d.heartbeat_interval)
        if self._role is Role.CLIENT:
            for r in self._requests.values():
                if r.deadline < soonest:
                    soonest = r.deadline
        return soonest

    # ------------------------------------------------------------------ client calls

    def lookup(self, keys: Sequence[bytes], now: float) -> Lookup:
        """Client: open a lookup; send the returned message. Answer: LookupAnswered."""
        keys_t = _check_keys(keys, self._peer_max_keys())
        req = self._open_request("lookup", keys_t, now + self._deadlines.lookup, 0)
        return Lookup(req, keys_t)

    def fetch(self, keys: Sequence[bytes], window: int, now: float) -> Fetch:
        """Client: open a fetch allowing ``window`` blocks in flight; send the message.

        Blocks arrive as BlockArrived; grant more window with :meth:`credit` as they
        land; FetchFinished ends it.
        """
        keys_t = _check_keys(keys, self._peer_max_keys())
        if type(window) is not int or not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be an int in [1, {MAX_WINDOW}], got {window!r}")
        req = self._open_request("fetch", keys_t, now + self._deadlines.fetch_idle, window)
        return Fetch(req, keys_t, window)

    def credit(self, req: int, n: int, now: float) -> Credit:
        """Client: allow ``n`` more blocks of fetch ``req`` in flight (resets its idle deadline)."""
        if type(n) is not int or not 1 <= n <= MAX_WINDOW:
            raise ValueError(f"credit n must be an int in [1, {MAX_WINDOW}], got {n!r}")
        r = self._own(req, "credit")
        if r.kind != "fetch" or r.aborting:
            raise LocalProtocolError(
                Code.UNEXPECTED, f"credit: request {req} is not a running fetch"
            )
        r.granted += n
        r.deadline = now + self._deadlines.fetch_idle
        return Credit(req, n)

    def abort(self, req: int, now: float) -> Abort:
        """Client: stop request ``req``; AbortAcknowledged follows (or a timeout)."""
        r = self._own(req, "abort")
        if r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"abort: request {req} is already aborting")
        r.aborting = True
        r.deadline = now + self._deadlines.abort
        return Abort(req)

    # ------------------------------------------------------------------ server calls

    def answer_lookup(self, req: int, hits: Sequence[bool]) -> Hits:
        """Server: the answer to lookup ``req``, one bool per key."""
        r = self._served(req, "lookup", "answer_lookup")
        hits_t = tuple(hits)
        if len(hits_t) != len(r.keys) or not set(map(type, hits_t)) <= {bool}:
            raise ValueError(
                f"answer_lookup: need {len(r.keys)} bools for request {req}, got {hits_t!r}"[:300]
            )
        self._finish(req)
        return Hits(req, hits_t)

    def block(
        self,
        req: int,
        idx: Sequence[int],
        sums: Sequence[int | None] | None = None,
        payload: Sequence[Frame] = (),
    ) -> Block:
        """Server: blocks ``idx`` of fetch ``req``; must fit the granted window.

        ``sums`` is required when checksums were negotiated and must be omitted otherwise.
        """
        r = self._served(req, "fetch", "block")
        idx_t = tuple(idx)
        n = len(idx_t)
        if n < 1:
            raise ValueError("block: idx must name at least one block")
        for i in idx_t:
            if type(i) is not int or not 0 <= i < len(r.keys):
                raise ValueError(f"block: index {i!r} is not a key of request {req}")
            if i in r.delivered:
                raise ValueError(f"block: index {i} of request {req} was already sent")
        if len(set(idx_t)) != n:
            raise ValueError(f"block: idx {idx_t!r} repeats an index")
        if r.received + n > r.granted:
            raise LocalProtocolError(
                Code.WINDOW_EXCEEDED,
                f"block: request {req} has {r.granted - r.received} block(s) of window "
                f"left, {n} asked",
            )
        if sums is None:
            if self._checksums:
                raise ValueError("block: checksums were negotiated, sums are required")
            sums_t: tuple[int | None, ...] = (None,) * n
        else:
            sums_t = tuple(sums)
            if len(sums_t) != n:
                raise ValueError(f"block: {n} block(s) need {n} sums, got {len(sums_t)}")
            for s in sums_t:
                ok = (type(s) is int and 0 <= s <= U64_MAX) if self._checksums else s is None
                if not ok:
                    raise ValueError(
                        f"block: sums must be {'u64' if self._checksums else 'None'}"
                        f" (checksums negotiated: {self._checksums}), got {s!r}"
                    )
        r.received += n
        r.delivered.update(idx_t)
        return Block(req, idx_t, sums_t, tuple(payload))

    def fetch_done(self, req: int, outcomes: Sequence[int]) -> Done:
        """Server: fetch ``req`` is over; outcome 0 exactly for the indices sent."""
        r = self._served(req, "fetch", "fetch_done")
        out = tuple(outcomes)
        if len(out) != len(r.keys):
            raise ValueError(f"fetch_done: need {len(r.keys)} outcomes, got {len(out)}")
        for i, o in enumerate(out):
            if type(o) is not int or not 0 <= o <= 2:
                raise ValueError(f"fetch_done: outcome {i} must be 0, 1 or 2, got {o!r}")
            if (o == OUTCOME_SENT) != (i in r.delivered):
                raise ValueError(
                    f"fetch_done: outcome {i} is {o} but block {i} was "
                    f"{'sent' if i in r.delivered else 'not sent'}"
                )
        self._finish(req)
        return Done(req, out)

    def abort_ack(self, req: int) -> AbortAck:
        """Server: request ``req`` is stopped (after AbortRequested)."""
        r = self._served(req, None, "abort_ack")
        if not r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"abort_ack: request {req} was not aborted")
        self._finish(req)
        return AbortAck(req)

    def fail(self, req: int, code: int, msg: str) -> Error:
        """Server: request ``req`` failed as a whole (for example UNAVAILABLE)."""
        self._served(req, None, "fail")
        self._finish(req)
        return Error(req, code, msg)

    # ------------------------------------------------------------------ internals

    @property
    def _peer_role(self) -> str:
        return "server" if self._role is Role.CLIENT else "client"

    def _require_ready(self, what: str) -> None:
        if self._state is not State.READY:
            raise LocalProtocolError(
                Code.UNEXPECTED, f"{what}: the connection is {self._state.value}, not ready"
            )

    def _peer_max_keys(self) -> int:
        limit = MAX_KEYS
        remote = self._remote
        if remote is not None and remote.limits is not None and remote.limits.max_keys:
            limit = min(limit, remote.limits.max_keys)
        return limit

    def _open_request(self, kind: str, keys: tuple[bytes, ...], deadline: float,
                      granted: int) -> int:
        if self._role is not Role.CLIENT:
            raise LocalProtocolError(Code.UNEXPECTED, f"{kind}: only the client sends requests")
        self._require_ready(kind)
        limit = self._limits.max_in_flight
        remote = self._remote
        if remote is not None and remote.limits is not None and remote.limits.in_flight:
            limit = min(limit, remote.limits.in_flight)
        if len(self._requests) >= limit:
            raise LocalProtocolError(
                Code.TOO_MANY_IN_FLIGHT, f"{kind}: {len(self._requests)} requests in flight "
                f"(limit {limit})"
            )
        req = self._next_req
        self._next_req += 1
        self._requests[req] = _Request(kind, keys, deadline, granted)
        return req

    def _own(self, req: int, what: str) -> _Request:
        if self._role is not Role.CLIENT:
            raise LocalProtocolError(Code.UNEXPECTED, f"{what}: only the client sends it")
        self._require_ready(what)
        r = self._requests.get(req)
        if r is None:
            raise LocalProtocolError(Code.UNKNOWN_REQUEST, f"{what}: no open request {req}")
        return r

    def _served(self, req: int, kind: str | None, what: str) -> _Request:
        if self._role is not Role.SERVER:
            raise LocalProtocolError(Code.UNEXPECTED, f"{what}: only the server sends it")
        self._require_ready(what)
        r = self._requests.get(req)
        if r is None:
            raise LocalProtocolError(Code.UNKNOWN_REQUEST, f"{what}: no open request {req}")
        if kind is not None and r.kind != kind:
            raise LocalProtocolError(
                Code.UNEXPECTED, f"{what}: request {req} is a {r.kind}, not a {kind}"
            )
        return r

    def _finish(self, req: int) -> None:
        self._requests.pop(req, None)
        if req not in self._finished:
            self._finished.add(req)
            self._finished_order.append(req)
            if len(self._finished_order) > _FINISHED_MEMORY:
                self._finished.discard(self._finished_order.popleft())

    def _fail_all(self, code: int, msg: str) -> list[Event]:
        events: list[Event] = [RequestFailed(req, code, msg) for req in self._requests]
        for req in list(self._requests):
            self._finish(req)
        return events

    def _violate(self, code: int, msg: str) -> Output:
        """The peer broke the protocol: tell it why, fail everything, move to ERROR."""
        state = self._state
        if state in (State.CLOSED, State.ERROR):
            return _NOTHING
        events = self._fail_all(code, msg)
        events.append(ProtocolViolated(code, msg))
        reply: Message
        if state in _HANDSHAKE_STATES:
            local = self._local
            reply = Refuse(code, msg, (), local.node, local.rc, local.fp, local.geo, local.khash)
        else:
            reply = Bye(code, msg)
        self._state = State.ERROR
        return Output(events=tuple(events), replies=(reply,))

    def _refuse(self, reasons: tuple[Reason, ...], msg: str,
                remote: Greeting | None) -> Output:
        code = int(reasons[0].code) if reasons else int(Code.UNEXPECTED)
        local = self._local
        refuse = Refuse(code, msg, reasons, local.node, local.rc, local.fp, local.geo, local.khash)
        self._state = State.REFUSED
        return Output(events=(HandshakeRefused(reasons, False, code, msg, remote),),
                      replies=(refuse,))

    def _accept(self, remote: Greeting, caps: frozenset[str]) -> None:
        self._remote = remote
        self._caps = caps
        self._checksums = CAP_CHECKSUM_XXH3_64 in caps
        self._state = State.READY

    # ------------------------------------------------------------------ handlers

    def _on_hello(self, msg: Hello, now: float) -> Output:
        decision = decide(self._local, msg, required=self._required)
        if not decision.accepted:
            return self._refuse(decision.reasons, decision.summary(), msg)
        self._accept(msg, decision.capabilities)
        local = self._local
        welcome = Welcome(local.node, local.minor, local.rc, local.fp, local.geo, local.khash,
                          tuple(sorted(decision.capabilities)), local.limits, local.v)
        return Output(events=(HandshakeAccepted(msg, decision.capabilities),),
                      replies=(welcome,))

    def _on_welcome(self, msg: Welcome, now: float) -> Output:
        decision = decide(self._local, msg, required=self._required)
        if not decision.accepted:
            return self._refuse(decision.reasons, decision.summary(), msg)
        self._accept(msg, decision.capabilities)
        return Output(events=(HandshakeAccepted(msg, decision.capabilities),))

    def _on_refuse(self, msg: Refuse, now: float) -> Output:
        events = self._fail_all(msg.code, f"refused by the peer: {msg.msg}")
        events.append(HandshakeRefused(tuple(r.swapped() for r in msg.reasons), True,
                                       msg.code, msg.msg, msg))
        self._state = State.REFUSED
        return Output(events=tuple(events))

    def _on_bye(self, msg: Bye, now: float) -> Output:
        events = self._fail_all(msg.code, f"peer closed: {msg.msg}")
        events.append(PeerClosed(msg.code, msg.msg, True))
        self._state = State.CLOSED
        return Output(events=tuple(events))

    def _on_ignore(self, msg: Message, now: float) -> Output:
        return _NOTHING

    def _on_ping(self, msg: Ping, now: float) -> Output:
        return Output(replies=(Pong(msg.nonce),))

    def _on_pong(self, msg: Pong, now: float) -> Output:
        return _NOTHING

    def _on_error(self, msg: Error, now: float) -> Output:
        req = msg.req
        if req is None:
            return Output(events=(ErrorReceived(msg.code, msg.msg),))
        if req in self._requests:
            self._finish(req)
            return Output(events=(RequestFailed(req, msg.code, msg.msg),))
        if req in self._finished:
            return _NOTHING
        return self._violate(Code.UNKNOWN_REQUEST, f"error for unknown request {req}")

    def _late_or_unknown(self, req: int, tag: str) -> Output:
        if req in self._finished:
            return _NOTHING
        return self._violate(Code.UNKNOWN_REQUEST, f"{tag} for unknown request {req}")

    # client side

    def _on_hits(self, msg: Hits, now: float) -> Output:
        r = self._requests.get(msg.req)
        if r is None:
            return self._late_or_unknown(msg.req, "hits")
        if r.kind != "lookup":
            return self._violate(Code.UNEXPECTED, f"hits for request {msg.req}, a {r.kind}")
        if r.aborting:
            return _NOTHING
        if len(msg.hits) != len(r.keys):
            return self._violate(
                Code.OUT_OF_BOUNDS,
                f"hits: {len(msg.hits)} answers for {len(r.keys)} keys (request {msg.req})",
            )
        self._finish(msg.req)
        return Output(events=(LookupAnswered(msg.req, msg.hits),))

    def _on_block(self, msg: Block, now: float) -> Output:
        req = msg.req
        r = self._requests.get(req)
        if r is None:
            if req in self._finished:
                return Output(events=(BlockDiscarded(req, msg.idx),))
            return self._violate(Code.UNKNOWN_REQUEST, f"block for unknown request {req}")
        if r.kind != "fetch":
            return self._violate(Code.UNEXPECTED, f"block for request {req}, a {r.kind}")
        if r.aborting:
            return Output(events=(BlockDiscarded(req, msg.idx),))
        nkeys = len(r.keys)
        delivered = r.delivered
        for i in msg.idx:
            if i >= nkeys or i in delivered:
                what = "is not a key of" if i >= nkeys else "was already delivered for"
                return self._violate(Code.OUT_OF_BOUNDS, f"block index {i} {what} request {req}")
            delivered.add(i)
        r.received += len(msg.idx)
        if r.received > r.granted:
            return self._violate(
                Code.WINDOW_EXCEEDED,
                f"request {req}: {r.received} blocks arrived, {r.granted} granted",
            )
        if self._checksums:
            if None in msg.sums:
                return self._violate(Code.WRONG_TYPE, "block without checksum "
                                     "(checksum-xxh3-64 was negotiated)")
        elif any(s is not None for s in msg.sums):
            return self._violate(Code.WRONG_TYPE, "block with checksum "
                                 "(checksum-xxh3-64 was not negotiated)")
        r.deadline = now + self._deadlines.fetch_idle
        return Output(events=(BlockArrived(req, msg.idx, msg.sums, msg.payload),))

    def _on_done(self, msg: Done, now: float) -> Output:
        req = msg.req
        r = self._requests.get(req)
        if r is None:
            return self._late_or_unknown(req, "done")
        if r.kind != "fetch":
            return self._violate(Code.UNEXPECTED, f"done for request {req}, a {r.kind}")
        if r.aborting:
            return _NOTHING
        if len(msg.outcomes) != len(r.keys):
            return self._violate(
                Code.OUT_OF_BOUNDS,
                f"done: {len(msg.outcomes)} outcomes for {len(r.keys)} keys (request {req})",
            )
        for i, o in enumerate(msg.outcomes):
            if (o == OUTCOME_SENT) != (i in r.delivered):
                return self._violate(
                    Code.OUT_OF_BOUNDS,
                    f"done: outcome {i} is {o} but block {i} "
                    f"{'arrived' if i in r.delivered else 'never arrived'} (request {req})",
                )
        self._finish(req)
        return Output(events=(FetchFinished(req, msg.outcomes),))

    def _on_abort_ack(self, msg: AbortAck, now: float) -> Output:
        req = msg.req
        r = self._requests.get(req)
        if r is None:
            return self._late_or_unknown(req, "abort_ack")
        if not r.aborting:
            return self._violate(Code.UNEXPECTED, f"abort_ack for request {req}, never aborted")
        self._finish(req)
        return Output(events=(AbortAcknowledged(req),))

    # server side

    def _admit(self, req: int, keys: tuple[bytes, ...], tag: str) -> Output | None:
        """Checks shared by lookup and fetch: None when the request may open."""
        if req in self._requests:
            return self._violate(Code.DUPLICATE_REQUEST, f"{tag}: request {req} is already open")
        if len(keys) > self._limits.max_keys:
            self._finish(req)
            return Output(replies=(Error(
                req, Code.OUT_OF_BOUNDS,
                f"{tag}: {len(keys)} keys, this node accepts at most {self._limits.max_keys}",
            ),))
        if len(self._requests) >= self._limits.max_in_flight:
            self._finish(req)
            return Output(replies=(Error(
                req, Code.TOO_MANY_IN_FLIGHT,
                f"{tag}: {len(self._requests)} requests in flight, "
                f"limit {self._limits.max_in_flight}",
            ),))
        return None

    def _on_lookup(self, msg: Lookup, now: float) -> Output:
        refused = self._admit(msg.req, msg.keys, "lookup")
        if refused is not None:
            return refused
        self._requests[msg.req] = _Request("lookup", msg.keys, math.inf)
        return Output(events=(LookupRequested(msg.req, msg.keys),))

    def _on_fetch(self, msg: Fetch, now: float) -> Output:
        refused = self._admit(msg.req, msg.keys, "fetch")
        if refused is not None:
            return refused
        self._requests[msg.req] = _Request("fetch", msg.keys, math.inf, msg.window)
        return Output(events=(FetchRequested(msg.req, msg.keys, msg.window),))

    def _on_credit(self, msg: Credit, now: float) -> Output:
        r = self._requests.get(msg.req)
        if r is None:
            return self._late_or_unknown(msg.req, "credit")
        if r.kind != "fetch":
            return self._violate(Code.UNEXPECTED, f"credit for request {msg.req}, a {r.kind}")
        r.granted += msg.n
        return Output(events=(CreditGranted(msg.req, msg.n),))

    def _on_abort(self, msg: Abort, now: float) -> Output:
        r = self._requests.get(msg.req)
        if r is None:
            if msg.req in self._finished:
                # Already answered (or refused with error): the ack tells the client so.
                return Output(replies=(AbortAck(msg.req),))
            return self._violate(Code.UNKNOWN_REQUEST, f"abort for unknown request {msg.req}")
        if r.aborting:
            return self._violate(Code.UNEXPECTED, f"abort for request {msg.req} twice")
        r.aborting = True
        return Output(events=(AbortRequested(msg.req),))


_S = State
_CLIENT_TABLE: Final[dict[tuple[State, str], Handler]] = {
    (_S.AWAITING_WELCOME, "welcome"): Session._on_welcome,
    (_S.AWAITING_WELCOME, "refuse"): Session._on_refuse,
    (_S.AWAITING_WELCOME, "bye"): Session._on_bye,
    (_S.READY, "hits"): Session._on_hits,
    (_S.READY, "block"): Session._on_block,
    (_S.READY, "done"): Session._on_done,
    (_S.READY, "abort_ack"): Session._on_abort_ack,
    (_S.READY, "error"): Session._on_error,
    (_S.READY, "ping"): Session._on_ping,
    (_S.READY, "pong"): Session._on_pong,
    (_S.READY, "bye"): Session._on_bye,
    (_S.REFUSED, "bye"): Session._on_ignore,
    (_S.REFUSED, "refuse"): Session._on_ignore,
}
_SERVER_TABLE: Final[dict[tuple[State, str], Handler]] = {
    (_S.AWAITING_HELLO, "hello"): Session._on_hello,
    (_S.AWAITING_HELLO, "bye"): Session._on_bye,
    (_S.READY, "refuse"): Session._on_refuse,
    (_S.READY, "lookup"): Session._on_lookup,
    (_S.READY, "fetch"): Session._on_fetch,
    (_S.READY, "credit"): Session._on_credit,
    (_S.READY, "abort"): Session._on_abort,
    (_S.READY, "error"): Session._on_error,
    (_S.READY, "ping"): Session._on_ping,
    (_S.READY, "pong"): Session._on_pong,
    (_S.READY, "bye"): Session._on_bye,
    (_S.REFUSED, "bye"): Session._on_ignore,
    (_S.REFUSED, "refuse"): Session._on_ignore,
}
# Once closed (we sent or received bye) or failed, everything the peer still had in flight
# is dropped: it could not have seen our bye yet, so it is not a violation.
_ALL_TAGS: Final = ("hello", "welcome", "refuse", "lookup", "hits", "fetch", "credit", "block",
                    "done", "abort", "abort_ack", "ping", "pong", "bye", "error")
for _table in (_CLIENT_TABLE, _SERVER_TABLE):
    for _state in (_S.CLOSED, _S.ERROR):
        for _tag in _ALL_TAGS:
            _table[(_state, _tag)] = Session._on_ignore

TRANSITIONS: Final = {Role.CLIENT: _CLIENT_TABLE, Role.SERVER: _SERVER_TABLE}
"""The transition tables, by role: ``(state, message type) -> handler``."""

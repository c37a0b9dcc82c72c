"""The per-peer state machine's transitions, with no IO (``protocol/SPEC.md``, "State
machine").

Transitions are a table keyed by ``(state, message type)``, one per role. A pair missing
from the table is a protocol violation: the session answers ``refuse`` (during the
handshake) or ``bye`` with the code, and moves to ``ERROR``. Input from the peer never
raises here; it becomes events and replies.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any, Final

from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import CAP_CHECKSUM_XXH3_64, CAP_PACKED_V1, MAX_KEYS, OUTCOME_SENT, Code
from p2pkv.protocol.compat import decide
from p2pkv.protocol.events import (
    NOTHING,
    AbortAcknowledged,
    AbortRequested,
    BlockArrived,
    BlockDiscarded,
    CreditGranted,
    ErrorReceived,
    Event,
    FetchFinished,
    FetchRequested,
    HandshakeAccepted,
    HandshakeRefused,
    LookupAnswered,
    LookupRequested,
    Output,
    PeerClosed,
    ProtocolViolated,
    RequestFailed,
)
from p2pkv.protocol.limits import Deadlines, Limits
from p2pkv.protocol.messages import (
    Abort,
    AbortAck,
    Block,
    Bye,
    Credit,
    Done,
    Error,
    Fetch,
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
    "HANDSHAKE_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "Handler",
    "LocalProtocolError",
    "Machine",
    "Request",
    "Role",
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


HANDSHAKE_STATES: Final = frozenset({State.AWAITING_HELLO, State.AWAITING_WELCOME})
TERMINAL_STATES: Final = frozenset({State.REFUSED, State.CLOSED, State.ERROR})


class Request:
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


class Machine:
    """The session's state and its transitions: what each message from the peer does.

    :class:`~p2pkv.protocol.session.Session` adds the calls the node makes (requests,
    answers, deadlines); this base holds the per-connection state they share, the
    request bookkeeping, and one handler per ``(state, message type)`` pair of the
    transition tables below.
    """

    _role: Role
    _local: Greeting
    _deadlines: Deadlines
    _limits: Limits
    _required: frozenset[str]
    _identity_policy: str
    _state: State
    _remote: Greeting | None
    _caps: frozenset[str]
    _checksums: bool
    _next_req: int
    _requests: dict[int, Request]
    _finished: set[int]
    _finished_order: deque[int]

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

    def _request_limit(self) -> int:
        limit = self._limits.max_in_flight
        remote = self._remote
        if remote is not None and remote.limits is not None and remote.limits.in_flight:
            limit = min(limit, remote.limits.in_flight)
        return limit

    def _open_request(self, kind: str, keys: tuple[bytes, ...], deadline: float,
                      granted: int) -> int:
        if self._role is not Role.CLIENT:
            raise LocalProtocolError(Code.UNEXPECTED, f"{kind}: only the client sends requests")
        self._require_ready(kind)
        limit = self._request_limit()
        if len(self._requests) >= limit:
            raise LocalProtocolError(
                Code.TOO_MANY_IN_FLIGHT, f"{kind}: {len(self._requests)} requests in flight "
                f"(limit {limit})"
            )
        req = self._next_req
        self._next_req += 1
        self._requests[req] = Request(kind, keys, deadline, granted)
        return req

    def _own(self, req: int, what: str) -> Request:
        if self._role is not Role.CLIENT:
            raise LocalProtocolError(Code.UNEXPECTED, f"{what}: only the client sends it")
        self._require_ready(what)
        r = self._requests.get(req)
        if r is None:
            raise LocalProtocolError(Code.UNKNOWN_REQUEST, f"{what}: no open request {req}")
        return r

    def _served(self, req: int, kind: str | None, what: str) -> Request:
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
            return NOTHING
        events = self._fail_all(code, msg)
        events.append(ProtocolViolated(code, msg))
        reply: Message
        if state in HANDSHAKE_STATES:
            local = self._local
            reply = Refuse(code, msg, (), local.node, local.rc, local.fp, local.geo,
                           local.khash, local.ext)
        else:
            reply = Bye(code, msg)
        self._state = State.ERROR
        return Output(events=tuple(events), replies=(reply,))

    def _refuse(self, reasons: tuple[Reason, ...], msg: str,
                remote: Greeting | None) -> Output:
        code = int(reasons[0].code) if reasons else int(Code.UNEXPECTED)
        local = self._local
        refuse = Refuse(code, msg, reasons, local.node, local.rc, local.fp, local.geo,
                        local.khash, local.ext)
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
        decision = decide(self._local, msg, required=self._required,
                          identity_policy=self._identity_policy)
        if not decision.accepted:
            return self._refuse(decision.reasons, decision.summary(), msg)
        self._accept(msg, decision.capabilities)
        local = self._local
        welcome = Welcome(local.node, local.minor, local.rc, local.fp, local.geo, local.khash,
                          tuple(sorted(decision.capabilities)), local.limits, local.v,
                          local.ext)
        return Output(events=(HandshakeAccepted(msg, decision.capabilities,
                                                decision.warnings),),
                      replies=(welcome,))

    def _on_welcome(self, msg: Welcome, now: float) -> Output:
        decision = decide(self._local, msg, required=self._required,
                          identity_policy=self._identity_policy)
        if not decision.accepted:
            return self._refuse(decision.reasons, decision.summary(), msg)
        self._accept(msg, decision.capabilities)
        return Output(events=(HandshakeAccepted(msg, decision.capabilities,
                                                decision.warnings),))

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
        return NOTHING

    def _on_ping(self, msg: Ping, now: float) -> Output:
        return Output(replies=(Pong(msg.nonce),))

    def _on_pong(self, msg: Pong, now: float) -> Output:
        return NOTHING

    def _on_error(self, msg: Error, now: float) -> Output:
        req = msg.req
        if req is None:
            return Output(events=(ErrorReceived(msg.code, msg.msg),))
        if req in self._requests:
            self._finish(req)
            return Output(events=(RequestFailed(req, msg.code, msg.msg),))
        if req in self._finished:
            return NOTHING
        return self._violate(Code.UNKNOWN_REQUEST, f"error for unknown request {req}")

    def _late_or_unknown(self, req: int, tag: str) -> Output:
        if req in self._finished:
            return NOTHING
        return self._violate(Code.UNKNOWN_REQUEST, f"{tag} for unknown request {req}")

    # client side

    def _check_answer(self, req: int, tag: str, kind: str, count: int,
                      what: str) -> Output | None:
        """The checks every final answer (hits, done) passes: a known request of the
        right kind, not being aborted, one entry per key. None when they pass, else the
        Output that ends the answer's handling."""
        r = self._requests.get(req)
        if r is None:
            return self._late_or_unknown(req, tag)
        if r.kind != kind:
            return self._violate(Code.UNEXPECTED, f"{tag} for request {req}, a {r.kind}")
        if r.aborting:
            return NOTHING
        if count != len(r.keys):
            return self._violate(
                Code.OUT_OF_BOUNDS,
                f"{tag}: {count} {what} for {len(r.keys)} keys (request {req})",
            )
        return None

    def _on_hits(self, msg: Hits, now: float) -> Output:
        refused = self._check_answer(msg.req, "hits", "lookup", len(msg.hits), "answers")
        if refused is not None:
            return refused
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
        if msg.pk and CAP_PACKED_V1 not in self._caps:
            return self._violate(Code.UNEXPECTED, "packed block (packed-v1 was not negotiated)")
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
        return Output(events=(BlockArrived(req, msg.idx, msg.sums, msg.payload, msg.pk),))

    def _on_done(self, msg: Done, now: float) -> Output:
        req = msg.req
        refused = self._check_answer(req, "done", "fetch", len(msg.outcomes), "outcomes")
        if refused is not None:
            return refused
        r = self._requests[req]
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
        self._requests[msg.req] = Request("lookup", msg.keys, math.inf)
        return Output(events=(LookupRequested(msg.req, msg.keys),))

    def _on_fetch(self, msg: Fetch, now: float) -> Output:
        refused = self._admit(msg.req, msg.keys, "fetch")
        if refused is not None:
            return refused
        self._requests[msg.req] = Request("fetch", msg.keys, math.inf, msg.window)
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


Handler = Callable[[Machine, Any, float], Output]
_S = State
_CLIENT_TABLE: Final[dict[tuple[State, str], Handler]] = {
    (_S.AWAITING_WELCOME, "welcome"): Machine._on_welcome,
    (_S.AWAITING_WELCOME, "refuse"): Machine._on_refuse,
    (_S.AWAITING_WELCOME, "bye"): Machine._on_bye,
    (_S.READY, "hits"): Machine._on_hits,
    (_S.READY, "block"): Machine._on_block,
    (_S.READY, "done"): Machine._on_done,
    (_S.READY, "abort_ack"): Machine._on_abort_ack,
    (_S.READY, "error"): Machine._on_error,
    (_S.READY, "ping"): Machine._on_ping,
    (_S.READY, "pong"): Machine._on_pong,
    (_S.READY, "bye"): Machine._on_bye,
    (_S.REFUSED, "bye"): Machine._on_ignore,
    (_S.REFUSED, "refuse"): Machine._on_ignore,
}
_SERVER_TABLE: Final[dict[tuple[State, str], Handler]] = {
    (_S.AWAITING_HELLO, "hello"): Machine._on_hello,
    (_S.AWAITING_HELLO, "bye"): Machine._on_bye,
    (_S.READY, "refuse"): Machine._on_refuse,
    (_S.READY, "lookup"): Machine._on_lookup,
    (_S.READY, "fetch"): Machine._on_fetch,
    (_S.READY, "credit"): Machine._on_credit,
    (_S.READY, "abort"): Machine._on_abort,
    (_S.READY, "error"): Machine._on_error,
    (_S.READY, "ping"): Machine._on_ping,
    (_S.READY, "pong"): Machine._on_pong,
    (_S.READY, "bye"): Machine._on_bye,
    (_S.REFUSED, "bye"): Machine._on_ignore,
    (_S.REFUSED, "refuse"): Machine._on_ignore,
}
# Once closed (we sent or received bye) or failed, everything the peer still had in flight
# is dropped: it could not have seen our bye yet, so it is not a violation.
_ALL_TAGS: Final = ("hello", "welcome", "refuse", "lookup", "hits", "fetch", "credit", "block",
                    "done", "abort", "abort_ack", "ping", "pong", "bye", "error")
for _table in (_CLIENT_TABLE, _SERVER_TABLE):
    for _state in (_S.CLOSED, _S.ERROR):
        for _tag in _ALL_TAGS:
            _table[(_state, _tag)] = Machine._on_ignore

TRANSITIONS: Final = {Role.CLIENT: _CLIENT_TABLE, Role.SERVER: _SERVER_TABLE}
"""The transition tables, by role: ``(state, message type) -> handler``."""

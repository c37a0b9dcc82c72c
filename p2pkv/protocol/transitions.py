"""The per-peer state machine, every rule of it in one table, with no IO
(``protocol/SPEC.md``, "State machine", §16 for ``shm-v1``, §17 for ``packed-v1``, §18
for ``tcp-data-v1``).

:class:`~p2pkv.protocol.machine.Machine` is the state of one connection. The table has
two parts, both here:

* :data:`TRANSITIONS`, what a message from the peer does: ``(role, state, message
  type) -> Rule(handler, capability)``. A pair missing from it is a protocol violation:
  ``refuse`` during the handshake, ``bye`` after it, and the state moves to ``ERROR``.
* :data:`CALLS`, what this node may send: ``(role, call) -> Call(states,
  capability)``; :func:`allow` checks a call against it before the session builds the
  message, and a call it does not allow raises
  :class:`~p2pkv.errors.LocalProtocolError`.

Capabilities are data the table consults. What a capability allows is checked against
what the two sides *negotiated* (``Machine.caps``): the calls of a capability (the
``shm-v1`` calls), and the fields of a message that need one
(:data:`~p2pkv.protocol.rules.FIELD_CAPABILITIES`: a packed block, a block's checksums),
checked the same way on what the peer sends and on what this node sends. A message row
of a capability is recognized wherever the capability is *implemented*
(``Machine.implements``), negotiated or not: §16.5 gives each such message an answer
that tells the peer exactly what it got wrong (UNKNOWN_REQUEST for a ``release`` of a
request never opened, UNEXPECTED for an ``attach`` nobody offered), and a node that does
not implement the capability reads its messages as absent rows.

The checks a block, a located and a done pass are :mod:`p2pkv.protocol.rules`, shared
by both directions; what time does is :mod:`p2pkv.protocol.deadlines`. Input from the
peer never raises here; it becomes events and replies.

:class:`~p2pkv.protocol.session.Session` owns a machine and makes the calls.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from p2pkv.errors import ProtocolError
from p2pkv.protocol.codec import MajorVersionMismatch
from p2pkv.protocol.codes import (
    CAP_CHECKSUM_XXH3_64,
    CAP_NIXL_V1,
    CAP_PACKED_V1,
    CAP_PENDING_V1,
    CAP_SHM_V1,
    CAP_TCP_DATA_AEAD_V1,
    CAP_TCP_DATA_TLS_V1,
    CAP_TCP_DATA_V1,
    CAP_TCP_STREAMS_V1,
    VIA_SHM,
    Code,
)
from p2pkv.protocol.compat import decide
from p2pkv.protocol.datachannel import kept_offer
from p2pkv.protocol.events import (
    NOTHING,
    AbortAcknowledged,
    AbortRequested,
    AttachAnswered,
    AttachRequested,
    BlockArrived,
    BlockDiscarded,
    BlocksLocated,
    BlocksReleased,
    CreditGranted,
    ErrorReceived,
    FetchFinished,
    FetchRequested,
    HandshakeAccepted,
    HandshakeRefused,
    LocatedAbandoned,
    LookupAnswered,
    LookupRequested,
    MessageIgnored,
    Output,
    PeerClosed,
    RequestFailed,
)
from p2pkv.protocol.machine import HANDSHAKE_STATES, Machine, Proof, Role, State
from p2pkv.protocol.messages import (
    Abort,
    AbortAck,
    Attach,
    Attached,
    Block,
    Bye,
    Credit,
    Done,
    Error,
    Fetch,
    Hello,
    Hits,
    Located,
    Lookup,
    Message,
    Ping,
    Pong,
    Reason,
    Refuse,
    Release,
    Welcome,
)
from p2pkv.protocol.requests import LocalProtocolError, Request
from p2pkv.protocol.rules import (
    field_break,
    indices_break,
    outcomes_break,
    window_break,
)

__all__ = ["CALLS", "IMPLEMENTED", "TRANSITIONS", "Call", "Handler", "Rule", "allow",
           "receive", "remote_error"]


IMPLEMENTED: Final = frozenset({CAP_CHECKSUM_XXH3_64, CAP_SHM_V1, CAP_PACKED_V1,
                                CAP_TCP_DATA_V1, CAP_TCP_DATA_TLS_V1, CAP_TCP_DATA_AEAD_V1,
                                CAP_TCP_STREAMS_V1, CAP_PENDING_V1, CAP_NIXL_V1})
"""The capabilities whose rules this table holds (a session implements these by default)."""


Handler = Callable[[Machine, Any, float], Output]


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table: the handler of a message, and the capability (if any) the
    message belongs to."""

    handler: Handler
    capability: str | None = None


# ---------------------------------------------------------------------- the entries


def receive(m: Machine, msg: Message, now: float) -> Output:
    """One decoded message from the peer, through the table."""
    m.last_rx = now
    rule = TRANSITIONS[m.role].get((m.state, msg.TAG))
    # A capability's messages are recognized wherever it is implemented, negotiated or
    # not (§16.5 says what each then means); unimplemented, they are as absent.
    if rule is None or (rule.capability is not None and rule.capability not in m.implements):
        return m.violate(Code.UNEXPECTED, f"{msg.TAG!r} is not allowed from a "
                         f"{m.peer_role} in state {m.state.value}")
    if m.state is State.READY:
        broken = field_break(msg, m.caps)
        if broken is not None:
            return m.violate(broken.code, broken.text)
    return rule.handler(m, msg, now)


def allow(m: Machine, call: str) -> None:
    """Whether this node may make ``call`` now (its role, the state, the capability the
    call belongs to, as negotiated); LocalProtocolError when it may not."""
    rule = CALLS.get((m.role, call))
    if rule is None:
        other = "server" if m.role is Role.CLIENT else "client"
        raise LocalProtocolError(Code.UNEXPECTED, f"{call}: only the {other} sends it")
    if m.state not in rule.states:
        raise LocalProtocolError(
            Code.UNEXPECTED, f"{call}: the connection is {m.state.value}, not ready")
    if rule.capability is not None and rule.capability not in m.caps:
        raise LocalProtocolError(Code.UNEXPECTED, f"{call}: {rule.capability} was not "
                                 "negotiated")


def remote_error(m: Machine, error: ProtocolError, now: float) -> Output:
    """What the peer got wrong: unknown types get an ``error``, the rest is a violation."""
    m.last_rx = now
    if m.state in (State.CLOSED, State.ERROR):
        return NOTHING
    if error.code == Code.UNKNOWN_TYPE and m.state is State.READY:
        return Output(events=(MessageIgnored(error.code, error.message),),
                      replies=(Error(None, Code.UNKNOWN_TYPE, error.message),))
    if isinstance(error, MajorVersionMismatch) and m.state in HANDSHAKE_STATES:
        reason = Reason(
            Code.PROTOCOL_MAJOR_MISMATCH, "protocol.major", m.local.v, error.remote_major,
            f"this node speaks protocol major {m.local.v}, the peer speaks "
            f"{error.remote_major}",
        )
        return m.refuse((reason,), f"refused: {error.message}", None)
    return m.violate(error.code, error.message)


# ---------------------------------------------------------------------- both roles


def _on_refuse(m: Machine, msg: Refuse, now: float) -> Output:
    events = m.fail_all(msg.code, f"refused by the peer: {msg.msg}")
    events.append(HandshakeRefused(tuple(r.swapped() for r in msg.reasons), True,
                                   msg.code, msg.msg, msg))
    m.state = State.REFUSED
    return Output(events=tuple(events))


def _on_bye(m: Machine, msg: Bye, now: float) -> Output:
    events = m.fail_all(msg.code, f"peer closed: {msg.msg}")
    events.append(PeerClosed(msg.code, msg.msg, True))
    m.state = State.CLOSED
    return Output(events=tuple(events))


def _on_ignore(m: Machine, msg: Message, now: float) -> Output:
    return NOTHING


def _on_ping(m: Machine, msg: Ping, now: float) -> Output:
    return Output(replies=(Pong(msg.nonce),))


def _on_error(m: Machine, msg: Error, now: float) -> Output:
    req = msg.req
    if req is None:
        return Output(events=(ErrorReceived(msg.code, msg.msg),))
    if req in m.requests:
        m.requests.finish(req)
        return Output(events=(RequestFailed(req, msg.code, msg.msg),))
    if m.requests.finished(req):
        return NOTHING
    return m.violate(Code.UNKNOWN_REQUEST, f"error for unknown request {req}")


# ---------------------------------------------------------------------- client side


def _on_welcome(m: Machine, msg: Welcome, now: float) -> Output:
    decision = decide(m.local, msg, required=m.required, identity_policy=m.identity_policy)
    if not decision.accepted:
        return m.refuse(decision.reasons, decision.summary(), msg)
    m.accept(msg, decision.capabilities)
    if CAP_SHM_V1 in m.caps:
        m.offer = msg.shm  # ignored unless shm-v1 was negotiated (§4.1)
        if CAP_NIXL_V1 in m.caps:
            m.nixl_offer = msg.nixl  # likewise nixl-v1 (§20.1)
    m.data_offer = kept_offer(m.caps, msg.data)  # ignored where not negotiated (§18)
    return Output(events=(HandshakeAccepted(msg, decision.capabilities, decision.warnings),))


def _check_answer(m: Machine, req: int, tag: str, kind: str, count: int,
                  what: str) -> Request | Output:
    """The checks every final answer (hits, done) passes: a known request of the right
    kind, not being aborted, one entry per key. The request when they pass, else the
    Output that ends the answer's handling."""
    r = m.requests.get(req)
    if r is None:
        return m.late_or_unknown(req, tag)
    if r.kind != kind:
        return m.violate(Code.UNEXPECTED, f"{tag} for request {req}, a {r.kind}")
    if r.aborting:
        return NOTHING
    if count != len(r.keys):
        return m.violate(Code.OUT_OF_BOUNDS,
                         f"{tag}: {count} {what} for {len(r.keys)} keys (request {req})")
    return r


def _on_hits(m: Machine, msg: Hits, now: float) -> Output:
    checked = _check_answer(m, msg.req, "hits", "lookup", len(msg.hits), "answers")
    if isinstance(checked, Output):
        return checked
    m.requests.finish(msg.req)
    return Output(events=(LookupAnswered(msg.req, msg.hits, msg.due),))


def _on_block(m: Machine, msg: Block, now: float) -> Output:
    req = msg.req
    r = m.requests.get(req)
    if r is None:
        if m.requests.finished(req):
            return Output(events=(BlockDiscarded(req, msg.idx),))
        return m.violate(Code.UNKNOWN_REQUEST, f"block for unknown request {req}")
    if r.kind != "fetch":
        return m.violate(Code.UNEXPECTED, f"block for request {req}, a {r.kind}")
    if r.aborting:
        return Output(events=(BlockDiscarded(req, msg.idx),))
    # The codec checked each index and checksum's type and range already.
    broken = indices_break(r, req, msg.idx) or window_break(r, req, len(msg.idx))
    if broken is not None:
        return m.violate(broken.code, broken.text)
    r.delivered.update(msg.idx)
    r.received += len(msg.idx)
    r.deadline = now + m.deadlines.fetch_idle
    return Output(events=(BlockArrived(req, msg.idx, msg.sums, msg.payload, msg.pk),))


def _on_done(m: Machine, msg: Done, now: float) -> Output:
    req = msg.req
    checked = _check_answer(m, req, "done", "fetch", len(msg.outcomes), "outcomes")
    if isinstance(checked, Output):
        return checked
    broken = outcomes_break(checked, req, msg.outcomes)
    if broken is not None:
        return m.violate(broken.code, broken.text)
    m.requests.finish(req)
    return Output(events=(FetchFinished(req, msg.outcomes),))


def _on_abort_ack(m: Machine, msg: AbortAck, now: float) -> Output:
    req = msg.req
    r = m.requests.get(req)
    if r is None:
        return m.late_or_unknown(req, "abort_ack")
    if not r.aborting:
        return m.violate(Code.UNEXPECTED, f"abort_ack for request {req}, never aborted")
    m.requests.finish(req)
    return Output(events=(AbortAcknowledged(req),))


def _on_attached(m: Machine, msg: Attached, now: float) -> Output:
    if m.proof is not Proof.PENDING:
        return m.violate(Code.UNEXPECTED, "attached without an attach")
    m.proof = Proof.ACCEPTED if msg.ok else Proof.REFUSED
    return Output(events=(AttachAnswered(msg.ok, msg.msg),))


def _on_located(m: Machine, msg: Located, now: float) -> Output:
    # Checked as a block header: window, indices, checksums. A located block whose fetch
    # already ended is discarded like a late block (the server unpins it when it
    # acknowledges the abort, or when the connection ends).
    r = m.requests.get(msg.req)
    if r is not None and not r.shared:
        return m.violate(Code.UNEXPECTED, f"located for request {msg.req}, which is not a "
                         "shared fetch")
    out = _on_block(m, Block(msg.req, msg.idx, msg.sums), now)
    events = tuple(BlocksLocated(msg.req, msg.idx, msg.slots, msg.sums)
                   if type(e) is BlockArrived else e for e in out.events)
    return Output(events=events, replies=out.replies)


# ---------------------------------------------------------------------- server side


def _on_hello(m: Machine, msg: Hello, now: float) -> Output:
    decision = decide(m.local, msg, required=m.required, identity_policy=m.identity_policy)
    if not decision.accepted:
        return m.refuse(decision.reasons, decision.summary(), msg)
    m.accept(msg, decision.capabilities)
    local = m.local
    welcome = Welcome(local.node, local.minor, local.rc, local.fp, local.geo, local.khash,
                      tuple(sorted(decision.capabilities)), local.limits, local.v, local.ext)
    if m.offer is not None:
        welcome = dataclasses.replace(welcome, shm=m.offer)
    if m.nixl_offer is not None:  # kept by accept() only when nixl-v1 was negotiated
        welcome = dataclasses.replace(welcome, nixl=m.nixl_offer)
    if m.data_offer is not None:  # kept by accept() only when tcp-data-v1 was negotiated
        welcome = dataclasses.replace(welcome, data=m.data_offer)
    return Output(events=(HandshakeAccepted(msg, decision.capabilities, decision.warnings),),
                  replies=(welcome,))


def _admit(m: Machine, req: int, keys: tuple[bytes, ...], tag: str) -> Output | None:
    """Checks shared by lookup and fetch: None when the request may open."""
    if req in m.requests:
        return m.violate(Code.DUPLICATE_REQUEST, f"{tag}: request {req} is already open")
    limits = m.limits
    if len(keys) > limits.max_keys:
        m.requests.finish(req)
        return Output(replies=(Error(req, Code.OUT_OF_BOUNDS, f"{tag}: {len(keys)} keys, "
                                     f"this node accepts at most {limits.max_keys}"),))
    if len(m.requests) >= limits.max_in_flight:
        m.requests.finish(req)
        return Output(replies=(Error(req, Code.TOO_MANY_IN_FLIGHT,
                                     f"{tag}: {len(m.requests)} requests in flight, "
                                     f"limit {limits.max_in_flight}"),))
    return None


def _on_lookup(m: Machine, msg: Lookup, now: float) -> Output:
    refused = _admit(m, msg.req, msg.keys, "lookup")
    if refused is not None:
        return refused
    m.requests.record(msg.req, Request("lookup", msg.keys, math.inf))
    return Output(events=(LookupRequested(msg.req, msg.keys),))


def _on_fetch(m: Machine, msg: Fetch, now: float) -> Output:
    refused = _admit(m, msg.req, msg.keys, "fetch")
    if refused is not None:
        return refused
    r = Request("fetch", msg.keys, math.inf, msg.window)
    # A fetch that asks for the segment before an accepted proof is served over TCP.
    r.shared = bool(msg.shm) and m.shared_memory
    m.requests.record(msg.req, r)
    return Output(events=(FetchRequested(msg.req, msg.keys, msg.window, msg.stream),))


def _on_credit(m: Machine, msg: Credit, now: float) -> Output:
    r = m.requests.get(msg.req)
    if r is None:
        return m.late_or_unknown(msg.req, "credit")
    if r.kind != "fetch":
        return m.violate(Code.UNEXPECTED, f"credit for request {msg.req}, a {r.kind}")
    r.granted += msg.n
    return Output(events=(CreditGranted(msg.req, msg.n),))


def _on_abort(m: Machine, msg: Abort, now: float) -> Output:
    r = m.requests.get(msg.req)
    if r is None:
        if not m.requests.finished(msg.req):
            return m.violate(Code.UNKNOWN_REQUEST, f"abort for unknown request {msg.req}")
        # Already answered (or refused with error): the ack tells the client so, and
        # whatever the client held of it through the segment is unpinned.
        return Output(events=(LocatedAbandoned(msg.req),) if m.offer is not None else (),
                      replies=(AbortAck(msg.req),))
    if r.aborting:
        return m.violate(Code.UNEXPECTED, f"abort for request {msg.req} twice")
    r.aborting = True
    return Output(events=(AbortRequested(msg.req),))


def _on_attach(m: Machine, msg: Attach, now: float) -> Output:
    offered = m.offer if msg.via == VIA_SHM else m.nixl_offer
    if offered is None or m.proof is not Proof.NONE:
        what = "a segment" if msg.via == VIA_SHM else "a NIXL pool"
        return m.violate(Code.UNEXPECTED, f"attach without {what} offered, or a second "
                         "attach")
    m.proof = Proof.PENDING
    m.via = msg.via
    return Output(events=(AttachRequested(msg.nonce, msg.via),))


def _on_release(m: Machine, msg: Release, now: float) -> Output:
    r = m.requests.get(msg.req)
    if r is None and not m.requests.finished(msg.req):
        return m.violate(Code.UNKNOWN_REQUEST, f"release for unknown request {msg.req}")
    if r is not None and r.kind != "fetch":
        return m.violate(Code.UNEXPECTED, f"release for request {msg.req}, a {r.kind}")
    return Output(events=(BlocksReleased(msg.req, msg.idx),))


# ---------------------------------------------------------------------- the table

_C, _S = Role.CLIENT, Role.SERVER
_WAIT_WELCOME, _WAIT_HELLO = State.AWAITING_WELCOME, State.AWAITING_HELLO
_READY, _REFUSED = State.READY, State.REFUSED
_SHM = CAP_SHM_V1

_ROWS: Final[tuple[tuple[Role, State, str, Handler, str | None], ...]] = (
    # role, state, message from the peer, handler, capability
    (_C, _WAIT_WELCOME, "welcome", _on_welcome, None),
    (_C, _WAIT_WELCOME, "refuse", _on_refuse, None),
    (_C, _WAIT_WELCOME, "bye", _on_bye, None),
    (_C, _READY, "hits", _on_hits, None),
    (_C, _READY, "block", _on_block, None),  # `pk` needs packed-v1 (§17)
    (_C, _READY, "done", _on_done, None),
    (_C, _READY, "abort_ack", _on_abort_ack, None),
    (_C, _READY, "attached", _on_attached, _SHM),
    (_C, _READY, "located", _on_located, _SHM),
    (_S, _WAIT_HELLO, "hello", _on_hello, None),
    (_S, _WAIT_HELLO, "bye", _on_bye, None),
    (_S, _READY, "refuse", _on_refuse, None),
    (_S, _READY, "lookup", _on_lookup, None),
    (_S, _READY, "fetch", _on_fetch, None),  # `shm` true needs an accepted attach (§16.4)
    (_S, _READY, "credit", _on_credit, None),
    (_S, _READY, "abort", _on_abort, None),
    (_S, _READY, "attach", _on_attach, _SHM),
    (_S, _READY, "release", _on_release, _SHM),
    *((role, _READY, tag, handler, None) for role in (_C, _S) for tag, handler in (
        ("error", _on_error), ("ping", _on_ping), ("pong", _on_ignore), ("bye", _on_bye))),
    # A refused connection only waits for the peer to go.
    *((role, _REFUSED, tag, _on_ignore, None) for role in (_C, _S)
      for tag in ("bye", "refuse")),
)

# Once closed (we sent or received bye) or failed, everything the peer still had in flight
# is dropped: it could not have seen our bye yet, so it is not a violation.
_ALL_TAGS: Final = ("hello", "welcome", "refuse", "lookup", "hits", "fetch", "credit", "block",
                    "done", "abort", "abort_ack", "ping", "pong", "bye", "error", "attach",
                    "attached", "located", "release")


def _build() -> dict[Role, dict[tuple[State, str], Rule]]:
    tables: dict[Role, dict[tuple[State, str], Rule]] = {_C: {}, _S: {}}
    for role, state, tag, handler, cap in _ROWS:
        tables[role][(state, tag)] = Rule(handler, cap)
    for table in tables.values():
        for state in (State.CLOSED, State.ERROR):
            for tag in _ALL_TAGS:
                table[(state, tag)] = Rule(_on_ignore)
    return tables


TRANSITIONS: Final = _build()
"""Every transition on a message from the peer, by role: ``(state, type) -> Rule``."""



@dataclass(frozen=True, slots=True)
class Call:
    """One row of the calls' table: the states a call of this node is allowed in, and
    the capability (if any) it belongs to."""

    states: frozenset[State]
    capability: str | None = None


_CALL_ROWS: Final[tuple[tuple[Role, str, str | None], ...]] = (
    # role, call (a Session method), capability; every call needs the READY state
    (_C, "lookup", None),
    (_C, "fetch", None),
    (_C, "fetch_shared", _SHM),  # and an accepted attach (§16.4)
    (_C, "withdraw", None),
    (_C, "credit", None),
    (_C, "abort", None),
    (_C, "attach", _SHM),  # once, when the welcome offered a segment (§16.3)
    (_C, "release", _SHM),
    (_S, "answer_lookup", None),
    (_S, "block", None),  # packed needs packed-v1, sums need checksums (FIELD_CAPABILITIES)
    (_S, "located", _SHM),  # for a shared fetch only
    (_S, "fetch_done", None),
    (_S, "abort_ack", None),
    (_S, "fail", None),
    (_S, "attach_verdict", _SHM),  # once an attach is pending
    (_S, "window_left", None),
)

CALLS: Final[dict[tuple[Role, str], Call]] = {
    (role, call): Call(frozenset({_READY}), cap) for role, call, cap in _CALL_ROWS}
"""Every call this node's session may make, by role: ``(role, call) -> Call``."""

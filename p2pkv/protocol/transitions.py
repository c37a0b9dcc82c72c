"""The per-peer state machine, every rule of it in one place, with no IO
(``protocol/SPEC.md``, "State machine", §16 for ``shm-v1``, §17 for ``packed-v1``, §18
for ``tcp-data-v1``).

:class:`Machine` is the state of one connection. What a message from the peer does is a
row of :data:`TRANSITIONS`: ``(role, state, message type) -> handler``, each row naming
the capability its message belongs to. Capabilities are data here: what a capability
changes is written in the handlers that consult the negotiated set (``Machine.caps``) and
the capability's state (the ``shm-v1`` offer and proof, the ``tcp-data-v1`` offer: what
the greetings carry; the stream itself is the transport's, and whatever it carries
comes through this same table), and the rows of a capability a
session does not implement (``Machine.implements``) are as absent. A pair missing from
the table is a protocol violation: ``refuse`` during the handshake, ``bye`` after it,
and the state moves to ``ERROR``. Input from the peer never raises
here; it becomes events and replies.

:class:`~p2pkv.protocol.session.Session` owns a machine and adds the calls the node makes;
the state the rows read and change is :class:`~p2pkv.protocol.machine.Machine`.
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
    CAP_PACKED_V1,
    CAP_SHM_V1,
    CAP_TCP_DATA_V1,
    OUTCOME_SENT,
    Code,
)
from p2pkv.protocol.compat import decide
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
    Event,
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
    RequestTimedOut,
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
from p2pkv.protocol.requests import Request

__all__ = ["IMPLEMENTED", "TRANSITIONS", "Handler", "Rule", "abort_request", "expire",
           "next_deadline", "receive", "remote_error"]


IMPLEMENTED: Final = frozenset({CAP_CHECKSUM_XXH3_64, CAP_SHM_V1, CAP_PACKED_V1,
                                CAP_TCP_DATA_V1})
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
    if rule is None or (rule.capability is not None and rule.capability not in m.implements):
        return m.violate(Code.UNEXPECTED, f"{msg.TAG!r} is not allowed from a "
                         f"{m.peer_role} in state {m.state.value}")
    return rule.handler(m, msg, now)


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


def expire(m: Machine, now: float) -> Output:
    """Time: every deadline checked against ``now``; expired ones become events and
    replies (the handshake, the heartbeat, each request's deadline, §8)."""
    state = m.state
    d = m.deadlines
    if state in HANDSHAKE_STATES:
        if now >= m.handshake_deadline:
            want = "hello" if m.role is Role.SERVER else "welcome"
            text = f"no {want} within {d.handshake:g} s"
            m.state = State.CLOSED
            return Output(events=(PeerClosed(Code.TIMEOUT, text, False),),
                          replies=(Bye(Code.TIMEOUT, text),))
        return NOTHING
    if state is not State.READY:
        return NOTHING
    if now - m.last_rx >= d.heartbeat_timeout:
        return _closing(m, Code.PEER_TIMEOUT,
                        f"no traffic from the peer for {d.heartbeat_timeout:g} s", [], [])
    events: list[Event] = []
    replies: list[Message] = []
    if m.role is Role.CLIENT:
        for req, r in m.requests.items():
            if now < r.deadline and now < r.until:
                continue
            events.append(RequestTimedOut(req, "abort" if r.aborting else r.kind,
                                          overall=not r.aborting and now >= r.until))
            if r.aborting:
                return _closing(m, Code.TIMEOUT, f"no abort_ack for request {req} within "
                                f"{d.abort:g} s", events, replies)
            if r.kind == "fetch":
                abort_request(m, r, now)
                replies.append(Abort(req))
            else:
                m.requests.finish(req)
    if now - max(m.last_rx, m.last_ping) >= d.heartbeat_interval:
        m.last_ping = now
        m.ping_nonce += 1
        replies.append(Ping(m.ping_nonce))
    if not events and not replies:
        return NOTHING
    return Output(events=tuple(events), replies=tuple(replies))


def _closing(m: Machine, code: int, text: str, events: list[Event],
             replies: list[Message]) -> Output:
    """A deadline ends the connection: fail what is open, say bye with ``code``."""
    events.extend(m.fail_all(code, text))
    events.append(PeerClosed(code, text, False))
    m.state = State.CLOSED
    replies.append(Bye(code, text))
    return Output(events=tuple(events), replies=tuple(replies))


def next_deadline(m: Machine) -> float | None:
    """The earliest time :func:`expire` has something to do, or ``None`` when closed."""
    if m.state in HANDSHAKE_STATES:
        return m.handshake_deadline
    if m.state is not State.READY:
        return None
    d = m.deadlines
    soonest = min(m.last_rx + d.heartbeat_timeout,
                  max(m.last_rx, m.last_ping) + d.heartbeat_interval)
    if m.role is Role.CLIENT:
        for r in m.requests.values():
            soonest = min(soonest, r.deadline, r.until)
    return soonest


def abort_request(m: Machine, r: Request, now: float) -> None:
    """Client: fetch ``r`` is being aborted; only its abort_ack is awaited now, within
    the abort deadline (the caller's deadline no longer applies: it passed, or the
    caller stopped the fetch)."""
    r.aborting = True
    r.deadline = now + m.deadlines.abort
    r.until = math.inf


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
    if CAP_TCP_DATA_V1 in m.caps:
        m.data_offer = msg.data  # ignored unless tcp-data-v1 was negotiated (§18.1)
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
    return Output(events=(LookupAnswered(msg.req, msg.hits),))


def _on_block(m: Machine, msg: Block, now: float) -> Output:
    req = msg.req
    r = m.requests.get(req)
    if r is None:
        if m.requests.finished(req):
            return Output(events=(BlockDiscarded(req, msg.idx),))
        return m.violate(Code.UNKNOWN_REQUEST, f"block for unknown request {req}")
    if r.kind != "fetch":
        return m.violate(Code.UNEXPECTED, f"block for request {req}, a {r.kind}")
    if msg.pk and CAP_PACKED_V1 not in m.caps:
        return m.violate(Code.UNEXPECTED, "packed block (packed-v1 was not negotiated)")
    if r.aborting:
        return Output(events=(BlockDiscarded(req, msg.idx),))
    bad = _window_and_indices(m, r, req, msg.idx, msg.sums)
    if bad is not None:
        return bad
    r.deadline = now + m.deadlines.fetch_idle
    return Output(events=(BlockArrived(req, msg.idx, msg.sums, msg.payload, msg.pk),))


def _window_and_indices(m: Machine, r: Request, req: int, idx: tuple[int, ...],
                        sums: tuple[int | None, ...]) -> Output | None:
    """The rules a block (or located) header passes: each index a key of the request and
    delivered once, within the granted window, checksums as negotiated."""
    nkeys = len(r.keys)
    delivered = r.delivered
    for i in idx:
        if i >= nkeys or i in delivered:
            what = "is not a key of" if i >= nkeys else "was already delivered for"
            return m.violate(Code.OUT_OF_BOUNDS, f"block index {i} {what} request {req}")
        delivered.add(i)
    r.received += len(idx)
    if r.received > r.granted:
        return m.violate(Code.WINDOW_EXCEEDED,
                         f"request {req}: {r.received} blocks arrived, {r.granted} granted")
    if m.checksums:
        if None in sums:
            return m.violate(Code.WRONG_TYPE,
                             "block without checksum (checksum-xxh3-64 was negotiated)")
    elif any(s is not None for s in sums):
        return m.violate(Code.WRONG_TYPE,
                         "block with checksum (checksum-xxh3-64 was not negotiated)")
    return None


def _on_done(m: Machine, msg: Done, now: float) -> Output:
    req = msg.req
    checked = _check_answer(m, req, "done", "fetch", len(msg.outcomes), "outcomes")
    if isinstance(checked, Output):
        return checked
    delivered = checked.delivered
    for i, o in enumerate(msg.outcomes):
        if (o == OUTCOME_SENT) != (i in delivered):
            return m.violate(
                Code.OUT_OF_BOUNDS,
                f"done: outcome {i} is {o} but block {i} "
                f"{'arrived' if i in delivered else 'never arrived'} (request {req})",
            )
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
    return Output(events=(FetchRequested(msg.req, msg.keys, msg.window),))


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
    if m.offer is None or m.proof is not Proof.NONE:
        return m.violate(Code.UNEXPECTED, "attach without a segment offered, or a second "
                         "attach")
    m.proof = Proof.PENDING
    return Output(events=(AttachRequested(msg.nonce),))


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

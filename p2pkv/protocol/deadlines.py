"""What time does to a connection, with no IO (``protocol/SPEC.md`` §8, "Deadlines").

Every wait of a connection has a deadline, and they are all checked here against the
``now`` the session is given: the handshake, the heartbeat (a ping when the line was
quiet, the end of a peer silent too long) and each request's (the answer, the next
block or credit, the abort_ack, and the caller's deadline for the whole request: the
one clock a request has). :func:`expire` turns what passed into events and replies;
:func:`next_deadline` says when it next has something to do.
"""

from __future__ import annotations

import math

from p2pkv.protocol.codes import Code
from p2pkv.protocol.events import NOTHING, Event, Output, PeerClosed, RequestTimedOut
from p2pkv.protocol.machine import HANDSHAKE_STATES, Machine, Role, State
from p2pkv.protocol.messages import Abort, Bye, Message, Ping
from p2pkv.protocol.requests import Request

__all__ = ["abort_request", "expire", "next_deadline"]


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

"""What time does to a connection, with no IO (``protocol/SPEC.md`` §8, "Deadlines").

Every wait of a connection has a deadline, and they are all checked here against the
``now`` the session is given: the handshake (its own, and the caller's: the connect
timeout, which also bounds the client's wait for the shared-memory proof's verdict),
the heartbeat (a ping when the line was quiet, the end of a peer silent too long) and
each request's (the answer, the next block or credit, the abort_ack, and the caller's
deadline for the whole request). One clock per connection: the runtime keeps none of
its own. :func:`expire` turns what passed into events and replies;
:func:`next_deadline` says when it next has something to do.
"""

from __future__ import annotations

import math

from p2pkv.protocol.codes import Code
from p2pkv.protocol.events import (
    NOTHING,
    Event,
    HandshakeTimedOut,
    Output,
    PeerClosed,
    RequestTimedOut,
)
from p2pkv.protocol.machine import HANDSHAKE_STATES, Machine, Proof, Role, State
from p2pkv.protocol.messages import Abort, Bye, Message, Ping
from p2pkv.protocol.requests import Request

__all__ = ["abort_request", "expire", "next_deadline"]


def expire(m: Machine, now: float) -> Output:
    """Time: every deadline checked against ``now``; expired ones become events and
    replies (the handshake, the heartbeat, each request's deadline, §8)."""
    state = m.state
    d = m.deadlines
    if _setting_up(m) and now >= m.handshake_until:
        # The caller's deadline for the handshake: it gave up, nothing is sent.
        failed = m.fail_all(Code.TIMEOUT, "the deadline for the handshake passed")
        m.state = State.CLOSED
        return Output(events=(*failed, HandshakeTimedOut()))
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


def _setting_up(m: Machine) -> bool:
    """Whether the caller's deadline for the handshake still applies: the handshake is
    under way, or (client) the shared-memory proof awaits its verdict."""
    return m.state in HANDSHAKE_STATES or (
        m.state is State.READY and m.role is Role.CLIENT and m.proof is Proof.PENDING)


def next_deadline(m: Machine) -> float | None:
    """The earliest time :func:`expire` has something to do, or ``None`` when closed."""
    until = m.handshake_until if _setting_up(m) else math.inf
    if m.state in HANDSHAKE_STATES:
        return min(m.handshake_deadline, until)
    if m.state is not State.READY:
        return None
    d = m.deadlines
    soonest = min(until, m.last_rx + d.heartbeat_timeout,
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

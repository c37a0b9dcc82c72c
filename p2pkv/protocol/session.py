"""The per-peer protocol state machine, with no IO (``protocol/SPEC.md``, "State machine").

One :class:`Session` per peer connection. It never touches a socket, a thread or a clock:
the transport feeds it decoded messages (:meth:`Session.receive`) and the current
monotonic time, and sends whatever it returns in :attr:`Output.replies`. What happened is
reported as events (frozen dataclasses named in the past tense) in :attr:`Output.events`.
Deadlines are data: :meth:`Session.poll` checks them against the ``now`` it is given and
:meth:`Session.next_deadline` says when to call it next.

Transitions are a table keyed by ``(state, message type)``, one per role
(:mod:`p2pkv.protocol.transitions`); events and :class:`Output` are in
:mod:`p2pkv.protocol.events`, deadlines and limits in :mod:`p2pkv.protocol.limits`.

Roles are fixed per connection: the client (connecting side) sends ``hello`` and the
requests (``lookup``, ``fetch``, ``credit``, ``abort``); the server answers them.

Errors: input from the peer never raises; it becomes events and replies. Calling a method
in a state that does not allow it raises :class:`LocalProtocolError`; bad arguments raise
``ValueError``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.identity import IDENTITY_POLICIES
from p2pkv.keys import check_keys
from p2pkv.protocol.codec import MajorVersionMismatch, decode, decode_head
from p2pkv.protocol.codes import (
    CAP_PACKED_V1,
    MAX_KEY_LEN,
    MAX_PACKED_BYTES,
    MAX_WINDOW,
    OUTCOME_SENT,
    U64_MAX,
    Code,
)
from p2pkv.protocol.events import (
    NO_PAYLOAD,
    NOTHING,
    AbortAcknowledged,
    AbortRequested,
    BlockArrived,
    BlockDiscarded,
    CreditGranted,
    DataArrived,
    ErrorReceived,
    Event,
    FetchFinished,
    FetchRequested,
    HandshakeAccepted,
    HandshakeRefused,
    LookupAnswered,
    LookupRequested,
    MessageIgnored,
    Output,
    Payload,
    PeerClosed,
    ProtocolViolated,
    RequestFailed,
    RequestTimedOut,
)
from p2pkv.protocol.flow import FetchCredit
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
    Frame,
    Greeting,
    Hello,
    Hits,
    Lookup,
    Message,
    Ping,
    Reason,
)
from p2pkv.protocol.transitions import (
    HANDSHAKE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    LocalProtocolError,
    Machine,
    Request,
    Role,
    State,
)

__all__ = [
    "NO_PAYLOAD",
    "TRANSITIONS",
    "AbortAcknowledged",
    "AbortRequested",
    "BlockArrived",
    "BlockDiscarded",
    "CreditGranted",
    "DataArrived",
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
    "Payload",
    "PeerClosed",
    "ProtocolViolated",
    "RequestFailed",
    "RequestTimedOut",
    "Role",
    "Session",
    "State",
]


def _check_keys(keys: Sequence[bytes], limit: int) -> tuple[bytes, ...]:
    out = tuple(keys)
    if not 1 <= len(out) <= limit:
        raise ValueError(f"keys: need 1..{limit} keys, got {len(out)}")
    return check_keys(out, MAX_KEY_LEN)


def _block_sums(sums: Sequence[int | None] | None, n: int,
                checksums: bool) -> tuple[int | None, ...]:
    """The ``sums`` of a block message of ``n`` blocks: u64s exactly when checksums were
    negotiated (``None``: all absent)."""
    if sums is None:
        if checksums:
            raise ValueError("block: checksums were negotiated, sums are required")
        return (None,) * n
    sums_t = tuple(sums)
    if len(sums_t) != n:
        raise ValueError(f"block: {n} block(s) need {n} sums, got {len(sums_t)}")
    for s in sums_t:
        ok = (type(s) is int and 0 <= s <= U64_MAX) if checksums else s is None
        if not ok:
            raise ValueError(f"block: sums must be {'u64' if checksums else 'None'}"
                             f" (checksums negotiated: {checksums}), got {s!r}")
    return sums_t


def _done_outcomes(outcomes: Sequence[int], nkeys: int,
                   delivered: set[int]) -> tuple[int, ...]:
    """The outcomes of a ``done``: one per key, OUTCOME_SENT exactly for those sent."""
    out = tuple(outcomes)
    if len(out) != nkeys:
        raise ValueError(f"fetch_done: need {nkeys} outcomes, got {len(out)}")
    for i, o in enumerate(out):
        if type(o) is not int or not 0 <= o <= 2:
            raise ValueError(f"fetch_done: outcome {i} must be 0, 1 or 2, got {o!r}")
        if (o == OUTCOME_SENT) != (i in delivered):
            raise ValueError(f"fetch_done: outcome {i} is {o} but block {i} was "
                             f"{'sent' if i in delivered else 'not sent'}")
    return out


class Session(Machine):
    """The protocol state of one peer connection, driven by messages and time.

    Lifecycle: construct, call :meth:`start` (the client sends the ``hello`` it returns),
    feed everything the peer sends to :meth:`receive_data` (frame 0 and its payload;
    :meth:`receive_frames` for a whole message in memory, :meth:`receive` for a decoded
    one), call :meth:`poll` when :meth:`next_deadline` passes, send
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
        identity_policy: str = "strict",
    ) -> None:
        if identity_policy not in IDENTITY_POLICIES:
            raise ConfigError(f"identity_policy must be one of {', '.join(IDENTITY_POLICIES)},"
                              f" got {identity_policy!r}")
        self._identity_policy = identity_policy
        self._role = Role(role)
        self._local = local_hello
        self._deadlines = deadlines if deadlines is not None else Deadlines()
        self._limits = limits if limits is not None else Limits()
        self._required = frozenset(required_caps)
        self._table = TRANSITIONS[self._role]
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
        self._requests: dict[int, Request] = {}
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
    def packed_blocks(self) -> bool:
        """Whether a ``block`` may carry its blocks in one frame (``packed-v1``)."""
        return CAP_PACKED_V1 in self._caps

    @property
    def segments(self) -> tuple[int, ...] | None:
        """The negotiated segment sizes once READY (pass to ``codec.decode``)."""
        return self._local.geo.seg if self._remote is not None else None

    @property
    def is_open(self) -> bool:
        return self._state not in TERMINAL_STATES

    @property
    def in_flight(self) -> int:
        """Unfinished requests on this connection."""
        return len(self._requests)

    @property
    def request_limit(self) -> int:
        """Client: the most unfinished requests it may have (its own limit, or the
        peer's advertised ``in_flight`` when smaller)."""
        return self._request_limit()

    @property
    def key_limit(self) -> int:
        """Client: the most keys one request may carry (the peer's ``max_keys``)."""
        return self._peer_max_keys()

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
                              local.khash, local.caps, local.limits, local.v, local.ext)
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

    def receive_data(self, head: Frame, now: float, payload: Payload = NO_PAYLOAD) -> Output:
        """The one entry for data from the peer: frame 0 as it came, and what followed.

        Decodes ``head``, runs it through the state machine, and has ``payload`` land
        the bytes of an accepted ``block`` (or ``located``) message. Whatever the peer
        got wrong on the way (a frame 0 that does not decode, frames it should not have
        sent, a payload that is not what its header announced) becomes its protocol
        error here, once. Never raises for peer input.
        """
        try:
            msg = decode_head(head, payload.count, self.segments)
            if payload.count is None and type(msg) is not Block and payload.follows():
                raise ProtocolError(Code.FRAME_COUNT,
                                    f"{msg.TAG} must not carry payload frames")
        except ProtocolError as exc:
            payload.discard()
            return self._remote_error(exc, now)
        out = self.receive(msg, now)
        arrived = [ev for ev in out.events if isinstance(ev, DataArrived)]
        if type(msg) is Block and not arrived:
            payload.discard()  # discarded (aborted fetch) or a violation
        for ev in arrived:
            try:
                payload.land(ev)
            except ProtocolError as exc:
                bad = self._remote_error(exc, now)
                return Output(events=bad.events, replies=(*out.replies, *bad.replies))
        return out

    def receive_frames(self, frames: Sequence[Frame], now: float) -> Output:
        """Decode and feed one whole multipart message held in memory (its payload sizes
        checked once READY): :meth:`receive_data` for a transport without zero-copy."""
        try:
            msg = decode(frames, self.segments)
        except ProtocolError as exc:
            return self._remote_error(exc, now)
        return self.receive(msg, now)

    def _remote_error(self, error: ProtocolError, now: float) -> Output:
        """What the peer got wrong: unknown types get an ``error``, the rest is a violation."""
        self._last_rx = now
        if self._state in (State.CLOSED, State.ERROR):
            return NOTHING
        if error.code == Code.UNKNOWN_TYPE and self._state is State.READY:
            return Output(
                events=(MessageIgnored(error.code, error.message),),
                replies=(Error(None, Code.UNKNOWN_TYPE, error.message),),
            )
        if isinstance(error, MajorVersionMismatch) and self._state in HANDSHAKE_STATES:
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
        if self._state in TERMINAL_STATES:
            return NOTHING
        events = self._fail_all(code, msg or "connection closed by this node")
        self._state = State.CLOSED
        return Output(events=tuple(events), replies=(Bye(code, msg),))

    def poll(self, now: float) -> Output:
        """Check every deadline against ``now``; expired ones become events and replies."""
        state = self._state
        if state in HANDSHAKE_STATES:
            if now >= self._handshake_deadline:
                want = "hello" if self._role is Role.SERVER else "welcome"
                text = f"no {want} within {self._deadlines.handshake:g} s"
                self._state = State.CLOSED
                return Output(events=(PeerClosed(Code.TIMEOUT, text, False),),
                              replies=(Bye(Code.TIMEOUT, text),))
            return NOTHING
        if state is not State.READY:
            return NOTHING
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
            return NOTHING
        return Output(events=tuple(events), replies=tuple(replies))

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`poll` has something to do, or ``None`` when closed."""
        state = self._state
        if state in HANDSHAKE_STATES:
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
        *,
        packed: bool = False,
    ) -> Block:
        """Server: blocks ``idx`` of fetch ``req``; must fit the granted window.

        ``sums`` is required when checksums were negotiated and must be omitted otherwise.
        ``packed``: the payload goes as one frame (``packed-v1``, which must have been
        negotiated, and at most MAX_PACKED_BYTES).
        """
        r = self._served(req, "fetch", "block")
        idx_t = tuple(idx)
        n = len(idx_t)
        if n < 1:
            raise ValueError("block: idx must name at least one block")
        if packed and not self.packed_blocks:
            raise LocalProtocolError(Code.UNEXPECTED, "block: packed-v1 was not negotiated")
        if packed and n * self._local.geo.bpb > MAX_PACKED_BYTES:
            raise ValueError(f"block: {n} packed blocks exceed {MAX_PACKED_BYTES} bytes")
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
        sums_t = _block_sums(sums, n, self._checksums)
        r.received += n
        r.delivered.update(idx_t)
        return Block(req, idx_t, sums_t, tuple(payload), packed)

    def fetch_done(self, req: int, outcomes: Sequence[int]) -> Done:
        """Server: fetch ``req`` is over; outcome 0 exactly for the indices sent."""
        r = self._served(req, "fetch", "fetch_done")
        out = _done_outcomes(outcomes, len(r.keys), r.delivered)
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

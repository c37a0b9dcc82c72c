"""The per-peer protocol state machine, with no IO (``protocol/SPEC.md``, "State machine").

One :class:`Session` per peer connection. It never touches a socket, a thread or a clock:
the transport feeds it decoded messages (:meth:`Session.receive`) and the current
monotonic time, and sends whatever it returns in :attr:`Output.replies`. What happened is
reported as events (frozen dataclasses named in the past tense) in :attr:`Output.events`.
Deadlines are data: :meth:`Session.poll` checks them against the ``now`` it is given and
:meth:`Session.next_deadline` says when to call it next.

Every rule of the machine (what each message from the peer does, in each state, and what
time does) is in :mod:`p2pkv.protocol.transitions`; the state it changes is a
:class:`~p2pkv.protocol.machine.Machine`, owned here. Capabilities are data there: the
``shm-v1`` calls (``attach``, ``fetch_shared``, ``release``; ``attach_verdict``,
``located``) are calls of every session, allowed once the capability's state says so.
Events and :class:`Output` are in :mod:`p2pkv.protocol.events`, deadlines and limits in
:mod:`p2pkv.protocol.limits`.

Roles are fixed per connection: the client (connecting side) sends ``hello`` and the
requests (``lookup``, ``fetch``, ``credit``, ``abort``); the server answers them.

Errors: input from the peer never raises; it becomes events and replies. Calling a method
in a state that does not allow it raises :class:`LocalProtocolError`; bad arguments raise
``ValueError``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.identity import IDENTITY_POLICIES
from p2pkv.keys import check_keys
from p2pkv.protocol.codec import decode, decode_head
from p2pkv.protocol.codes import (
    CAP_PACKED_V1,
    CAP_SHM_V1,
    MAX_KEY_LEN,
    MAX_KEYS,
    MAX_PACKED_BYTES,
    MAX_WINDOW,
    OUTCOME_SENT,
    SHM_NONCE_LEN,
    U64_MAX,
    Code,
)
from p2pkv.protocol.events import (
    NO_PAYLOAD,
    NOTHING,
    DataArrived,
    Output,
    Payload,
)
from p2pkv.protocol.flow import FetchCredit
from p2pkv.protocol.limits import Deadlines, Limits
from p2pkv.protocol.machine import TERMINAL_STATES, Machine, Proof, Role, State
from p2pkv.protocol.messages import (
    Abort,
    AbortAck,
    Attach,
    Attached,
    Block,
    Bye,
    Credit,
    DataOffer,
    Done,
    Error,
    Fetch,
    Frame,
    Greeting,
    Hello,
    Hits,
    Located,
    Lookup,
    Message,
    Release,
    ShmOffer,
)
from p2pkv.protocol.requests import KeyLimitExceeded, LocalProtocolError, Request
from p2pkv.protocol.transitions import IMPLEMENTED, abort_request, expire, remote_error
from p2pkv.protocol.transitions import next_deadline as machine_deadline
from p2pkv.protocol.transitions import receive as machine_receive

__all__ = ["LocalProtocolError", "Session"]


def _check_keys(keys: Sequence[bytes], limit: int) -> tuple[bytes, ...]:
    """A request's keys: 1 to the peer's ``max_keys`` of them (KeyLimitExceeded, which
    the runtime reports as LocalLimitExceeded), each a valid key."""
    out = tuple(keys)
    if not out:
        raise ValueError("keys: need at least one key")
    if len(out) > limit:
        raise KeyLimitExceeded(f"keys: need 1..{limit} keys, got {len(out)}: the peer "
                               f"accepts at most {limit} keys per request; split the "
                               "request", allowed=limit, requested=len(out))
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


def _check_indices(idx: tuple[int, ...], r: Request, req: int) -> None:
    """The indices of a ``block`` the server sends: at least one, each a key of the
    request, none sent before, none repeated."""
    if not idx:
        raise ValueError("block: idx must name at least one block")
    for i in idx:
        if type(i) is not int or not 0 <= i < len(r.keys):
            raise ValueError(f"block: index {i!r} is not a key of request {req}")
        if i in r.delivered:
            raise ValueError(f"block: index {i} of request {req} was already sent")
    if len(set(idx)) != len(idx):
        raise ValueError(f"block: idx {idx!r} repeats an index")


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


class Session:
    """The protocol state of one peer connection, driven by messages and time.

    Lifecycle: construct, call :meth:`start` (the client sends the ``hello`` it returns),
    feed everything the peer sends to :meth:`receive_data` (frame 0 and its payload;
    :meth:`receive_frames` for a whole message in memory, :meth:`receive` for a decoded
    one), call :meth:`poll` when :meth:`next_deadline` passes, send
    every ``Output.replies`` message in order. Not thread-safe: one owner (the IO loop).

    ``shm_offer`` (server): this node's shared-memory segment, offered in the ``welcome``
    when ``shm-v1`` is negotiated (None: the pool is not shared); ``data_offer`` (server):
    this session's data stream (the node's data port and a fresh token), offered when
    ``tcp-data-v1`` is negotiated (None: no data channel). ``implements``: the
    capabilities whose messages this session recognizes (all of
    :data:`~p2pkv.protocol.transitions.IMPLEMENTED` by default); the messages of any
    other are unknown types to it.
    """

    __slots__ = ("_m",)

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
        shm_offer: ShmOffer | None = None,
        data_offer: DataOffer | None = None,
        implements: Iterable[str] = IMPLEMENTED,
    ) -> None:
        if identity_policy not in IDENTITY_POLICIES:
            raise ConfigError(f"identity_policy must be one of {', '.join(IDENTITY_POLICIES)},"
                              f" got {identity_policy!r}")
        self._m = Machine(Role(role), local_hello,
                          deadlines if deadlines is not None else Deadlines(),
                          limits if limits is not None else Limits(),
                          frozenset(required_caps), identity_policy, frozenset(implements),
                          shm_offer, now, data_offer)

    # ------------------------------------------------------------------ properties

    @property
    def role(self) -> Role:
        return self._m.role

    @property
    def state(self) -> State:
        return self._m.state

    @property
    def local(self) -> Greeting:
        return self._m.local

    @property
    def remote(self) -> Greeting | None:
        """The peer's greeting once the handshake was accepted."""
        return self._m.remote

    @property
    def capabilities(self) -> frozenset[str]:
        """The negotiated capabilities (empty before the handshake)."""
        return self._m.caps

    @property
    def checksums(self) -> bool:
        """Whether every block carries an xxh3-64 (``checksum-xxh3-64`` negotiated)."""
        return self._m.checksums

    @property
    def packed_blocks(self) -> bool:
        """Whether a ``block`` may carry its blocks in one frame (``packed-v1``)."""
        return CAP_PACKED_V1 in self._m.caps

    @property
    def shm_negotiated(self) -> bool:
        """Both sides offered ``shm-v1``."""
        return CAP_SHM_V1 in self._m.caps

    @property
    def shm_offer(self) -> ShmOffer | None:
        """The server's segment: our own (server), or the one the ``welcome`` offered
        when ``shm-v1`` was negotiated (client)."""
        return self._m.offer

    @property
    def data_offer(self) -> DataOffer | None:
        """The server's data stream: our own (server), or the one the ``welcome`` offered
        (client), once ``tcp-data-v1`` was negotiated; None otherwise."""
        return self._m.data_offer

    @property
    def shared_memory(self) -> bool:
        """The server accepted the client's proof: fetches may use the segment."""
        return self._m.shared_memory

    @property
    def segments(self) -> tuple[int, ...] | None:
        """The negotiated segment sizes once READY (pass to ``codec.decode``)."""
        return self._m.local.geo.seg if self._m.remote is not None else None

    @property
    def is_open(self) -> bool:
        return self._m.state not in TERMINAL_STATES

    @property
    def in_flight(self) -> int:
        """Unfinished requests on this connection."""
        return len(self._m.requests)

    @property
    def request_limit(self) -> int:
        """Client: the most unfinished requests it may have (its own limit, or the
        peer's advertised ``in_flight`` when smaller)."""
        return self._m.request_limit()

    @property
    def key_limit(self) -> int:
        """Client: the most keys one request may carry (the peer's ``max_keys``)."""
        return self._m.peer_max_keys()

    def is_pending(self, req: int) -> bool:
        return req in self._m.requests

    def shared_fetch(self, req: int) -> bool:
        """Whether running fetch ``req`` is served through the segment."""
        r = self._m.requests.get(req)
        return r is not None and r.shared

    def window_left(self, req: int) -> int:
        """Server: blocks of fetch ``req`` that may still be sent under the granted credit."""
        r = self._m.served(req, "fetch", "window_left")
        return r.granted - r.received

    def fetch_credit(self, req: int) -> FetchCredit | None:
        """Client: the credit state of running fetch ``req`` (``None`` when ``req`` is not
        a running fetch): what :class:`~p2pkv.protocol.flow.CreditBudget` decides on."""
        r = self._m.requests.get(req)
        if r is None or r.kind != "fetch" or self._m.role is not Role.CLIENT:
            return None
        return FetchCredit(req, r.granted, r.received, len(r.keys))

    # ------------------------------------------------------------------ lifecycle

    def start(self, now: float) -> list[Message]:
        """Open the connection: the client returns ``[hello]``, the server ``[]``."""
        m = self._m
        if m.started:
            raise LocalProtocolError(Code.UNEXPECTED, "start() called twice")
        m.started = True
        m.handshake_deadline = now + m.deadlines.handshake
        m.last_rx = now
        if m.role is Role.CLIENT:
            local = m.local
            if type(local) is not Hello:
                local = Hello(local.node, local.minor, local.rc, local.fp, local.geo,
                              local.khash, local.caps, local.limits, local.v, local.ext)
            return [local]
        return []

    def receive(self, msg: Message, now: float) -> Output:
        """Feed one decoded message from the peer; never raises for peer input."""
        return machine_receive(self._m, msg, now)

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
            return remote_error(self._m, exc, now)
        out = self.receive(msg, now)
        arrived = [ev for ev in out.events if isinstance(ev, DataArrived)]
        if type(msg) is Block and not arrived:
            payload.discard()  # discarded (aborted fetch) or a violation
        for ev in arrived:
            try:
                payload.land(ev)
            except ProtocolError as exc:
                bad = remote_error(self._m, exc, now)
                return Output(events=bad.events, replies=(*out.replies, *bad.replies))
        return out

    def receive_frames(self, frames: Sequence[Frame], now: float) -> Output:
        """Decode and feed one whole multipart message held in memory (its payload sizes
        checked once READY): :meth:`receive_data` for a transport without zero-copy."""
        try:
            msg = decode(frames, self.segments)
        except ProtocolError as exc:
            return remote_error(self._m, exc, now)
        return self.receive(msg, now)

    def close(self, code: int = Code.NORMAL_CLOSE, msg: str = "") -> Output:
        """End the connection: a ``bye`` to send, and a failure for each open request."""
        m = self._m
        if m.state in TERMINAL_STATES:
            return NOTHING
        events = m.fail_all(code, msg or "connection closed by this node")
        m.state = State.CLOSED
        return Output(events=tuple(events), replies=(Bye(code, msg),))

    def poll(self, now: float) -> Output:
        """Check every deadline against ``now``; expired ones become events and replies."""
        return expire(self._m, now)

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`poll` has something to do, or ``None`` when closed."""
        return machine_deadline(self._m)

    # ------------------------------------------------------------------ client calls

    def lookup(self, keys: Sequence[bytes], now: float, *,
               deadline: float = math.inf) -> Lookup:
        """Client: open a lookup; send the returned message. Answer: LookupAnswered, or
        RequestTimedOut once ``lookup`` seconds (or the caller's ``deadline``) passed."""
        keys_t = _check_keys(keys, self._m.peer_max_keys())
        req = self._m.open("lookup", keys_t, now + self._m.deadlines.lookup, 0, deadline)
        return Lookup(req, keys_t)

    def fetch(self, keys: Sequence[bytes], window: int, now: float, *,
              deadline: float = math.inf) -> Fetch:
        """Client: open a fetch allowing ``window`` blocks in flight; send the message.

        Blocks arrive as BlockArrived; grant more window with :meth:`credit` as they
        land; FetchFinished ends it. It times out (aborted, RequestTimedOut) when no
        block or credit moved it for ``fetch_idle`` seconds, or at ``deadline``.
        """
        keys_t = _check_keys(keys, self._m.peer_max_keys())
        if type(window) is not int or not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be an int in [1, {MAX_WINDOW}], got {window!r}")
        req = self._m.open("fetch", keys_t, now + self._m.deadlines.fetch_idle, window,
                           deadline)
        return Fetch(req, keys_t, window)

    def fetch_shared(self, keys: Sequence[bytes], window: int, now: float, *,
                     deadline: float = math.inf) -> Fetch:
        """Client: :meth:`fetch`, served through the segment (``shm-v1``, after an
        accepted :meth:`attach`): its blocks arrive as BlocksLocated."""
        if not self._m.shared_memory:
            raise LocalProtocolError(Code.UNEXPECTED, "fetch_shared: no accepted attach")
        msg = self.fetch(keys, window, now, deadline=deadline)
        self._m.requests[msg.req].shared = True
        return dataclasses.replace(msg, shm=True)

    def withdraw(self, req: int) -> None:
        """Client: forget request ``req``, opened but never sent (as if never opened)."""
        r = self._m.own(req, "withdraw")
        if r.received or r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"withdraw: request {req} was sent")
        self._m.requests.withdraw(req)

    def credit(self, req: int, n: int, now: float) -> Credit:
        """Client: allow ``n`` more blocks of fetch ``req`` in flight (resets its idle deadline)."""
        if type(n) is not int or not 1 <= n <= MAX_WINDOW:
            raise ValueError(f"credit n must be an int in [1, {MAX_WINDOW}], got {n!r}")
        r = self._m.own(req, "credit")
        if r.kind != "fetch" or r.aborting:
            raise LocalProtocolError(
                Code.UNEXPECTED, f"credit: request {req} is not a running fetch"
            )
        r.granted += n
        r.deadline = now + self._m.deadlines.fetch_idle
        return Credit(req, n)

    def abort(self, req: int, now: float) -> Abort:
        """Client: stop request ``req``; AbortAcknowledged follows (or a timeout)."""
        r = self._m.own(req, "abort")
        if r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"abort: request {req} is already aborting")
        abort_request(self._m, r, now)
        return Abort(req)

    def attach(self, nonce: bytes) -> Attach:
        """Client: echo the nonce read through the offered segment's mapping (once)."""
        m = self._m
        self._m.check_role(Role.CLIENT, "attach")
        if m.offer is None or m.proof is not Proof.NONE:
            raise LocalProtocolError(Code.UNEXPECTED, "attach: no segment offered, or "
                                     "attach already sent")
        if type(nonce) is not bytes or len(nonce) != SHM_NONCE_LEN:
            raise ValueError(f"attach: the nonce must be {SHM_NONCE_LEN} bytes")
        m.proof = Proof.PENDING
        return Attach(nonce)

    def release(self, req: int, idx: Sequence[int]) -> Release:
        """Client: the located blocks ``idx`` of fetch ``req`` were copied or dropped."""
        self._m.check_role(Role.CLIENT, "release")
        idx_t = tuple(idx)
        if not 1 <= len(idx_t) <= MAX_KEYS:
            raise ValueError(f"release: need 1..{MAX_KEYS} indices, got {len(idx_t)}")
        return Release(req, idx_t)

    # ------------------------------------------------------------------ server calls

    def answer_lookup(self, req: int, hits: Sequence[bool]) -> Hits:
        """Server: the answer to lookup ``req``, one bool per key."""
        r = self._m.served(req, "lookup", "answer_lookup")
        hits_t = tuple(hits)
        if len(hits_t) != len(r.keys) or not set(map(type, hits_t)) <= {bool}:
            raise ValueError(
                f"answer_lookup: need {len(r.keys)} bools for request {req}, got {hits_t!r}"[:300]
            )
        self._m.requests.finish(req)
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
        r = self._m.served(req, "fetch", "block")
        idx_t = tuple(idx)
        n = len(idx_t)
        _check_indices(idx_t, r, req)
        if packed and not self.packed_blocks:
            raise LocalProtocolError(Code.UNEXPECTED, "block: packed-v1 was not negotiated")
        if packed and n * self._m.local.geo.bpb > MAX_PACKED_BYTES:
            raise ValueError(f"block: {n} packed blocks exceed {MAX_PACKED_BYTES} bytes")
        if r.received + n > r.granted:
            raise LocalProtocolError(
                Code.WINDOW_EXCEEDED,
                f"block: request {req} has {r.granted - r.received} block(s) of window "
                f"left, {n} asked",
            )
        sums_t = _block_sums(sums, n, self._m.checksums)
        r.received += n
        r.delivered.update(idx_t)
        return Block(req, idx_t, sums_t, tuple(payload), packed)

    def located(self, req: int, idx: Sequence[int], slots: Sequence[int],
                sums: Sequence[int | None] | None = None) -> Located:
        """Server: blocks ``idx`` of shared fetch ``req`` are pinned at ``slots``; the
        window and checksum rules are those of :meth:`block`."""
        if not self.shared_fetch(req):
            raise LocalProtocolError(Code.UNEXPECTED, f"located: request {req} is not a "
                                     "shared fetch")
        slots_t = tuple(slots)
        if len(slots_t) != len(tuple(idx)) or any(type(s) is not int or s < 0
                                                  for s in slots_t):
            raise ValueError("located: one slot (an int >= 0) per index")
        blk = self.block(req, idx, sums)
        return Located(req, blk.idx, slots_t, blk.sums)

    def fetch_done(self, req: int, outcomes: Sequence[int]) -> Done:
        """Server: fetch ``req`` is over; outcome 0 exactly for the indices sent."""
        r = self._m.served(req, "fetch", "fetch_done")
        out = _done_outcomes(outcomes, len(r.keys), r.delivered)
        self._m.requests.finish(req)
        return Done(req, out)

    def abort_ack(self, req: int) -> AbortAck:
        """Server: request ``req`` is stopped (after AbortRequested)."""
        r = self._m.served(req, None, "abort_ack")
        if not r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"abort_ack: request {req} was not aborted")
        self._m.requests.finish(req)
        return AbortAck(req)

    def fail(self, req: int, code: int, msg: str) -> Error:
        """Server: request ``req`` failed as a whole (for example UNAVAILABLE)."""
        self._m.served(req, None, "fail")
        self._m.requests.finish(req)
        return Error(req, code, msg)

    def attach_verdict(self, ok: bool, msg: str) -> Attached:
        """Server: the answer to the client's ``attach`` (after AttachRequested)."""
        m = self._m
        if m.role is not Role.SERVER or m.proof is not Proof.PENDING:
            raise LocalProtocolError(Code.UNEXPECTED, "attach_verdict: no attach to answer")
        m.proof = Proof.ACCEPTED if ok else Proof.REFUSED
        return Attached(bool(ok), msg)

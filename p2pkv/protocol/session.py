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
from typing import Final

from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.identity import IDENTITY_POLICIES
from p2pkv.keys import check_keys
from p2pkv.protocol.codec import decode, decode_head
from p2pkv.protocol.codes import (
    CAP_PENDING_V1,
    MAX_DUE_MS,
    MAX_KEY_LEN,
    MAX_KEYS,
    MAX_PACKED_BYTES,
    MAX_STREAMS,
    MAX_WINDOW,
    SHM_NONCE_LEN,
    VIA_NIXL,
    VIA_SHM,
    Code,
)
from p2pkv.protocol.deadlines import abort_request, expire
from p2pkv.protocol.deadlines import next_deadline as machine_deadline
from p2pkv.protocol.events import (
    NO_PAYLOAD,
    NOTHING,
    DataArrived,
    Output,
    Payload,
)
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
    NixlOffer,
    Release,
    ShmOffer,
)
from p2pkv.protocol.requests import KeyLimitExceeded, LocalProtocolError, Request
from p2pkv.protocol.rules import (
    Broken,
    field_break,
    indices_break,
    outcomes_break,
    sums_break,
    window_break,
)
from p2pkv.protocol.transitions import IMPLEMENTED, allow, remote_error
from p2pkv.protocol.transitions import receive as machine_receive
from p2pkv.protocol.view import SessionView

__all__ = ["LocalProtocolError", "Session"]


def _check_keys(keys: Sequence[bytes], limit: int) -> tuple[bytes, ...]:
    """A request's keys: 1 to the peer's ``max_keys`` of them (KeyLimitExceeded, which
    the runtime reports as LocalLimitExceeded), each a valid key: the session's own
    boundary (whoever drives it, it sends nothing SPEC §15 forbids), one pass in C for
    valid keys. Keys the peer sent were checked by the codec."""
    out = tuple(keys)
    if not out:
        raise ValueError("keys: need at least one key")
    if len(out) > limit:
        raise KeyLimitExceeded(f"keys: need 1..{limit} keys, got {len(out)}: the peer "
                               f"accepts at most {limit} keys per request; split the "
                               "request", allowed=limit, requested=len(out))
    return check_keys(out, MAX_KEY_LEN)


_INT: Final = frozenset({int})


def _refused(broken: Broken | None, what: str) -> None:
    """A rule of :mod:`p2pkv.protocol.rules` this node's own call breaks: what the
    protocol does not allow now is a LocalProtocolError, a bad argument a ValueError."""
    if broken is None:
        return
    text = f"{what}: {broken.text}"
    if broken.code in (Code.UNEXPECTED, Code.WINDOW_EXCEEDED):
        raise LocalProtocolError(broken.code, text)
    raise ValueError(text)


class Session(SessionView):
    """The protocol state of one peer connection, driven by messages and time.

    Lifecycle: construct, call :meth:`start` (the client sends the ``hello`` it returns),
    feed everything the peer sends to :meth:`receive_data` (frame 0 and its payload;
    :meth:`receive_frames` for a whole message in memory, :meth:`receive` for a decoded
    one), call :meth:`poll` when :meth:`next_deadline` passes, send
    every ``Output.replies`` message in order. Not thread-safe: one owner (the IO loop).

    ``shm_offer`` (server): this node's shared-memory segment, offered in the ``welcome``
    when ``shm-v1`` is negotiated (None: the pool is not shared); ``data_offer`` (server):
    this session's data stream (the node's data port and a fresh token), offered when
    ``tcp-data-v1`` is negotiated (None: no data channel); ``nixl_offer`` (server): this
    node's pool as its NIXL agent exposes it, offered when ``nixl-v1`` (with ``shm-v1``)
    is negotiated (SPEC §20). ``implements``: the
    capabilities whose messages this session recognizes (all of
    :data:`~p2pkv.protocol.transitions.IMPLEMENTED` by default); the messages of any
    other are unknown types to it.
    """

    __slots__ = ()

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
        nixl_offer: NixlOffer | None = None,
    ) -> None:
        if identity_policy not in IDENTITY_POLICIES:
            raise ConfigError(f"identity_policy must be one of {', '.join(IDENTITY_POLICIES)},"
                              f" got {identity_policy!r}")
        self._m = Machine(Role(role), local_hello,
                          deadlines if deadlines is not None else Deadlines(),
                          limits if limits is not None else Limits(),
                          frozenset(required_caps), identity_policy, frozenset(implements),
                          shm_offer, now, data_offer, nixl_offer)

    def window_left(self, req: int) -> int:
        """Server: blocks of fetch ``req`` that may still be sent under the granted credit."""
        r = self._served(req, "fetch", "window_left")
        return r.granted - r.received

    def _own(self, req: int, call: str) -> Request:
        """Client: an open request this node's ``call`` is about (after :func:`allow`)."""
        allow(self._m, call)
        r = self._m.requests.get(req)
        if r is None:
            raise LocalProtocolError(Code.UNKNOWN_REQUEST, f"{call}: no open request {req}")
        return r

    def _served(self, req: int, kind: str | None, call: str) -> Request:
        """Server: an open request of ``kind`` (None: any) that ``call`` answers."""
        r = self._own(req, call)
        if kind is not None and r.kind != kind:
            raise LocalProtocolError(
                Code.UNEXPECTED, f"{call}: request {req} is a {r.kind}, not a {kind}")
        return r

    # ------------------------------------------------------------------ lifecycle

    def start(self, now: float, *, deadline: float = math.inf) -> list[Message]:
        """Open the connection: the client returns ``[hello]``, the server ``[]``.

        ``deadline`` (client): the caller's deadline for the handshake and, when one is
        sent, the shared-memory proof's verdict; once it passes, :meth:`poll` reports
        HandshakeTimedOut. The handshake's own deadline (``Deadlines.handshake``)
        applies either way."""
        m = self._m
        if m.started:
            raise LocalProtocolError(Code.UNEXPECTED, "start() called twice")
        m.started = True
        m.handshake_deadline = now + m.deadlines.handshake
        m.handshake_until = deadline
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

    def violated(self, error: ProtocolError, now: float) -> Output:
        """A violation the transport found outside :meth:`receive_data` (the bytes of
        the peer's data stream): the same way out as one found inside it, the same code,
        ``bye`` and report, once."""
        return remote_error(self._m, error, now)

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
        allow(self._m, "lookup")
        keys_t = _check_keys(keys, self._m.peer_max_keys())
        req = self._m.open("lookup", keys_t, now + self._m.deadlines.lookup, 0, deadline)
        return Lookup(req, keys_t)

    def fetch(self, keys: Sequence[bytes], window: int, now: float, *,
              deadline: float = math.inf, stream: int = 0) -> Fetch:
        """Client: open a fetch allowing ``window`` blocks in flight; send the message.

        Blocks arrive as BlockArrived; grant more window with :meth:`credit` as they
        land; FetchFinished ends it. It times out (aborted, RequestTimedOut) when no
        block or credit moved it for ``fetch_idle`` seconds, or at ``deadline``.
        """
        allow(self._m, "fetch")
        keys_t = _check_keys(keys, self._m.peer_max_keys())
        if type(window) is not int or not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be an int in [1, {MAX_WINDOW}], got {window!r}")
        msg = Fetch(0, keys_t, window, stream=stream)
        _refused(field_break(msg, self._m.caps), "fetch")  # stream needs tcp-streams-v1
        if type(stream) is not int or not 0 <= stream < MAX_STREAMS:
            raise ValueError(f"fetch: stream must be in [0, {MAX_STREAMS - 1}], got {stream!r}")
        req = self._m.open("fetch", keys_t, now + self._m.deadlines.fetch_idle, window,
                           deadline)
        return dataclasses.replace(msg, req=req)

    def fetch_shared(self, keys: Sequence[bytes], window: int, now: float, *,
                     deadline: float = math.inf) -> Fetch:
        """Client: :meth:`fetch`, served through the segment (``shm-v1``, after an
        accepted :meth:`attach`): its blocks arrive as BlocksLocated."""
        allow(self._m, "fetch_shared")
        if not self._m.shared_memory:
            raise LocalProtocolError(Code.UNEXPECTED, "fetch_shared: no accepted attach")
        msg = self.fetch(keys, window, now, deadline=deadline)
        self._m.requests[msg.req].shared = True
        return dataclasses.replace(msg, shm=True)

    def withdraw(self, req: int) -> None:
        """Client: forget request ``req``, opened but never sent (as if never opened)."""
        r = self._own(req, "withdraw")
        if r.received or r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"withdraw: request {req} was sent")
        self._m.requests.withdraw(req)

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
        r.deadline = now + self._m.deadlines.fetch_idle
        return Credit(req, n)

    def abort(self, req: int, now: float) -> Abort:
        """Client: stop request ``req``; AbortAcknowledged follows (or a timeout)."""
        r = self._own(req, "abort")
        if r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"abort: request {req} is already aborting")
        abort_request(self._m, r, now)
        return Abort(req)

    def attach(self, nonce: bytes, via: str = VIA_SHM) -> Attach:
        """Client: echo the nonce read through the offered segment's mapping, or (``via``
        ``nixl-v1``) READ through NIXL from the offered pool (once)."""
        m = self._m
        allow(m, "attach")
        offered = m.offer if via == VIA_SHM else m.nixl_offer if via == VIA_NIXL else None
        if offered is None or m.proof is not Proof.NONE:
            raise LocalProtocolError(Code.UNEXPECTED, f"attach ({via}): nothing offered "
                                     "for it, or attach already sent")
        if type(nonce) is not bytes or len(nonce) != SHM_NONCE_LEN:
            raise ValueError(f"attach: the nonce must be {SHM_NONCE_LEN} bytes")
        m.proof = Proof.PENDING
        m.via = via
        return Attach(nonce, via)

    def release(self, req: int, idx: Sequence[int]) -> Release:
        """Client: the located blocks ``idx`` of fetch ``req`` were copied or dropped."""
        allow(self._m, "release")
        idx_t = tuple(idx)
        if not 1 <= len(idx_t) <= MAX_KEYS:
            raise ValueError(f"release: need 1..{MAX_KEYS} indices, got {len(idx_t)}")
        return Release(req, idx_t)

    # ------------------------------------------------------------------ server calls

    def answer_lookup(self, req: int, hits: Sequence[bool],
                      due: Sequence[int] | None = None) -> Hits:
        """Server: the answer to lookup ``req``, one bool per key; ``due``, with
        ``pending-v1`` negotiated: per key the milliseconds until this node expects to
        hold a key it is computing (0: not pending; all 0 or None: nothing is sent)."""
        r = self._served(req, "lookup", "answer_lookup")
        hits_t = tuple(hits)
        if len(hits_t) != len(r.keys) or not set(map(type, hits_t)) <= {bool}:
            raise ValueError(
                f"answer_lookup: need {len(r.keys)} bools for request {req}, got {hits_t!r}"[:300]
            )
        due_t = None if due is None or not any(due) else tuple(due)
        if due_t is not None:
            if CAP_PENDING_V1 not in self._m.caps:
                raise LocalProtocolError(Code.UNEXPECTED, "answer_lookup: due needs "
                                         "pending-v1, which was not negotiated")
            if len(due_t) != len(hits_t) or any(
                    type(d) is not int or not 0 <= d <= MAX_DUE_MS or (d and h)
                    for d, h in zip(due_t, hits_t, strict=False)):
                raise ValueError(f"answer_lookup: due must be {len(hits_t)} ints in "
                                 f"0..{MAX_DUE_MS}, 0 for every hit; got {due_t!r}"[:300])
        self._m.requests.finish(req)
        return Hits(req, hits_t, due_t)

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
        sums_t = (None,) * n if sums is None else tuple(sums)
        if len(sums_t) != n:
            raise ValueError(f"block: {n} block(s) need {n} sums, got {len(sums_t)}")
        if not set(map(type, idx_t)) <= _INT:  # what the peer's codec checks of its own
            raise ValueError(f"block: indices must be ints, got {idx_t!r}"[:200])
        msg = Block(req, idx_t, sums_t, tuple(payload), bool(packed))
        # The same rules as a block from the peer (p2pkv.protocol.rules).
        _refused(field_break(msg, self._m.caps) or indices_break(r, req, idx_t)
                 or window_break(r, req, n, "sent") or sums_break(sums_t), "block")
        if packed and n * self._m.local.geo.bpb > MAX_PACKED_BYTES:
            raise ValueError(f"block: {n} packed blocks exceed {MAX_PACKED_BYTES} bytes")
        r.received += n
        r.delivered.update(idx_t)
        return msg

    def located(self, req: int, idx: Sequence[int], slots: Sequence[int],
                sums: Sequence[int | None] | None = None) -> Located:
        """Server: blocks ``idx`` of shared fetch ``req`` are pinned at ``slots``; the
        window and checksum rules are those of :meth:`block`."""
        allow(self._m, "located")
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
        r = self._served(req, "fetch", "fetch_done")
        out = tuple(outcomes)
        _refused(outcomes_break(r, req, out), "fetch_done")
        self._m.requests.finish(req)
        return Done(req, out)

    def abort_ack(self, req: int) -> AbortAck:
        """Server: request ``req`` is stopped (after AbortRequested)."""
        r = self._served(req, None, "abort_ack")
        if not r.aborting:
            raise LocalProtocolError(Code.UNEXPECTED, f"abort_ack: request {req} was not aborted")
        self._m.requests.finish(req)
        return AbortAck(req)

    def fail(self, req: int, code: int, msg: str) -> Error:
        """Server: request ``req`` failed as a whole (for example UNAVAILABLE)."""
        self._served(req, None, "fail")
        self._m.requests.finish(req)
        return Error(req, code, msg)

    def attach_verdict(self, ok: bool, msg: str) -> Attached:
        """Server: the answer to the client's ``attach`` (after AttachRequested)."""
        m = self._m
        allow(m, "attach_verdict")
        if m.proof is not Proof.PENDING:
            raise LocalProtocolError(Code.UNEXPECTED, "attach_verdict: no attach to answer")
        m.proof = Proof.ACCEPTED if ok else Proof.REFUSED
        return Attached(bool(ok), msg)

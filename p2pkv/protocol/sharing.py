"""Same-host shared memory in the session (capability ``shm-v1``, ``protocol/SPEC.md`` §16).

:class:`SharingSession` is a :class:`~p2pkv.protocol.session.Session` that also speaks
``shm-v1``; without the capability negotiated it behaves exactly like its base. What it
adds, still with no IO:

* the server puts its segment (:class:`~p2pkv.protocol.messages.ShmOffer`) in the
  ``welcome`` when ``shm-v1`` was negotiated (never in a ``hello``);
* the client proves it can map that segment with ``attach`` (the nonce read through its
  mapping), and the server answers ``attached`` with its verdict
  (:meth:`SharingSession.attach_verdict`); both happen once per connection;
* after an accepted attach, a fetch opened with :meth:`SharingSession.fetch_shared`
  carries ``shm: true``; the server answers it with ``located`` messages (slots in its
  pool) instead of ``block`` messages, under the same window, index and checksum rules;
* the client ``release``s the located blocks it copied; the server unpins them.

The node decides the proof itself (reading the segment, comparing nonces); the session
only checks that the messages come in an order the protocol allows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

from p2pkv.protocol.codes import CAP_SHM_V1, MAX_KEYS, SHM_NONCE_LEN, Code
from p2pkv.protocol.events import BlockArrived, DataArrived, Event, Output
from p2pkv.protocol.messages import (
    Abort,
    Attach,
    Attached,
    Block,
    Fetch,
    Greeting,
    Hello,
    Located,
    Release,
    ShmOffer,
    Welcome,
)
from p2pkv.protocol.session import Session
from p2pkv.protocol.transitions import (
    TRANSITIONS,
    LocalProtocolError,
    Machine,
    Role,
    State,
)

__all__ = [
    "SHARING_TRANSITIONS",
    "AttachAnswered",
    "AttachRequested",
    "BlocksLocated",
    "BlocksReleased",
    "LocatedAbandoned",
    "SharingSession",
]


@dataclass(frozen=True, slots=True)
class AttachRequested(Event):
    """Server: the client echoes ``nonce``; check it and answer with
    :meth:`SharingSession.attach_verdict`."""

    nonce: bytes


@dataclass(frozen=True, slots=True)
class AttachAnswered(Event):
    """Client: the server accepted (``ok``) or refused the shared-memory proof."""

    ok: bool
    msg: str


@dataclass(frozen=True, slots=True)
class BlocksLocated(DataArrived):
    """Client: blocks ``idx`` of fetch ``req`` wait in the server's pool at ``slots``;
    copy them, then :meth:`SharingSession.release` them."""

    req: int
    idx: tuple[int, ...]
    slots: tuple[int, ...]
    sums: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class BlocksReleased(Event):
    """Server: the client is done with blocks ``idx`` of fetch ``req``; unpin them."""

    req: int
    idx: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LocatedAbandoned(Event):
    """Server: the client aborted fetch ``req`` after its ``done`` (the two crossed): it
    reads none of its located blocks any more; unpin whatever it still holds."""

    req: int


# Attach progress of a connection.
_NONE: Final = "none"
_PENDING: Final = "pending"  # client: attach sent; server: attach received, no verdict yet
_ACCEPTED: Final = "accepted"
_REFUSED: Final = "refused"


class SharingSession(Session):
    """A session that also speaks ``shm-v1``. ``shm_offer`` is the server's own segment
    (None: this node's pool is not shared, and no ``welcome`` will offer one)."""

    def __init__(self, role: Role | str, local_hello: Greeting, *, now: float,
                 shm_offer: ShmOffer | None = None, **kwargs: Any) -> None:
        super().__init__(role, local_hello, now=now, **kwargs)
        self._table = SHARING_TRANSITIONS[self._role]
        self._offer = shm_offer if self._role is Role.SERVER else None
        self._attach = _NONE
        self._shared_reqs: set[int] = set()

    # ------------------------------------------------------------------ properties

    @property
    def shm_negotiated(self) -> bool:
        """Both sides offered ``shm-v1``."""
        return CAP_SHM_V1 in self._caps

    @property
    def shm_offer(self) -> ShmOffer | None:
        """The server's segment: our own (server), or the one the ``welcome`` offered
        when ``shm-v1`` was negotiated (client)."""
        return self._offer

    @property
    def shared_memory(self) -> bool:
        """The server accepted the client's proof: fetches may use the segment."""
        return self._attach == _ACCEPTED

    def shared_fetch(self, req: int) -> bool:
        """Whether running fetch ``req`` is served through the segment."""
        return req in self._shared_reqs

    # ------------------------------------------------------------------ client calls

    def attach(self, nonce: bytes) -> Attach:
        """Client: echo the nonce read through the segment's mapping (once)."""
        if self._role is not Role.CLIENT:
            raise LocalProtocolError(Code.UNEXPECTED, "attach: only the client sends it")
        self._require_ready("attach")
        if self._offer is None or self._attach != _NONE:
            raise LocalProtocolError(Code.UNEXPECTED, "attach: no segment offered, or "
                                     "attach already sent")
        if type(nonce) is not bytes or len(nonce) != SHM_NONCE_LEN:
            raise ValueError(f"attach: the nonce must be {SHM_NONCE_LEN} bytes")
        self._attach = _PENDING
        return Attach(nonce)

    def fetch_shared(self, keys: Sequence[bytes], window: int, now: float) -> Fetch:
        """Client: :meth:`fetch`, served through the segment (needs an accepted attach)."""
        if not self.shared_memory:
            raise LocalProtocolError(Code.UNEXPECTED, "fetch_shared: no accepted attach")
        msg = self.fetch(keys, window, now)
        self._shared_reqs.add(msg.req)
        return dataclasses.replace(msg, shm=True)

    def release(self, req: int, idx: Sequence[int]) -> Release:
        """Client: the located blocks ``idx`` of fetch ``req`` were copied or dropped."""
        if self._role is not Role.CLIENT:
            raise LocalProtocolError(Code.UNEXPECTED, "release: only the client sends it")
        self._require_ready("release")
        idx_t = tuple(idx)
        if not 1 <= len(idx_t) <= MAX_KEYS:
            raise ValueError(f"release: need 1..{MAX_KEYS} indices, got {len(idx_t)}")
        return Release(req, idx_t)

    # ------------------------------------------------------------------ server calls

    def attach_verdict(self, ok: bool, msg: str) -> Attached:
        """Server: the answer to the client's ``attach`` (after AttachRequested)."""
        if self._role is not Role.SERVER or self._attach != _PENDING:
            raise LocalProtocolError(Code.UNEXPECTED, "attach_verdict: no attach to answer")
        self._attach = _ACCEPTED if ok else _REFUSED
        return Attached(bool(ok), msg)

    def located(self, req: int, idx: Sequence[int], slots: Sequence[int],
                sums: Sequence[int | None] | None = None) -> Located:
        """Server: blocks ``idx`` of shared fetch ``req`` are pinned at ``slots``; the
        window and checksum rules are those of :meth:`block`."""
        if req not in self._shared_reqs:
            raise LocalProtocolError(Code.UNEXPECTED, f"located: request {req} is not a "
                                     "shared fetch")
        slots_t = tuple(slots)
        if len(slots_t) != len(tuple(idx)) or any(type(s) is not int or s < 0
                                                  for s in slots_t):
            raise ValueError("located: one slot (an int >= 0) per index")
        blk = self.block(req, idx, sums)
        return Located(req, blk.idx, slots_t, blk.sums)

    # ------------------------------------------------------------------ internals

    def _finish(self, req: int) -> None:
        super()._finish(req)
        self._shared_reqs.discard(req)

    # ------------------------------------------------------------------ handlers

    def _on_hello_shared(self, msg: Hello, now: float) -> Output:
        out = Machine._on_hello(self, msg, now)
        if self._state is State.READY and not self.shm_negotiated:
            self._offer = None
        if self._state is not State.READY or self._offer is None:
            return out
        replies = tuple(dataclasses.replace(r, shm=self._offer) if isinstance(r, Welcome)
                        else r for r in out.replies)
        return Output(events=out.events, replies=replies)

    def _on_welcome_shared(self, msg: Welcome, now: float) -> Output:
        out = Machine._on_welcome(self, msg, now)
        if self._state is State.READY and self.shm_negotiated:
            self._offer = msg.shm
        return out

    def _on_fetch_shared(self, msg: Fetch, now: float) -> Output:
        out = Machine._on_fetch(self, msg, now)
        # A fetch that asks for the segment before an accepted attach is served over TCP.
        if msg.shm and self.shared_memory and msg.req in self._requests:
            self._shared_reqs.add(msg.req)
        return out

    def _on_attach(self, msg: Attach, now: float) -> Output:
        if self._offer is None or self._attach != _NONE:
            return self._violate(Code.UNEXPECTED, "attach without a segment offered, or "
                                 "a second attach")
        self._attach = _PENDING
        return Output(events=(AttachRequested(msg.nonce),))

    def _on_attached(self, msg: Attached, now: float) -> Output:
        if self._attach != _PENDING:
            return self._violate(Code.UNEXPECTED, "attached without an attach")
        self._attach = _ACCEPTED if msg.ok else _REFUSED
        return Output(events=(AttachAnswered(msg.ok, msg.msg),))

    def _on_located(self, msg: Located, now: float) -> Output:
        # Checked as a block header: window, indices, checksums. A located block whose
        # fetch already ended is discarded like a late block (the server unpins it when
        # it acknowledges the abort, or when the connection ends).
        req = msg.req
        if req in self._requests and req not in self._shared_reqs:
            return self._violate(Code.UNEXPECTED, f"located for request {req}, which is "
                                 "not a shared fetch")
        out = Machine._on_block(self, Block(req, msg.idx, msg.sums), now)
        events = tuple(BlocksLocated(req, msg.idx, msg.slots, msg.sums)
                       if type(e) is BlockArrived else e for e in out.events)
        return Output(events=events, replies=out.replies)

    def _on_abort_shared(self, msg: Abort, now: float) -> Output:
        out = Machine._on_abort(self, msg, now)
        if msg.req in self._finished and self._state is State.READY:
            return Output(events=(*out.events, LocatedAbandoned(msg.req)), replies=out.replies)
        return out

    def _on_release(self, msg: Release, now: float) -> Output:
        r = self._requests.get(msg.req)
        if r is None and msg.req not in self._finished:
            return self._violate(Code.UNKNOWN_REQUEST, f"release for unknown request "
                                 f"{msg.req}")
        if r is not None and r.kind != "fetch":
            return self._violate(Code.UNEXPECTED, f"release for request {msg.req}, a "
                                 f"{r.kind}")
        return Output(events=(BlocksReleased(msg.req, msg.idx),))


_Handler = Callable[[Machine, Any, float], Output]
_SHM_TAGS: Final = ("attach", "attached", "located", "release")


def _table(role: Role, extra: dict[tuple[State, str], object]) -> dict[tuple[State, str],
                                                                        _Handler]:
    table = dict(TRANSITIONS[role])
    table.update({k: cast(_Handler, v) for k, v in extra.items()})
    for state in (State.CLOSED, State.ERROR):
        for tag in _SHM_TAGS:
            table[(state, tag)] = Machine._on_ignore
    return table


SHARING_TRANSITIONS: Final = {
    Role.CLIENT: _table(Role.CLIENT, {
        (State.AWAITING_WELCOME, "welcome"): SharingSession._on_welcome_shared,
        (State.READY, "attached"): SharingSession._on_attached,
        (State.READY, "located"): SharingSession._on_located,
    }),
    Role.SERVER: _table(Role.SERVER, {
        (State.AWAITING_HELLO, "hello"): SharingSession._on_hello_shared,
        (State.READY, "fetch"): SharingSession._on_fetch_shared,
        (State.READY, "abort"): SharingSession._on_abort_shared,
        (State.READY, "attach"): SharingSession._on_attach,
        (State.READY, "release"): SharingSession._on_release,
    }),
}
""":data:`~p2pkv.protocol.session.TRANSITIONS` plus the ``shm-v1`` messages, by role."""

"""What a :class:`~p2pkv.protocol.Session` reports: events, and its output.

Events are frozen dataclasses named in the past tense; :class:`Output` carries the
events of one step and the replies the transport must send, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Protocol

from p2pkv.protocol.messages import (
    Frame,
    Greeting,
    Message,
    Reason,
    Refuse,
)

__all__ = [
    "NOTHING",
    "NO_PAYLOAD",
    "AbortAcknowledged",
    "AbortRequested",
    "AttachAnswered",
    "AttachRequested",
    "BlockArrived",
    "BlockDiscarded",
    "BlocksLocated",
    "BlocksReleased",
    "CreditGranted",
    "DataArrived",
    "ErrorReceived",
    "Event",
    "FetchFinished",
    "FetchRequested",
    "HandshakeAccepted",
    "HandshakeRefused",
    "HandshakeTimedOut",
    "LocatedAbandoned",
    "LookupAnswered",
    "LookupRequested",
    "MessageIgnored",
    "Output",
    "Payload",
    "PeerClosed",
    "ProtocolViolated",
    "RequestFailed",
    "RequestTimedOut",
]



@dataclass(frozen=True, slots=True)
class Event:
    """Base class of everything a session reports."""


@dataclass(frozen=True, slots=True)
class HandshakeAccepted(Event):
    """Both sides agreed; ``capabilities`` is the negotiated set.

    ``warnings`` are identity-extension fields only one side declares, accepted because
    the identity policy is ``lenient`` (the node logs and counts them).
    """

    remote: Greeting
    capabilities: frozenset[str]
    warnings: tuple[Reason, ...] = ()


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
    """Client: one bool per key of lookup ``req``; with ``pending-v1``, ``due``: per key
    the milliseconds until the server expects to hold it (0: not pending), or None."""

    req: int
    hits: tuple[bool, ...]
    due: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class FetchRequested(Event):
    """Server: send the blocks of ``keys``, at most ``window`` blocks beyond credits
    (on data stream ``stream`` when it is bound, ``tcp-streams-v1``)."""

    req: int
    keys: tuple[bytes, ...]
    window: int
    stream: int = 0


@dataclass(frozen=True, slots=True)
class CreditGranted(Event):
    """Server: the peer allows ``n`` more blocks of fetch ``req``."""

    req: int
    n: int


@dataclass(frozen=True, slots=True)
class DataArrived(Event):
    """Client: the bytes of accepted blocks are ready to land (:meth:`Payload.land`)."""


@dataclass(frozen=True, slots=True)
class BlockArrived(DataArrived):
    """Client: blocks ``idx`` of fetch ``req`` arrived (payload frames follow the header).

    ``payload`` is empty when the transport fed the header alone (zero-copy receive);
    ``packed``: the blocks travel in one payload frame (``packed-v1``).
    """

    req: int
    idx: tuple[int, ...]
    sums: tuple[int | None, ...]
    payload: tuple[Frame, ...] = field(default=(), repr=False)
    packed: bool = False


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

    ``overall``: it was the caller's deadline for the whole request that passed (the
    ``deadline`` given when it opened), not its progress deadline (no answer, no block
    within ``fetch_idle``). A timed-out fetch is aborted by the session (an ``abort`` is
    in the replies); blocks that still arrive for it are reported as
    :class:`BlockDiscarded`.
    """

    req: int
    kind: str
    overall: bool = False


# shm-v1 (protocol/SPEC.md §16)


@dataclass(frozen=True, slots=True)
class HandshakeTimedOut(Event):
    """Client: the caller's deadline for the handshake (the ``deadline`` given to
    :meth:`~p2pkv.protocol.Session.start`) passed before the handshake, and the
    shared-memory proof if one was sent, were answered. Nothing is sent: the caller gave
    up on the connection, which is over (the session is CLOSED); its transport is
    dropped. The handshake's own deadline (``Deadlines.handshake``) ends it with a
    ``bye`` and :class:`PeerClosed` instead."""


@dataclass(frozen=True, slots=True)
class AttachRequested(Event):
    """Server: the client echoes ``nonce``; check it and answer with
    :meth:`~p2pkv.protocol.Session.attach_verdict`. ``via``: the offer it proves
    (``shm-v1``: the segment; ``nixl-v1``: the pool as the NIXL agent exposes it)."""

    nonce: bytes
    via: str = "shm-v1"


@dataclass(frozen=True, slots=True)
class AttachAnswered(Event):
    """Client: the server accepted (``ok``) or refused the shared-memory proof."""

    ok: bool
    msg: str


@dataclass(frozen=True, slots=True)
class BlocksLocated(DataArrived):
    """Client: blocks ``idx`` of fetch ``req`` wait in the server's pool at ``slots``;
    copy them, then :meth:`~p2pkv.protocol.Session.release` them."""

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


NOTHING: Final = Output()
"""The output of a step that did nothing."""


class Payload(Protocol):
    """What followed a frame 0, still held by the transport: the session decides what
    becomes of it (:meth:`~p2pkv.protocol.Session.receive_data`) and never reads it."""

    @property
    def count(self) -> int | None:
        """How many frames followed frame 0, when the transport counted them."""

    def follows(self) -> bool:
        """Whether any frame followed frame 0."""

    def land(self, arrived: DataArrived) -> None:
        """Move the bytes of an accepted ``block`` (or ``located``) message into their
        destinations; raise :class:`~p2pkv.errors.ProtocolError` when they are not what
        its header announced."""

    def discard(self) -> None:
        """Drop what followed (the message was refused, or its blocks are not wanted)."""


class _NoPayload:
    count = 0

    def follows(self) -> bool:
        return False

    def land(self, arrived: DataArrived) -> None:  # pragma: no cover - nothing to land
        raise AssertionError("a message without payload frames has no blocks to land")

    def discard(self) -> None:
        pass


NO_PAYLOAD: Final[Payload] = _NoPayload()
"""The payload of a frame 0 that came alone."""

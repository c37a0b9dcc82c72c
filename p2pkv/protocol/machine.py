"""The state of one connection, with no IO: what the rows of
:data:`~p2pkv.protocol.transitions.TRANSITIONS` read and change.

:class:`Machine` holds it all, set in one place: the role, the greetings, the negotiated
capabilities, the requests (:class:`~p2pkv.protocol.requests.RequestBook`), the
``shm-v1`` offer and proof, and the clocks of the handshake and the heartbeat. It also
has the three moves every rule ends in: accept the handshake, refuse it, or close on a
violation.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Final

from p2pkv.protocol.codes import (
    CAP_CHECKSUM_XXH3_64,
    CAP_NIXL_V1,
    CAP_SHM_V1,
    MAX_KEYS,
    VIA_SHM,
    Code,
)
from p2pkv.protocol.datachannel import kept_offer
from p2pkv.protocol.events import NOTHING, Event, HandshakeRefused, Output, ProtocolViolated
from p2pkv.protocol.limits import Deadlines, Limits
from p2pkv.protocol.messages import (
    Bye,
    DataOffer,
    Greeting,
    Message,
    NixlOffer,
    Reason,
    Refuse,
    ShmOffer,
)
from p2pkv.protocol.requests import RequestBook

__all__ = ["HANDSHAKE_STATES", "TERMINAL_STATES", "Machine", "Proof", "Role", "State"]


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

class Proof(str, Enum):
    """How far the shared-memory proof of a connection got (``shm-v1``, §16.3)."""

    NONE = "none"
    PENDING = "pending"  # client: attach sent; server: attach received, no verdict yet
    ACCEPTED = "accepted"
    REFUSED = "refused"


class Machine:
    """Everything one connection's protocol state is: set here, changed by the rows of
    :data:`TRANSITIONS`, by time (:mod:`~p2pkv.protocol.deadlines`) and by the calls of
    :class:`~p2pkv.protocol.session.Session`."""

    __slots__ = (
        "caps",
        "checksums",
        "data_offer",
        "deadlines",
        "handshake_deadline",
        "handshake_until",
        "identity_policy",
        "implements",
        "last_ping",
        "last_rx",
        "limits",
        "local",
        "nixl_offer",
        "offer",
        "ping_nonce",
        "proof",
        "remote",
        "requests",
        "required",
        "role",
        "started",
        "state",
        "via",
    )

    def __init__(self, role: Role, local: Greeting, deadlines: Deadlines, limits: Limits,
                 required: frozenset[str], identity_policy: str, implements: frozenset[str],
                 offer: ShmOffer | None, now: float,
                 data_offer: DataOffer | None = None,
                 nixl_offer: NixlOffer | None = None) -> None:
        self.role = role
        self.local = local
        self.deadlines = deadlines
        self.limits = limits
        self.required = required
        self.identity_policy = identity_policy
        self.implements = implements
        self.state = State.AWAITING_WELCOME if role is Role.CLIENT else State.AWAITING_HELLO
        self.started = False
        self.handshake_deadline = now + deadlines.handshake
        #: Client: the caller's deadline for the handshake and the shared-memory proof
        #: (inf: none), checked by :func:`~p2pkv.protocol.deadlines.expire` like a
        #: request's ``until``.
        self.handshake_until = math.inf
        self.last_rx = now
        self.last_ping = now
        self.ping_nonce = 0
        self.remote: Greeting | None = None
        self.caps: frozenset[str] = frozenset()  # negotiated
        self.checksums = False
        self.requests = RequestBook()
        # shm-v1: the server's segment (our own as server; the welcome's as client) and
        # the proof's progress.
        self.offer = offer if role is Role.SERVER else None
        self.proof = Proof.NONE
        # nixl-v1: the server's pool as its NIXL agent exposes it (SPEC §20), and which
        # offer the proof is about (``attach.via``).
        self.nixl_offer = nixl_offer if role is Role.SERVER else None
        self.via = VIA_SHM
        # tcp-data-v1: the server's data stream (our own as server; the welcome's as
        # client), offered and used only when negotiated.
        self.data_offer = data_offer if role is Role.SERVER else None

    @property
    def peer_role(self) -> str:
        return "server" if self.role is Role.CLIENT else "client"

    @property
    def shared_memory(self) -> bool:
        """The server accepted the client's proof: fetches may use the segment."""
        return self.proof is Proof.ACCEPTED

    def peer_max_keys(self) -> int:
        limit = MAX_KEYS
        remote = self.remote
        if remote is not None and remote.limits is not None and remote.limits.max_keys:
            limit = min(limit, remote.limits.max_keys)
        return limit

    def request_limit(self) -> int:
        limit = self.limits.max_in_flight
        remote = self.remote
        if remote is not None and remote.limits is not None and remote.limits.in_flight:
            limit = min(limit, remote.limits.in_flight)
        return limit

    def fail_all(self, code: int, msg: str) -> list[Event]:
        return list(self.requests.fail_all(code, msg))

    def violate(self, code: int, msg: str) -> Output:
        """The peer broke the protocol: tell it why, fail everything, move to ERROR."""
        state = self.state
        if state in (State.CLOSED, State.ERROR):
            return NOTHING
        events = self.fail_all(code, msg)
        events.append(ProtocolViolated(code, msg))
        reply: Message = (self._refusal(code, msg, ()) if state in HANDSHAKE_STATES
                          else Bye(code, msg))
        self.state = State.ERROR
        return Output(events=tuple(events), replies=(reply,))

    def refuse(self, reasons: tuple[Reason, ...], msg: str, remote: Greeting | None) -> Output:
        code = int(reasons[0].code) if reasons else int(Code.UNEXPECTED)
        self.state = State.REFUSED
        return Output(events=(HandshakeRefused(reasons, False, code, msg, remote),),
                      replies=(self._refusal(code, msg, reasons),))

    def _refusal(self, code: int, msg: str, reasons: tuple[Reason, ...]) -> Refuse:
        local = self.local
        return Refuse(code, msg, reasons, local.node, local.rc, local.fp, local.geo,
                      local.khash, local.ext)

    def accept(self, remote: Greeting, caps: frozenset[str]) -> None:
        self.remote = remote
        self.caps = caps
        self.checksums = CAP_CHECKSUM_XXH3_64 in caps
        self.state = State.READY
        if CAP_SHM_V1 not in caps:
            self.offer = None  # a segment is offered only when shm-v1 was negotiated
        if CAP_NIXL_V1 not in caps or CAP_SHM_V1 not in caps:
            self.nixl_offer = None  # nixl-v1 speaks shm-v1's messages (§20.1)
        # and a data stream only when one of its forms was (§18)
        self.data_offer = kept_offer(caps, self.data_offer)

    def late_or_unknown(self, req: int, tag: str) -> Output:
        if self.requests.finished(req):
            return NOTHING
        return self.violate(Code.UNKNOWN_REQUEST, f"{tag} for unknown request {req}")

    def open(self, kind: str, keys: tuple[bytes, ...], deadline: float, granted: int,
             until: float) -> int:
        """Client: a new request (the session checked the call against the table)."""
        return self.requests.open(kind, keys, deadline, granted, self.request_limit(), until)

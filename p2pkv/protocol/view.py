"""What a session tells about its connection: read-only views of its state, no IO.

:class:`SessionView` is the reading half of :class:`~p2pkv.protocol.session.Session`:
the role, the state and the greetings, what was negotiated (capabilities, checksums,
the shared-memory and data-stream offers), the limits that apply to the next request,
and the counts of the requests in flight. The session adds what changes the state: its
lifecycle and the calls that build messages.
"""

from __future__ import annotations

from p2pkv.protocol.codes import CAP_PACKED_V1, CAP_PENDING_V1, CAP_SHM_V1
from p2pkv.protocol.flow import FetchCredit
from p2pkv.protocol.machine import TERMINAL_STATES, Machine, Role, State
from p2pkv.protocol.messages import DataOffer, Greeting, NixlOffer, ShmOffer

__all__ = ["SessionView"]


class SessionView:
    """The read-only side of a session (its machine is ``_m``)."""

    __slots__ = ("_m",)

    _m: Machine

    @property
    def role(self) -> Role:
        return self._m.role

    @property
    def state(self) -> State:
        return self._m.state

    @property
    def handshake_until(self) -> float:
        """The caller's deadline for the handshake (``start``'s ``deadline``; inf: none).
        It is the session's to enforce; a runtime reads it to bound what it does for the
        handshake on its own (binding a data stream)."""
        return self._m.handshake_until

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
    def pending_answers(self) -> bool:
        """Whether a lookup's answer may say when a key being computed will be held
        (``pending-v1``)."""
        return CAP_PENDING_V1 in self._m.caps

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
    def nixl_offer(self) -> NixlOffer | None:
        """The server's pool as its NIXL agent exposes it: our own (server), or the one
        the ``welcome`` offered when ``nixl-v1`` was negotiated (client)."""
        return self._m.nixl_offer

    @property
    def attached_via(self) -> str:
        """Which offer the connection's ``attach`` is about (``shm-v1``, ``nixl-v1``)."""
        return self._m.via

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

    def fetch_credit(self, req: int) -> FetchCredit | None:
        """Client: the credit state of running fetch ``req`` (``None`` when ``req`` is not
        a running fetch): what :class:`~p2pkv.protocol.flow.CreditBudget` decides on."""
        r = self._m.requests.get(req)
        if r is None or r.kind != "fetch" or self._m.role is not Role.CLIENT:
            return None
        return FetchCredit(req, r.granted, r.received, len(r.keys))


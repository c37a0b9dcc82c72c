"""The two halves of a data path, as interfaces: :class:`FetchPath` (the fetching half,
chosen once per connection) and :class:`ServePath` (the serving half, chosen per fetch),
and :class:`Sending`, the fetch a serving half carries (the path it was bound to
included).

A leaf: it imports nothing of the runtime, so that the records, the paths and the
connections can all name these types without closing an import circle (not even one
made only for the type checker). See :mod:`p2pkv.runtime.paths` for the paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from p2pkv import protocol as proto

__all__ = ["Arrived", "FetchPath", "Sending", "ServePath"]

Arrived = proto.BlockArrived | proto.BlocksLocated
"""What a fetching half lands: the blocks of a ``block`` or of a ``located``."""


class FetchPath(Protocol):
    """The fetching half of a connection's data path."""

    #: One of :data:`~p2pkv.runtime.paths.frames.KINDS`.
    kind: str
    #: How blocks move on this connection and why (``PeerHandle.data_path_detail``).
    detail: str
    #: How much data the fetches of this connection may have in flight together.
    budget: proto.CreditBudget
    #: Over how many lanes a caller's fetch is striped (several data streams: one
    #: protocol fetch per stream; 1 for every other path).
    lanes: int

    def open_fetch(self, session: proto.Session, keys: tuple[bytes, ...], window: int,
                   now: float, deadline: float, lane: int = 0) -> proto.Fetch:
        """Open a fetch in the session, asking for this path (``fetch``, the shared
        form, or a fetch naming the stream of ``lane``); the caller sends it."""

    def land(self, arrived: proto.DataArrived) -> None:
        """Land the blocks of a message the session accepted (called from inside
        :meth:`~p2pkv.protocol.Session.receive_data`), into its fetch's destinations
        while the fetch may be written (:func:`~p2pkv.runtime.state.writable`), or
        nowhere. Raises the peer's :class:`~p2pkv.errors.ProtocolError`."""

    def settled(self, session: proto.Session, ev: Arrived) -> list[proto.Message]:
        """What goes back to the peer once the session reported ``ev`` landed."""

    def cancel(self, req: int) -> None:
        """Fetch ``req`` was cancelled or is over: drop whatever of it is in progress."""

    def read_pending(self, now: float) -> None:
        """The ZeroMQ connection ended: handle what this path still holds first."""

    def close(self) -> None:
        """The connection ended: release what the path holds. Idempotent."""


class ServePath(Protocol):
    """The serving half of a data path (one per peer, shared by its fetches)."""

    kind: str

    def can_send(self, session: proto.Session, job: Sending) -> bool:
        """Whether the path has room for more of ``job`` now (its credit aside)."""

    def send(self, session: proto.Session, job: Sending) -> bool:
        """Send what the credit of ``job`` (and the path's room) allows. False: the peer
        is unreachable (the caller drops it; what failed was unpinned)."""

    def finish(self, session: proto.Session, job: Sending) -> bool:
        """Send the ``done`` of a job whose every key was handled, after its blocks."""

    def abort(self, req: int) -> None:
        """Fetch ``req`` was aborted: unpin whatever the peer still held of it."""

    def stalled_for(self, now: float) -> float:
        """Seconds the peer has taken nothing of what waits for it on this path, while
        blocks stay pinned for it (0: nothing waits, or it moved). Its connection cuts
        it at the send deadline (``send_timeout``)."""

    @property
    def busy(self) -> bool:
        """Whether bytes are still queued on the path."""

    def close(self) -> None:
        """The peer is gone: release what the path holds. Idempotent."""


@dataclass(eq=False)
class Sending:
    """A fetch this node serves: which keys are left and what became of each."""

    req: int
    keys: tuple[bytes, ...]
    outcomes: list[int]
    next_index: int = 0
    #: The path its blocks and its done take (:mod:`p2pkv.runtime.paths`): bound when
    #: the fetch arrived, so that every block of the fetch and its done take the same
    #: way, even if the connection's path changes meanwhile (a data stream binding).
    path: ServePath | None = None

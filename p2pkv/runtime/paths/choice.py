"""How an outbound connection comes to its data path: the candidates, tried in order.

Right after an accepted handshake, a connection's :class:`PathChoice` tries the ways a
peer's blocks may come, best first: the peer's pool in shared memory (``shm-v1``: map
the segment and prove it, :class:`~p2pkv.runtime.paths.shm_client.SharedIn`), else the
peer's pool READ through NIXL (``nixl-v1``: READ its nonce and prove it,
:class:`~p2pkv.runtime.paths.nixl_client.NixlIn`), else a data stream beside ZeroMQ
(``tcp-data-v1``: dial and bind it, :class:`~p2pkv.runtime.paths.data_dial.StreamDialer`),
else ZeroMQ frames
(:class:`~p2pkv.runtime.paths.frames.FramesIn`, always there). When the attempts are over it
calls ``ready`` once, and :meth:`PathChoice.choose` fixes the connection's path for the
rest of its life, with the reasons the better ones are not used.

IO thread only.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from p2pkv import protocol as proto
from p2pkv.runtime.paths.data_client import DataReceiver, StreamIn, StreamOwner, Striped
from p2pkv.runtime.paths.data_dial import StreamDialer
from p2pkv.runtime.paths.frames import FramesIn
from p2pkv.runtime.paths.interfaces import Arrived, FetchPath
from p2pkv.runtime.paths.nixl_client import NixlIn, NixlReceiver
from p2pkv.runtime.paths.shm_client import SharedIn, SharedReceiver
from p2pkv.runtime.reactor import Reactor
from p2pkv.runtime.state import Receiving
from p2pkv.runtime.stats import Counters

__all__ = ["PathChoice"]


class PathChoice:
    """The data-path candidates of one outbound connection, and the one chosen.

    ``owner``: what the data stream calls back (the connection), ``ready``: called once
    the attempts are over (the connection then calls :meth:`choose`).
    """

    def __init__(self, frames: FramesIn, shm: SharedReceiver, data: DataReceiver,
                 reactor: Reactor, counters: Counters, address: str,
                 fetch_of: Callable[[int], Receiving | None], owner: StreamOwner,
                 ready: Callable[[], None], nixl: NixlReceiver) -> None:
        self._address = address
        self._data = data
        self._owner = owner
        self._ready = ready
        self._reactor = reactor
        self._counters = counters
        #: How many data streams this node opens to a peer that takes several.
        self._want = data.streams
        self.frames = frames
        self.shm: SharedIn = shm.link(address, fetch_of)
        self.nixl: NixlIn = nixl.link(address, fetch_of)
        self._dialers = [self._dialer_for(0)]
        self._dialing = 0
        self._streams: dict[int, StreamIn] = {}
        self._stream: FetchPath | None = None
        #: The data path: frames until the attempts are over and a better one is up.
        self.path: FetchPath = frames

    # -- trying --------------------------------------------------------------------------

    def begin(self, session: proto.Session, deadline: float) -> list[proto.Message]:
        """The handshake was accepted: what to send to try shared memory (its proof),
        or nothing while a stream is being bound; ``ready`` follows either way."""
        attach = self.shm.begin(session) or self.nixl.begin(session, deadline)
        if attach is not None:
            return [attach]
        self._open_stream(session, deadline)
        return []

    def answered(self, session: proto.Session, ev: proto.AttachAnswered,
                 deadline: float) -> None:
        """The server's verdict on the shared-memory (or NIXL) proof."""
        self._located(session).answered(ev)
        if session.shared_memory:
            self._ready()
        else:
            self._open_stream(session, deadline)

    def next_deadline(self) -> float | None:
        """When :meth:`check` next has something to do (a stream still being bound)."""
        return min((d for d in (dialer.next_deadline() for dialer in self._dialers)
                    if d is not None), default=None)

    def check(self, now: float) -> None:
        """A data port that does not answer by the deadline: stay on ZeroMQ."""
        for dialer in self._dialers:
            dialer.check(now)

    def _dialer_for(self, index: int) -> StreamDialer:
        return StreamDialer(self._reactor, self._counters, self._address,
                            enabled=self._data.enabled, index=index,
                            bound=lambda sock: self._bound(sock, index),
                            gave_up=self._one_done)

    def _open_stream(self, session: proto.Session, deadline: float) -> None:
        """Dial the first stream, and the further ones both sides take (several with
        ``tcp-streams-v1``: as many as this node wants and the offer has tokens for)."""
        offer = session.data_offer
        if proto.CAP_TCP_STREAMS_V1 in session.capabilities and offer is not None:
            self._dialers += [self._dialer_for(k)
                              for k in range(1, min(self._want, 1 + len(offer.more)))]
        self._dialing = sum(1 for d in self._dialers if d.begin(session, deadline))
        if not self._dialing:
            self._ready()

    def _bound(self, sock: socket.socket, index: int) -> None:
        self._streams[index] = self._data.stream(self._address, sock, self._owner,
                                                 self._dialers[index].detail)
        self._one_done()

    def _one_done(self) -> None:
        """One stream bound or given up: ready once none is still being bound."""
        self._dialing -= 1
        if self._dialing == 0:
            streams = self._streams
            if len(streams) > 1:
                target = self._dialers[min(streams)].target
                self._stream = Striped(streams, proto.CreditBudget(
                    self._data.budget.window * len(streams)),
                    f"{len(streams)} data streams to {target}")
            elif streams:
                self._stream = next(iter(streams.values()))
            self._ready()

    def _located(self, session: proto.Session) -> SharedIn | NixlIn:
        """The half whose proof the connection's ``attach`` was (``attach.via``)."""
        return self.nixl if session.attached_via == proto.VIA_NIXL else self.shm

    # -- chosen --------------------------------------------------------------------------

    def choose(self, session: proto.Session) -> str:
        """Fix the data path (best of what came up) and say why: the segment or stream
        used, and why the better ones are not, where both sides offered them."""
        if session.shared_memory:
            self.path = self._located(session)
        elif self._stream is not None:
            self.path = self._stream
        why_not_shm = self.shm.detail if proto.CAP_SHM_V1 in session.capabilities else ""
        why_not_nixl = self.nixl.detail if proto.CAP_NIXL_V1 in session.capabilities else ""
        if self.path is self.shm or self.path is self.nixl:
            detail = self.path.detail
        elif self.path is self._stream:
            detail = "; ".join(d for d in (self._stream.detail, why_not_shm, why_not_nixl)
                               if d)
        else:
            detail = "; ".join(d for d in (why_not_shm or self.shm.detail, why_not_nixl,
                                           self._dialers[0].detail) if d)
        self.path.detail = detail
        return detail

    def of(self, arrived: Arrived) -> FetchPath:
        """The path a message on the DEALER lands through: a ``located`` copies from
        shared memory or READs through NIXL (whichever proof was accepted), a ``block``
        reads its frames (the stream lands its own)."""
        if isinstance(arrived, proto.BlocksLocated):
            return self.nixl if self.path is self.nixl else self.shm
        return self.frames

    def close(self) -> None:
        """The connection ended: every candidate lets go of what it holds."""
        for dialer in self._dialers:
            dialer.close()
        for path in (self.path, self.shm, self.nixl, self._stream, *self._streams.values()):
            if path is not None:
                path.close()

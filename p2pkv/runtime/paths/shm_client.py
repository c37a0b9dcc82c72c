"""The fetching side of ``shm-v1``: map a same-host peer's pool, prove it, copy from it.

After a handshake that negotiated ``shm-v1`` and whose ``welcome`` named a segment, the
client maps the segment read-only (:class:`~p2pkv.shm.MappedSegment` checks owner uid,
mode 0600, boot id and network namespace) and echoes the nonce it read in an ``attach``.
Anything less (shared memory off here, a peer without a segment, a segment it cannot
map, a refused proof) leaves the connection on TCP, silently, and the reason is kept in
:attr:`SharedIn.detail` for ``PeerHandle``, ``probe`` and stats. Once the proof was
accepted, :class:`SharedIn` is the connection's data path (the ``shm`` kind of
:mod:`p2pkv.runtime.paths`).

Landing a ``located`` message copies each block's segments straight from the mapped pool
into its destination (a store slot invisible until committed, or caller buffers), hashing
each piece right after it was copied, then settles it like a received block
(:class:`~p2pkv.runtime.paths.landing.Landing`). The whole message is one
:func:`p2pkv.checksum.copy_blocks` call: with the compiled helper it runs without the GIL,
over ``NodeConfig.shm_copy_threads`` threads; without it, in Python on the IO thread. A
read burst is at most a few MiB, well under a millisecond of copying, so a lookup queued
meanwhile waits no longer than behind the TCP path's ``recv_into``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from p2pkv import protocol as proto
from p2pkv.checksum import copy_blocks, copy_threads
from p2pkv.errors import ProtocolError
from p2pkv.runtime.paths.landing import Landing
from p2pkv.runtime.state import Receiving, writable
from p2pkv.runtime.stats import RECEIVED, Counters, ShmFallback
from p2pkv.shm import MappedSegment, ShmUnavailable

__all__ = ["LocatedIn", "SharedIn", "SharedReceiver"]

log = logging.getLogger("p2pkv.node")


class SharedReceiver:
    """What the shared-memory links of this node's outbound connections share."""

    def __init__(self, landing: Landing, segments: Sequence[int], counters: Counters,
                 budget: proto.CreditBudget, *, enabled: bool, threads: int = 1) -> None:
        self.landing = landing
        #: Threads a located message's copy is shared out over (1 without the compiled
        #: helper, :func:`p2pkv.checksum.copy_threads`).
        self.threads = copy_threads(threads)
        self.segments = tuple(segments)
        self.bpb = sum(self.segments)
        self.counters = counters
        self.budget = budget
        self.enabled = enabled

    def link(self, address: str, fetch_of: Callable[[int], Receiving | None]) -> SharedIn:
        """The shared-memory side of a new connection to ``address`` (not attached);
        ``fetch_of``: the connection's running fetch of a request id."""
        return SharedIn(self, address, fetch_of)


class LocatedIn:
    """What every fetching half answered with ``located`` slots shares (``shm-v1``'s
    :class:`SharedIn`, ``nixl-v1``'s ``NixlIn``): its fetches ask for located answers, a
    landed message is released whole, and a message lands within one call."""

    def open_fetch(self, session: proto.Session, keys: tuple[bytes, ...], window: int,
                   now: float, deadline: float, lane: int = 0) -> proto.Fetch:
        return session.fetch_shared(keys, window, now, deadline=deadline)

    def settled(self, session: proto.Session,
                ev: proto.BlockArrived | proto.BlocksLocated) -> list[proto.Message]:
        return [session.release(ev.req, ev.idx)]

    def cancel(self, req: int) -> None:
        pass  # a located message is landed whole, within one call

    def read_pending(self, now: float) -> None:
        pass  # located messages come on the DEALER


class SharedIn(LocatedIn):
    """One outbound connection's view of its peer's pool (IO thread only).

    Attaching: :meth:`begin` right after the handshake, :meth:`answered` with the
    server's verdict. Then, as the connection's data path: :meth:`open_fetch` asks for
    the segment, :meth:`land` copies each ``located`` message, :meth:`settled` releases
    it. :meth:`close` once the connection ends.
    """

    kind = "shm"
    lanes = 1

    def __init__(self, parts: SharedReceiver, address: str,
                 fetch_of: Callable[[int], Receiving | None]) -> None:
        self._parts = parts
        self._address = address
        self._fetch_of = fetch_of
        self.budget = parts.budget
        #: The peer's pool, mapped read-only once the proof was sent.
        self.mapping: MappedSegment | None = None
        #: How blocks move on this connection and why (the segment used, or the reason
        #: it stays on TCP).
        self.detail = ""

    # -- attaching -----------------------------------------------------------------------

    def begin(self, session: proto.Session) -> proto.Attach | None:
        """Right after the handshake: the ``attach`` to send, or None when this
        connection stays on TCP (:attr:`detail` says why)."""
        offer = session.shm_offer
        if not self._parts.enabled:
            self.detail = "shared memory is off on this node"
            return None
        if not session.shm_negotiated:
            self.detail = "the peer does not offer shm-v1"
            return None
        if offer is None:
            self.detail = "the peer's pool is not in shared memory"
            self._fell_back(ShmFallback.NO_SEGMENT)
            return None
        try:
            mapping = MappedSegment(offer.name, offer.size, self._parts.segments)
        except ShmUnavailable as exc:
            self.detail = f"cannot use the peer's segment: {exc}"
            self._fell_back(ShmFallback.CANNOT_MAP)
            return None
        self.mapping = mapping
        return session.attach(mapping.nonce)

    def answered(self, ev: proto.AttachAnswered) -> None:
        """The server's verdict on our proof."""
        mapping = self.mapping
        if ev.ok and mapping is not None:
            self.detail = f"segment {mapping.name}, mapped read-only"
            log.info("%s: blocks move through shared memory (%s)", self._address,
                     mapping.name)
            return
        self.detail = f"the peer refused the shared-memory proof: {ev.msg}"
        self._fell_back(ShmFallback.REFUSED)
        self.close()

    def close(self) -> None:
        """Unmap the peer's segment (connection closed, or the proof was refused)."""
        mapping, self.mapping = self.mapping, None
        if mapping is not None:
            mapping.close()

    def _fell_back(self, why: ShmFallback) -> None:
        self._parts.counters.fell_back(why)
        log.info("%s: blocks move over TCP: %s", self._address, self.detail)

    # -- the data path -------------------------------------------------------------------

    def land(self, arrived: proto.DataArrived) -> None:
        """Copy the located blocks into their fetch's destinations (none once it was
        cancelled or is over) and settle each key. Raises the violation when the server
        names a slot outside its pool; :meth:`settled` releases every index, copied or
        not."""
        assert isinstance(arrived, proto.BlocksLocated)
        recv = self._fetch_of(arrived.req)
        with writable(recv, recv) as ok:
            self._copy(recv if ok else None, arrived)

    def _copy(self, recv: Receiving | None, ev: proto.BlocksLocated) -> None:
        mapping = self.mapping
        if mapping is None:
            raise ProtocolError(proto.Code.UNEXPECTED, "located without an attached segment")
        slots = mapping.num_blocks
        for slot in ev.slots:
            if slot >= slots:
                raise ProtocolError(proto.Code.OUT_OF_BOUNDS, f"located slot {slot} is "
                                    f"outside the peer's {slots}-slot pool")
        if recv is None:
            return
        landing = self._parts.landing
        index_map = recv.index_map
        wanted = [n for n, idx in enumerate(ev.idx) if idx < len(index_map)]
        with landing.guard():
            # The message's slots are taken in one store call, copied (and hashed on the
            # way) one after the other, and committed in one store call.
            blocks = landing.open_many(recv, [index_map[ev.idx[n]] for n in wanted],
                                       [ev.sums[n] for n in wanted])
            copied = [(n, block) for n, block in zip(wanted, blocks, strict=True)
                      if block is not None]
            sums = copy_blocks([block.views for _, block in copied],
                               [mapping.sources(ev.slots[n]) for n, _ in copied],
                               checksums=any(b.expected is not None for _, b in copied),
                               threads=self._parts.threads)
            if sums is not None:
                for (_, block), actual in zip(copied, sums, strict=True):
                    if block.expected is not None:
                        block.actual = actual
            landed = landing.settle_many(recv, [block for _, block in copied])
        self._parts.counters.moved(self.kind, RECEIVED, landed, landed * self._parts.bpb)

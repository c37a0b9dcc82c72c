"""The fetching side of ``shm-v1``: map a same-host peer's pool, prove it, copy from it.

After a handshake that negotiated ``shm-v1`` and whose ``welcome`` named a segment, the
client maps the segment read-only (:class:`~p2pkv.shm.MappedSegment` checks owner uid,
mode 0600, boot id and network namespace) and echoes the nonce it read in an ``attach``.
Anything less (shared memory off here, a peer without a segment, a segment it cannot
map, a refused proof) leaves the connection on TCP, silently, and the reason is kept in
:attr:`~p2pkv.runtime.state.Outbound.shm_detail` for ``PeerHandle``, ``probe`` and stats.

Landing a ``located`` message copies each block's segments straight from the mapped pool
into its destination (a store slot invisible until committed, or caller buffers), one
bounded ``memcpy`` per segment, then verifies it like a received block. The copy runs on
the IO thread: a read burst is at most a few MiB, well under a millisecond of copying,
so a lookup queued meanwhile waits no longer than behind the TCP path's ``recv_into``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import xxhash

from p2pkv import protocol as proto
from p2pkv.errors import ProtocolError, StoreFullError
from p2pkv.runtime.public import KeyOutcome
from p2pkv.runtime.state import Outbound, Receiving
from p2pkv.runtime.stats import Counters
from p2pkv.shm import MappedSegment, ShmUnavailable
from p2pkv.store import BlockStore, BlockWriter, ChecksumMismatch, StoreError

__all__ = ["SharedReceiver"]

log = logging.getLogger("p2pkv.node")


class SharedReceiver:
    """Attaches to peers' segments and lands located blocks (IO thread only)."""

    def __init__(self, store: BlockStore, segments: Sequence[int], bytes_per_block: int,
                 counters: Counters, *, enabled: bool) -> None:
        self._store = store
        self._segments = tuple(segments)
        self._bpb = bytes_per_block
        self._counters = counters
        self._enabled = enabled

    # -- attaching -----------------------------------------------------------------------

    def begin(self, conn: Outbound) -> proto.Attach | None:
        """Right after the handshake: the ``attach`` to send, or None when this
        connection stays on TCP (``conn.shm_detail`` says why)."""
        session = conn.session
        offer = session.shm_offer
        if not self._enabled:
            conn.shm_detail = "shared memory is off on this node"
            return None
        if not session.shm_negotiated:
            conn.shm_detail = "the peer does not offer shm-v1"
            return None
        if offer is None:
            conn.shm_detail = "the peer's pool is not in shared memory"
            self._fell_back(conn, "no_segment")
            return None
        try:
            mapping = MappedSegment(offer.name, offer.size, self._segments)
        except ShmUnavailable as exc:
            conn.shm_detail = f"cannot use the peer's segment: {exc}"
            self._fell_back(conn, "cannot_map")
            return None
        conn.shm = mapping
        return session.attach(mapping.nonce)

    def answered(self, conn: Outbound, ev: proto.AttachAnswered) -> None:
        """The server's verdict on our proof."""
        mapping = conn.shm
        if ev.ok and mapping is not None:
            conn.shm_detail = f"segment {mapping.name}, mapped read-only"
            log.info("%s: blocks move through shared memory (%s)", conn.address, mapping.name)
            return
        conn.shm_detail = f"the peer refused the shared-memory proof: {ev.msg}"
        self._fell_back(conn, "refused")
        self.forget(conn)

    def forget(self, conn: Outbound) -> None:
        """Unmap the peer's segment (connection closed, or the proof was refused)."""
        mapping, conn.shm = conn.shm, None
        if mapping is not None:
            mapping.close()

    def _fell_back(self, conn: Outbound, kind: str) -> None:
        self._counters.add(f"shm_fallback.{kind}")
        log.info("%s: blocks move over TCP: %s", conn.address, conn.shm_detail)

    # -- landing -------------------------------------------------------------------------

    def land(self, conn: Outbound, recv: Receiving | None,
             ev: proto.BlocksLocated) -> ProtocolError | None:
        """Copy the located blocks into their destinations and settle each key.

        Returns the violation when the server names a slot outside its pool. The caller
        releases every index of ``ev`` afterwards, copied or not.
        """
        mapping = conn.shm
        if mapping is None:
            return ProtocolError(proto.Code.UNEXPECTED, "located without an attached segment")
        slots = mapping.num_blocks
        for slot in ev.slots:
            if slot >= slots:
                return ProtocolError(proto.Code.OUT_OF_BOUNDS, f"located slot {slot} is "
                                     f"outside the peer's {slots}-slot pool")
        landed = 0
        for n, idx in enumerate(ev.idx):
            if recv is None or idx >= len(recv.index_map):
                continue
            key_index = recv.index_map[idx]
            if self._copy(recv, key_index, mapping.sources(ev.slots[n]), ev.sums[n]):
                landed += 1
        self._counters.add("blocks_received", landed)
        self._counters.add("bytes_received", landed * self._bpb)
        self._counters.add("blocks_received_shm", landed)
        return None

    def _copy(self, recv: Receiving, key_index: int, sources: list[memoryview],
              expected: int | None) -> bool:
        """One block: copy, verify, commit. True when it landed."""
        writer: BlockWriter | None = None
        if recv.destinations is not None:
            views: Sequence[memoryview] = recv.destinations[key_index]
        else:
            try:
                writer = self._store.begin_write(recv.keys[key_index])
            except (StoreError, StoreFullError) as exc:
                recv.outcomes[key_index] = KeyOutcome.FAILED
                recv.errors[key_index] = f"no slot in the local pool: {exc}"
                return False
            if writer is None:
                # Being written by another fetch, or stored meanwhile.
                stored = self._store.contains(recv.keys[key_index])
                recv.outcomes[key_index] = KeyOutcome.STORED if stored else KeyOutcome.FAILED
                if not stored:
                    recv.errors[key_index] = ("the block was being written by another "
                                              "fetch at the time")
                return False
            views = writer.views
        try:
            if expected is None:
                for dst, src in zip(views, sources, strict=True):
                    dst[:] = src
            else:
                # Hash each segment right after copying it, while it is still in cache:
                # verifying then costs a fraction of a second pass over the block.
                h = xxhash.xxh3_64()
                for dst, src in zip(views, sources, strict=True):
                    dst[:] = src
                    h.update(dst)
                actual = h.intdigest()
                if actual != expected:
                    raise ChecksumMismatch(recv.keys[key_index], expected, actual)
            if writer is not None:
                writer.commit()
        except ChecksumMismatch as exc:
            self._counters.add("checksum_failures")
            recv.outcomes[key_index] = KeyOutcome.FAILED
            recv.errors[key_index] = f"block dropped: {exc}"
            return False
        finally:
            if writer is not None and not writer.done:
                writer.abort()
        recv.outcomes[key_index] = KeyOutcome.STORED
        recv.blocks += 1
        recv.nbytes += self._bpb
        return True

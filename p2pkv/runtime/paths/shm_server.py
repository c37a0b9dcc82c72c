"""The serving side of ``shm-v1`` (and ``nixl-v1``): check a peer's proof, locate blocks,
hold their pins.

A peer that negotiated ``shm-v1`` gets this node's segment in the ``welcome``; its
``attach`` must echo the nonce that exists only inside the segment (a peer that cannot
map the segment cannot know it). After an accepted attach, a fetch that asks for shared
memory is answered with ``located`` messages: each block is pinned in the store and its
slot sent instead of its bytes. A pin lasts until the peer's ``release``, an ``abort``
of the fetch, or the end of the connection — a peer that dies or goes silent ends it at
its heartbeat deadline — so nothing the peer may still be copying is ever overwritten,
and nothing a dead peer held stays pinned.

``nixl-v1`` (SPEC §20) is served by the same machinery: the proof is the nonce the
node's NIXL exporter registered (read one-sided by the peer's agent instead of through
a mapping), and the located slots are READ out of the pool instead of copied from it.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterable

import zmq

from p2pkv import protocol as proto
from p2pkv.protocol.codes import OUTCOME_SENT
from p2pkv.runtime.paths.interfaces import Sending
from p2pkv.runtime.paths.sender import pin_next_batch
from p2pkv.runtime.stats import SENT, Count, Counters
from p2pkv.shm import SharedSegment
from p2pkv.store import BlockReader, BlockStore

__all__ = ["SharedOut", "SharedSender"]

log = logging.getLogger("p2pkv.node")

_BATCH: int = 1024
"""Most blocks per ``located`` message (its header is a few bytes per block)."""


class SharedSender:
    """Proof checks, ``located`` answers and the pins they hold (IO thread only).

    ``pin_limit`` bounds the blocks one peer may hold pinned at once, whatever credit it
    grants: a peer that never releases cannot pin the whole pool.
    """

    def __init__(self, sock: zmq.Socket[bytes], store: BlockStore,
                 segment: SharedSegment | None, bytes_per_block: int, counters: Counters,
                 *, pin_limit: int, nixl_nonce: bytes | None = None) -> None:
        self._sock = sock
        self._store = store
        self._segment = segment
        #: The nonce this node's NIXL exporter registered (None: no NIXL pool offered).
        self._nixl_nonce = nixl_nonce
        self._bpb = bytes_per_block
        self._counters = counters
        self._pin_limit = max(1, pin_limit)
        # Pins by peer, fetch and index.
        self._pins: dict[bytes, dict[int, dict[int, BlockReader]]] = {}
        self._attached: set[bytes] = set()
        # Since when each peer holding pins has released none (the stall clock).
        self._progress: dict[bytes, float] = {}

    @property
    def offer(self) -> proto.ShmOffer | None:
        """What the ``welcome`` names: this node's segment, if its pool has one."""
        seg = self._segment
        return None if seg is None or seg.closed else proto.ShmOffer(seg.name, seg.size)

    def attached_peers(self) -> int:
        return len(self._attached)

    def pinned(self) -> int:
        """Blocks pinned for located answers not yet released, over all peers."""
        return sum(len(p) for peers in self._pins.values() for p in peers.values())

    # -- the proof -----------------------------------------------------------------------

    def verify(self, rid: bytes, session: proto.Session,
               ev: proto.AttachRequested) -> proto.Attached:
        """The verdict on a peer's ``attach``: its nonce must be the segment's, or (``via``
        ``nixl-v1``) the one registered with this node's NIXL agent."""
        seg = self._segment
        if ev.via == proto.VIA_NIXL:
            want, what = self._nixl_nonce, "NIXL pool"
        else:
            want, what = (None if seg is None or seg.closed else seg.nonce), "segment"
        if want is not None and hmac.compare_digest(ev.nonce, want):
            self._attached.add(rid)
            self._counters.add(Count.SHM_ATTACHED)
            log.info("peer %s proved it reads this node's %s: blocks are located for it",
                     rid.hex(), what)
            return session.attach_verdict(True, "")
        self._counters.add(Count.SHM_ATTACH_REFUSED)
        log.warning("peer %s echoed a wrong nonce for the %s; it gets TCP", rid.hex(), what)
        return session.attach_verdict(False, f"the nonce does not match this node's {what}")

    # -- located answers -----------------------------------------------------------------

    def stalled_for(self, rid: bytes, now: float) -> float:
        """Seconds peer ``rid`` has held pins without releasing any (0: it holds none).
        A peer that maps the pool but never releases would otherwise keep
        ``pin_limit`` blocks pinned for as long as it answers pings."""
        since = self._progress.get(rid)
        if since is None or not any(self._pins.get(rid, {}).values()):
            self._progress.pop(rid, None)
            return 0.0
        return max(0.0, now - since)

    def can_send(self, rid: bytes) -> bool:
        return sum(len(p) for p in self._pins.get(rid, {}).values()) < self._pin_limit

    def send_job(self, rid: bytes, session: proto.Session, job: Sending) -> bool:
        """Locate what the credit of ``job`` and the pin limit allow. False: the peer is
        unreachable (the caller drops it, which releases its pins)."""
        store = self._store
        n = len(job.keys)
        checksums = session.checksums
        peer_pins = self._pins.setdefault(rid, {})
        held = sum(len(p) for p in peer_pins.values())
        credit = min(session.window_left(job.req), self._pin_limit - held)
        while credit > 0 and job.next_index < n:
            idx, readers = pin_next_batch(store, job, credit, _BATCH)
            credit -= len(idx)
            if not idx:
                continue
            if not any(peer_pins.values()):
                self._progress[rid] = time.monotonic()  # the clock starts with a pin
            pins = peer_pins.setdefault(job.req, {})
            pins.update(zip(idx, readers, strict=True))
            sums = [r.checksum for r in readers] if checksums else None
            msg = session.located(job.req, idx, [r.slot for r in readers], sums)
            try:
                self._sock.send_multipart([rid, *proto.encode(msg)], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.info("peer %s unreachable while locating blocks (%s)", rid.hex(), exc)
                return False
            for i in idx:
                job.outcomes[i] = OUTCOME_SENT
            self._counters.add(Count.BLOCKS_SENT, len(idx))
            self._counters.add(Count.BYTES_SENT, len(idx) * self._bpb)
            self._counters.moved("shm", SENT, len(idx), len(idx) * self._bpb)
        return True

    # -- pins ----------------------------------------------------------------------------

    def release(self, rid: bytes, req: int, idx: Iterable[int]) -> None:
        """The peer copied blocks ``idx`` of fetch ``req``; indices it does not hold are
        ignored (a release may cross an abort)."""
        pins = self._pins.get(rid, {}).get(req)
        if not pins:
            return
        readers = [r for r in (pins.pop(i, None) for i in idx) if r is not None]
        if readers:
            self._progress[rid] = time.monotonic()
        if not pins:
            self._pins[rid].pop(req, None)
        self._store.release_many(readers)

    def abort(self, rid: bytes, req: int) -> None:
        """The fetch was aborted: the peer reads none of its blocks any more."""
        pins = self._pins.get(rid, {}).pop(req, None)
        if pins:
            self._store.release_many(pins.values())

    def forget(self, rid: bytes) -> None:
        """The connection ended (bye, heartbeat deadline, violation): unpin everything."""
        self._attached.discard(rid)
        self._progress.pop(rid, None)
        for pins in self._pins.pop(rid, {}).values():
            self._store.release_many(pins.values())

    def release_all(self) -> None:
        for rid in list(self._pins):
            self.forget(rid)


class SharedOut:
    """The serving half of ``shm-v1`` for one peer whose proof was accepted (the
    ``shm`` kind of :mod:`p2pkv.runtime.paths`): its shared fetches are located, their
    ``done`` goes on ZeroMQ, and its pins end with the fetch or the peer."""

    kind = "shm"

    def __init__(self, shm: SharedSender, rid: bytes,
                 send: Callable[[Iterable[proto.Message]], bool]) -> None:
        self._shm = shm
        self._rid = rid
        self._send = send

    def can_send(self, session: proto.Session, job: Sending) -> bool:
        return self._shm.can_send(self._rid)  # the pin limit

    def send(self, session: proto.Session, job: Sending) -> bool:
        return self._shm.send_job(self._rid, session, job)

    def finish(self, session: proto.Session, job: Sending) -> bool:
        return self._send([session.fetch_done(job.req, job.outcomes)])

    def abort(self, req: int) -> None:
        self._shm.abort(self._rid, req)

    def release(self, req: int, idx: Iterable[int]) -> None:
        """The peer copied blocks ``idx`` of fetch ``req``."""
        self._shm.release(self._rid, req, idx)

    def stalled_for(self, now: float) -> float:
        return self._shm.stalled_for(self._rid, now)

    @property
    def busy(self) -> bool:
        return False

    def close(self) -> None:
        self._shm.forget(self._rid)

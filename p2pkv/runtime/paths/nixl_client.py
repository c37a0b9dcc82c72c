"""The fetching side of ``nixl-v1``: READ a peer's blocks one-sided out of its pool.

After a handshake that negotiated ``nixl-v1`` (with ``shm-v1``, whose messages it
speaks) and whose ``welcome`` described the peer's pool as its NIXL agent exposes it,
the client loads the agent's metadata into its own agent, READs the 16-byte nonce at
the address the offer names and echoes it in an ``attach`` with ``via`` ``nixl-v1``
(SPEC §20). Anything less (NIXL off here, no offer, metadata NIXL refuses, a READ that
fails) leaves the connection on its other paths, and the reason is kept in
:attr:`NixlIn.detail`. Once the proof was accepted, :class:`NixlIn` is the connection's
data path (the ``nixl`` kind of :mod:`p2pkv.runtime.paths`).

Landing a ``located`` message READs its blocks' segments into this node's staging
memory (:class:`~p2pkv.nixl.Importer`), then copies each block into its destination (a
store slot invisible until committed, or caller buffers) while hashing it, and settles
it like any received block. Never straight into the destination: a READ that misses its
deadline may still complete later, and must not write where a later block lands (the
importer retires its staging memory until then). A READ that misses its deadline, or
whose holder is gone, fails the keys of its message and nothing else; one that the
holder's agent refuses (addresses the offer said were registered) is the peer's
violation. The READ runs on the IO thread, bounded by ``NodeConfig.nixl_read_timeout``
(the proof's by the handshake's).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from p2pkv import protocol as proto
from p2pkv.checksum import copy_blocks, copy_threads
from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.nixl import (
    Exporter,
    Importer,
    NixlReadFailed,
    NixlUnavailable,
    rdma_devices,
    ucx_version,
    unavailable_reason,
)
from p2pkv.protocol.codes import SHM_NONCE_LEN
from p2pkv.runtime.config import NodeConfig
from p2pkv.runtime.paths.landing import Landed, Landing
from p2pkv.runtime.paths.shm_client import LocatedIn
from p2pkv.runtime.public import PeerHandle
from p2pkv.runtime.state import Receiving, writable
from p2pkv.runtime.stats import RECEIVED, Counters, ShmFallback
from p2pkv.store.pool import BlockPool

__all__ = ["NixlIn", "NixlPool", "NixlReceiver", "nixl_caps", "nixl_stats", "start_nixl"]

log = logging.getLogger("p2pkv.node")

_STAGING_BYTES = 64 << 20
"""The importer's staging memory, the most one READ moves (a located message's blocks
are READ in batches that fit, at least one block each)."""


@dataclass(frozen=True, eq=False)
class NixlPool:
    """A node's two NIXL agents: the exporter of its pool (its own thread) and the
    importer its outbound connections READ with (the IO thread's)."""

    exporter: Exporter
    importer: Importer
    #: Slots per region of the exported pool.
    slots: int

    @property
    def offer(self) -> proto.NixlOffer:
        """What the ``welcome`` says of the pool (SPEC §20.2)."""
        ex = self.exporter
        return proto.NixlOffer(ex.name, ex.metadata, tuple(ex.regions), self.slots,
                               ex.nonce_address)

    def close(self) -> None:
        """Both agents go (IO thread, once it is done with the importer)."""
        self.importer.close()
        self.exporter.close()


def start_nixl(config: NodeConfig, pool: BlockPool, node_id: str
               ) -> tuple[NixlPool | None, str]:
    """The NIXL agents of a node whose ``pool`` it exports, as ``config.nixl`` asks, or
    None and why not. ``"on"`` where NIXL cannot be used is the user's error
    (ConfigError, named); ``"auto"`` then goes on without it."""
    mode, name, slots = config.nixl, f"p2pkv-{node_id}", pool.num_blocks
    regions = [(addr, slots * size) for addr, size in
               zip(pool.region_data_ptrs(), pool.segment_sizes, strict=True)]
    if mode == "off":
        return None, "off (nixl = off)"
    if config.curve is not None:
        return None, "off: never under CURVE (UCX moves blocks in the clear)"
    if mode == "auto" and not rdma_devices():
        return None, "off: this host has no RDMA device (nixl = auto)"
    why = unavailable_reason()
    if why is None:
        exporter: Exporter | None = None
        try:
            exporter = Exporter(name, regions)
            # Staging for at least one whole block: a READ never splits one.
            staging = max(_STAGING_BYTES, sum(pool.segment_sizes))
            agents = NixlPool(exporter, Importer(f"{name}-in", staging_bytes=staging), slots)
            devices = ", ".join(rdma_devices()) or "none"
            return agents, (f"on: UCX {ucx_version() or 'of unknown version'}, UCX_TLS "
                          f"{os.environ.get('UCX_TLS') or 'unset (UCX chooses)'}, "
                          f"RDMA devices: {devices}")
        except NixlUnavailable as exc:
            if exporter is not None:
                exporter.close()
            why = str(exc)
    if mode == "on":
        raise ConfigError(f"'on', but NIXL cannot be used here: {why}", option="nixl")
    log.warning("NIXL is not used: %s", why)
    return None, f"off: {why}"


def nixl_caps(caps: tuple[str, ...], nixl: NixlPool | None) -> tuple[str, ...]:
    """A node's capabilities with nixl-v1, and shm-v1 whose messages it speaks (§20.1),
    where it uses NIXL."""
    return caps if nixl is None else tuple(
        dict.fromkeys((*caps, proto.CAP_SHM_V1, proto.CAP_NIXL_V1)))


def nixl_stats(nixl: NixlPool | None, handles: Sequence[PeerHandle]) -> dict[str, int]:
    """The NIXL counts of ``NodeStats``."""
    return {"nixl_peers_out": sum(1 for h in handles if h.data_path == "nixl"),
            "nixl_read_failures": 0 if nixl is None else nixl.importer.failures,
            "nixl_retired": 0 if nixl is None else nixl.importer.zombies}


class NixlReceiver:
    """What the NIXL links of this node's outbound connections share: the one importer
    (its agent is used on the IO thread only) and the landing."""

    def __init__(self, landing: Landing, segments: Sequence[int], counters: Counters,
                 budget: proto.CreditBudget, importer: Importer | None, *,
                 read_timeout: float, proof_timeout: float, threads: int = 1) -> None:
        self.landing = landing
        self.segments = tuple(segments)
        self.bpb = sum(self.segments)
        self.counters = counters
        self.budget = budget
        #: None: NIXL is not used by this node (off, or unavailable; see the node).
        self.importer = importer
        self.read_timeout = read_timeout
        #: Connections reading from each loaded holder (two connections to one holder,
        #: or a new one before the old one closed, share its metadata).
        self._users: collections.Counter[str] = collections.Counter()
        #: The nonce's READ is part of the handshake: bounded by its timeout.
        self.proof_timeout = proof_timeout
        self.threads = copy_threads(threads)

    def link(self, address: str, fetch_of: Callable[[int], Receiving | None]) -> NixlIn:
        """The NIXL side of a new connection to ``address`` (not attached)."""
        return NixlIn(self, address, fetch_of)

    def load(self, meta: bytes) -> str:
        """A holder's agent, loaded for one more connection (NixlReadFailed where NIXL
        refuses its metadata)."""
        assert self.importer is not None
        agent = self.importer.add_peer(meta)
        self._users[agent] += 1
        return agent

    def unload(self, agent: str) -> None:
        """One connection less reads from ``agent``; its metadata goes with the last."""
        self._users[agent] -= 1
        if self._users[agent] <= 0:
            del self._users[agent]
            if self.importer is not None:
                self.importer.remove_peer(agent)


class NixlIn(LocatedIn):
    """One outbound connection's READs from its peer's pool (IO thread only).

    Attaching: :meth:`begin` right after the handshake (when shared memory is not
    used), :meth:`answered` with the server's verdict. Then, as the connection's data
    path: :meth:`open_fetch` asks for located answers, :meth:`land` READs each
    ``located`` message, :meth:`settled` releases it. :meth:`close` once the
    connection ends.
    """

    kind = "nixl"
    lanes = 1

    def __init__(self, parts: NixlReceiver, address: str,
                 fetch_of: Callable[[int], Receiving | None]) -> None:
        self._parts = parts
        self._address = address
        self._fetch_of = fetch_of
        self.budget = parts.budget
        #: The peer's offer and its agent's name here, once its metadata was loaded.
        self._offer: proto.NixlOffer | None = None
        self._agent: str | None = None
        #: How blocks move on this connection and why (the agent used, or the reason
        #: it stays on the other paths).
        self.detail = ""

    # -- attaching -----------------------------------------------------------------------

    def begin(self, session: proto.Session, deadline: float) -> proto.Attach | None:
        """Right after the handshake: the ``attach`` to send, or None when this
        connection does not READ through NIXL (:attr:`detail` says why). The nonce's
        READ is bounded by ``deadline`` and the handshake's timeout."""
        importer = self._parts.importer
        offer = session.nixl_offer
        if importer is None:
            self.detail = "NIXL is not used by this node"
            return None
        if proto.CAP_NIXL_V1 not in session.capabilities:
            self.detail = "the peer does not offer nixl-v1"
            return None
        if offer is None:
            self.detail = "the peer's pool is not registered with NIXL"
            self._fell_back(ShmFallback.NO_SEGMENT)
            return None
        until = min(deadline, time.monotonic() + self._parts.proof_timeout)
        try:
            agent = self._parts.load(offer.meta)
            self._offer, self._agent = offer, agent
            if agent != offer.agent:
                raise NixlReadFailed(f"its metadata names agent {agent!r}, its offer "
                                     f"{offer.agent!r}", peer_fault=True)
            (nonce,) = importer.read(agent, [(offer.nonce, SHM_NONCE_LEN)], until)
            proof = bytes(nonce)
        except NixlReadFailed as exc:
            self.detail = f"cannot READ the peer's pool through NIXL: {exc}"
            self._fell_back(ShmFallback.CANNOT_MAP)
            self.close()
            return None
        return session.attach(proof, proto.VIA_NIXL)

    def answered(self, ev: proto.AttachAnswered) -> None:
        """The server's verdict on our proof."""
        if ev.ok and self._agent is not None:
            self.detail = f"NIXL agent {self._agent}, read one-sided"
            log.info("%s: blocks are READ through NIXL (agent %s)", self._address,
                     self._agent)
            return
        self.detail = f"the peer refused the NIXL proof: {ev.msg}"
        self._fell_back(ShmFallback.REFUSED)
        self.close()

    def close(self) -> None:
        """Forget the peer's agent (connection closed, or the proof failed)."""
        agent, self._agent = self._agent, None
        self._offer = None
        if agent is not None:
            self._parts.unload(agent)

    def _fell_back(self, why: ShmFallback) -> None:
        self._parts.counters.fell_back(why)
        log.info("%s: blocks do not move through NIXL: %s", self._address, self.detail)

    # -- the data path -------------------------------------------------------------------

    def land(self, arrived: proto.DataArrived) -> None:
        """READ the located blocks into their fetch's destinations (none once it was
        cancelled or is over) and settle each key. Raises the violation when the server
        names a slot outside its pool, the same slot twice, or addresses its agent
        refuses; :meth:`settled` releases every index, read or not."""
        assert isinstance(arrived, proto.BlocksLocated)
        offer, agent = self._offer, self._agent
        if offer is None or agent is None:
            raise ProtocolError(proto.Code.UNEXPECTED, "located without an attached pool")
        if len(set(arrived.slots)) != len(arrived.slots):
            raise ProtocolError(proto.Code.OUT_OF_BOUNDS, "located names one slot twice")
        for slot in arrived.slots:
            if slot >= offer.slots:
                raise ProtocolError(proto.Code.OUT_OF_BOUNDS, f"located slot {slot} is "
                                    f"outside the peer's {offer.slots}-slot pool")
        recv = self._fetch_of(arrived.req)
        with writable(recv, recv) as ok:
            if ok and recv is not None:
                self._read(recv, arrived, offer, agent)

    def _read(self, recv: Receiving, ev: proto.BlocksLocated, offer: proto.NixlOffer,
              agent: str) -> None:
        parts = self._parts
        landing = parts.landing
        index_map = recv.index_map
        wanted = [n for n, idx in enumerate(ev.idx) if idx < len(index_map)]
        until = time.monotonic() + parts.read_timeout
        with landing.guard():
            blocks = landing.open_many(recv, [index_map[ev.idx[n]] for n in wanted],
                                       [ev.sums[n] for n in wanted])
            opened = [(ev.slots[n], block) for n, block in zip(wanted, blocks, strict=True)
                      if block is not None]
            landed = 0
            for batch in self._batches(opened):
                landed += self._read_batch(recv, batch, offer, agent, until)
        parts.counters.moved(self.kind, RECEIVED, landed, landed * parts.bpb)

    def _batches(self, opened: list[tuple[int, Landed]]) -> list[list[tuple[int, Landed]]]:
        """The blocks of one message in READs that each fit the staging memory."""
        importer = self._parts.importer
        assert importer is not None
        per = max(1, importer.staging_bytes // self._parts.bpb)
        return [opened[i:i + per] for i in range(0, len(opened), per)]

    def _read_batch(self, recv: Receiving, batch: list[tuple[int, Landed]],
                    offer: proto.NixlOffer, agent: str, until: float) -> int:
        """One READ for ``batch``, copied (and hashed) into its destinations and
        settled; a READ that fails fails these keys only. The blocks landed."""
        parts = self._parts
        importer = parts.importer
        assert importer is not None
        segments = parts.segments
        sources = [piece for slot, _ in batch for piece in offer.sources(slot, segments)]
        try:
            staged = importer.read(agent, sources, until)
        except NixlReadFailed as exc:
            if exc.peer_fault:
                raise ProtocolError(proto.Code.OUT_OF_BOUNDS,
                                    f"the peer's agent refused a READ of its pool: {exc}"
                                    ) from exc
            for _, block in batch:
                parts.landing.fail(recv, block.key_index, f"NIXL read failed: {exc}")
            return 0
        per_block = len(segments)
        sums = copy_blocks([block.views for _, block in batch],
                           [staged[i * per_block:(i + 1) * per_block]
                            for i in range(len(batch))],
                           checksums=any(b.expected is not None for _, b in batch),
                           threads=parts.threads)
        if sums is not None:
            for (_, block), actual in zip(batch, sums, strict=True):
                if block.expected is not None:
                    block.actual = actual
        return parts.landing.settle_many(recv, [block for _, block in batch])

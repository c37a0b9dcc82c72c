"""The reader's side of the one-sided NIXL read path: reads of a holder's memory into a
registered staging area.

An :class:`Importer` is an agent used from one thread (the node's IO thread: NIXL
agents are not safe to share between threads) and a staging buffer registered with it.
:meth:`Importer.read` reads pieces ``(remote address, length)`` of one holder with one
READ, packed one after the other in the staging buffer, and returns a view of each; the
caller copies them out (and verifies their checksums) before its next read.

Failures. NIXL refuses pieces outside what the holder registered before anything is
sent (``nixlNotFoundError``): the holder's answer was wrong, ``peer_fault`` is True. A
disconnect comes as an exception, a hung holder as a READ in progress forever that the
reader's own deadline ends: ``peer_fault`` is False.

Retired buffers ("zombies"). Releasing an unfinished READ does not stop it: its data
may still land later (seen with a hung holder that resumes, even after its metadata was
removed). So a READ that did not complete keeps its staging buffer and its unreleased
handle, and the next read gets a fresh buffer. Each later call checks the retired READs
(non-blocking) and frees a buffer once its READ is over: done, or failed in UCX. With
``max_zombies`` pending, reads are refused until one ends. A holder removed while READs
from it are pending stays loaded until they end (without its metadata, NIXL no longer
says whether they did); where its metadata must be replaced (it restarted under the
same name), they are orphaned: kept until :meth:`~Importer.close`, which destroys the
agent, and with it every endpoint, before it unmaps any buffer.

Descriptors are built per read with ``initialize_xfer``. Measured here (CMA; build,
post, wait, release; median): 1 piece 7 µs against 10 µs for two ``prep_xfer_dlist``
and ``make_prepped_xfer``, 256 pieces 199 against 207 µs, 1024 pieces 0.80 against
0.91 ms. Past :data:`_ARRAY_FROM` pieces, numpy checks and lays them out (1024 pieces:
242 µs against 287 µs in Python; 8 pieces: 16 µs against 5 µs).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import numpy as np

from p2pkv.nixl.agent import NixlReadFailed, NixlUnavailable, agent_name_of, new_agent

__all__ = ["Importer"]

log = logging.getLogger("p2pkv.nixl")

_ARRAY_FROM: Final = 128  # longer descriptor lists are built with numpy
_TIGHT_S: Final = 0.0001  # seconds a read polls without sleeping after it is posted
_FIRST_PAUSE_S: Final = 0.00005
_MAX_PAUSE_S: Final = 0.001
_PAUSE_SHARE: Final = 0.01
"""The sleeps between two polls after that: 1 % of the time waited, 50 µs to 1 ms (over
TCP the reader's progress moves the data too; a hung holder costs 1000 polls/s)."""
_CLOSE_WAIT_S: Final = 30.0  # seconds close() waits for a read on another thread
_ADDRESS_END: Final = 1 << 64


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Staging:
    """One anonymous mapping registered with the agent; ``view`` covers all of it."""

    __slots__ = ("_export", "address", "memory", "registration", "view")

    def __init__(self, agent: Any, size: int) -> None:
        self.memory = mmap.mmap(-1, size)
        # The export keeps the mapping from being closed while NIXL knows its address.
        self._export: ctypes.c_char | None = ctypes.c_char.from_buffer(self.memory)
        self.address = ctypes.addressof(self._export)
        self.view = memoryview(self.memory)
        try:
            self.registration: Any = agent.register_memory(
                [(self.address, size, 0, "")], "DRAM")
        except BaseException:
            self.registration = None
            self.unmap()
            raise

    def deregister(self, agent: Any) -> None:
        registration, self.registration = self.registration, None
        if registration is not None:
            with contextlib.suppress(Exception):
                agent.deregister_memory(registration)

    def unmap(self) -> None:
        """Unmap, or leave it to the garbage collector while views handed out live."""
        with contextlib.suppress(BufferError):
            self.view.release()
        self._export = None
        with contextlib.suppress(BufferError):
            self.memory.close()


class _Zombie:
    """A READ that did not complete, with the staging buffer it may still write."""

    __slots__ = ("handle", "orphaned", "peer", "staging")

    def __init__(self, staging: _Staging, handle: Any, peer: str) -> None:
        self.staging = staging
        self.handle = handle
        self.peer = peer
        #: Its holder's metadata was replaced: NIXL can no longer say when it ends.
        self.orphaned = False

    def release(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.release()


class _Retired:
    """The zombies of one agent: retired READs and the buffers they may still write."""

    __slots__ = ("zombies",)

    def __init__(self) -> None:
        self.zombies: list[_Zombie] = []

    def __len__(self) -> int:
        return len(self.zombies)

    def reap(self, agent: Any) -> None:
        """Free the buffers of the READs that ended: their state is final, or raises (a
        failure in UCX). Orphans are kept: theirs raises while they may go on."""
        kept = []
        for zombie in self.zombies:
            ended = False
            if not zombie.orphaned:
                try:
                    ended = agent.check_xfer_state(zombie.handle) != "PROC"
                except Exception:
                    ended = True
            if not ended:
                kept.append(zombie)
                continue
            zombie.release()
            zombie.staging.deregister(agent)
            zombie.staging.unmap()
        self.zombies = kept

    def pending(self) -> set[str]:
        """The holders with READs NIXL can still say the end of."""
        return {z.peer for z in self.zombies if not z.orphaned}

    def orphan(self, peer: str) -> int:
        """Orphan the pending READs of ``peer`` (its metadata goes); how many."""
        orphans = [z for z in self.zombies if z.peer == peer and not z.orphaned]
        for zombie in orphans:
            zombie.orphaned = True
        return len(orphans)


def _layout(sources: Sequence[tuple[int, int]], base: int,
            limit: int) -> tuple[Any, Any, list[tuple[int, int]]]:
    """Local and remote descriptors of one read, and each piece's (offset, length) in
    the staging buffer. NixlReadFailed(peer_fault=True) for pieces that are not byte
    ranges (empty, negative, or ending past 2**64: NIXL does not check the end for
    wrapping); ValueError when they do not fit in ``limit`` bytes."""
    if len(sources) > _ARRAY_FROM:
        return _layout_array(sources, base, limit)
    remote = []
    spans = []
    offset = 0
    for address, length in sources:
        if length < 1 or address < 0 or address + length >= _ADDRESS_END:
            raise NixlReadFailed(f"piece ({address}, {length}) is not a byte range",
                                 peer_fault=True)
        remote.append((address, length, 0))
        spans.append((offset, length))
        offset += length
    if offset > limit:
        raise ValueError(f"{offset} bytes do not fit in the {limit}-byte staging area")
    return [(base + at, length, 0) for at, length in spans], remote, spans


def _layout_array(sources: Sequence[tuple[int, int]], base: int,
                  limit: int) -> tuple[Any, Any, list[tuple[int, int]]]:
    """:func:`_layout` for long lists, with numpy (Nx3 uint64 descriptor arrays)."""
    try:
        table = np.array(sources, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        table = None
    if table is None or table.ndim != 2 or table.shape[1] != 2:
        raise NixlReadFailed("the pieces are not (address, length) byte ranges",
                             peer_fault=True)
    addresses, lengths = table[:, 0], table[:, 1]
    # uint64 sums wrap silently: an end below its start wrapped.
    if (lengths == 0).any() or (addresses + lengths < addresses).any():
        raise NixlReadFailed("a piece is not a byte range (empty, or ending past 2**64)",
                             peer_fault=True)
    if (lengths > limit).any() or int(lengths.sum()) > limit:
        raise ValueError(f"{int(lengths.sum(dtype=object))} bytes do not fit in the "
                         f"{limit}-byte staging area")
    offsets = np.cumsum(lengths) - lengths
    devices = np.zeros_like(lengths)
    local = np.column_stack((offsets + np.uint64(base), lengths, devices))
    remote = np.column_stack((addresses, lengths, devices))
    return local, remote, list(zip(offsets.tolist(), lengths.tolist(), strict=True))


class Importer:
    """The reader's side: an agent used from one thread at a time (the node's IO
    thread; two at once raise RuntimeError, where NIXL would crash the process), and a
    registered staging area each read lands in.

    ``name`` is this agent's name (no holder's); ``staging_bytes`` the most one
    :meth:`read` moves; ``max_zombies`` the most retired buffers kept before reads are
    refused. The agent is made here, on the calling thread; NixlUnavailable if it cannot.
    """

    def __init__(self, name: str, *, staging_bytes: int = 64 << 20,
                 max_zombies: int = 4) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("an importer needs a non-empty agent name")
        if staging_bytes < 1:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        if max_zombies < 1:
            raise ValueError(f"max_zombies must be at least 1, got {max_zombies}")
        self.name = name
        self.staging_bytes = staging_bytes
        self.max_zombies = max_zombies
        self._agent: Any = new_agent(name)
        try:
            self._staging: _Staging | None = _Staging(self._agent, staging_bytes)
        except Exception as exc:
            self._agent = None
            raise NixlUnavailable(f"cannot register a {staging_bytes}-byte staging area "
                                  f"with NIXL: {_describe(exc)}") from None
        self._peers: dict[str, bytes] = {}  # loaded holders: name -> their blob
        self._leaving: set[str] = set()     # removed, still loaded until their READs end
        self._retired = _Retired()
        self._inflight: Any = None          # the READ of the running read(), if any
        self._lock = threading.Lock()
        self._closed = False
        self._reads = 0
        self._bytes_read = 0
        self._failures = 0

    # ------------------------------------------------------------------ statistics

    @property
    def reads(self) -> int:
        """Reads that completed."""
        return self._reads

    @property
    def bytes_read(self) -> int:
        """Bytes the completed reads moved."""
        return self._bytes_read

    @property
    def failures(self) -> int:
        """Reads that raised NixlReadFailed."""
        return self._failures

    @property
    def zombies(self) -> int:
        """Retired staging buffers whose READ may still write them."""
        return len(self._retired)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> tuple[str, ...]:
        """The holders :meth:`read` can read from now."""
        return tuple(sorted(set(self._peers) - self._leaving))

    @contextlib.contextmanager
    def _owned(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("an Importer is used by one thread at a time (NIXL agents "
                               "are not thread-safe)")
        try:
            yield
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ holders

    def add_peer(self, metadata: bytes) -> str:
        """Load a holder's metadata blob; returns the holder's agent name.

        The same blob again is a no-op; a later blob of the same holder (more regions)
        is merged. A blob under a name already loaded that NIXL refuses as another
        agent's (the holder restarted: new connection details) replaces the old one;
        its pending READs are orphaned. NixlReadFailed(peer_fault=True) for a blob
        NIXL refuses otherwise, or one that names this agent; what was loaded stays.
        """
        with self._owned():
            if self._closed:
                raise NixlUnavailable("the importer is closed")
            blob = bytes(metadata)
            name = agent_name_of(blob)
            if name is None:
                raise NixlReadFailed("the peer's blob is not NIXL agent metadata",
                                     peer_fault=True)
            if name == self.name:
                raise NixlReadFailed(f"the peer's metadata names this agent ({name!r})",
                                     peer_fault=True)
            known = self._peers.get(name)
            if known == blob:
                self._leaving.discard(name)
                return name
            error, replaced = self._load(blob)
            if replaced and known is not None:
                # The holder restarted: its new blob is refused until the old one goes.
                self._replace(name)
                error, replaced = self._load(blob)
            if error is not None:
                raise NixlReadFailed(f"NIXL refused the metadata of {name!r}: {error}",
                                     peer_fault=True)
            self._peers[name] = blob
            self._leaving.discard(name)
            return name

    def _load(self, blob: bytes) -> tuple[str | None, bool]:
        """Give a blob to NIXL: (None, False) when loaded, else what went wrong and
        whether NIXL refused it because another blob is loaded under its name."""
        try:
            self._agent.add_remote_agent(blob)
        except Exception as exc:
            return _describe(exc), type(exc).__name__ == "nixlNotAllowedError"
        return None, False

    def _replace(self, name: str) -> None:
        """Forget a holder whose metadata changed; its pending READs are orphaned."""
        self._reap()
        orphans = self._retired.orphan(name)
        if orphans:
            log.warning("NIXL holder %s restarted with %d reads from it pending: their "
                        "staging buffers are kept until the importer closes", name,
                        orphans)
        self._forget(name)

    def _forget(self, name: str) -> None:
        self._peers.pop(name, None)
        self._leaving.discard(name)
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(name)

    def remove_peer(self, name: str) -> None:
        """Forget a holder (its connection ended); unknown names are ignored. Reads from
        it fail from now on; NIXL keeps its metadata until its pending READs end."""
        with self._owned():
            if self._closed or name not in self._peers:
                return
            self._reap()
            if name in self._retired.pending():
                self._leaving.add(name)
            else:
                self._forget(name)

    # ------------------------------------------------------------------ reads

    def read(self, peer: str, sources: Sequence[tuple[int, int]],
             deadline: float) -> list[memoryview]:
        """Read the pieces ``(remote address, length)`` of holder ``peer`` with one
        READ; a view of each, in order, packed in the staging area.

        The views are valid until the next call of :meth:`read`. ``deadline`` is a
        :func:`time.monotonic` time. ValueError when the pieces add up to more than
        ``staging_bytes`` (the caller splits); NixlReadFailed otherwise (its
        ``peer_fault`` says whose fault).
        """
        with self._owned():
            try:
                return self._read(peer, sources, deadline)
            except NixlReadFailed:
                self._failures += 1
                raise

    def _read(self, peer: str, sources: Sequence[tuple[int, int]],
              deadline: float) -> list[memoryview]:
        if self._closed:
            raise NixlReadFailed("the importer is closed", peer_fault=False)
        self._reap()
        if peer not in self._peers or peer in self._leaving:
            raise NixlReadFailed(f"{peer!r} is not a loaded NIXL holder", peer_fault=False)
        if len(self._retired) >= self.max_zombies:
            raise NixlReadFailed(f"reads are suspended: {len(self._retired)} earlier reads "
                                 "have not ended", peer_fault=False)
        staging = self._staging_area()
        local, remote, spans = _layout(sources, staging.address, self.staging_bytes)
        if not spans:
            return []
        if time.monotonic() >= deadline:
            raise NixlReadFailed("the deadline passed before the read", peer_fault=False)
        self._post(peer, local, remote)
        failure = self._complete(deadline)
        if failure is not None:
            self._retire(peer)
            raise NixlReadFailed(f"read of {len(spans)} pieces from {peer}: {failure}",
                                 peer_fault=False)
        with contextlib.suppress(Exception):
            self._inflight.release()
        self._inflight = None
        self._reads += 1
        self._bytes_read += spans[-1][0] + spans[-1][1]
        view = staging.view
        return [view[at:at + length] for at, length in spans]

    def _staging_area(self) -> _Staging:
        """The staging buffer, a fresh one where the last was retired."""
        if self._staging is not None:
            return self._staging
        error = None
        try:
            self._staging = _Staging(self._agent, self.staging_bytes)
        except Exception as exc:
            error = _describe(exc)
        if self._staging is None:
            raise NixlReadFailed(f"no staging area: {error}", peer_fault=False)
        return self._staging

    def _post(self, peer: str, local: Any, remote: Any) -> None:
        """Create the READ request (``self._inflight``). NixlReadFailed, nothing sent,
        where NIXL refuses it; peer_fault where the pieces lie outside what the (loaded)
        holder registered: ``nixlNotFoundError``."""
        agent = self._agent
        error = None
        refused = False
        try:
            self._inflight = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"), peer, b"")
        except Exception as exc:
            refused = type(exc).__name__ == "nixlNotFoundError"
            error = _describe(exc)
        if error is not None:
            reason = "pieces outside what it registered" if refused else "a local error"
            raise NixlReadFailed(f"NIXL refused a read from {peer} ({reason}): {error}",
                                 peer_fault=refused)

    def _complete(self, deadline: float) -> str | None:
        """Post the READ and poll it until it is done (None) or the deadline, an error
        state or an exception ends it (what happened). Sleeps between polls after
        :data:`_TIGHT_S`, so that a holder in this process gets the GIL and the CPU."""
        agent = self._agent
        handle = self._inflight
        try:
            posted = time.monotonic()
            state = agent.transfer(handle)
            while state == "PROC":
                now = time.monotonic()
                if now >= deadline:
                    return "no answer by the deadline"
                waited = now - posted
                if waited >= _TIGHT_S:
                    time.sleep(min(max(waited * _PAUSE_SHARE, _FIRST_PAUSE_S), _MAX_PAUSE_S,
                                   deadline - now))
                state = agent.check_xfer_state(handle)
        except Exception as exc:
            return _describe(exc)
        return None if state == "DONE" else f"NIXL reported {state}"

    def _retire(self, peer: str) -> None:
        """Keep the failed READ's handle and buffer; the next read gets a fresh one."""
        assert self._staging is not None
        self._retired.zombies.append(_Zombie(self._staging, self._inflight, peer))
        self._staging = None
        self._inflight = None
        log.info("NIXL read from %s did not complete: its staging buffer is retired "
                 "(%d retired)", peer, len(self._retired))

    def reap(self) -> int:
        """Free the retired buffers whose READ ended (every :meth:`read` does this
        first; an idle caller may too); returns how many are left."""
        with self._owned():
            if not self._closed:
                self._reap()
            return len(self._retired)

    def _reap(self) -> None:
        if self._retired.zombies:
            self._retired.reap(self._agent)
        if self._leaving:
            for name in self._leaving - self._retired.pending():
                self._forget(name)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Release every READ and buffer, and drop the agent (idempotent).

        The agent (its UCX worker and endpoints) is destroyed before any buffer is
        unmapped, so a READ still pending cannot land in freed memory. Waits up to 30 s
        for a read running on another thread; RuntimeError after that.
        """
        if not self._lock.acquire(timeout=_CLOSE_WAIT_S):
            raise RuntimeError("Importer.close(): a read on another thread did not end")
        try:
            if self._closed:
                return
            self._closed = True
            zombies, self._retired.zombies = self._retired.zombies, []
            buffers = [z.staging for z in zombies]
            if self._staging is not None:
                buffers.append(self._staging)
                self._staging = None
            for zombie in zombies:
                zombie.release()
            del zombies
            for staging in buffers:
                staging.deregister(self._agent)
            self._peers.clear()
            self._leaving.clear()
            self._agent = None  # the last reference: NIXL destroys the agent here
            for staging in buffers:
                staging.unmap()
        finally:
            self._lock.release()

    def __repr__(self) -> str:
        return (f"Importer({self.name!r}, peers={len(self._peers)}, reads={self._reads}, "
                f"zombies={len(self._retired)}, closed={self._closed})")

"""Named POSIX shared-memory segments that hold a block pool (``protocol/SPEC.md`` §16).

The owner (:class:`SharedSegment`) creates ``/dev/shm/<name>`` with mode 0600, reserves
its pages up front (``posix_fallocate``: a full ``/dev/shm`` fails here, at start, never
later as a ``SIGBUS`` in the middle of a copy), writes a header with a random nonce and
its host identity, and maps it read-write for the pool. A peer (:class:`MappedSegment`)
opens the segment by name, checks that it is a regular file owned by its own uid with
mode 0600 and that the header names its own boot and network namespace, and maps it
read-only; the nonce it reads through that mapping is the proof it echoes.

Lifetime. The name is removed when the owner closes the segment; a small watchdog
process (``/bin/sh`` blocked reading a pipe that only the owner holds) removes it when
the owner dies, ``kill -9`` included; and every new segment first removes the segments
of dead owners (:func:`remove_stale`), which covers a watchdog killed with its owner.
Removing the name never invalidates a mapping: the memory lives until the last process
unmaps it, so a peer that is copying when the owner dies still reads valid bytes.

Names: ``p2pkv-<pid>-<start time>-<16 hex>``; the pid and its start time identify the
owner for the whole boot (pids are reused, start times are not).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from p2pkv.protocol.codes import SHM_NAME_PATTERN
from p2pkv.shm.host import (
    HostIdentity,
    ShmUnavailable,
    host_identity,
    process_alive,
    process_start_time,
)

__all__ = [
    "HEADER",
    "MAGIC",
    "NAME_PATTERN",
    "NAME_PREFIX",
    "SHM_DIR",
    "MappedSegment",
    "SegmentHeader",
    "SharedSegment",
    "header_bytes",
    "pack_header",
    "parse_header",
    "remove_stale",
]

log = logging.getLogger("p2pkv.shm")

SHM_DIR: Final = Path("/dev/shm")
NAME_PREFIX: Final = "p2pkv-"
NAME_PATTERN: Final = re.compile(SHM_NAME_PATTERN)
"""A segment name on the wire: a POSIX shm name without its slash, no path in it."""
MAGIC: Final = b"P2PKVSHM"
FORMAT_VERSION: Final = 1
PAGE: Final = 4096
HEADER: Final = struct.Struct("<8sII16s16sQQQQIIQ")
"""magic, format version, header bytes, nonce, boot id, network namespace, owner pid,
total size, slots, regions, ready flag, PID namespace (96 bytes, little-endian)."""
REGION: Final = struct.Struct("<QQ")
"""Per region: offset from the start of the segment, segment (bytes per slot)."""
#: Seconds the watchdog's shell gets to exit once its stdin closes (it exits at once;
#: then it is killed).
_WATCHDOG_EXIT_S: Final = 5.0
_NAME_OF_OWNER: Final = re.compile(r"p2pkv-(\d+)-(\d+)-[0-9a-f]{16}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def header_bytes(regions: int) -> int:
    """Bytes before the first region: the fixed header and the region table, in pages."""
    return _round_up(HEADER.size + REGION.size * regions, PAGE)


class SegmentHeader:
    """A parsed segment header (what :func:`parse_header` read and checked)."""

    __slots__ = ("header_bytes", "identity", "nonce", "num_blocks", "owner_pid", "regions",
                 "total")

    def __init__(self, nonce: bytes, identity: HostIdentity, owner_pid: int, total: int,
                 num_blocks: int, regions: tuple[tuple[int, int], ...],
                 header_bytes: int) -> None:
        self.nonce = nonce
        self.identity = identity
        self.owner_pid = owner_pid
        self.total = total
        self.num_blocks = num_blocks
        #: (offset, bytes per slot) of each region, in ``geo.seg`` order.
        self.regions = regions
        self.header_bytes = header_bytes


def pack_header(nonce: bytes, identity: HostIdentity, owner_pid: int, total: int,
                num_blocks: int, regions: Sequence[tuple[int, int]], *, ready: bool) -> bytes:
    """The header bytes (fixed part and region table, without the page padding)."""
    fixed = HEADER.pack(MAGIC, FORMAT_VERSION, header_bytes(len(regions)), nonce,
                        identity.boot_id, identity.netns, owner_pid, total, num_blocks,
                        len(regions), 1 if ready else 0, identity.pidns)
    return fixed + b"".join(REGION.pack(off, size) for off, size in regions)


def parse_header(data: bytes | memoryview, size: int) -> SegmentHeader:
    """Read and check a header against the segment's real ``size``; ShmUnavailable
    names the first thing that is wrong."""
    if len(data) < HEADER.size:
        raise ShmUnavailable(f"segment of {len(data)} bytes has no header")
    (magic, version, hbytes, nonce, boot, netns, pid, total, slots, nreg, ready,
     pidns) = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ShmUnavailable("not a p2pkv segment (bad magic)")
    if version != FORMAT_VERSION:
        raise ShmUnavailable(f"segment format {version}, this node reads {FORMAT_VERSION}")
    if not ready:
        raise ShmUnavailable("segment is not initialised yet")
    if total != size:
        raise ShmUnavailable(f"segment header says {total} bytes, the file has {size}")
    if not 1 <= nreg <= 1024 or hbytes != header_bytes(nreg) or hbytes > size:
        raise ShmUnavailable(f"segment header is malformed ({nreg} regions, {hbytes} bytes)")
    regions = tuple(REGION.unpack_from(data, HEADER.size + REGION.size * i)
                    for i in range(nreg))
    for off, seg in regions:
        if seg < 1 or off < hbytes or off + slots * seg > size:
            raise ShmUnavailable(f"segment region at {off} ({slots} x {seg} bytes) lies "
                                 f"outside the {size}-byte segment")
    return SegmentHeader(bytes(nonce), HostIdentity(bytes(boot), netns, pidns), pid, total,
                         slots, regions, hbytes)


def remove_stale(directory: Path = SHM_DIR) -> list[str]:
    """Remove the segments of owners that are gone; returns the names removed.

    Only p2pkv names owned by this uid are considered, and only those whose header names
    this boot's PID namespace (a pid from another namespace says nothing here).
    """
    removed: list[str] = []
    try:
        me = host_identity()
        names = os.listdir(directory)
    except (OSError, ShmUnavailable):
        return removed
    for name in names:
        m = _NAME_OF_OWNER.fullmatch(name)
        if m is None or process_alive(int(m.group(1)), int(m.group(2))):
            continue
        path = directory / name
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
            if len(head) == HEADER.size:
                fields = HEADER.unpack(head)
                boot, pidns = fields[4], fields[11]
                if boot == me.boot_id and pidns != me.pidns:
                    continue  # another PID namespace on this boot: not ours to judge
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
        log.info("removed stale shared-memory segment %s (its owner is gone)", name)
    return removed


class _Watchdog:
    """``/bin/sh`` that removes ``path`` once the pipe it reads is closed, which happens
    when the owner closes it or dies. In its own session, so signals sent to the owner's
    process group do not stop it first."""

    def __init__(self, path: Path) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._proc = subprocess.Popen(
                ["/bin/sh", "-c", 'read _ignored; rm -f -- "$1"', "p2pkv-shm-watchdog",
                 str(path)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                close_fds=True, start_new_session=True)
        except OSError as exc:
            log.warning("no watchdog for %s (%s): if this process is killed, the segment "
                        "stays until the next node on this host starts", path, exc)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=_WATCHDOG_EXIT_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - sh exits at once
            proc.kill()


class SharedSegment:
    """The owner's side: a new segment of ``num_blocks`` slots per region, mapped
    read-write. ``buffer`` holds the whole segment (header first); region ``i`` starts at
    ``region_offsets[i]`` (page-aligned) and holds slot ``s`` at ``s * segment_sizes[i]``.

    :meth:`close` removes the name (idempotent); the mapping stays valid for as long as
    ``buffer`` is referenced.
    """

    def __init__(self, segment_sizes: Sequence[int], num_blocks: int, *,
                 directory: Path = SHM_DIR) -> None:
        sizes = tuple(segment_sizes)
        if not sizes or num_blocks < 1:
            raise ValueError("a segment needs at least one region and one slot")
        identity = host_identity()
        if not directory.is_dir():
            raise ShmUnavailable(f"{directory} does not exist")
        remove_stale(directory)
        pid = os.getpid()
        start = process_start_time(pid)
        if start is None:
            raise ShmUnavailable("cannot read this process's start time from /proc")
        self.name = f"{NAME_PREFIX}{pid}-{start}-{secrets.token_hex(8)}"
        self.path = directory / self.name
        offsets = []
        offset = header_bytes(len(sizes))
        for size in sizes:
            offsets.append(offset)
            offset += _round_up(num_blocks * size, PAGE)
        self.size = offset
        self.num_blocks = num_blocks
        self.segment_sizes = sizes
        self.region_offsets = tuple(offsets)
        self.nonce = secrets.token_bytes(16)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise ShmUnavailable(f"cannot create {self.path}: {exc}") from None
        try:
            os.fchmod(fd, 0o600)
            # Reserve every page now: without it a full /dev/shm would SIGBUS a later write.
            os.posix_fallocate(fd, 0, self.size)
            self.buffer = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise ShmUnavailable(f"cannot reserve {self.size} bytes in {directory}: "
                                 f"{exc}") from None
        os.close(fd)
        regions = list(zip(offsets, sizes, strict=True))
        head = pack_header(self.nonce, identity, pid, self.size, num_blocks, regions,
                           ready=False)
        self.buffer[:len(head)] = head
        # The ready flag last: a peer never reads a half-written header as valid.
        ready = pack_header(self.nonce, identity, pid, self.size, num_blocks, regions,
                            ready=True)
        self.buffer[:len(ready)] = ready
        self._closed = False
        self._watchdog = _Watchdog(self.path)
        log.info("shared-memory segment %s: %d bytes, %d slots x %d regions", self.name,
                 self.size, num_blocks, len(sizes))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Remove the name (peers can no longer open it) and stop the watchdog."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._watchdog.stop()

    def __repr__(self) -> str:
        return f"SharedSegment({self.name!r}, size={self.size})"


class MappedSegment:
    """A peer's segment, mapped read-only after every check of SPEC §16 passed.

    :meth:`sources` gives read-only views of one slot, one per segment; :meth:`close`
    unmaps (views still referenced keep the memory until they are released).
    """

    def __init__(self, name: str, size: int, segment_sizes: Sequence[int], *,
                 directory: Path = SHM_DIR) -> None:
        if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
            raise ShmUnavailable(f"segment name {name!r} is not a plain shm name")
        me = host_identity()
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmUnavailable(f"{path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise ShmUnavailable(f"{path} is owned by uid {st.st_uid}, not by this "
                                     f"node's uid {os.geteuid()}")
            if stat.S_IMODE(st.st_mode) != 0o600:
                raise ShmUnavailable(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, "
                                     "not 0600")
            if st.st_size != size:
                raise ShmUnavailable(f"{path} is {st.st_size} bytes, the peer announced "
                                     f"{size}")
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:
            raise ShmUnavailable(f"cannot map {path}: {exc}") from None
        finally:
            os.close(fd)
        try:
            header = parse_header(mapped[:header_bytes(1024)], size)
            if header.identity.boot_id != me.boot_id:
                raise ShmUnavailable("the segment was written on another host (boot ids "
                                     "differ)")
            if header.identity.netns != me.netns:
                raise ShmUnavailable("the segment's owner is in another network namespace "
                                     "(another host to the network)")
            sizes = tuple(segment_sizes)
            if tuple(s for _, s in header.regions) != sizes:
                raise ShmUnavailable(f"segment regions {[s for _, s in header.regions]} do "
                                     f"not match the negotiated segments {list(sizes)}")
        except ShmUnavailable:
            mapped.close()
            raise
        self.name = name
        self.size = size
        self.nonce = header.nonce
        self.num_blocks = header.num_blocks
        self.owner_pid = header.owner_pid
        self._mmap = mapped
        whole = memoryview(mapped)
        self._regions: tuple[memoryview, ...] = tuple(
            whole[off: off + header.num_blocks * seg] for off, seg in header.regions)
        self._sizes = sizes
        whole.release()

    def sources(self, slot: int) -> list[memoryview]:
        """Read-only views of slot ``slot`` (0 <= slot < num_blocks), one per segment."""
        return [view[slot * size:(slot + 1) * size]
                for view, size in zip(self._regions, self._sizes, strict=True)]

    def close(self) -> None:
        regions, self._regions = self._regions, ()
        for view in regions:
            view.release()
        with contextlib.suppress(BufferError):  # a view still referenced: GC unmaps later
            self._mmap.close()

    def __repr__(self) -> str:
        return f"MappedSegment({self.name!r}, size={self.size}, slots={self.num_blocks})"

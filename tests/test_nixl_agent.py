"""NIXL's one-sided read path (``p2pkv.nixl``) with real agents, in one process and
across processes.

What is held: a reader reads a holder's nonce and scattered pieces of its memory, byte
for byte, over TCP and over the default transports; pieces outside what the holder
registered are the holder's fault and leave the next read working, and input that is
no byte range, or too large, or a blob that is no NIXL metadata, is refused before
anything is sent; a hung holder makes a read fail at its deadline, the read's staging
buffer is retired until the holder answers again (and reads are refused while too many
are retired), a holder removed meanwhile stays loaded until its reads end, and a killed
holder makes a read fail within a second; a holder restarted under the same name is
read again once its new blob is loaded; closing is idempotent and leaves no thread.

Skipped where NIXL cannot make an agent (``unavailable_reason()`` says why). Every
holder process is killed at teardown; every wait is bounded.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from p2pkv.nixl import (
    NONCE_BYTES,
    Exporter,
    Importer,
    NixlReadFailed,
    NixlUnavailable,
    rdma_devices,
    ucx_version,
    unavailable_reason,
)
from p2pkv.nixl import importer as importing

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SIZE = 8 << 20
TCP = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
#: Pieces enough for the numpy descriptor path.
LONG = importing._ARRAY_FROM + 12
#: A holder process: an Exporter over SIZE seeded random bytes; it prints its blob and
#: region address as one JSON line, then lives until its stdin closes.
HOLDER = """
import ctypes, json, mmap, random, sys
from p2pkv.nixl import Exporter
name, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
region = mmap.mmap(-1, size)
region[:] = random.Random(seed).randbytes(size)
address = ctypes.addressof(ctypes.c_char.from_buffer(region))
exporter = Exporter(name, [(address, size)])
print(json.dumps({"metadata": exporter.metadata.hex(), "address": address}), flush=True)
sys.stdin.read()
exporter.close()
"""


@pytest.fixture(autouse=True)
def _nixl_here() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"NIXL cannot be used here: {reason}")


@pytest.fixture
def tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX over TCP on the loopback only (read by UCX when an agent is made)."""
    for key, value in TCP.items():
        monkeypatch.setenv(key, value)


def unique(role: str) -> str:
    return f"p2pkv-test-{role}-{uuid.uuid4().hex[:8]}"


def soon(seconds: float) -> float:
    return time.monotonic() + seconds


class Region:
    """SIZE bytes of seeded random memory in this process, at a fixed address."""

    def __init__(self, seed: int) -> None:
        self.memory = mmap.mmap(-1, SIZE)
        self.memory[:] = random.Random(seed).randbytes(SIZE)
        self._export: Any = ctypes.c_char.from_buffer(self.memory)
        self.address = ctypes.addressof(self._export)

    def close(self) -> None:
        self._export = None
        self.memory.close()


@pytest.fixture
def exported() -> Iterator[Callable[[int], tuple[Exporter, Region]]]:
    """An Exporter over a fresh Region; both closed at teardown."""
    made: list[tuple[Exporter, Region]] = []

    def make(seed: int) -> tuple[Exporter, Region]:
        region = Region(seed)
        try:
            exporter = Exporter(unique("holder"), [(region.address, SIZE)])
        except BaseException:
            region.close()
            raise
        made.append((exporter, region))
        return exporter, region

    yield make
    for exporter, region in made:
        exporter.close()
        region.close()


@pytest.fixture
def importer() -> Iterator[Importer]:
    reader = Importer(unique("reader"), staging_bytes=4 << 20, max_zombies=2)
    yield reader
    reader.close()


@pytest.fixture
def holders() -> Iterator[Callable[[str, int], tuple[subprocess.Popen[bytes], dict[str, Any]]]]:
    """Start holder processes (HOLDER); each is killed at teardown, stopped or not."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, seed: int) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, name, str(SIZE), str(seed)], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE)
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else b""
        assert line, f"holder {name} did not start (exit status {proc.poll()})"
        info = json.loads(line)
        info["metadata"] = bytes.fromhex(info["metadata"])
        return proc, info

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL ends a stopped process too
            proc.wait(timeout=10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def content(seed: int) -> bytes:
    return random.Random(seed).randbytes(SIZE)


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("transport", ["tcp", "default"])
def test_reads_the_nonce_and_scattered_pieces(
        transport: str, monkeypatch: pytest.MonkeyPatch,
        exported: Callable[[int], tuple[Exporter, Region]]) -> None:
    for key, value in TCP.items():
        if transport == "tcp":
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    exporter, region = exported(1)
    reader = Importer(unique("reader"), staging_bytes=4 << 20)
    try:
        assert reader.add_peer(exporter.metadata) == exporter.name
        assert reader.add_peer(exporter.metadata) == exporter.name  # the same blob again
        [nonce] = reader.read(exporter.name, [(exporter.nonce_address, NONCE_BYTES)],
                              soon(5))
        assert len(exporter.nonce) == NONCE_BYTES and bytes(nonce) == exporter.nonce
        few = [(0, 100), (4096 * 3 + 7, 4096), (1 << 20, 576 << 10), (SIZE - 12345, 12345)]
        many = [(i * 50_000 + i, 1000 + i) for i in range(LONG)]  # the numpy path
        for pieces in (few, many):
            views = reader.read(exporter.name,
                                [(region.address + at, n) for at, n in pieces], soon(5))
            assert [len(v) for v in views] == [n for _, n in pieces]
            for view, (at, n) in zip(views, pieces, strict=True):
                assert bytes(view) == region.memory[at:at + n]
        assert (reader.reads, reader.failures, reader.zombies) == (3, 0, 0)
        assert reader.bytes_read == NONCE_BYTES + sum(n for _, n in few + many)
        assert reader.peers == (exporter.name,)
    finally:
        reader.close()


def test_pieces_outside_the_registration_are_the_holders_fault(
        importer: Importer, exported: Callable[[int], tuple[Exporter, Region]]) -> None:
    exporter, region = exported(2)
    importer.add_peer(exporter.metadata)
    outside = [[(region.address + SIZE - 10, 11)], [(region.address - 4096, 100)],
               [(region.address + SIZE + (1 << 30), 64)],
               [(region.address, 10)] * LONG + [(region.address + SIZE, 1)]]
    for pieces in outside:
        with pytest.raises(NixlReadFailed) as failed:
            importer.read(exporter.name, pieces, soon(5))
        assert failed.value.peer_fault, pieces
    assert importer.zombies == 0  # nothing was sent
    [view] = importer.read(exporter.name, [(region.address + 5000, 3000)], soon(5))
    assert bytes(view) == region.memory[5000:8000]
    assert (importer.reads, importer.failures) == (1, len(outside))


def test_what_is_no_byte_range_or_too_large_is_refused_before_anything_is_sent(
        importer: Importer, exported: Callable[[int], tuple[Exporter, Region]]) -> None:
    exporter, region = exported(3)
    name = importer.add_peer(exporter.metadata)
    for pieces in ([(region.address, 0)], [(-1, 16)], [(2**64 - 10, 20)],
                   [(region.address, 16)] * LONG + [(2**64 - 10, 20)],
                   [(region.address, 16)] * LONG + [(-5, 16)],
                   [(region.address, 16, 0)] * LONG):
        with pytest.raises(NixlReadFailed) as failed:
            importer.read(name, pieces, soon(5))
        assert failed.value.peer_fault, pieces
    with pytest.raises(ValueError, match="staging"):
        importer.read(name, [(region.address, (4 << 20) + 1)], soon(5))
    with pytest.raises(ValueError, match="staging"):
        importer.read(name, [(region.address + i * 4096, 40_000) for i in range(LONG)],
                      soon(5))
    with pytest.raises(NixlReadFailed) as failed:
        importer.read("p2pkv-test-nobody", [(region.address, 16)], soon(5))
    assert not failed.value.peer_fault
    with pytest.raises(NixlReadFailed) as failed:
        importer.read(name, [(region.address, 16)], time.monotonic() - 1)
    assert not failed.value.peer_fault and "deadline" in str(failed.value)
    blob = exporter.metadata
    for bad in (b"", os.urandom(400), blob[:len(blob) // 2], blob[:40]):
        with pytest.raises(NixlReadFailed) as failed:
            importer.add_peer(bad)
        assert failed.value.peer_fault
    assert importer.read(name, [], soon(5)) == []
    assert bytes(importer.read(name, [(region.address, 64)], soon(5))[0]) == \
        region.memory[:64]
    assert importer.zombies == 0


def test_an_agent_that_cannot_start_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(threading.enumerate())
    # UCX's shared-memory transports alone cannot serve the default error handling mode.
    monkeypatch.setenv("UCX_TLS", "sm,self")
    with pytest.raises(NixlUnavailable, match="cannot"):
        Exporter(unique("holder"), [(4096, 4096)])
    with pytest.raises(NixlUnavailable, match="cannot"):
        Importer(unique("reader"))
    assert set(threading.enumerate()) == before
    with pytest.raises(ValueError):
        Exporter(unique("holder"), [(0, 4096)])
    with pytest.raises(ValueError):
        Importer(unique("reader"), staging_bytes=0)


def test_closing_is_idempotent_and_leaves_no_thread(
        exported: Callable[[int], tuple[Exporter, Region]]) -> None:
    before = set(threading.enumerate())
    exporter, _ = exported(4)
    assert exporter.name in {t.name.removeprefix("p2pkv-nixl-export-")
                             for t in threading.enumerate()}
    reader = Importer(unique("reader"), staging_bytes=1 << 20)
    reader.add_peer(exporter.metadata)
    assert reader.read(exporter.name, [(exporter.nonce_address, 16)], soon(5))
    with reader._owned(), pytest.raises(RuntimeError, match="one thread"):
        reader.read(exporter.name, [(exporter.nonce_address, 16)], soon(5))  # one running
    agent = weakref.ref(reader._agent)
    reader.close()
    assert agent() is None  # NIXL's agent is gone when close() returns
    reader.close()
    exporter.close()
    exporter.close()
    assert reader.closed and exporter.closed
    assert set(threading.enumerate()) == before
    with pytest.raises(NixlReadFailed, match="closed"):
        reader.read(exporter.name, [(exporter.nonce_address, 16)], soon(5))
    with pytest.raises(NixlUnavailable, match="closed"):
        reader.add_peer(exporter.metadata)
    reader.remove_peer(exporter.name)
    assert reader.reap() == 0


def test_what_the_host_offers() -> None:
    version = ucx_version()
    assert version is not None and version.count(".") == 2, version
    assert all(isinstance(name, str) and name for name in rdma_devices())


# ------------------------------------------------------------------ holder processes


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP, and wait until every thread of the process is stopped (the signal is
    delivered asynchronously: a thread may still run for a moment)."""
    os.kill(proc.pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{proc.pid}/task")
    end = soon(5)
    while True:
        states = {(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in tasks.iterdir()}
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < end, f"holder not stopped: {states}"
        time.sleep(0.001)


def wait_for_no_zombies(reader: Importer, seconds: float) -> None:
    end = soon(seconds)
    while reader.reap() > 0:
        assert time.monotonic() < end, f"{reader.zombies} reads still pending"
        time.sleep(0.01)


def test_a_hung_holder_times_out_and_a_killed_one_fails_fast(
        tcp: None, importer: Importer, holders: Callable[..., Any]) -> None:
    name = unique("holder")
    proc, info = holders(name, 5)
    expected = content(5)
    piece = [(info["address"] + 12345, 1 << 20)]
    good = expected[12345:12345 + (1 << 20)]
    assert importer.add_peer(info["metadata"]) == name
    assert bytes(importer.read(name, piece, soon(5))[0]) == good

    stop(proc)
    start = time.monotonic()
    with pytest.raises(NixlReadFailed) as failed:
        importer.read(name, piece, start + 0.5)
    assert not failed.value.peer_fault
    assert 0.5 <= time.monotonic() - start < 1.5
    assert importer.zombies == 1  # its READ may still land: the buffer is retired
    os.kill(proc.pid, signal.SIGCONT)
    for _ in range(20):  # the stuck READ ends once the holder runs again
        assert bytes(importer.read(name, piece, soon(5))[0]) == good
        if importer.zombies == 0:
            break
        time.sleep(0.01)
    assert importer.zombies == 0

    # Two retired (max_zombies=2): reads are suspended; the holder is removed meanwhile.
    stop(proc)
    for _ in range(2):
        with pytest.raises(NixlReadFailed):
            importer.read(name, piece, soon(0.2))
    assert importer.zombies == 2
    start = time.monotonic()
    with pytest.raises(NixlReadFailed, match="suspended") as failed:
        importer.read(name, piece, start + 5)
    assert not failed.value.peer_fault and time.monotonic() - start < 0.5
    importer.remove_peer(name)  # deferred: its READs are pending
    assert name not in importer.peers
    with pytest.raises(NixlReadFailed, match="not a loaded"):
        importer.read(name, piece, soon(5))
    os.kill(proc.pid, signal.SIGCONT)
    wait_for_no_zombies(importer, 5)
    assert importer.add_peer(info["metadata"]) == name
    assert bytes(importer.read(name, piece, soon(5))[0]) == good

    proc.kill()
    proc.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(NixlReadFailed) as failed:
        importer.read(name, piece, start + 3)
    assert not failed.value.peer_fault
    assert time.monotonic() - start < 1.0
    wait_for_no_zombies(importer, 5)  # a disconnect ends the READ for good
    importer.remove_peer(name)
    assert importer.peers == ()
    assert importer.failures == 6


def test_a_holder_restarted_under_the_same_name_is_read_again(
        importer: Importer, holders: Callable[..., Any]) -> None:
    name = unique("holder")
    first, info = holders(name, 6)
    assert importer.add_peer(info["metadata"]) == name
    piece = [(info["address"] + 777, 50_000)]
    assert bytes(importer.read(name, piece, soon(5))[0]) == content(6)[777:50_777]
    first.kill()
    first.wait(timeout=10)
    _, again = holders(name, 7)
    assert again["metadata"] != info["metadata"]
    assert importer.add_peer(again["metadata"]) == name
    piece = [(again["address"] + 777, 50_000)]
    assert bytes(importer.read(name, piece, soon(5))[0]) == content(7)[777:50_777]
    assert importer.peers == (name,)


def test_reads_pending_from_a_replaced_holder_keep_their_buffers_until_close(
        tcp: None, importer: Importer, holders: Callable[..., Any]) -> None:
    name = unique("holder")
    hung, info = holders(name, 8)
    assert importer.add_peer(info["metadata"]) == name
    piece = [(info["address"], 4096)]
    assert bytes(importer.read(name, piece, soon(5))[0]) == content(8)[:4096]
    stop(hung)
    with pytest.raises(NixlReadFailed):
        importer.read(name, piece, soon(0.2))
    # Another process takes the name while the first one's READ is pending.
    second, again = holders(name, 9)
    assert importer.add_peer(again["metadata"]) == name
    piece = [(again["address"], 4096)]
    expected = content(9)[:4096]
    assert bytes(importer.read(name, piece, soon(5))[0]) == expected
    # NIXL can no longer say when the orphaned READ ends: its buffer stays retired.
    hung.send_signal(signal.SIGCONT)
    time.sleep(0.05)
    assert importer.reap() == 1
    assert bytes(importer.read(name, piece, soon(5))[0]) == expected

    # A reader closed with a READ pending: its agent goes first, so nothing lands in
    # the unmapped buffer when the holder resumes.
    other = Importer(unique("reader"), staging_bytes=1 << 20)
    try:
        other.add_peer(again["metadata"])
        assert bytes(other.read(name, piece, soon(5))[0]) == expected
        stop(second)
        with pytest.raises(NixlReadFailed):
            other.read(name, piece, soon(0.2))
        assert other.zombies == 1
    finally:
        other.close()
    assert other.zombies == 0
    second.send_signal(signal.SIGCONT)
    time.sleep(0.1)
    assert bytes(importer.read(name, piece, soon(5))[0]) == expected

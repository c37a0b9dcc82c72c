"""Where a data stream's payload lands (``p2pkv.transport.datachannel.scatter_for``): the
Python ``Scatter`` and its compiled twin ``p2pkv._fastcopy.Scatter`` fill the same
buffers in order, spill what follows into the tail, and take bytes read ahead; the
compiled one also hashes every block as it lands, equal to ``block_checksum`` over the
block's segments whatever the pieces the bytes came in. Bad buffers are refused when the
scatter is made; a closed or failed stream says so; the buffers are let go once full.
"""

from __future__ import annotations

import os
import random
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv.checksum import block_checksum
from p2pkv.transport import datachannel as dc
from p2pkv.transport.datachannel import Scatter

pytestmark = pytest.mark.timeout(60)

REQUIRED = os.environ.get("P2PKV_REQUIRE_NATIVE") == "1"
native = pytest.mark.skipif(
    dc.NativeScatter is None and not REQUIRED,
    reason="the compiled helper was not built (it needs xxhash.h: apt install libxxhash-dev)")

Make = Callable[..., Any]


def kinds() -> list[Any]:
    return [pytest.param(lambda views, block=0: Scatter(views), id="python"),
            pytest.param(lambda views, block=0: dc.NativeScatter(views, block), id="native",
                         marks=native)]


def receive_all(scatter: Any, sock: socket.socket, tail: bytearray, limits: list[int],
                rng: random.Random, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not scatter.done and time.monotonic() < deadline:
        before = scatter.filled
        got = scatter.receive(sock, memoryview(tail), limit=rng.choice(limits))
        assert got is None or got > 0
        assert scatter.filled >= before
        if got is None:  # nothing there now: wait for the sender, never spin
            select.select([sock], [], [], 0.5)
    assert scatter.done, "the payload did not land in time"


@pytest.mark.parametrize("make", kinds())
def test_scatter_fills_buffers_in_order_and_spills_the_rest(make: Make) -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        data = os.urandom(100_000)
        bufs = [bytearray(40_000), bytearray(60_000)]
        scatter = make([memoryview(x) for x in bufs])
        assert scatter.receive(b) is None  # nothing there yet
        assert scatter.put(memoryview(data)[:1000]) == 1000
        a.sendall(data[1000:] + b"NEXT")
        tail = bytearray(16)
        while not scatter.done:
            got = scatter.receive(b, memoryview(tail), limit=8192)
            assert got is None or got > 0
        assert bytes(bufs[0]) + bytes(bufs[1]) == data
        assert scatter.spilled in (0, 4)
        if scatter.spilled == 0:
            b.setblocking(True)
            assert b.recv(4) == b"NEXT"
        else:
            assert bytes(tail[:4]) == b"NEXT"


@pytest.mark.parametrize("make", kinds())
def test_scatter_over_many_buffers_lands_every_byte_in_order(make: Make) -> None:
    """Buffers of many sizes (some empty), bytes read ahead put across several of them,
    receives of random limits: every byte lands where it belongs, and what follows the
    last buffer goes to the tail."""
    rng = random.Random(5)
    sizes = [rng.choice((0, 1, 7, 4096, 16384, 50_000)) for _ in range(60)]
    bufs = [bytearray(n) for n in sizes]
    data = os.urandom(sum(sizes))
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        scatter = make([memoryview(x) for x in bufs])
        assert scatter.total == len(data)
        ahead = 30_000
        assert scatter.put(memoryview(data)[:ahead]) == ahead
        sender = threading.Thread(target=a.sendall, args=(data[ahead:] + b"NEXT",))
        sender.start()
        tail = bytearray(16)
        receive_all(scatter, b, tail, [1, 5000, 70_000, 1 << 20], rng)
        sender.join(10)
        assert not sender.is_alive()
        assert b"".join(bytes(x) for x in bufs) == data
        assert bytes(tail[:scatter.spilled]) == b"NEXT"[:scatter.spilled]


@native
@settings(max_examples=40, deadline=None)
@given(segments=st.lists(st.integers(1, 70_000), min_size=1, max_size=5),
       blocks=st.integers(1, 12), ahead=st.integers(0, 200_000),
       limits=st.lists(st.integers(1, 600_000), min_size=1, max_size=4),
       seed=st.integers(0, 2**32 - 1))
def test_native_scatter_hashes_each_block_as_block_checksum_does(
        segments: list[int], blocks: int, ahead: int, limits: list[int], seed: int) -> None:
    """Whatever the layout, the bytes read ahead and the size of each receive, the sums
    are each block's ``block_checksum`` over its segments, in order."""
    bpb = sum(segments)
    bufs = [bytearray(n) for _ in range(blocks) for n in segments]
    rng = random.Random(seed)
    data = rng.randbytes(bpb * blocks)
    scatter = dc.NativeScatter([memoryview(x) for x in bufs], bpb)
    assert scatter.sums == [] and scatter.block == bpb
    ahead = min(ahead, len(data))
    assert scatter.put(memoryview(data)[:ahead]) == ahead
    assert scatter.sums is not None and len(scatter.sums) == ahead // bpb
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        sender = threading.Thread(target=a.sendall, args=(data[ahead:] + b"TAIL",))
        sender.start()
        tail = bytearray(8)
        if ahead < len(data):
            receive_all(scatter, b, tail, limits, rng)
        sender.join(10)
    assert b"".join(bytes(x) for x in bufs) == data
    n = len(segments)
    want = [block_checksum([memoryview(x) for x in bufs[i * n:(i + 1) * n]])
            for i in range(blocks)]
    assert scatter.sums == want


@native
def test_native_scatter_sums_only_whole_blocks() -> None:
    """A block's sum appears once its last byte landed, not before."""
    bufs = [bytearray(1000) for _ in range(3)]
    scatter = dc.NativeScatter([memoryview(x) for x in bufs], 1000)
    data = os.urandom(3000)
    assert scatter.put(data[:999]) == 999 and scatter.sums == []
    assert scatter.put(data[999:1000]) == 1 and scatter.sums == [block_checksum([data[:1000]])]
    assert scatter.put(data[1000:2500]) == 1500 and len(scatter.sums) == 2
    assert scatter.put(data[2500:] + b"more") == 500  # only what the buffers take
    assert scatter.sums == [block_checksum([data[i:i + 1000]]) for i in (0, 1000, 2000)]
    assert scatter.done


@native
def test_native_scatter_refuses_bad_buffers_and_shapes() -> None:
    with pytest.raises(ValueError, match="writable"):
        dc.NativeScatter([memoryview(bytearray(10)), memoryview(b"read-only")])
    with pytest.raises(TypeError, match="item 1 is not a writable contiguous buffer"):
        dc.NativeScatter([memoryview(bytearray(10)), 7])
    with pytest.raises(TypeError, match="sequence"):
        dc.NativeScatter(5)
    with pytest.raises(ValueError, match="not a whole number of 4-byte blocks"):
        dc.NativeScatter([memoryview(bytearray(10))], 4)
    with pytest.raises(ValueError, match="block"):
        dc.NativeScatter([memoryview(bytearray(8))], -1)
    scatter = dc.NativeScatter([memoryview(bytearray(8))])
    with pytest.raises(ValueError, match="limit"):
        scatter.receive(0, None, 0)
    with pytest.raises(TypeError):
        scatter.receive("not a socket")
    assert scatter.sums is None and scatter.filled == 0  # nothing moved


@native
def test_native_scatter_reports_the_end_and_failures_of_its_stream() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    scatter = dc.NativeScatter([memoryview(bytearray(100))])
    with b:
        a.sendall(b"x" * 10)
        a.close()
        assert scatter.receive(b) == 10
        assert scatter.receive(b) == 0  # the peer closed the stream
    closed = socket.socket()
    fd = closed.fileno()
    closed.close()
    with pytest.raises(OSError):
        scatter.receive(fd)
    assert scatter.filled == 10


@native
def test_native_scatter_lets_go_of_its_buffers_when_full_or_closed() -> None:
    """A bytearray cannot be resized while a buffer of it is held: once the scatter is
    full, or closed, it can."""
    full, open_ = bytearray(4), bytearray(4)
    scatter = dc.NativeScatter([memoryview(full)])
    held = dc.NativeScatter([memoryview(open_)])
    with pytest.raises(BufferError):
        open_.extend(b"x")
    assert scatter.put(b"abcd") == 4 and scatter.done
    full.extend(b"e")
    held.close()
    held.close()  # idempotent
    open_.extend(b"x")
    with pytest.raises(ValueError, match="closed"):
        held.put(b"zz")
    with pytest.raises(ValueError, match="closed"):
        held.receive(0)
    assert scatter.put(b"more") == 0  # full: it takes nothing more


def test_scatter_for_picks_the_compiled_one_for_plain_streams_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = socket.socketpair()
    with a, b:
        views = [memoryview(bytearray(16))]
        got = dc.scatter_for(b, views, 16)
        if dc.NATIVE_SCATTER:
            assert isinstance(got, dc.NativeScatter) and got.sums == []
        else:
            assert isinstance(got, Scatter) and got.sums is None
        assert isinstance(dc.scatter_for(None, views, 16), Scatter)
        monkeypatch.setattr(dc, "NATIVE_SCATTER", False)
        python = dc.scatter_for(b, views, 16)
        assert isinstance(python, Scatter) and python.sums is None

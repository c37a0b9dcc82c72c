"""The batch copy of the same-host path (``p2pkv.checksum.copy_blocks``): the compiled
helper ``p2pkv._fastcopy`` and the Python path give the same bytes and the same checksums
as ``block_checksum`` for any shape of blocks and any thread count; a bad batch is
refused whole, before any byte moves; calls from several threads at once, and after a
fork, stay right.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pkv import checksum
from p2pkv.checksum import _copy_blocks_python, block_checksum, copy_threads

pytestmark = pytest.mark.timeout(120)

try:
    from p2pkv import _fastcopy
except ImportError:
    _fastcopy = None  # type: ignore[assignment]

REQUIRED = os.environ.get("P2PKV_REQUIRE_NATIVE") == "1"
native = pytest.mark.skipif(
    _fastcopy is None and not REQUIRED,
    reason="the compiled helper was not built (it needs xxhash.h: apt install libxxhash-dev)")

Copy = Callable[..., "list[int] | None"]


def copies() -> list[Any]:
    out: list[Any] = [pytest.param(_copy_blocks_python, id="python")]
    out.append(pytest.param(None if _fastcopy is None else _fastcopy.copy_blocks,
                            id="native", marks=native))
    return out


def batch(sizes: list[list[int]], seed: int = 1
          ) -> tuple[list[list[memoryview]], list[list[memoryview]], list[bytes]]:
    """Destinations (zeroed), sources (random) and each block's bytes, in one buffer
    each side so that blocks sit next to each other as in a pool."""
    total = sum(map(sum, sizes))
    src = np.random.default_rng(seed).integers(0, 256, size=total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    s, d = memoryview(src), memoryview(dst)
    srcs: list[list[memoryview]] = []
    dsts: list[list[memoryview]] = []
    blocks: list[bytes] = []
    at = 0
    for segs in sizes:
        start = at
        srcs.append([])
        dsts.append([])
        for n in segs:
            srcs[-1].append(s[at:at + n])
            dsts[-1].append(d[at:at + n])
            at += n
        blocks.append(bytes(s[start:at]))
    return dsts, srcs, blocks


def test_the_helper_is_built_where_it_can_be() -> None:
    """`make test` sets P2PKV_REQUIRE_NATIVE where xxhash.h is there: then the helper
    must have been built and be the one in use."""
    if not REQUIRED:
        pytest.skip("P2PKV_REQUIRE_NATIVE is not set")
    assert _fastcopy is not None and checksum.NATIVE
    assert checksum.NATIVE_VARIANT in ("avx2", "generic")
    assert copy_threads(4) == 4


@pytest.mark.parametrize("copy", copies())
@pytest.mark.parametrize("sizes", [
    [[16384]], [[49152] * 12] * 3, [[589824]] * 2, [[1, 7, 64, 240, 241, 1023]],
    [[0]], [[0, 5]], [], [[16384]] * 200, [[3], [65536 + 17], [200000]],
], ids=["16k", "v2", "v1", "odd", "empty-seg", "with-empty", "none", "many", "mixed"])
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_bytes_and_checksums_match_for_any_shape(copy: Copy, sizes: list[list[int]],
                                                 threads: int) -> None:
    dsts, srcs, blocks = batch(sizes)
    sums = copy(dsts, srcs, checksums=True, threads=threads)
    assert sums == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    assert sums == [block_checksum(d) for d in dsts]
    assert [b"".join(bytes(v) for v in d) for d in dsts] == blocks
    # Without checksums: the same bytes, no result.
    dsts, srcs, blocks = batch(sizes, seed=2)
    assert copy(dsts, srcs, checksums=False, threads=threads) is None
    assert [b"".join(bytes(v) for v in d) for d in dsts] == blocks


@native
@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 70000), min_size=1, max_size=6), max_size=12),
       st.integers(1, 4))
def test_the_helper_equals_the_python_path(sizes: list[list[int]], threads: int) -> None:
    assert _fastcopy is not None
    a_dst, a_src, blocks = batch(sizes, seed=3)
    b_dst, b_src, _ = batch(sizes, seed=3)
    assert (_fastcopy.copy_blocks(a_dst, a_src, threads=threads)
            == _copy_blocks_python(b_dst, b_src, threads=threads))
    assert [b"".join(map(bytes, d)) for d in a_dst] == blocks
    assert _fastcopy.hash_blocks(a_src, threads=threads) == [
        xxhash.xxh3_64_intdigest(b) for b in blocks]


def zeroed(dsts: list[list[memoryview]]) -> bool:
    return all(not any(bytes(v)) for d in dsts for v in d)


@pytest.mark.parametrize("copy", copies())
def test_a_bad_batch_is_refused_whole_before_any_byte_moves(copy: Copy) -> None:
    dsts, srcs, _ = batch([[64, 64], [64, 64], [64]])
    cases: list[tuple[Any, Any, type[Exception], str]] = [
        (dsts, srcs[:2], ValueError, r"3 destination blocks for 2 source blocks"),
        ([*dsts[:2], [dsts[2][0], dsts[2][0]]], srcs, ValueError,
         r"block 2: 2 destination segments for 1 source segments"),
        ([*dsts[:2], [dsts[2][0][:63]]], srcs, ValueError,
         r"block 2, segment 0: destination of 63 bytes for a source of 64"),
        ([*dsts[:2], [dsts[2][0].toreadonly()]], srcs, ValueError,
         r"destinations: block 2, segment 0 is not a writable contiguous buffer"),
        (dsts, [*srcs[:2], [12345]], TypeError, r"block 2, segment 0"),
    ]
    for d, s, exc, match in cases:
        with pytest.raises(exc, match=match):
            copy(d, s, threads=2)
        assert zeroed(dsts), match  # blocks 0 and 1 were fine, and still nothing moved
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"threads must be between 1 and 8"):
            copy(dsts, srcs, threads=bad)
    with pytest.raises(ValueError, match=r"copy threads must be between 1 and 8, got 0"):
        copy_threads(0)


@native
def test_calls_from_several_threads_at_once_stay_right() -> None:
    """One call at a time has the helper pool; the others run alone on their own
    thread. Either way every block is right."""
    assert _fastcopy is not None
    fastcopy = _fastcopy
    errors: list[str] = []

    def worker(seed: int) -> None:
        for _ in range(30):
            dsts, srcs, blocks = batch([[16384]] * 64 + [[49152] * 4] * 8, seed=seed)
            sums = fastcopy.copy_blocks(dsts, srcs, threads=3)
            if sums != [xxhash.xxh3_64_intdigest(b) for b in blocks]:
                errors.append(f"seed {seed}: wrong checksums")
            if [b"".join(map(bytes, d)) for d in dsts] != blocks:
                errors.append(f"seed {seed}: wrong bytes")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


CHILD = """
import os, sys
import numpy as np, xxhash
from p2pkv import _fastcopy
src = np.arange(1 << 20, dtype=np.uint8); dst = np.zeros_like(src)
s, d = memoryview(src), memoryview(dst)
blocks = [[s[i:i + 65536]] for i in range(0, 1 << 20, 65536)]
outs = [[d[i:i + 65536]] for i in range(0, 1 << 20, 65536)]
want = [xxhash.xxh3_64_intdigest(b[0]) for b in blocks]
assert _fastcopy.copy_blocks(outs, blocks, threads=4) == want  # the pool has helpers now
pid = os.fork()
if pid == 0:
    dst[:] = 0
    ok = _fastcopy.copy_blocks(outs, blocks, threads=4) == want and (dst == src).all()
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(_fastcopy.VARIANT, os.waitstatus_to_exitcode(status))
"""


@native
@pytest.mark.parametrize("variant", ["default", "generic"])
def test_a_forked_child_and_the_generic_build_copy_right(variant: str) -> None:
    """A child forked while the helper pool existed makes its own helpers (none of the
    parent's threads live there); the build without AVX2 gives the same checksums."""
    env = dict(os.environ)
    env.pop("P2PKV_FASTCOPY_GENERIC", None)
    if variant == "generic":
        env["P2PKV_FASTCOPY_GENERIC"] = "1"
    # Its own process group, so that a child that hangs is killed with its parent.
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        pytest.fail("the copy in the forked child did not finish within 60 s")
    assert proc.returncode == 0, stderr
    out = stdout.split()
    assert out[1] == "0", out
    if variant == "generic":
        assert out[0] == "generic"

"""The block checksum: xxh3-64 (seed 0) of a block's segments, hashed in order.

One definition shared by the wire protocol (capability ``checksum-xxh3-64``, see
``protocol/SPEC.md``), the block store (which verifies a block before it becomes visible)
and the node's landing (which verifies blocks landed in caller-owned buffers, and blocks
copied from a peer's shared memory). Pure.

:func:`copy_blocks` copies a batch of blocks and hashes them on the way. Where the
compiled helper ``p2pkv._fastcopy`` was built (:data:`NATIVE`), it does so in one call
that releases the GIL and shares the blocks out over several threads; otherwise it runs
the same in Python, on one thread, with the same results and the same errors' kinds.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias

import xxhash

__all__ = ["NATIVE", "NATIVE_VARIANT", "BytesLike", "block_checksum", "block_checksums",
           "copy_blocks", "copy_threads", "copy_with_checksum"]

BytesLike: TypeAlias = "bytes | bytearray | memoryview"

_one_shot = xxhash.xxh3_64_intdigest  # one C call for a block of one segment (V1)
_first = operator.itemgetter(0)

_native_copy: Callable[..., list[int] | None] | None
try:
    from p2pkv import _fastcopy
except ImportError:
    _native_copy = None
    NATIVE_VARIANT = ""
else:
    _native_copy = _fastcopy.copy_blocks
    NATIVE_VARIANT = str(_fastcopy.VARIANT)
NATIVE = _native_copy is not None
"""Whether the compiled copy (``p2pkv._fastcopy``) is in use."""
MAX_COPY_THREADS = 8
"""The most threads one :func:`copy_blocks` call shares its blocks over."""


def block_checksum(segments: Iterable[BytesLike]) -> int:
    """xxh3-64 (seed 0) of one block's bytes, its segments hashed in order as one stream.

    Equal to ``xxh3_64(b"".join(segments))`` without building the joined bytes.
    """
    if type(segments) in (list, tuple) and len(segments) == 1:  # type: ignore[arg-type]
        return _one_shot(segments[0])  # type: ignore[index]
    h = xxhash.xxh3_64(seed=0)
    for seg in segments:
        h.update(seg)
    value: int = h.intdigest()
    return value


def block_checksums(blocks: Sequence[Sequence[BytesLike]]) -> list[int]:
    """:func:`block_checksum` of each block. Where every block is one segment (V1
    layouts), the batch is hashed with one C call per block and no Python step."""
    if blocks and set(map(len, blocks)) == {1}:
        return list(map(_one_shot, map(_first, blocks)))
    return list(map(block_checksum, blocks))


def copy_with_checksum(destinations: Sequence[memoryview],
                       sources: Sequence[BytesLike]) -> int:
    """Copy each segment of a block into its destination and return the block's checksum.

    Each segment is hashed right after it was copied, while it is still in cache:
    verifying then costs a fraction of a second pass over the block. Equal to copying,
    then ``block_checksum(destinations)``.
    """
    if len(destinations) == 1 == len(sources):
        destinations[0][:] = sources[0]
        return _one_shot(destinations[0])
    h = xxhash.xxh3_64(seed=0)
    for dst, src in zip(destinations, sources, strict=True):
        dst[:] = src
        h.update(dst)
    value: int = h.intdigest()
    return value


def copy_threads(requested: int) -> int:
    """The threads a batch copy can use here: ``requested`` (1 to
    :data:`MAX_COPY_THREADS`), or 1 without the compiled helper."""
    if not 1 <= requested <= MAX_COPY_THREADS:
        raise ValueError(f"copy threads must be between 1 and {MAX_COPY_THREADS}, "
                         f"got {requested}")
    return requested if NATIVE else 1


def copy_blocks(destinations: Sequence[Sequence[memoryview]],
                sources: Sequence[Sequence[BytesLike]], *, checksums: bool = True,
                threads: int = 1) -> list[int] | None:
    """Copy each block's segments into its destinations; each block's checksum, or None
    when ``checksums`` is false.

    The shapes must match (as many blocks, as many segments per block, each destination
    as long as its source) and every destination must be writable: otherwise
    ``ValueError`` (``TypeError`` for what is not a buffer) and no byte moves. With the
    compiled helper the whole batch runs without the GIL, over up to ``threads`` threads
    (see :func:`copy_threads`); in Python, one block after the other.
    """
    if _native_copy is not None:
        return _native_copy(destinations, sources, checksums=checksums, threads=threads)
    return _copy_blocks_python(destinations, sources, checksums=checksums, threads=threads)


def _copy_blocks_python(destinations: Sequence[Sequence[memoryview]],
                        sources: Sequence[Sequence[BytesLike]], *, checksums: bool = True,
                        threads: int = 1) -> list[int] | None:
    """:func:`copy_blocks` without the compiled helper: one block after the other."""
    if not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(f"threads must be between 1 and {MAX_COPY_THREADS}, got {threads}")
    _check_shapes(destinations, sources)
    if not checksums:
        for dsts, srcs in zip(destinations, sources, strict=True):
            for dst, src in zip(dsts, srcs, strict=True):
                dst[:] = src
        return None
    return [copy_with_checksum(dsts, srcs)
            for dsts, srcs in zip(destinations, sources, strict=True)]


def _check_shapes(destinations: Sequence[Sequence[memoryview]],
                  sources: Sequence[Sequence[BytesLike]]) -> None:
    """The Python path's checks of :func:`copy_blocks`, made before any byte moves."""
    if len(destinations) != len(sources):
        raise ValueError(f"{len(destinations)} destination blocks for {len(sources)} "
                         f"source blocks")
    for i, (dsts, srcs) in enumerate(zip(destinations, sources, strict=True)):
        if len(dsts) != len(srcs):
            raise ValueError(f"block {i}: {len(dsts)} destination segments for "
                             f"{len(srcs)} source segments")
        for j, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
            try:
                out_of = memoryview(src)
            except TypeError:
                raise TypeError(f"sources: block {i}, segment {j} is not a contiguous "
                                f"buffer") from None
            try:
                into = memoryview(dst)
            except TypeError:
                raise TypeError(f"destinations: block {i}, segment {j} is not a writable "
                                f"contiguous buffer") from None
            if into.readonly or not into.contiguous:
                raise ValueError(f"destinations: block {i}, segment {j} is not a writable "
                                 f"contiguous buffer")
            if into.nbytes != out_of.nbytes:
                raise ValueError(f"block {i}, segment {j}: destination of {into.nbytes} "
                                 f"bytes for a source of {out_of.nbytes}")

"""The block checksum: xxh3-64 (seed 0) of a block's segments, hashed in order.

One definition shared by the wire protocol (capability ``checksum-xxh3-64``, see
``protocol/SPEC.md``), the block store (which verifies a block before it becomes visible)
and the node's landing (which verifies blocks landed in caller-owned buffers, and blocks
copied from a peer's shared memory). Pure.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import TypeAlias

import xxhash

__all__ = ["BytesLike", "block_checksum", "block_checksums", "copy_with_checksum"]

BytesLike: TypeAlias = "bytes | bytearray | memoryview"

_one_shot = xxhash.xxh3_64_intdigest  # one C call for a block of one segment (V1)
_first = operator.itemgetter(0)


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

"""The block checksum: xxh3-64 (seed 0) of a block's segments, hashed in order.

One definition shared by the wire protocol (capability ``checksum-xxh3-64``, see
``protocol/SPEC.md``), the block store (which verifies a block before it becomes visible)
and the node's receiver (which verifies blocks landed in caller-owned buffers). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeAlias

import xxhash

__all__ = ["BytesLike", "block_checksum"]

BytesLike: TypeAlias = "bytes | bytearray | memoryview"


def block_checksum(segments: Iterable[BytesLike]) -> int:
    """xxh3-64 (seed 0) of one block's bytes, its segments hashed in order as one stream.

    Equal to ``xxh3_64(b"".join(segments))`` without building the joined bytes.
    """
    h = xxhash.xxh3_64(seed=0)
    for seg in segments:
        h.update(seg)
    value: int = h.intdigest()
    return value

"""Known block content: the fill rule of ``protocol/SPEC.md`` Appendix A.

``p2pkv-node serve --fill N`` starts a node holding N blocks whose keys and bytes any
implementation can compute, and ``p2pkv-node fetch ADDR --fill-keys N`` fetches them and
checks every byte. The rule:

* **Keys.** The block keys (SPEC §15) of the token ids ``0, 1, ..., N*T - 1``, where
  ``T`` is the run config's ``tokens_per_hash`` and the seed is the node's ``khash.seed``;
  group 0, no extra keys, the chain starting at the root hash. Block ``i`` covers tokens
  ``i*T .. i*T + T - 1``.
* **Bytes.** With ``s = XXH3_64(key, seed 0)``, word ``j`` (``j = 0, 1, ...``) of the
  block is ``splitmix64(s + (j + 1) * 0x9E3779B97F4A7C15 mod 2**64)``, written as 8
  little-endian bytes; the block is the first ``bytes_per_block`` bytes of those words
  (segments concatenated in ``geo.seg`` order).

``splitmix64(z)``: ``z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9``;
``z = (z ^ (z >> 27)) * 0x94D049BB133111EB``; ``z ^ (z >> 31)``, all modulo 2**64.

Everything here is pure and thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from p2pkv.keys import block_keys

__all__ = ["GOLDEN_GAMMA", "MAX_FILL_BLOCKS", "fill_block", "fill_keys", "first_mismatch"]

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
#: Token ids are u32: N * tokens_per_hash must stay below 2**32.
MAX_FILL_BLOCKS = 1 << 24

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def fill_keys(count: int, *, seed: int, tokens_per_hash: int) -> list[bytes]:
    """The keys of fill blocks ``0 .. count - 1`` (SPEC Appendix A)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_FILL_BLOCKS:
        raise ValueError(f"fill count must be an int in [0, {MAX_FILL_BLOCKS}], got {count!r}")
    if count * tokens_per_hash >= 2**32:
        raise ValueError(f"{count} fill blocks of {tokens_per_hash} tokens need token ids "
                         "beyond 2**32 - 1")
    if count == 0:
        return []
    return block_keys(range(count * tokens_per_hash), seed=seed,
                      tokens_per_block=tokens_per_hash)


def fill_block(key: bytes, nbytes: int) -> bytes:
    """The ``nbytes`` bytes of the fill block with ``key`` (SPEC Appendix A)."""
    if not isinstance(key, bytes) or not key:
        raise ValueError(f"key must be non-empty bytes, got {key!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    start = np.uint64(xxhash.xxh3_64_intdigest(key, seed=0))
    words = (nbytes + 7) // 8
    with np.errstate(over="ignore"):
        z = start + np.arange(1, words + 1, dtype=np.uint64) * np.uint64(GOLDEN_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z ^= z >> np.uint64(31)
    data: bytes = z.astype("<u8").tobytes()
    return data[:nbytes]


def first_mismatch(key: bytes, data: bytes | Sequence[int] | None, nbytes: int) -> str | None:
    """``None`` when ``data`` is the fill block of ``key``; otherwise what is wrong."""
    if data is None:
        return "not held"
    got = bytes(data)
    if len(got) != nbytes:
        return f"{len(got)} bytes, expected {nbytes}"
    want = fill_block(key, nbytes)
    if got == want:
        return None
    at = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    return f"byte {at} is 0x{got[at]:02x}, the fill rule gives 0x{want[at]:02x}"

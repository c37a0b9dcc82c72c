"""Block keys: chained xxh3-128 content hashes plus the KV-cache group index.

A block key is 20 bytes: the block's 16-byte content hash followed by its
KV-cache group index as 4 big-endian bytes (vLLM's convention). Content hashes
chain over the prompt, so equal keys mean equal prefixes: the hash of block
``i`` covers the hash of block ``i - 1``.

Wire-level definition (``protocol/SPEC.md`` §15; another implementation must reproduce
it byte for byte; all integers little-endian unless stated otherwise):

``root(seed)``
    ``XXH3_128(b"p2pkv/block-key/root/v1", seed)``: the parent of block 0.

``content_hash(parent, tokens, extras, seed)``
    ``XXH3_128(message, seed)`` where ``message`` is::

        parent        16 bytes (the previous block's content hash, or root(seed))
        n_tokens      u32
        token ids     n_tokens x u32   (each 0 <= id < 2**32)
        n_extras      u32
        each extra    1 tag byte, then:
                        0x01 int   -> i64 (two's complement)
                        0x02 str   -> u32 byte length + UTF-8 bytes
                        0x03 bytes -> u32 byte length + raw bytes

Hashes are taken as the canonical 16-byte digest (``XXH128_canonicalFromHash``,
big-endian, i.e. ``xxhash.xxh3_128(...).digest()``). ``seed`` is an unsigned
64-bit integer both peers must agree on, as they must on
:data:`KEY_HASH_ALGORITHM`.

Only full blocks are keyed; a partial tail block has no key. Extra keys (LoRA
id, multimodal hashes, cache salt ...) are an ordered sequence; the same
sequence is applied to every block of a call. Everything here is pure and
thread-safe.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final, TypeAlias

import xxhash

__all__ = [
    "BLOCK_KEY_BYTES",
    "CONTENT_HASH_BYTES",
    "KEY_HASH_ALGORITHM",
    "MAX_KEY_LEN",
    "ExtraKey",
    "block_keys",
    "check_keys",
    "content_hash",
    "find_bad_key",
    "full_blocks",
    "keys_well_formed",
    "make_block_key",
    "root_hash",
    "split_block_key",
]

#: Advertised at handshake; peers with a different algorithm never match keys.
KEY_HASH_ALGORITHM = "xxh3-128"
CONTENT_HASH_BYTES = 16
BLOCK_KEY_BYTES = CONTENT_HASH_BYTES + 4
MAX_KEY_LEN: Final = 64
"""Longest block key in bytes (a key is at least 1 byte): on the wire, in the store, at
the node's API (``protocol/SPEC.md`` §15). Chained keys are :data:`BLOCK_KEY_BYTES`."""

ExtraKey: TypeAlias = "int | str | bytes"


def keys_well_formed(keys: Sequence[object], max_len: int) -> bool:
    """True when every key is ``bytes`` of 1..``max_len`` bytes.

    The iteration runs in C (``map``/``set``/``min``/``max``): a 10,000-key lookup is
    checked on every layer it crosses, so the common, valid case must be cheap. Callers
    walk the keys one by one only to name the bad one.
    """
    if not keys:
        return True
    if set(map(type, keys)) != {bytes}:
        return False
    lengths = set(map(len, keys))  # type: ignore[arg-type]
    return min(lengths) >= 1 and max(lengths) <= max_len


def find_bad_key(keys: Sequence[object], max_len: int) -> tuple[int, str] | None:
    """``None`` when every key is ``bytes`` of 1..``max_len`` bytes; otherwise the index
    of the first bad key and what is wrong with it (``"type"`` or ``"length"``).

    The one key rule of the package, checked once at each boundary a key crosses into
    p2pkv: the node's API for its callers' keys, the codec for a peer's (a wire error
    code), the session for the keys of a request it is asked to send (the sans-IO core
    never emits what SPEC §15 forbids, whoever drives it), and the store's per-key API
    for its own callers. Inside a boundary keys are trusted (the store's slot batches,
    the data paths).
    """
    if keys_well_formed(keys, max_len):
        return None
    for i, key in enumerate(keys):
        if type(key) is not bytes:
            return i, "type"
        if not 1 <= len(key) <= max_len:
            return i, "length"
    return None  # pragma: no cover - keys_well_formed said otherwise


def check_keys(keys: Sequence[object], max_len: int, *, what: str = "keys") -> tuple[bytes, ...]:
    """``keys`` as a tuple; ``ValueError`` naming the first key that is not ``bytes`` of
    1..``max_len`` bytes."""
    out = tuple(keys)
    bad = find_bad_key(out, max_len)
    if bad is not None:
        i = bad[0]
        raise ValueError(f"{what}[{i}] must be bytes of length 1..{max_len}, got {out[i]!r:.60}")
    return out  # type: ignore[return-value]

_ROOT_LABEL = b"p2pkv/block-key/root/v1"
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_TAG_INT = b"\x01"
_TAG_STR = b"\x02"
_TAG_BYTES = b"\x03"


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"hash seed must be an int, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"hash seed must be in [0, 2**64), got {seed}")
    return seed


def _check_group(group: object) -> int:
    if isinstance(group, bool) or not isinstance(group, int):
        raise ValueError(f"group index must be an int, got {type(group).__name__} {group!r}")
    if not 0 <= group < 2**32:
        raise ValueError(f"group index must be in [0, 2**32), got {group}")
    return group


def root_hash(seed: int) -> bytes:
    """The 16-byte parent hash of a prompt's first block for ``seed``."""
    return xxhash.xxh3_128(_ROOT_LABEL, seed=_check_seed(seed)).digest()


def _encode_tokens(token_ids: Sequence[int], offset: int = 0) -> bytes:
    n = len(token_ids)
    try:
        return _U32.pack(n) + struct.pack(f"<{n}I", *token_ids)
    except struct.error:
        pass
    # Slow path only to name the offending token in the error.
    for i, tok in enumerate(token_ids):
        if isinstance(tok, bool) or not hasattr(tok, "__index__"):
            raise ValueError(
                f"token id at position {offset + i} is not an integer: {tok!r}"
            ) from None
        if not 0 <= int(tok) < 2**32:
            raise ValueError(
                f"token id at position {offset + i} is out of range [0, 2**32): {tok}"
            ) from None
    raise ValueError("token ids cannot be encoded as u32")  # pragma: no cover


def _encode_extras(extra_keys: Sequence[ExtraKey]) -> bytes:
    parts = [_U32.pack(len(extra_keys))]
    for i, extra in enumerate(extra_keys):
        # bool is checked first: True is not the LoRA id 1 by accident.
        if isinstance(extra, bool):
            raise ValueError(f"extra key {i} must be int, str or bytes, got bool")
        if isinstance(extra, int):
            if not -(2**63) <= extra < 2**63:
                raise ValueError(f"extra key {i} does not fit in a signed 64-bit int: {extra}")
            parts += [_TAG_INT, _I64.pack(extra)]
        elif isinstance(extra, str):
            data = extra.encode("utf-8")
            parts += [_TAG_STR, _U32.pack(len(data)), data]
        elif isinstance(extra, bytes):
            parts += [_TAG_BYTES, _U32.pack(len(extra)), extra]
        else:
            raise ValueError(f"extra key {i} must be int, str or bytes, got {type(extra).__name__}")
    return b"".join(parts)


def content_hash(
    parent_hash: bytes,
    token_ids: Sequence[int],
    *,
    seed: int,
    extra_keys: Sequence[ExtraKey] = (),
) -> bytes:
    """The 16-byte content hash of one block chained on ``parent_hash``."""
    _check_seed(seed)
    if not isinstance(parent_hash, bytes) or len(parent_hash) != CONTENT_HASH_BYTES:
        raise ValueError(f"parent hash must be {CONTENT_HASH_BYTES} bytes, got {parent_hash!r}")
    return _content_hash(parent_hash, _encode_tokens(token_ids), seed, _encode_extras(extra_keys))


def _content_hash(parent: bytes, tokens: bytes, seed: int, extras: bytes) -> bytes:
    h = xxhash.xxh3_128(seed=seed)
    h.update(parent)
    h.update(tokens)
    h.update(extras)
    return h.digest()


def make_block_key(content: bytes, group: int = 0) -> bytes:
    """``content`` (16 bytes) followed by ``group`` as 4 big-endian bytes."""
    if not isinstance(content, bytes) or len(content) != CONTENT_HASH_BYTES:
        raise ValueError(f"content hash must be {CONTENT_HASH_BYTES} bytes, got {content!r}")
    return content + _check_group(group).to_bytes(4, "big")


def split_block_key(key: bytes) -> tuple[bytes, int]:
    """Inverse of :func:`make_block_key`: ``(content_hash, group)``."""
    if not isinstance(key, bytes) or len(key) != BLOCK_KEY_BYTES:
        raise ValueError(f"block key must be {BLOCK_KEY_BYTES} bytes, got {key!r}")
    return key[:CONTENT_HASH_BYTES], int.from_bytes(key[CONTENT_HASH_BYTES:], "big")


def full_blocks(token_ids: Sequence[int], tokens_per_block: int) -> list[Sequence[int]]:
    """Split ``token_ids`` into full blocks; the partial tail is dropped."""
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise ValueError(f"tokens_per_block must be an int, got {tokens_per_block!r}")
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    n_full = len(token_ids) // tokens_per_block
    return [token_ids[i * tokens_per_block : (i + 1) * tokens_per_block] for i in range(n_full)]


def block_keys(
    token_ids: Sequence[int],
    *,
    seed: int,
    tokens_per_block: int = 16,
    group: int = 0,
    extra_keys: Sequence[ExtraKey] = (),
    parent_hash: bytes | None = None,
) -> list[bytes]:
    """Keys of every full block of ``token_ids``, in order.

    ``parent_hash`` continues a chain (the content hash of the block before
    ``token_ids[0]``); by default the chain starts at :func:`root_hash`.
    """
    _check_seed(seed)
    group_suffix = _check_group(group).to_bytes(4, "big")
    if parent_hash is None:
        parent = root_hash(seed)
    elif isinstance(parent_hash, bytes) and len(parent_hash) == CONTENT_HASH_BYTES:
        parent = parent_hash
    else:
        raise ValueError(f"parent hash must be {CONTENT_HASH_BYTES} bytes, got {parent_hash!r}")
    extras = _encode_extras(extra_keys)
    keys: list[bytes] = []
    for index, block in enumerate(full_blocks(token_ids, tokens_per_block)):
        encoded = _encode_tokens(block, offset=index * tokens_per_block)
        parent = _content_hash(parent, encoded, seed, extras)
        keys.append(parent + group_suffix)
    return keys

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import xxhash

from p2pkv.keys import (
    BLOCK_KEY_BYTES,
    KEY_HASH_ALGORITHM,
    block_keys,
    content_hash,
    full_blocks,
    make_block_key,
    root_hash,
    split_block_key,
)

SEED = 1234
TOKENS = list(range(1000, 1000 + 16 * 4 + 5))  # four full blocks and a partial tail


def reference_keys(tokens: list[int], seed: int, group: int, extra: bytes) -> list[bytes]:
    """An independent transcription of the wire definition in p2pkv.keys' docstring."""
    parent = xxhash.xxh3_128(b"p2pkv/block-key/root/v1", seed=seed).digest()
    keys = []
    for start in range(0, len(tokens) - 15, 16):
        block = tokens[start : start + 16]
        message = parent + struct.pack("<I", 16) + struct.pack("<16I", *block) + extra
        parent = xxhash.xxh3_128(message, seed=seed).digest()
        keys.append(parent + struct.pack(">I", group))
    return keys


def test_algorithm_constant() -> None:
    assert KEY_HASH_ALGORITHM == "xxh3-128"


def test_keys_follow_the_documented_encoding() -> None:
    no_extras = struct.pack("<I", 0)
    assert block_keys(TOKENS, seed=SEED) == reference_keys(TOKENS, SEED, 0, no_extras)
    extras = (
        struct.pack("<I", 3)
        + b"\x01"
        + struct.pack("<q", -7)
        + b"\x02"
        + struct.pack("<I", 4)
        + "lór".encode()
        + b"\x03"
        + struct.pack("<I", 2)
        + b"\x00\xff"
    )
    got = block_keys(TOKENS, seed=SEED, group=5, extra_keys=[-7, "lór", b"\x00\xff"])
    assert got == reference_keys(TOKENS, SEED, 5, extras)


def test_keys_are_deterministic_and_only_full_blocks_are_keyed() -> None:
    keys = block_keys(TOKENS, seed=SEED)
    assert keys == block_keys(list(TOKENS), seed=SEED)
    assert len(keys) == 4
    assert all(len(key) == BLOCK_KEY_BYTES for key in keys)
    assert len(set(keys)) == 4
    assert block_keys(TOKENS[:15], seed=SEED) == []
    assert block_keys(TOKENS, seed=SEED, tokens_per_block=32) == block_keys(
        TOKENS, seed=SEED, tokens_per_block=32
    )
    assert len(block_keys(TOKENS, seed=SEED, tokens_per_block=32)) == 2


def test_numpy_token_ids_give_the_same_keys() -> None:
    tokens = np.array(TOKENS, dtype=np.int64)
    # Engines hand over token ids as arrays; any integer sequence is accepted.
    assert block_keys(tokens, seed=SEED) == block_keys(TOKENS, seed=SEED)  # type: ignore[arg-type]


def test_equal_prefixes_give_equal_leading_keys() -> None:
    other = list(TOKENS)
    other[40] += 1  # inside block 2
    a = block_keys(TOKENS, seed=SEED)
    b = block_keys(other, seed=SEED)
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]


def test_a_changed_first_token_changes_every_key() -> None:
    other = list(TOKENS)
    other[0] += 1
    a = block_keys(TOKENS, seed=SEED)
    b = block_keys(other, seed=SEED)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_the_chain_distinguishes_equal_blocks_at_different_positions() -> None:
    keys = block_keys([7] * 48, seed=SEED)
    assert len(set(keys)) == 3


def test_seed_extra_keys_and_group_change_keys() -> None:
    base = block_keys(TOKENS, seed=SEED)
    reseeded = block_keys(TOKENS, seed=SEED + 1)
    assert all(x != y for x, y in zip(base, reseeded, strict=True))
    lora = block_keys(TOKENS, seed=SEED, extra_keys=[1])
    assert all(x != y for x, y in zip(base, lora, strict=True))
    # Types are part of the encoding: the int 1, the string "1" and b"1" differ.
    variants = [block_keys(TOKENS, seed=SEED, extra_keys=[e])[0] for e in (1, "1", b"1")]
    assert len(set(variants)) == 3
    # Order of extra keys matters.
    assert block_keys(TOKENS, seed=SEED, extra_keys=["a", "b"]) != block_keys(
        TOKENS, seed=SEED, extra_keys=["b", "a"]
    )
    grouped = block_keys(TOKENS, seed=SEED, group=3)
    for plain, other in zip(base, grouped, strict=True):
        assert plain != other
        assert plain[:16] == other[:16]  # the group only changes the suffix
        assert other[16:] == b"\x00\x00\x00\x03"


def test_parent_hash_continues_a_chain() -> None:
    keys = block_keys(TOKENS, seed=SEED)
    content0, _ = split_block_key(keys[0])
    assert block_keys(TOKENS[16:], seed=SEED, parent_hash=content0) == keys[1:]
    assert content_hash(root_hash(SEED), TOKENS[:16], seed=SEED) == content0
    assert make_block_key(content0, 0) == keys[0]


def test_block_key_split_round_trip() -> None:
    content = bytes(range(16))
    key = make_block_key(content, 0xDEADBEEF)
    assert key[16:] == bytes.fromhex("deadbeef")
    assert split_block_key(key) == (content, 0xDEADBEEF)


def test_full_blocks() -> None:
    assert full_blocks(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert full_blocks([], 4) == []
    with pytest.raises(ValueError, match="tokens_per_block"):
        full_blocks([1, 2], 0)


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1] * 20 + [-1] + [1] * 11, "position 20 is out of range"),
        ([1] * 16 + [2**32] + [1] * 15, "position 16 is out of range"),
        ([1] * 5 + [1.5] + [1] * 10, "position 5 is not an integer"),
    ],
)
def test_bad_token_ids(tokens: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        block_keys(tokens, seed=SEED)


@pytest.mark.parametrize("seed", [-1, 2**64, True, "1", 1.0, None])
def test_bad_seeds(seed: Any) -> None:
    with pytest.raises(ValueError, match="seed"):
        block_keys(TOKENS, seed=seed)
    with pytest.raises(ValueError, match="seed"):
        root_hash(seed)


@pytest.mark.parametrize("group", [-1, 2**32, False, "0"])
def test_bad_groups(group: Any) -> None:
    with pytest.raises(ValueError, match="group"):
        block_keys(TOKENS, seed=SEED, group=group)
    with pytest.raises(ValueError, match="group"):
        make_block_key(bytes(16), group)


@pytest.mark.parametrize("extra", [True, 2**63, 1.0, None, bytearray(b"x")])
def test_bad_extra_keys(extra: Any) -> None:
    with pytest.raises(ValueError, match="extra key 0"):
        block_keys(TOKENS, seed=SEED, extra_keys=[extra])


def test_bad_parent_and_key_lengths() -> None:
    with pytest.raises(ValueError, match="parent hash"):
        block_keys(TOKENS, seed=SEED, parent_hash=b"short")
    with pytest.raises(ValueError, match="parent hash"):
        content_hash(b"x" * 17, TOKENS[:16], seed=SEED)
    with pytest.raises(ValueError, match="20 bytes"):
        split_block_key(b"x" * 16)

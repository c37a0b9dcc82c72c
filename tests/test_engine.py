from __future__ import annotations

import pytest
import torch

from p2pkv.keys import block_keys
from p2pkv.layout import SEED_GEOMETRY, Geometry, KVLayout, make_layout, torch_dtype
from p2pkv.store import BlockStore, StoreFullError
from p2pkv.store.engine import EngineKVCopier
from p2pkv.store.pool import BlockPool

SMALL = Geometry(num_layers=3, num_kv_heads=2, head_size=4, tokens_per_block=4)
SMALL_MLA = Geometry(
    num_layers=3, num_kv_heads=1, head_size=6, tokens_per_block=4, dtype="bfloat16", kv_kind="mla"
)


def logical_kv(geometry: Geometry, blocks: int, seed: int = 0) -> torch.Tensor:
    """Random KV shaped (blocks, layers, heads, tokens, values) in the model dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, *geometry.logical_block_shape)
    return torch.randn(shape, generator=gen).to(torch_dtype(geometry.dtype))


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def stored(store: BlockStore, key: bytes) -> bytes:
    data = store.get(key)
    assert data is not None, f"block {key!r} is not stored"
    return data


def store_for(layout: KVLayout, capacity: int) -> BlockStore:
    return BlockStore(BlockPool(layout, capacity))


def zeros_like_engine(layout: KVLayout, blocks: int, device: str = "cpu") -> list[torch.Tensor]:
    dtype = torch_dtype(layout.geometry.dtype)
    return [torch.zeros(s, dtype=dtype, device=device) for s in layout.engine_shapes(blocks)]


def test_v1_and_v2_store_the_same_kv_in_different_byte_orders() -> None:
    kv = logical_kv(SEED_GEOMETRY, blocks=2)
    keys = block_keys(list(range(32)), seed=0)
    by_layout: dict[str, list[bytes]] = {}
    for name in ("v1", "v2"):
        layout = make_layout(name, SEED_GEOMETRY)
        store = store_for(layout, 2)
        copier = EngineKVCopier(store, layout.engine_from_logical(kv))
        assert copier.save_many([(0, keys[0]), (1, keys[1])]) == [True, True]
        by_layout[name] = [stored(store, key) for key in keys]

        # Each layout round-trips exactly through its own engine tensors.
        restored = zeros_like_engine(layout, 2)
        back = EngineKVCopier(store, restored)
        assert back.load_many([(keys[1], 0), (keys[0], 1)]) == [True, True]
        assert torch.equal(layout.logical_from_engine(restored), kv[[1, 0]])

    for block in range(2):
        v1, v2 = by_layout["v1"][block], by_layout["v2"][block]
        assert len(v1) == len(v2) == 589_824
        assert v1 != v2  # same size, different order: a size check cannot tell them apart
        # The documented orders: V1 rows are (head, layer, token, value) ...
        assert v1 == tensor_bytes(kv[block].permute(1, 0, 2, 3))
        # ... and V2 is layer after layer of (head, token, value).
        assert v2 == tensor_bytes(kv[block])


def test_loading_bytes_of_the_other_layout_silently_corrupts() -> None:
    """What the handshake exists to prevent: nothing fails, the KV is just wrong."""
    kv = logical_kv(SMALL, blocks=1, seed=3)
    key = b"k" * 20
    v1, v2 = make_layout("v1", SMALL), make_layout("v2", SMALL)
    v1_store = store_for(v1, 1)
    EngineKVCopier(v1_store, v1.engine_from_logical(kv)).save(0, key)
    v2_store = store_for(v2, 1)
    assert v2_store.put(key, stored(v1_store, key))  # sizes match, so this is accepted
    engine = zeros_like_engine(v2, 1)
    assert EngineKVCopier(v2_store, engine).load(key, 0)
    assert not torch.equal(v2.logical_from_engine(engine), kv)


def test_replicated_mla_round_trip() -> None:
    layout = make_layout("replicated", SMALL_MLA)
    kv = logical_kv(SMALL_MLA, blocks=3, seed=5)
    store = store_for(layout, 3)
    copier = EngineKVCopier(store, layout.engine_from_logical(kv))
    assert copier.save(2, b"mla")
    assert stored(store, b"mla") == tensor_bytes(kv[2, :, 0])
    restored = zeros_like_engine(layout, 3)
    assert EngineKVCopier(store, restored).load(b"mla", 0)
    assert torch.equal(restored[0][0], kv[2, :, 0])


def test_save_skips_present_keys_and_load_skips_missing_ones() -> None:
    layout = make_layout("v2", SMALL)
    kv = logical_kv(SMALL, blocks=2, seed=1)
    store = store_for(layout, 4)
    copier = EngineKVCopier(store, layout.engine_from_logical(kv))
    assert copier.save_many([(0, b"a"), (1, b"a")]) == [True, False]
    assert copier.save(1, b"a") is False
    engine = zeros_like_engine(layout, 2)
    loader = EngineKVCopier(store, engine)
    assert loader.load_many([(b"missing", 1), (b"a", 0)]) == [False, True]
    assert torch.equal(layout.logical_from_engine(engine)[0], kv[0])
    assert not any(t[1].any() for t in engine)  # block 1 untouched
    assert store.stats().pinned == 0


def test_failed_batch_leaves_nothing_visible() -> None:
    layout = make_layout("v1", SMALL)
    kv = logical_kv(SMALL, blocks=2)
    store = store_for(layout, 2)
    copier = EngineKVCopier(store, layout.engine_from_logical(kv))
    copier.save(0, b"held")
    reader = store.acquire_read(b"held")
    assert reader is not None
    with pytest.raises(StoreFullError):
        copier.save_many([(0, b"x"), (1, b"y")])  # one free slot for two blocks
    assert store.lookup([b"x", b"y"]) == [False, False]
    stats = store.stats()
    assert (stats.used, stats.pinned) == (1, 1)
    reader.release()


def test_engine_tensors_are_validated() -> None:
    layout = make_layout("v2", SMALL)
    store = store_for(layout, 1)
    good = zeros_like_engine(layout, 2)
    with pytest.raises(ValueError, match="3 engine tensors"):
        EngineKVCopier(store, good[:2])
    with pytest.raises(ValueError, match="shaped"):
        EngineKVCopier(store, [*good[:2], torch.zeros(2, 2, 4, 9, dtype=torch.float16)])
    with pytest.raises(ValueError, match="shaped"):
        EngineKVCopier(store, [*good[:2], torch.zeros(3, 2, 4, 8, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"torch\.float32"):
        EngineKVCopier(store, [t.float() for t in good])
    copier = EngineKVCopier(store, good)
    assert not copier.uses_copy_stream
    with pytest.raises(IndexError):
        copier.save(2, b"k")
    with pytest.raises(IndexError):
        copier.load(b"k", -1)
    assert store.stats().used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["v1", "v2"])
def test_cuda_engine_tensors_round_trip_through_pinned_pool(name: str) -> None:
    layout = make_layout(name, SEED_GEOMETRY)
    pool = BlockPool(layout, 4)
    assert pool.pinned and pool.memory_kind == "pinned"
    store = BlockStore(pool)
    kv = logical_kv(SEED_GEOMETRY, blocks=3, seed=11)
    engine = zeros_like_engine(layout, 3, device="cuda")
    # The engine writes its KV on its own (current) stream right before the save:
    # the copy stream must wait for that work, or it would save zeros.
    for dst, src in zip(engine, layout.engine_from_logical(kv), strict=True):
        dst.copy_(src.pin_memory(), non_blocking=True)
    copier = EngineKVCopier(store, engine)
    assert copier.uses_copy_stream
    keys = [b"c0", b"c1", b"c2"]
    assert copier.save_many(list(zip(range(3), keys, strict=True))) == [True] * 3
    for block, key in enumerate(keys):
        expected = layout.engine_from_logical(kv[block : block + 1])
        assert stored(store, key) == b"".join(tensor_bytes(t) for t in expected)

    restored = zeros_like_engine(layout, 3, device="cuda")
    loader = EngineKVCopier(store, restored)
    assert loader.load_many([(keys[2], 0), (keys[0], 2)]) == [True, True]
    logical = layout.logical_from_engine([t.cpu() for t in restored])
    assert torch.equal(logical[0], kv[2])
    assert torch.equal(logical[2], kv[0])
    assert not logical[1].any()
    assert store.stats().pinned == 0

from __future__ import annotations

import contextlib
import gc
import logging
import random
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import zmq

from p2pkv import errors
from p2pkv.layout import Geometry, KVLayout, make_layout
from p2pkv.store import (
    BlockStore,
    ChecksumMismatch,
    StoreError,
    StoreFullError,
    block_checksum,
)
from p2pkv.store.handles import split_segments
from p2pkv.store.pool import PAGE_SIZE, BlockPool

# 2 layers x 2 heads x 4 tokens x 8 values x fp16: 128 bytes per layer, 256 per block.
TINY = Geometry(num_layers=2, num_kv_heads=2, head_size=4, tokens_per_block=4)
V1 = make_layout("v1", TINY)
V2 = make_layout("v2", TINY)


def payload(key: bytes, size: int = 256) -> bytes:
    """Block content derived from its key, so any mix-up is detectable."""
    return (key * (size // len(key) + 1))[:size]


def make_store(capacity: int, layout: KVLayout = V1) -> BlockStore:
    return BlockStore(BlockPool(layout, capacity))


def view_address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


# -- pool ---------------------------------------------------------------------


def test_pool_is_pageable_and_page_aligned_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine pins memory")
    with caplog.at_level(logging.INFO, logger="p2pkv.pool"):
        pool = BlockPool(V2, 5)
    assert not pool.pinned and pool.memory_kind == "pageable"
    assert all(ptr % PAGE_SIZE == 0 for ptr in pool.region_data_ptrs())
    records = [r for r in caplog.records if r.name == "p2pkv.pool"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "pageable" in records[0].getMessage()
    with pytest.raises(ValueError, match="CUDA"):
        BlockPool(V1, 1, pin=True)


def test_pool_sizes() -> None:
    pool = BlockPool.for_bytes(V1, 256 * 10 + 255)
    assert pool.num_blocks == 10 and pool.nbytes == 2560
    with pytest.raises(ValueError, match="holds no block"):
        BlockPool.for_bytes(V1, 255)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(V1, 0)


def test_typed_tensors_have_the_layout_shapes() -> None:
    v1 = BlockPool(V1, 3)
    assert [tuple(t.shape) for t in v1.kv_tensors] == [(3, 2, 2, 4, 8)]
    v2 = BlockPool(V2, 3)
    assert [tuple(t.shape) for t in v2.kv_tensors] == [(3, 2, 4, 8)] * 2
    assert all(t.dtype == torch.float16 for t in v1.kv_tensors + v2.kv_tensors)


@pytest.mark.parametrize("layout", [V1, V2], ids=["v1", "v2"])
def test_segment_views_alias_pool_memory(layout: KVLayout) -> None:
    pool = BlockPool(layout, 4)
    views = pool.segment_views(2)
    assert [len(v) for v in views] == list(layout.segment_sizes)
    for i, view in enumerate(views):
        assert view.format == "B" and view.c_contiguous and not view.readonly
        size = layout.segment_sizes[i]
        assert view_address(view) == pool.region_data_ptrs()[i] + 2 * size
    # Write through a view, read through the typed tensor.
    value = torch.tensor([3.5], dtype=torch.float16)
    views[-1][:2] = value.numpy().tobytes()
    assert pool.kv_tensors[-1][2].reshape(-1)[0].item() == 3.5
    assert pool.block_tensors(2)[-1].reshape(-1)[0].item() == 3.5
    # And the other way round.
    pool.kv_tensors[0][2].fill_(-2.0)
    expected = torch.full((layout.segment_sizes[0] // 2,), -2.0, dtype=torch.float16)
    assert bytes(views[0]) == expected.numpy().tobytes()
    with pytest.raises(IndexError):
        pool.segment_views(4)


def test_segment_views_work_with_zmq_zero_copy() -> None:
    sender, receiver = make_store(2, V2), make_store(2, V2)
    key = b"k" * 20
    sender.put(key, payload(key))
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PAIR)
        pull = ctx.socket(zmq.PAIR)
        push.bind("inproc://blocks")
        pull.connect("inproc://blocks")
        reader = sender.acquire_read(key)
        assert reader is not None
        trackers = [push.send(v, copy=False, track=True) for v in reader.views]
        writer = receiver.begin_write(key)
        assert writer is not None
        for view in writer.views:
            assert pull.poll(5000, zmq.POLLIN)
            assert pull.recv_into(view) == len(view)
        for tracker in trackers:
            assert tracker is not None
            tracker.wait(5)
        reader.release()
        writer.commit(expected_checksum=sender.checksum(key))
        assert receiver.get(key) == payload(key)
    finally:
        ctx.destroy(linger=0)


# -- store basics ---------------------------------------------------------------


def test_put_get_lookup_and_counters() -> None:
    store = make_store(4)
    a, b = b"a" * 20, b"b" * 20
    assert store.put(a, payload(a))
    assert store.get(a) == payload(a)
    assert store.lookup([a, b, a]) == [True, False, True]
    assert store.contains(a) and not store.contains(b)
    assert a in store and b not in store and "x" not in store
    stats = store.stats()
    assert (stats.hits, stats.misses) == (2, 1)  # contains() does not count
    assert (stats.capacity, stats.used, stats.stored, stats.pinned) == (4, 1, 1, 0)
    assert stats.bytes_per_block == 256 and stats.memory_kind == store.pool.memory_kind
    assert store.checksum(a) == xxhash.xxh3_64(payload(a), seed=0).intdigest()
    assert store.get(b) is None and store.checksum(b) is None


def test_put_segments_for_v2() -> None:
    store = make_store(2, V2)
    key = b"seg"
    data = payload(key)
    assert store.put(key, [data[:128], bytearray(data[128:])])
    assert store.get(key) == data
    with pytest.raises(ValueError, match="segment sizes"):
        store.put(b"other", [data])
    with pytest.raises(ValueError, match="255 bytes"):
        store.put(b"other", data[:255])
    assert store.stats().used == 1  # failed puts take no slot


def test_reader_checksum_matches_the_bytes() -> None:
    store = make_store(2, V2)
    store.put(b"r", payload(b"r"))
    reader = store.acquire_read(b"r")
    assert reader is not None
    with reader:
        assert reader.checksum == xxhash.xxh3_64(payload(b"r"), seed=0).intdigest()
        assert reader.checksum == block_checksum(reader.views)


def test_a_slot_reused_after_its_reader_let_go_gets_the_new_blocks_checksum() -> None:
    """The checksum is kept per slot: a block discarded while pinned keeps its slot (and
    its checksum) until the reader releases; the next block in that slot is checked and
    served with its own, and a released reader cannot write its old one back."""
    store = make_store(1, V1)
    store.put(b"old", payload(b"old"))
    reader = store.acquire_read(b"old")
    assert reader is not None
    assert store.discard(b"old")
    with pytest.raises(StoreFullError):  # the only slot is still pinned
        store.put(b"new", payload(b"new"))
    assert reader.checksum == block_checksum([payload(b"old")])
    reader.release()
    with pytest.raises(StoreError, match="released"):
        _ = reader.checksum
    assert store.put(b"new", payload(b"new"))  # unverified: nothing hashed on commit
    assert store.checksum(b"new") == block_checksum([payload(b"new")])
    assert store.get(b"new") == payload(b"new")
    assert store.stats().used == 1


def test_store_errors_belong_to_the_package_hierarchy() -> None:
    assert StoreFullError is errors.StoreFullError
    assert issubclass(ChecksumMismatch, errors.P2PKVError)
    assert issubclass(StoreError, errors.P2PKVError)


def test_block_checksum_streams_segments() -> None:
    data = payload(b"xyz", 1000)
    views = [memoryview(data)[:10], memoryview(data)[10:700], memoryview(data)[700:]]
    assert block_checksum(views) == xxhash.xxh3_64(data, seed=0).intdigest()


@pytest.mark.parametrize("key", [b"", b"x" * 65, "text", bytearray(b"x")])
def test_bad_keys(key: object) -> None:
    store = make_store(1)
    with pytest.raises(ValueError, match="keys"):
        store.begin_write(key)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keys"):
        store.lookup([key])  # type: ignore[list-item]


def test_write_is_invisible_until_commit() -> None:
    store = make_store(2)
    key = b"pending"
    writer = store.begin_write(key)
    assert writer is not None
    writer.views[0][:] = payload(key)
    assert store.lookup([key]) == [False]
    assert not store.contains(key)
    assert store.acquire_read(key) is None
    assert store.begin_write(key) is None  # one write per key at a time
    assert store.stats().pinned == 1
    writer.commit()
    assert store.lookup([key]) == [True]
    assert store.get(key) == payload(key)
    assert store.begin_write(key) is None  # already stored
    assert not store.put(key, payload(b"other"))
    assert store.get(key) == payload(key)
    with pytest.raises(StoreError, match="already finished"):
        writer.commit()
    writer.abort()  # no-op after commit
    assert store.contains(key)


def test_aborted_writes_leave_no_trace() -> None:
    store = make_store(2)
    before = store.stats()
    writer = store.begin_write(b"gone")
    assert writer is not None
    writer.views[0][:] = payload(b"gone")
    writer.abort()
    writer.abort()
    assert store.stats() == before
    assert store.lookup([b"gone"]) == [False]
    with pytest.raises(RuntimeError), store.begin_write(b"gone") as w:  # type: ignore[union-attr]
        assert w is not None
        raise RuntimeError("engine failed mid-copy")
    assert store.stats().used == 0 and not store.contains(b"gone")
    with pytest.raises(StoreError):
        writer.commit()
    # The key can be written again.
    assert store.put(b"gone", payload(b"gone"))


def test_checksum_mismatch_drops_the_block() -> None:
    store = make_store(2)
    key = b"checked"
    data = payload(key)
    good = xxhash.xxh3_64(data, seed=0).intdigest()
    writer = store.begin_write(key)
    assert writer is not None
    writer.views[0][:] = data
    with pytest.raises(ChecksumMismatch) as info:
        writer.commit(expected_checksum=good ^ 1)
    assert info.value.key == key and info.value.actual == good
    stats = store.stats()
    assert not store.contains(key)
    assert (stats.checksum_failures, stats.used, stats.pinned) == (1, 0, 0)
    assert store.put(key, data, expected_checksum=good)
    assert store.get(key) == data
    with pytest.raises(ValueError, match="u64"):
        store.put(b"neg", data, expected_checksum=-1)


# -- eviction and pins ----------------------------------------------------------


def test_lru_eviction_order() -> None:
    store = make_store(3)
    for key in (b"a", b"b", b"c"):
        store.put(key, payload(key))
    store.lookup([b"a"])  # a becomes most recent; b is now the oldest
    store.put(b"d", payload(b"d"))
    assert store.stored_keys() == [b"c", b"a", b"d"]
    assert store.stats().evictions == 1
    for key in (b"c", b"a", b"d"):
        assert store.get(key) == payload(key)


def test_eviction_never_touches_pinned_blocks() -> None:
    store = make_store(2)
    store.put(b"a", payload(b"a"))
    store.put(b"b", payload(b"b"))
    reader = store.acquire_read(b"a")
    store.lookup([b"b"])  # a is least recently used, but pinned
    assert reader is not None
    store.put(b"c", payload(b"c"))  # must evict b, not a
    assert store.stored_keys() == [b"a", b"c"]
    assert bytes(reader.views[0]) == payload(b"a")
    reader2 = store.acquire_read(b"c")
    assert reader2 is not None
    with pytest.raises(StoreFullError):
        store.begin_write(b"d")
    assert store.stats().pinned == 2
    reader.release()
    reader.release()  # idempotent
    assert store.stats().pinned == 1
    store.put(b"d", payload(b"d"))  # now a can go
    assert not store.contains(b"a")
    assert bytes(reader2.views[0]) == payload(b"c")
    reader2.release()


def test_discard_of_a_pinned_block_waits_for_its_readers() -> None:
    store = make_store(1)
    store.put(b"a", payload(b"a"))
    reader = store.acquire_read(b"a")
    assert reader is not None
    assert store.discard(b"a")
    assert not store.discard(b"a")
    assert not store.contains(b"a") and store.acquire_read(b"a") is None
    # The slot is still held by the reader: nothing may be written over it.
    with pytest.raises(StoreFullError):
        store.begin_write(b"b")
    assert bytes(reader.views[0]) == payload(b"a")
    assert store.stats().pinned == 1
    # Release from another thread, as a zmq tracker callback would.
    t = threading.Thread(target=reader.release)
    t.start()
    t.join()
    assert store.stats().used == 0
    assert store.put(b"b", payload(b"b"))
    assert store.get(b"b") == payload(b"b")


def test_all_slots_being_written_is_store_full() -> None:
    store = make_store(2)
    w1, w2 = store.begin_write(b"1"), store.begin_write(b"2")
    assert w1 is not None and w2 is not None
    with pytest.raises(StoreFullError, match="2 being written"):
        store.begin_write(b"3")
    w1.abort()
    assert store.begin_write(b"3") is not None


def statm_resident_bytes() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    import resource

    return pages * resource.getpagesize()


def test_ten_thousand_put_evict_cycles_do_not_grow_memory() -> None:
    store = make_store(4, V2)
    ptrs = store.pool.region_data_ptrs()
    data = payload(b"0123456789abcdef")
    for i in range(200):  # warm up caches and free lists
        store.put(i.to_bytes(8, "big"), data)
    gc.collect()
    rss_before = statm_resident_bytes()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for i in range(200, 10_200):
            key = i.to_bytes(8, "big")
            assert store.put(key, data)
            if i % 3 == 0:
                reader = store.acquire_read(key)
                assert reader is not None
                reader.release()
                store.discard(key)
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert current - base < 64 * 1024
    rss_after = statm_resident_bytes()
    if rss_before is not None and rss_after is not None:
        assert rss_after - rss_before < 32 * 1024 * 1024
    assert store.pool.region_data_ptrs() == ptrs
    stats = store.stats()
    assert stats.capacity == 4 and stats.used <= 4 and stats.pinned == 0
    assert stats.evictions > 6000
    assert store.get((10_199).to_bytes(8, "big")) == data


def test_concurrent_readers_and_writers_keep_invariants() -> None:
    store = make_store(4)
    keys = [bytes([i]) * 8 for i in range(24)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1500):
                key = rng.choice(keys)
                with contextlib.suppress(StoreFullError):
                    store.put(key, payload(key))
                time.sleep(0)
                if rng.random() < 0.1:
                    store.discard(rng.choice(keys))
        except BaseException as exc:
            errors.append(exc)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                key = rng.choice(keys)
                held = store.acquire_read(key)
                if held is None:
                    continue
                # While pinned, the slot must keep exactly this key's bytes even
                # as writers evict and reuse other slots; sleep(0) hands the GIL
                # to the writers while the pin is held.
                for _ in range(4):
                    if bytes(held.views[0]) != payload(key):
                        raise AssertionError(f"pinned block {key.hex()} changed under a reader")
                    time.sleep(0)
                held.release()
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    readers = [threading.Thread(target=reader, args=(100 + i,)) for i in range(3)]
    # Switch threads often so pins, evictions and commits really interleave.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for t in writers + readers:
            t.start()
        for t in writers:
            t.join(timeout=60)
        stop.set()
        for t in readers:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in writers + readers)
    assert errors == []
    stats = store.stats()
    assert stats.pinned == 0
    assert stats.used == stats.stored <= stats.capacity
    for key in store.stored_keys():
        assert store.get(key) == payload(key)


def test_batched_read_pins_hold_like_single_ones() -> None:
    """acquire_read_many pins every present key (None for the absent ones) under one
    lock; pinned blocks survive eviction; release_many frees them all, once."""
    store = make_store(3)
    keys = [bytes([i]) * 20 for i in range(3)]
    for k in keys:
        store.put(k, payload(k))
    readers = store.acquire_read_many([keys[0], b"\xff" * 20, keys[2]])
    assert readers[1] is None
    held = [r for r in readers if r is not None]
    assert [bytes(r.views[0]) for r in held] == [payload(keys[0]), payload(keys[2])]
    assert store.stats().pinned == 2
    # Only keys[1] is evictable: a new block must take its slot, not a pinned one.
    store.put(b"n" * 20, payload(b"n" * 20))
    assert store.lookup(keys) == [True, False, True]
    store.release_many(held)
    store.release_many(held)  # idempotent
    assert store.stats().pinned == 0
    with pytest.raises(ValueError):
        store.acquire_read_many([b""])


# -- listeners ------------------------------------------------------------------


def test_listeners_hear_commits_evictions_and_discards_in_order() -> None:
    store = make_store(2)
    heard: list[tuple[bytes, bool]] = []
    store.add_listener(lambda key, visible: heard.append((key, visible)))
    store.put(b"a", payload(b"a"))
    store.put(b"b", payload(b"b"))
    store.put(b"c", payload(b"c"))  # evicts a (least recently used)
    assert store.discard(b"b")
    assert not store.discard(b"b")  # nothing visible changed: nothing heard
    writer = store.begin_write(b"d")
    assert writer is not None
    writer.abort()  # never visible: nothing heard
    assert heard == [(b"a", True), (b"b", True), (b"a", False), (b"c", True), (b"b", False)]


def test_a_failed_checksum_is_never_heard_and_removed_listeners_go_quiet() -> None:
    store = make_store(2)
    heard: list[tuple[bytes, bool]] = []

    def listener(key: bytes, visible: bool) -> None:
        heard.append((key, visible))

    store.add_listener(listener)
    with pytest.raises(ChecksumMismatch):
        store.put(b"x", payload(b"x"), expected_checksum=1)
    store.remove_listener(listener)
    store.remove_listener(listener)  # idempotent
    store.put(b"y", payload(b"y"))
    assert heard == []


def test_slots_taken_without_writer_objects_commit_verify_and_abort() -> None:
    """The data stream's batch API: slots.begin_write / commit / abort keep
    every rule of the writer objects (a slot commits once, a bad checksum drops its
    block and frees its slot, a slot given back is free again, a full store says so)."""
    store = make_store(4)
    bpb = store.pool.bytes_per_block
    keys = [bytes([i]) * 16 for i in range(5)]
    slots = store.slots.begin_write(keys)
    assert [type(s) for s in slots[:4]] == [int] * 4
    assert isinstance(slots[4], StoreFullError)  # 4 slots, all being written
    assert store.slots.begin_write(keys[:1]) == [None]  # being written already
    good = [int(s) for s in slots[:4]]  # type: ignore[call-overload]
    for i, slot in enumerate(good):
        for view in store.pool.slot_views(slot):
            view[:] = bytes([i + 1]) * view.nbytes
    sums = [block_checksum(store.pool.slot_views(s)) for s in good]
    with pytest.raises(StoreError, match="not being written"):  # commits nothing
        store.slots.commit(keys[:2], [good[1], good[0]], sums[:2])
    assert store.stats().used == 4 and not store.contains(keys[0])
    wrong = [sums[0], sums[1] ^ 1]
    out = store.slots.commit(keys[:2], good[:2], wrong)
    assert out[0] is None and isinstance(out[1], ChecksumMismatch)
    assert store.get(keys[0]) == bytes([1]) * bpb and not store.contains(keys[1])
    with pytest.raises(StoreError):  # committed (or dropped) already
        store.slots.commit(keys[:1], good[:1], sums[:1])
    store.slots.abort(keys[2:4], good[2:4])
    store.slots.abort(keys[2:4], good[2:4])  # finished already: left alone
    assert store.stats().used == 1 and store.stats().checksum_failures == 1
    assert not store.contains(keys[2]) and not store.contains(keys[3])
    assert [type(s) for s in store.slots.begin_write(keys[1:4])] == [int] * 3


@pytest.mark.parametrize("layout", [V1, V2], ids=["one segment", "segments"])
def test_a_batch_commit_of_slots_is_the_same_block_by_block_or_at_once(layout: KVLayout
                                                                        ) -> None:
    """slots.commit gives the same blocks and outcomes whether or not listeners hear
    each commit, and whether a batch's blocks all pass (the data stream's common case)
    or some fail; each commit is heard, and mixed or bad expected checksums keep their
    rules."""
    heard: list[tuple[bytes, bool]] = []
    results = []
    for listening in (False, True):
        store = make_store(8, layout)
        if listening:
            store.add_listener(lambda key, visible: heard.append((key, visible)))
        keys = [bytes([i]) * 16 for i in range(6)]
        slots = [int(s) for s in store.slots.begin_write(keys)]  # type: ignore[call-overload]
        for key, slot in zip(keys, slots, strict=True):
            parts = split_segments(payload(key, store.pool.bytes_per_block),
                                   store.pool.segment_sizes, store.pool.bytes_per_block)
            for view, part in zip(store.pool.slot_views(slot), parts, strict=True):
                view[:] = part
        sums = [block_checksum(store.pool.slot_views(s)) for s in slots]
        with pytest.raises(ValueError, match="must be a u64"):  # commits nothing
            store.slots.commit(keys[:2], slots[:2], [sums[0], -1])
        with pytest.raises(ValueError, match="must be a u64"):
            store.slots.commit(keys[:2], slots[:2], [sums[0], 1 << 64])
        assert store.slots.commit(keys[:3], slots[:3], sums[:3]) == [None] * 3
        out = store.slots.commit(keys[3:], slots[3:], [None, sums[4] ^ 1, sums[5]])
        assert out[0] is None and isinstance(out[1], ChecksumMismatch) and out[2] is None
        results.append(([store.get(k) for k in keys], store.stats().used))
    assert results[0] == results[1]
    assert results[0][0][4] is None and results[0][1] == 5
    assert heard == [(bytes([i]) * 16, True) for i in (0, 1, 2, 3, 5)]


def test_a_commit_of_slots_with_checksums_computed_as_they_landed() -> None:
    """The data stream hashes blocks as they land and hands the sums to slots.commit:
    a computed sum that differs from the expected one drops its block just as a hash
    taken by the store would; the store keeps the computed sum (also where none was
    expected); a wrong count of computed sums commits nothing."""
    store = make_store(4)
    keys = [bytes([i]) * 16 for i in range(3)]
    slots = [int(s) for s in store.slots.begin_write(keys)]  # type: ignore[call-overload]
    for slot, key in zip(slots, keys, strict=True):
        store.pool.slot_views(slot)[0][:] = payload(key, store.pool.bytes_per_block)
    real = [block_checksum(store.pool.slot_views(s)) for s in slots]
    with pytest.raises(ValueError, match="2 computed"):
        store.slots.commit(keys, slots, real, real[:2])
    assert store.stats().stored == 0
    out = store.slots.commit(keys, slots, [real[0], real[1], None],
                             [real[0], real[1] ^ 1, real[2]])
    assert out[0] is None and isinstance(out[1], ChecksumMismatch) and out[2] is None
    assert store.contains(keys[0]) and not store.contains(keys[1]) and store.contains(keys[2])
    assert store.slots.checksums([slots[0], slots[2]]) == [real[0], real[2]]
    assert store.stats().checksum_failures == 1


def test_the_views_of_a_batch_of_slots_are_each_slots_views() -> None:
    pool = BlockPool(V2, 6)
    assert pool.views_of_slots([4, 0, 4]) == [pool.slot_views(4), pool.slot_views(0),
                                              pool.slot_views(4)]
    assert pool.views_of_slots([]) == []
    with pytest.raises(IndexError, match="slot 6 out of range"):
        pool.views_of_slots([1, 6])
    with pytest.raises(IndexError, match="slot -1 out of range"):
        pool.views_of_slots([-1, 2])


def test_slots_pinned_without_reader_objects_hold_their_bytes_until_unpinned() -> None:
    """The data stream sender's batch API: slots.pin / checksums / unpin
    keep every rule of the reader objects (a pinned block is neither evicted nor
    reused, a discarded one frees its slot at its last unpin, a pin is released once)."""
    store = make_store(2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    store.put(a, payload(a))
    store.put(b, payload(b))
    slots = store.slots.pin([a, c, b, a])
    assert slots[1] == -1 and slots[0] == slots[3] and slots[0] != slots[2]
    pinned = [slots[0], slots[2], slots[3]]
    assert store.slots.checksums(pinned) == [block_checksum([payload(a)]),
                                             block_checksum([payload(b)]),
                                             block_checksum([payload(a)])]
    assert store.discard(a)  # pinned twice: its slot stays taken, its bytes still
    with pytest.raises(StoreFullError):  # nothing to evict: b pinned, a's slot held
        store.put(c, payload(c))
    assert bytes(store.pool.slot_views(slots[0])[0]) == payload(a)
    with pytest.raises(StoreError, match="not pinned"):  # three pins of a's slot: no
        store.slots.unpin([slots[0]] * 3)
    store.slots.unpin(pinned)
    assert store.stats().pinned == 0
    with pytest.raises(StoreError, match="not pinned"):  # released once only
        store.slots.unpin([slots[2]])
    assert store.put(c, payload(c)) and store.get(c) == payload(c)  # a's slot is free


def test_the_slot_calls_and_the_handles_share_one_store() -> None:
    """``store.slots`` works on the store's own bookkeeping: a key being written through
    it is being written for the handles too (and the other way round), a wrong checksum
    leaves no block and frees its slot, its commits are heard and counted like any
    other, a block it pins is skipped by eviction even when least recently used, and a
    discarded block's slot comes back at its unpin."""
    store = make_store(3)
    assert store.slots is store.slots
    heard: list[tuple[bytes, bool]] = []
    store.add_listener(lambda key, visible: heard.append((key, visible)))
    a, b, c, d = (bytes([ch]) * 16 for ch in b"abcd")
    sa, sb = (int(s) for s in store.slots.begin_write([a, b]))  # type: ignore[call-overload]
    assert store.begin_write(a) is None  # being written through the slot calls
    writer = store.begin_write(c)
    assert writer is not None
    assert store.slots.begin_write([c]) == [None]  # being written through a handle
    for slot, key in ((sa, a), (sb, b)):
        store.pool.slot_views(slot)[0][:] = payload(key)
    good = [block_checksum([payload(a)]), block_checksum([payload(b)])]
    out = store.slots.commit([a, b], [sa, sb], [good[0], good[1] ^ 1])
    assert out[0] is None and isinstance(out[1], ChecksumMismatch)
    assert not store.contains(b) and store.get(a) == payload(a)
    stats = store.stats()
    assert (stats.used, stats.pinned, stats.checksum_failures) == (2, 1, 1)
    writer.views[0][:] = payload(c)
    writer.commit()
    assert heard == [(a, True), (c, True)]

    (pa,) = store.slots.pin([a])
    assert store.put(b, payload(b))  # b's dropped write left its slot free
    assert store.lookup([c]) == [True]  # LRU now: a (pinned), b, c
    assert store.put(d, payload(d))  # evicts b, not a
    assert store.lookup([a, b, c, d]) == [True, False, True, True]
    assert heard[2:] == [(b, True), (b, False), (d, True)]
    assert store.discard(a)
    assert store.stats().used == 3  # a's slot stays taken while pinned
    assert bytes(store.pool.slot_views(pa)[0]) == payload(a)
    store.slots.unpin([pa])
    stats = store.stats()
    assert (stats.used, stats.pinned, stats.evictions) == (2, 0, 1)
    assert store.put(b, payload(b)) and store.stats().evictions == 1  # a's slot, freed

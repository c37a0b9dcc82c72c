"""Two or more nodes in separate processes on 127.0.0.1: handshake, refusal, streaming."""

from __future__ import annotations

from typing import Any

import pytest
from nodeproc import content, keys_for
from rawpeer import ThrottlingProxy, wait_until

from p2pkv import KeyOutcome, PeerIncompatible
from p2pkv.identity import ABSENT

pytestmark = pytest.mark.timeout(180)

SEED_V2 = {"layout": "v2", "geometry": "seed"}
SEED_V1 = {"layout": "v1", "geometry": "seed"}


def serve(spawn: Any, spec: dict[str, Any]) -> tuple[Any, str]:
    proc = spawn("serve", spec)
    ready = proc.event()
    assert ready["event"] == "ready"
    return proc, ready["address"]


@pytest.mark.parametrize("spec", [SEED_V2, SEED_V1], ids=["v2", "v1"])
def test_seed_fetch_is_byte_exact(spawn: Any, nodes: Any, spec: dict[str, Any]) -> None:
    blocks = 48
    producer, address = serve(spawn, {**spec, "blocks": blocks})
    node = nodes({**spec, "blocks": blocks})
    peer = node.connect(address)
    keys = keys_for(blocks)
    assert peer.lookup(keys) == [True] * blocks
    result = peer.fetch(keys)
    assert result.outcomes == (KeyOutcome.STORED,) * blocks
    assert result.blocks == blocks and result.nbytes == blocks * 589_824
    size = node.layout.bytes_per_block
    for key in keys:
        assert node.get(key) == content(key, size)
    stats = producer.stop()
    assert stats is not None and stats["blocks_sent"] == blocks


def test_v1_vs_v2_refused_on_both_sides_with_zero_bytes(spawn: Any, nodes: Any) -> None:
    producer, address = serve(spawn, {**SEED_V2, "blocks": 8})
    node = nodes({**SEED_V1, "blocks": 8})
    with pytest.raises(PeerIncompatible) as info:
        node.connect(address)
    by_field = {r.field: r for r in info.value.reasons}
    # Same bytes per block, different identity AND different segment list.
    assert "run_config.parallel_agnostic" in by_field
    assert by_field["run_config.parallel_agnostic"].ours is ABSENT
    assert by_field["run_config.parallel_agnostic"].theirs is False
    assert "V1 cross-layer" in by_field["run_config.parallel_agnostic"].meaning
    assert "geometry.segments" in by_field
    assert "geometry.bytes_per_block" not in by_field
    assert any(d.field == "parallel_agnostic" for d in info.value.diff)
    assert node.store.stats().used == 0
    stats = producer.stop()
    assert stats is not None and stats["blocks_sent"] == 0 and stats["bytes_sent"] == 0
    assert stats["accepted"] == 0 and sum(stats["refused"].values()) >= 2


def test_refused_peer_cannot_lookup_or_fetch(spawn: Any, nodes: Any) -> None:
    _, address = serve(spawn, {**SEED_V2, "blocks": 4})
    node = nodes({**SEED_V1, "blocks": 4})
    with pytest.raises(PeerIncompatible):
        node.connect(address)
    assert node.peers() == []


def test_replicated_tp2_and_tp4_share(spawn: Any, nodes: Any) -> None:
    blocks = 32
    spec = {"layout": "replicated", "geometry": "mla-small", "blocks": blocks}
    _, address = serve(spawn, {**spec, "tp": 2, "rank": 1})
    node = nodes({**spec, "tp": 4, "rank": 3})
    peer = node.connect(address)
    keys = keys_for(blocks)
    result = peer.fetch(keys)
    assert result.stored == keys
    for key in keys:
        assert node.get(key) == content(key, node.layout.bytes_per_block)


def test_replicated_vs_agnostic_refused(spawn: Any, nodes: Any) -> None:
    # Same MLA geometry and byte count; one replicated, one plain cross-layer rows.
    _, address = serve(spawn, {"layout": "replicated", "geometry": "mla-small", "blocks": 2})
    node = nodes({"layout": "v1", "geometry": "mla-small", "blocks": 2})
    with pytest.raises(PeerIncompatible) as info:
        node.connect(address)
    fields = {r.field for r in info.value.reasons}
    assert "run_config.replicated_layout" in fields


def test_missing_keys_reported_without_failing_the_rest(spawn: Any, nodes: Any) -> None:
    _, address = serve(spawn, {**SEED_V2, "blocks": 10})
    node = nodes({**SEED_V2, "blocks": 20})
    peer = node.connect(address)
    present = keys_for(10)
    absent = keys_for(5, offset=100)
    keys = [present[0], absent[0], *present[1:5], *absent[1:], *present[5:]]
    result = peer.fetch(keys)
    assert set(result.missing) == set(absent)
    assert set(result.stored) == set(present)
    assert result.failed == []
    for key in present:
        assert node.get(key) == content(key, node.layout.bytes_per_block)
    assert node.lookup_local(absent) == [False] * len(absent)


def test_lookup_answered_during_large_fetch(spawn: Any, nodes: Any) -> None:
    """A 10,000-key lookup on the connection of a bulk fetch is answered while the fetch
    still streams. The producer is reached through a ThrottlingProxy (30 MB/s), so the
    ~150 MB fetch takes about 5 s whatever the machine's load: the lookup, queued behind
    at most the granted credit (16 MiB, about 0.6 s), must come back long before."""
    blocks = 256
    _, address = serve(spawn, {**SEED_V2, "blocks": blocks})
    node = nodes({**SEED_V2, "blocks": blocks})
    proxy = ThrottlingProxy(address, 30e6)
    try:
        peer = node.connect(proxy.address)
        keys = keys_for(blocks)
        fetch = node.fetch_async(peer, keys, timeout=120)
        # Wait until blocks are flowing, then ask a lookup of 10,000 keys.
        assert wait_until(lambda: node.store.stats().used >= 8 or fetch.done(), 60)
        absent = keys_for(10_000 - blocks, offset=blocks)
        lookup = node.lookup_async(peer, [*keys, *absent], timeout=60)
        hits = lookup.result(timeout=60)
        assert not fetch.done(), "the lookup should be answered while the fetch still streams"
        assert hits == [True] * blocks + [False] * len(absent)
        result = fetch.result(timeout=120)
        assert len(result.stored) == blocks
    finally:
        proxy.close()


def test_three_consumers_at_once(spawn: Any) -> None:
    blocks = 64
    producer, address = serve(spawn, {**SEED_V2, "blocks": blocks})
    consumers = [spawn("fetch", {**SEED_V2, "blocks": blocks}, address) for _ in range(3)]
    for c in consumers:
        ev = c.event(timeout=120)
        assert ev["event"] == "fetched", ev
        assert ev["stored"] == blocks and ev["corrupt"] == 0 and ev["failed"] == 0
        assert c.wait() == 0
    stats = producer.stop()
    assert stats is not None and stats["blocks_sent"] == 3 * blocks


def test_fetch_into_caller_buffers(spawn: Any, nodes: Any) -> None:
    blocks = 6
    _, address = serve(spawn, {**SEED_V2, "blocks": blocks})
    node = nodes({**SEED_V2, "blocks": 1})
    peer = node.connect(address)
    keys = keys_for(blocks)
    seg = node.layout.segment_sizes
    buffers = [[bytearray(n) for n in seg] for _ in keys]
    result = node.fetch_into(peer, keys, [[memoryview(b) for b in bufs] for bufs in buffers])
    assert result.stored == keys
    for key, bufs in zip(keys, buffers, strict=True):
        assert b"".join(bufs) == content(key, sum(seg))
    assert node.store.stats().used == 0


def test_reconnect_to_restarted_peer(spawn: Any, nodes: Any) -> None:
    from p2pkv import PeerGone

    first, address = serve(spawn, {**SEED_V2, "blocks": 4, "port": 0})
    node = nodes({**SEED_V2, "blocks": 8}, heartbeat_timeout=1.0, heartbeat_interval=0.2)
    peer = node.connect(address)
    assert peer.lookup(keys_for(4)) == [True] * 4
    first.kill()
    with pytest.raises(PeerGone):
        for _ in range(50):
            peer.lookup(keys_for(4), timeout=10.0)
    _second, address2 = serve(spawn, {**SEED_V2, "blocks": 4})
    peer2 = node.connect(address2)
    assert peer2.fetch(keys_for(4)).stored == keys_for(4)


def test_empty_requests_and_close_from_a_callback(nodes: Any) -> None:
    """Empty lookups/fetches answer at once; closing a node from a future's callback
    (which runs on the node's IO thread) neither deadlocks nor raises."""
    import threading

    server = nodes({**SEED_V2, "blocks": 2})
    client = nodes({**SEED_V2, "blocks": 2})
    peer = client.connect(server.address)
    assert peer.lookup([]) == []
    assert client.fetch(peer, []).outcomes == ()
    closed = threading.Event()
    fut = client.lookup_async(peer, keys_for(1))
    fut.add_done_callback(lambda _: (client.close(), closed.set()))
    assert closed.wait(10)
    assert fut.result(timeout=5) == [False]
    client.close()  # idempotent from the caller's thread too


def test_a_peer_is_told_when_keys_being_computed_will_be_held(nodes: Any) -> None:
    """pending-v1 (SPEC §19): a key a node announced as being computed is answered
    "not held, due in about t" until it is stored (then a hit), withdrawn, or overdue
    by its own estimate; the plain lookup of the same keys says only what is held."""
    small = {"layout": "v2", "geometry": "small"}
    holder = nodes(small)
    asker = nodes(small)
    peer = asker.connect(holder.address)
    keys = keys_for(4)
    bpb = holder.layout.bytes_per_block
    holder.put(keys[0], content(keys[0], bpb))
    holder.announce_pending(keys[1:3], [2.0, 30.0])
    answer = asker.lookup_pending_async(peer, keys).result(timeout=10)
    assert answer.hits == (True, False, False, False)
    assert answer.due[0] == 0.0 and answer.due[3] == 0.0
    assert 1.0 < answer.due[1] <= 2.0 and 25.0 < answer.due[2] <= 30.0, answer
    assert asker.lookup(peer, keys) == [True, False, False, False]
    # Stored: a hit, no longer pending. Withdrawn: neither.
    holder.put(keys[1], content(keys[1], bpb))
    holder.withdraw_pending([keys[2]])
    answer = asker.lookup_pending_async(peer, keys).result(timeout=10)
    assert answer.hits == (True, True, False, False) and answer.due == (0.0,) * 4
    # An estimate overdue by itself (and at least 10 s) is forgotten: the computation
    # fell behind.
    holder.announce_pending([keys[3]], [0.1])
    assert asker.lookup_pending_async(peer, keys[3:]).result(timeout=10).due[0] > 0
    assert wait_until(lambda: asker.lookup_pending_async(peer, keys[3:]).result(
        timeout=10).due == (0.0,), 15)
    with pytest.raises(ValueError, match="finite number of seconds"):
        holder.announce_pending(keys[:1], [float("nan")])
    with pytest.raises(ValueError, match="2 keys but 1 estimates"):
        holder.announce_pending(keys[:2], [1.0])

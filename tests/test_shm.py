"""Same-host shared memory (capability ``shm-v1``, SPEC §16) with real nodes and processes.

What is held: the segment is private (0600, this uid) and disappears when its node
closes or is killed; segments of dead owners are removed at start; a shared-memory fetch
stores exactly the bytes a TCP fetch stores, for every layout, into the pool and into
caller buffers, with the same per-key outcomes; checksums still catch a block changed
under its pin; a consumer killed mid-fetch leaves no pin behind once its heartbeat
deadline passed; a node that cannot map the segment, or echoes a wrong nonce, or sits in
another network namespace, moves its blocks over TCP and says why.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from netns_helper import NetnsPair, NsProcess, Unavailable
from nodeproc import content, fill, keys_for
from nodeproc import pooled_node as node
from procs import NodeProcess
from rawpeer import RawPeer, wait_until

from p2pkv import protocol as proto
from p2pkv.errors import LocalLimitExceeded, PeerIncompatible
from p2pkv.node import KeyOutcome, Node, NodeConfig
from p2pkv.shm import SHM_DIR, MappedSegment, remove_stale
from p2pkv.shm.host import host_identity
from p2pkv.shm.segment import pack_header
from p2pkv.store import BlockStore
from p2pkv.store.pool import BlockPool

pytestmark = pytest.mark.timeout(120)

SHM = {"shm": True}
HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
#: Pools are pinned (a shared one registered with CUDA) where CUDA is available.
CUDA = torch.cuda.is_available()
LAYOUTS = [
    {"layout": "v2", "geometry": "seed"},
    {"layout": "v1", "geometry": "seed"},
    {"layout": "replicated", "geometry": "mla-small"},
    {"layout": "v2", "geometry": "small"},
]


def segment_path(n: Node) -> Path:
    name = n.stats().shm_segment
    assert name is not None, n.stats().shm_unavailable
    return SHM_DIR / name


@pytest.fixture
def producer() -> Iterator[Node]:
    with node({**LAYOUTS[0], "pool": 256}, **SHM, **HEARTBEAT) as n:
        yield n


# ---------------------------------------------------------------------- the segment


def test_the_segment_is_private_and_removed_on_close() -> None:
    n = node(LAYOUTS[0], **SHM)
    path = segment_path(n)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert path.name.startswith(f"p2pkv-{os.getpid()}-")
    # Where CUDA is available the segment is registered with it (page-locked).
    assert n.store.stats().memory_kind == ("shared-pinned" if CUDA else "shared")
    n.close()
    assert not path.exists()
    plain = node(LAYOUTS[0])
    try:
        assert plain.stats().shm_segment is None
        assert plain.store.stats().memory_kind == ("pinned" if CUDA else "pageable")
    finally:
        plain.close()


def test_the_segment_of_a_killed_node_is_removed() -> None:
    proc = NodeProcess("serve", {**LAYOUTS[0], "blocks": 4, "config": SHM})
    try:
        ready = proc.event(timeout=60)
        assert ready["event"] == "ready", ready
        pid = proc.proc.pid
        mine = [p for p in SHM_DIR.glob(f"p2pkv-{pid}-*")]
        assert len(mine) == 1
        proc.proc.kill()  # SIGKILL: no Python code of the node runs any more
        proc.wait(timeout=30)
        assert wait_until(lambda: not mine[0].exists(), timeout=10), "segment left behind"
    finally:
        proc.kill()


def test_stale_segments_of_dead_owners_are_removed_at_start(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    me = host_identity()
    header = pack_header(b"\0" * 16, me, dead.pid, 8192, 1, [(4096, 4096)], ready=True)
    stale = tmp_path / f"p2pkv-{dead.pid}-12345-0011223344556677"
    stale.write_bytes(header.ljust(8192, b"\0"))
    other_ns = tmp_path / f"p2pkv-{dead.pid}-12346-0011223344556677"
    foreign = pack_header(b"\0" * 16, type(me)(me.boot_id, me.netns, me.pidns + 1),
                          dead.pid, 8192, 1, [(4096, 4096)], ready=True)
    other_ns.write_bytes(foreign.ljust(8192, b"\0"))
    unrelated = tmp_path / "psm_0123"
    unrelated.write_bytes(b"x")
    n = node(LAYOUTS[0], **SHM)  # a live owner: its own segment stays
    try:
        live = segment_path(n)
        assert remove_stale(tmp_path) == [stale.name]
        assert not stale.exists() and other_ns.exists() and unrelated.exists()
        remove_stale(SHM_DIR)
        assert live.exists()
    finally:
        n.close()


# ---------------------------------------------------------------------- same bytes as TCP


@pytest.mark.parametrize("spec", LAYOUTS, ids=lambda s: f"{s['layout']}-{s['geometry']}")
def test_same_bytes_as_tcp_for_every_layout(spec: dict[str, Any]) -> None:
    # The consumer copies each message over two threads where the compiled helper is
    # there (every other test here copies on the IO thread alone).
    with node(spec, **SHM) as a, node(spec, **SHM, shm_copy_threads=2) as b, \
            node(spec) as c:
        keys = fill(a, 12)
        absent = keys_for(3, offset=40)
        wanted = [*keys[:6], absent[0], *keys[6:], *absent[1:]]
        shm_peer, tcp_peer = b.connect(a.address), c.connect(a.address)
        assert shm_peer.data_path == "shm", shm_peer.data_path_detail
        # Off shared memory, blocks take the data stream (tcp-data-v1), then TCP.
        assert tcp_peer.data_path == "tcp-data"
        assert tcp_peer.data_path_detail.startswith("data stream to ")
        via_shm, via_tcp = shm_peer.fetch(wanted), tcp_peer.fetch(wanted)
        assert via_shm.outcomes == via_tcp.outcomes
        assert via_shm.missing == absent and via_shm.stored == keys
        for k in keys:
            assert b.get(k) == c.get(k) == a.get(k) == content(k, a.layout.bytes_per_block)
        # Into caller buffers (fetch_into), one buffer per segment.
        bufs = [[bytearray(s) for s in a.layout.segment_sizes] for _ in wanted]
        into = b.fetch_into(shm_peer, wanted, bufs)
        assert into.outcomes == via_tcp.outcomes
        for k, segs in zip(wanted, bufs, strict=True):
            if k in keys:
                assert b"".join(segs) == a.get(k)
        sa, sb = a.stats(), b.stats()
        assert sb.blocks_received_shm == 2 * len(keys) and sb.shm_peers_out == 1
        assert sa.blocks_sent_shm == 2 * len(keys) and sa.shm_peers_in == 1
        assert sa.blocks_sent == 3 * len(keys)  # TCP and shared memory both count
        assert wait_until(lambda: a.stats().shm_pinned == 0, timeout=10)
        assert a.store.stats().pinned == 0


def test_lookups_and_refusals_behave_as_over_tcp() -> None:
    with node(LAYOUTS[0], **SHM, max_keys_per_request=4) as a, node(LAYOUTS[0], **SHM) as b, \
            node(LAYOUTS[0]) as c:
        keys = fill(a, 8)
        for n in (b, c):
            peer = n.connect(a.address)
            assert peer.data_path == ("shm" if n is b else "tcp-data")
            assert peer.lookup(keys[:3] + keys_for(1, offset=50)) == [True] * 3 + [False]
            with pytest.raises(LocalLimitExceeded, match=r"at most 4 keys"):
                peer.fetch(keys[:5])  # more keys than the server advertised it serves
            assert peer.fetch(keys[:4]).stored == keys[:4]
            # Already held locally: reported stored, nothing moves.
            before = n.stats().blocks_received
            assert peer.fetch(keys[:2]).outcomes == (KeyOutcome.STORED,) * 2
            assert n.stats().blocks_received == before


@pytest.mark.parametrize("threads", [1, 3])
def test_checksums_stay_available(producer: Node, threads: int) -> None:
    keys = fill(producer, 4)
    # Change a stored block's bytes under the store (after its checksum was taken): only
    # the checksum can tell.
    assert producer.store.checksum(keys[1]) is not None
    reader = producer.store.acquire_read(keys[1])
    assert reader is not None
    slot = reader.slot
    reader.release()
    view = producer.store.pool.segment_views(slot)[3]
    view[100] ^= 0xFF
    with node(LAYOUTS[0], **SHM, shm_copy_threads=threads) as b:
        peer = b.connect(producer.address)
        assert peer.data_path == "shm"
        result = peer.fetch(keys)
        assert result.outcomes[1] is KeyOutcome.FAILED and "checksum" in result.errors[1]
        assert result.stored == [keys[0], *keys[2:]]
        assert b.stats().checksum_failures == 1 and not b.lookup_local([keys[1]])[0]
        bufs = [[bytearray(s) for s in b.layout.segment_sizes] for _ in keys]
        into = b.fetch_into(peer, keys, bufs)
        assert into.outcomes[1] is KeyOutcome.FAILED


# ---------------------------------------------------------------------- pins


def attach_raw(raw: RawPeer, server: Node) -> proto.Welcome:
    welcome = raw.handshake(server)
    assert welcome.shm is not None
    mapping = MappedSegment(welcome.shm.name, welcome.shm.size, welcome.geo.seg)
    raw.send_msg(proto.Attach(mapping.nonce))
    assert raw.expect(proto.Attached).ok
    mapping.close()
    return welcome


def test_pins_of_a_peer_that_dies_are_released_at_its_heartbeat_deadline(
        producer: Node) -> None:
    keys = fill(producer, 8)
    raw = RawPeer(producer.address)
    try:
        attach_raw(raw, producer)
        raw.send_msg(proto.Fetch(1, tuple(keys), 8, shm=True))
        located = raw.expect(proto.Located)
        assert located.req == 1
        assert producer.stats().shm_pinned == len(located.idx) > 0
        assert producer.store.stats().pinned >= len(located.idx)
    finally:
        raw.close()  # gone without a bye, like a killed process
    # Nothing tells the server that the peer is gone but its silence.
    assert wait_until(lambda: producer.stats().shm_pinned == 0, timeout=15)
    assert producer.store.stats().pinned == 0


def test_release_abort_and_a_wrong_nonce(producer: Node) -> None:
    keys = fill(producer, 6)
    raw = RawPeer(producer.address)
    try:
        attach_raw(raw, producer)
        raw.send_msg(proto.Fetch(1, tuple(keys), 6, shm=True))
        located = raw.expect(proto.Located)
        raw.send_msg(proto.Release(1, located.idx[:2]))
        assert wait_until(lambda: producer.stats().shm_pinned == len(located.idx) - 2, 10)
        raw.send_msg(proto.Abort(1))
        while type(msg := raw.recv_msg()) is not proto.AbortAck:
            assert type(msg) in (proto.Located, proto.Done), msg
        assert producer.stats().shm_pinned == 0
    finally:
        raw.close()
    liar = RawPeer(producer.address)
    try:
        liar.handshake(producer)
        liar.send_msg(proto.Attach(b"\x00" * 16))
        verdict = liar.expect(proto.Attached)
        assert not verdict.ok and "nonce" in verdict.msg
        liar.send_msg(proto.Fetch(1, tuple(keys[:2]), 2, shm=True))
        assert type(liar.recv_msg()) is proto.Block  # served over TCP
    finally:
        liar.close()


def test_a_consumer_killed_mid_copy_leaves_no_pin(producer: Node) -> None:
    fill(producer, 200)
    spec = {**LAYOUTS[0], "blocks": 200, "pool": 260, "flowing": 16,
            "config": {**SHM, **HEARTBEAT}}
    consumer = NodeProcess("watch", spec, producer.address)
    try:
        flowing = consumer.event(timeout=60)
        assert flowing["event"] == "flowing" and flowing["data_path"] == "shm", flowing
        consumer.proc.kill()
        consumer.wait(timeout=30)
    finally:
        consumer.kill()
    assert wait_until(lambda: producer.stats().shm_pinned == 0
                      and producer.store.stats().pinned == 0, timeout=15)
    # The producer serves the next peer as before.
    with node(LAYOUTS[0], **SHM) as b:
        peer = b.connect(producer.address)
        assert len(peer.fetch(keys_for(20)).stored) == 20


# ---------------------------------------------------------------------- falling back


def private_pool_node(spec: dict[str, Any]) -> Node:
    """A node that speaks shm-v1 but whose pool (the caller's store) is not shared."""
    n = node(spec)
    try:
        return Node(n.run_config, n.layout, store=BlockStore(BlockPool(n.layout, 16)),
                    config=NodeConfig(shm=True))
    finally:
        n.close()


@pytest.mark.parametrize("how", ["mode", "gone", "no_segment"])
def test_a_node_that_cannot_map_the_segment_falls_back_to_tcp(how: str) -> None:
    server = private_pool_node(LAYOUTS[0]) if how == "no_segment" else node(LAYOUTS[0], **SHM)
    try:
        keys = fill(server, 6)
        if how == "mode":
            os.chmod(segment_path(server), 0o640)
        elif how == "gone":
            os.unlink(segment_path(server))
        expect = {"mode": "mode 0640, not 0600", "gone": "No such file",
                  "no_segment": "not in shared memory"}[how]
        with node(LAYOUTS[0], **SHM) as b:
            peer = b.connect(server.address)
            assert peer.data_path == "tcp-data" and expect in peer.data_path_detail, \
                peer.data_path_detail
            result = peer.fetch(keys)
            assert result.stored == keys
            assert all(b.get(k) == server.get(k) for k in keys)
            kind = "no_segment" if how == "no_segment" else "cannot_map"
            assert b.stats().shm_fallbacks == {kind: 1}
            assert b.stats().blocks_received_shm == 0 and b.stats().shm_peers_out == 0
    finally:
        server.close()



@pytest.mark.netns
@pytest.mark.slow
def test_a_node_on_another_host_never_uses_shared_memory() -> None:
    """Another host, made of network namespaces (root only): the consumer can open the
    segment (same /dev/shm) but it belongs to another network namespace, so the proof
    fails and blocks move over TCP; a consumer in the producer's namespace uses it."""
    try:
        pair = NetnsPair()
    except Unavailable as exc:
        pytest.skip(str(exc))
    started: list[NsProcess] = []
    try:
        spec = {**LAYOUTS[0], "blocks": 8, "config": {**SHM, "listen": f"tcp://{pair.ip_a}:0"}}
        producer = NsProcess(pair.a, "serve", spec)
        started.append(producer)
        ready = producer.event(timeout=60)
        assert ready["event"] == "ready", ready
        consumers = {}
        for ns in (pair.b, pair.a):
            proc = NsProcess(ns, "fetch", {**LAYOUTS[0], "blocks": 8, "config": SHM},
                             ready["address"])
            started.append(proc)
            consumers[ns] = proc.event(timeout=60)
        far, near = consumers[pair.b], consumers[pair.a]
        assert far["event"] == near["event"] == "fetched", consumers
        assert far["stored"] == near["stored"] == 8 and far["corrupt"] == near["corrupt"] == 0
        assert far["data_path"] == "tcp-data", far
        assert "network namespace" in far["data_path_detail"], far
        assert near["data_path"] == "shm", near
    finally:
        for p in started:
            p.kill()
        pair.close()


def test_refusals_are_unchanged_between_shared_memory_nodes() -> None:
    with node(LAYOUTS[0], **SHM) as v2, node(LAYOUTS[1], **SHM) as v1:
        with pytest.raises(PeerIncompatible) as excinfo:
            v1.connect(v2.address)
        fields = {r.field for r in excinfo.value.reasons}
        assert "geometry.segments" in fields
        assert v1.stats().shm_fallbacks == {} and v2.stats().shm_peers_in == 0

"""One-sided reads through NIXL (capability ``nixl-v1``, SPEC §20) between real nodes.

NIXL's UCX backend runs over TCP on 127.0.0.1 here (``UCX_TLS=tcp,self``), the transport
the RDMA verbs replace on a fabric that has them; the calls are the same. What is held:
blocks READ from the holder's pool land byte for byte in the store and in caller buffers,
with their checksums, and every pin is released; the path is offered and chosen only
where both sides use NIXL, and says why not otherwise; a wrong nonce gets no located
answer, an attach nobody offered is a violation; a holder that lies (a slot outside its
pool, one slot twice, a key not asked) is closed on as a violation; a READ that does not
complete in time fails its blocks, not the connection; a leased block is never evicted,
and a lease never released ends with its reader's connection; a holder that dies fails
its reader within the heartbeat deadline. Skipped, with the reason, where NIXL cannot be
installed.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from nodeproc import content, fill, keys_for
from nodeproc import pooled_node as node
from procs import NodeProcess
from rawpeer import RawPeer, wait_until

from p2pkv import protocol as proto
from p2pkv.errors import ConfigError, P2PKVError, PeerGone, TransferFailed
from p2pkv.metrics import serve_metrics
from p2pkv.nixl import Importer, unavailable_reason
from p2pkv.node import KeyOutcome, Node, NodeConfig
from p2pkv.transport.curve import CurveKeys

pytestmark = pytest.mark.timeout(120)

SPEC = {"layout": "v2", "geometry": "seed", "pool": 128}
NIXL = {"nixl": "on", "nixl_read_timeout": 1.0}
HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.5}


@pytest.fixture(autouse=True)
def ucx_over_loopback_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"NIXL cannot be used here: {why}")
    # Read by UCX when an agent is made: TCP on loopback, as between two hosts.
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


@pytest.fixture
def producer() -> Iterator[Node]:
    with node(SPEC, **NIXL, **HEARTBEAT) as n:
        yield n


def test_blocks_are_read_one_sided_into_the_store_and_caller_buffers(
        producer: Node) -> None:
    keys = fill(producer, 40)
    bpb = producer.layout.bytes_per_block
    with node(SPEC, **NIXL) as consumer:
        assert consumer.stats().nixl.startswith("on: UCX "), consumer.stats().nixl
        peer = consumer.connect(producer.address)
        assert peer.data_path == "nixl", peer.data_path_detail
        assert proto.CAP_NIXL_V1 in peer.capabilities
        result = peer.fetch(keys)
        assert list(result.stored) == keys
        for k in keys:
            assert consumer.get(k) == content(k, bpb)
        # fetch_into: the caller's buffers, one per segment
        segs = consumer.layout.segment_sizes
        dests = [[memoryview(bytearray(s)) for s in segs] for _ in keys[:10]]
        into = consumer.fetch_into(peer, keys[:10], dests)
        assert all(o is KeyOutcome.LANDED for o in into.outcomes), into
        for k, views in zip(keys[:10], dests, strict=True):
            assert b"".join(bytes(v) for v in views) == content(k, bpb)
        stats = consumer.stats()
        assert stats.nixl_peers_out == 1
        assert stats.paths["nixl"].blocks_received == 50
        assert stats.nixl_read_failures == 0
        # What a Prometheus scrape shows of it.
        metrics = serve_metrics(consumer, 0)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics.port}/metrics",
                                        timeout=10) as r:
                text = r.read().decode()
        finally:
            metrics.close()
        assert re.search(r'^p2pkv_nixl\{state="on: UCX [^"]*"\} 1\.0$', text, re.M), text
        moved = re.search(r'^p2pkv_bytes_received_by_path_total\{path="nixl"\} (\S+)$', text,
                          re.M)
        assert moved is not None and float(moved.group(1)) == 50 * bpb, text
        assert "p2pkv_nixl_read_failures_total 0.0" in text
    # Every located block was released: nothing stays pinned at the holder.
    assert wait_until(lambda: producer.stats().shm_pinned == 0, 10)
    assert producer.store.stats().pinned == 0


def test_the_path_is_chosen_only_where_both_sides_use_nixl(producer: Node) -> None:
    keys = fill(producer, 4)
    with node(SPEC, nixl="off") as plain:
        assert plain.stats().nixl.startswith("off")
        peer = plain.connect(producer.address)
        assert peer.data_path == "tcp-data"
        assert proto.CAP_NIXL_V1 not in peer.capabilities
        assert len(peer.fetch(keys).stored) == 4
    with node(SPEC, nixl="auto") as auto:
        # This host has no RDMA device: auto leaves NIXL alone, and says so.
        assert auto.stats().nixl.startswith("off"), auto.stats().nixl


def test_nixl_on_is_refused_under_curve() -> None:
    public, secret = zmq.curve_keypair()
    with pytest.raises(ConfigError, match=r"nixl.*CURVE"):
        NodeConfig(nixl="on", curve=CurveKeys(public, secret))


def greet(raw: RawPeer, server: Node, caps: tuple[str, ...]) -> proto.Welcome:
    raw.send_msg(proto.Hello.for_config("raw", server.run_config, server.hello.geo,
                                        server.hello.khash, caps=caps))
    welcome: proto.Welcome = raw.expect(proto.Welcome)
    return welcome


def test_a_wrong_nonce_gets_no_located_answer(producer: Node) -> None:
    keys = fill(producer, 2)
    liar = RawPeer(producer.address)
    try:  # a peer that did not offer nixl-v1 attaches through it all the same
        assert greet(liar, producer, (proto.CAP_CHECKSUM_XXH3_64, proto.CAP_SHM_V1)
                     ).nixl is None
        liar.send_msg(proto.Attach(b"\x00" * 16, proto.VIA_NIXL))
        bye = liar.expect(proto.Bye)  # nothing was offered for it: a violation
        assert bye.code == proto.Code.UNEXPECTED
    finally:
        liar.close()
    guesser = RawPeer(producer.address)
    try:
        welcome = greet(guesser, producer, (proto.CAP_CHECKSUM_XXH3_64, proto.CAP_SHM_V1,
                                            proto.CAP_NIXL_V1))
        assert welcome.nixl is not None and welcome.nixl.slots == 128
        guesser.send_msg(proto.Attach(b"\x00" * 16, proto.VIA_NIXL))
        verdict = guesser.expect(proto.Attached)
        assert not verdict.ok and "NIXL pool" in verdict.msg
        guesser.send_msg(proto.Fetch(1, tuple(keys), 2, shm=True))
        assert type(guesser.recv_msg()) is proto.Block  # served over ZeroMQ
    finally:
        guesser.close()


@pytest.mark.parametrize("lie", ["outside", "twice", "unasked"])
def test_a_holder_that_lies_about_its_slots_is_closed_on(
        producer: Node, monkeypatch: pytest.MonkeyPatch, lie: str) -> None:
    keys = fill(producer, 4)
    honest = proto.Session.located

    def lying(self: proto.Session, req: int, idx: Any, slots: Any, sums: Any) -> Any:
        slots = list(slots)
        if lie == "outside":
            slots[0] = 10**6
        elif lie == "twice" and len(slots) > 1:
            slots[1] = slots[0]
        located = honest(self, req, idx, slots, sums)
        if lie == "unasked":  # a lease for a key the fetch did not ask for
            located = dataclasses.replace(located, idx=(100, *located.idx[1:]))
        return located

    with node(SPEC, **NIXL) as consumer:
        peer = consumer.connect(producer.address)
        assert peer.data_path == "nixl"
        monkeypatch.setattr(proto.Session, "located", lying)
        with pytest.raises(TransferFailed, match="OUT_OF_BOUNDS") as failed:
            peer.fetch(keys)
        assert {"outside": "outside the peer's 128-slot pool", "twice": "one slot twice",
                "unasked": "100"}[lie] in str(failed.value), failed.value
        assert consumer.stats().protocol_violations == 1
        for k in keys:
            assert k not in consumer.store
    monkeypatch.undo()
    assert wait_until(lambda: producer.stats().shm_pinned == 0, 10)


def test_a_read_past_its_deadline_fails_its_blocks_not_the_connection(
        producer: Node) -> None:
    keys = fill(producer, 8)
    # A deadline no READ over TCP meets: each READ fails, and only its blocks do.
    with node(SPEC, nixl="on", nixl_read_timeout=1e-6) as consumer:
        peer = consumer.connect(producer.address)
        assert peer.data_path == "nixl", peer.data_path_detail
        result = peer.fetch(keys)
        assert not result.stored
        assert all(o is KeyOutcome.FAILED for o in result.outcomes), result
        assert all("NIXL read failed" in e for e in result.errors.values()), result.errors
        stats = consumer.stats()
        assert stats.nixl_read_failures >= 1 and stats.protocol_violations == 0
        # The connection is as it was: it answers, and nothing stays pinned.
        assert peer.lookup(keys) == [True] * 8
        for k in keys:
            assert k not in consumer.store
    assert wait_until(lambda: producer.stats().shm_pinned == 0, 10)


def test_a_holder_killed_mid_read_fails_its_reader_within_the_heartbeat_deadline() -> None:
    holder = NodeProcess("serve", {**SPEC, "blocks": 100, "config": {**NIXL, **HEARTBEAT}})
    try:
        ready = holder.event(timeout=60)
        keys = keys_for(100)
        with node(SPEC, **NIXL, **HEARTBEAT) as consumer:
            peer = consumer.connect(ready["address"])
            assert peer.data_path == "nixl", peer.data_path_detail
            bpb = consumer.layout.bytes_per_block
            dests = [[memoryview(bytearray(s)) for s in consumer.layout.segment_sizes]
                     for _ in keys]
            seen: dict[str, Any] = {"rounds": 0, "wrong": 0}

            def read_until_it_fails() -> None:
                try:
                    while True:  # the holder's whole set, again and again
                        result = consumer.fetch_into(peer, keys, dests, timeout=10)
                        seen["wrong"] += sum(
                            1 for k, o, views in zip(keys, result.outcomes, dests, strict=True)
                            if o is KeyOutcome.LANDED
                            and b"".join(bytes(v) for v in views) != content(k, bpb))
                        seen["rounds"] += 1
                except P2PKVError as exc:
                    seen["failed"], seen["at"] = exc, time.monotonic()

            reading = threading.Thread(target=read_until_it_fails, daemon=True)
            reading.start()
            assert wait_until(lambda: seen["rounds"] >= 2, 30), seen
            killed = time.monotonic()
            holder.proc.kill()  # while the reader is inside one of its reads
            reading.join(15)
            assert not reading.is_alive()
            assert isinstance(seen["failed"], (PeerGone, TransferFailed)), seen
            assert seen["at"] - killed < 1.5 + 3.0  # the heartbeat deadline, and some
            assert seen["wrong"] == 0
            assert consumer.stats().peers_out == 0
    finally:
        holder.kill()


def test_a_lease_is_never_evicted_under_it_and_expires_unreleased(producer: Node) -> None:
    """A reader of its own (a raw peer with an importer) proves it reads the pool, is
    located blocks and never releases them: the holder keeps them while the pool fills
    past its size, the bytes at the located slots stay the blocks', and the pins end
    with the silent peer's connection."""
    keys = fill(producer, 8)
    bpb = producer.layout.bytes_per_block
    raw = RawPeer(producer.address)
    importer = Importer("p2pkv-test-reader")
    try:
        welcome = greet(raw, producer, (proto.CAP_CHECKSUM_XXH3_64, proto.CAP_SHM_V1,
                                        proto.CAP_NIXL_V1))
        offer = welcome.nixl
        assert offer is not None
        agent = importer.add_peer(offer.meta)
        (nonce,) = importer.read(agent, [(offer.nonce, 16)], time.monotonic() + 5)
        raw.send_msg(proto.Attach(bytes(nonce), proto.VIA_NIXL))
        assert raw.expect(proto.Attached).ok
        raw.send_msg(proto.Fetch(1, tuple(keys), 8, shm=True))
        located = raw.expect(proto.Located)
        assert producer.stats().shm_pinned == len(located.idx) > 0
        fill(producer, 300, offset=8)  # more than the pool holds: the rest is evicted
        segs = producer.layout.segment_sizes
        for idx, slot in zip(located.idx, located.slots, strict=True):
            assert keys[idx] in producer.store
            pieces = importer.read(agent, offer.sources(slot, segs), time.monotonic() + 5)
            assert b"".join(bytes(p) for p in pieces) == content(keys[idx], bpb)
    finally:
        raw.close()  # gone without a release, or a bye
        importer.close()
    assert wait_until(lambda: producer.stats().shm_pinned == 0, 15)
    assert producer.store.stats().pinned == 0


def test_two_connections_to_one_holder_share_its_agent_until_the_last_closes(
        producer: Node) -> None:
    keys = fill(producer, 6)
    with node(SPEC, **NIXL) as consumer:
        first = consumer.connect(producer.address)
        second = consumer.connect(producer.address)
        assert first.data_path == second.data_path == "nixl"
        first.close()  # the holder's metadata stays loaded for the second
        result = second.fetch(keys)
        assert list(result.stored) == keys, result.errors
        assert consumer.stats().nixl_read_failures == 0


def test_a_node_that_fails_to_start_leaves_no_agent_behind(producer: Node) -> None:
    exporting = {t.name for t in threading.enumerate() if "nixl-export" in t.name}
    with pytest.raises(P2PKVError):  # the address is the producer's: it cannot be bound
        node(SPEC, **NIXL, listen=producer.address)
    assert {t.name for t in threading.enumerate() if "nixl-export" in t.name} == exporting

"""Capability ``packed-v1`` (SPEC §17): small blocks as one payload frame per message.

Real nodes on loopback: the bytes a packed fetch stores equal those of an unpacked one
for every layout, into the pool and into caller buffers; peers without the capability
(either side) get unpacked messages and the same bytes; every block of a packed message
is checked against its own checksum. A hostile server that sends broken packed messages
(wrong size, frames missing or extra, packing without the capability, random bytes)
makes the fetch fail with a protocol error — the node neither crashes nor hangs.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from internals import io_thread_alive
from nodeproc import content, keys_for, make_node
from rawpeer import CorruptingProxy, FakeServer, wait_until
from test_protocol_vectors import VECTORS, as_vector, frames_of

from p2pkv import KeyOutcome
from p2pkv import protocol as proto
from p2pkv.errors import P2PKVError, ProtocolError
from p2pkv.node import Node
from p2pkv.protocol import CAP_CHECKSUM_XXH3_64, CAP_PACKED_V1, Block, Done, Fetch
from p2pkv.runtime.paths.packing import packs
from p2pkv.store import BlockStore

pytestmark = pytest.mark.timeout(120)

PACKED_VECTORS = json.loads((VECTORS / "packed.json").read_text())

LAYOUTS = [
    {"layout": "v2", "geometry": "seed"},  # 12 x 48 KiB: one block per packed message
    {"layout": "v1", "geometry": "seed"},  # one 576 KiB segment: never packed
    {"layout": "replicated", "geometry": "mla-small"},
    {"layout": "v2", "geometry": "small"},  # many blocks per packed message
    {"layout": "v1", "geometry": {"num_layers": 1, "num_kv_heads": 8, "head_size": 64,
                                  "tokens_per_block": 8}},  # 16 KiB blocks
]


def _id(spec: dict[str, Any]) -> str:
    g = spec["geometry"]
    return f"{spec['layout']}-{g if isinstance(g, str) else '16k'}"


class RecordingProxy(CorruptingProxy):
    """Passes every message through untouched; records ``pk`` of each block message."""

    def __init__(self, server_address: str) -> None:
        self.packed_flags: list[bool] = []
        super().__init__(server_address, every=1 << 30, first=1 << 30)

    def _to_client(self, frames: list[bytes]) -> list[bytes] | None:
        with contextlib.suppress(Exception):
            head = msgpack.unpackb(frames[0], raw=False)
            if isinstance(head, dict) and head.get("t") == "block":
                self.packed_flags.append(bool(head.get("pk")))
        return super()._to_client(frames)


def _node(made: list[Any], spec: dict[str, Any], blocks: int, **config: Any) -> Node:
    node = make_node({**spec, "blocks": blocks}, **config)
    made.append(node)
    return node


def _fill(node: Node, count: int) -> list[bytes]:
    keys = keys_for(count)
    for k in keys:
        node.put(k, content(k, node.layout.bytes_per_block))
    return keys


@pytest.mark.parametrize("spec", LAYOUTS, ids=_id)
@pytest.mark.parametrize("who", ["both", "producer-without", "consumer-without"])
def test_same_bytes_packed_or_not_for_every_layout(made: list[Any], spec: dict[str, Any],
                                                   who: str) -> None:
    blocks = 40
    producer = _node(made, spec, blocks,
                     **({"packed_blocks": False} if who == "producer-without" else {}))
    keys = _fill(producer, blocks)
    consumer = _node(made, spec, blocks,
                     **({"packed_blocks": False} if who == "consumer-without" else {}))
    proxy = RecordingProxy(producer.address)
    made.append(proxy)
    peer = consumer.connect(proxy.address)
    negotiated = who == "both"
    assert (CAP_PACKED_V1 in peer.capabilities) == negotiated
    assert CAP_CHECKSUM_XXH3_64 in peer.capabilities
    absent = keys_for(2, offset=100)
    wanted = [absent[0], *keys, absent[1]]
    result = peer.fetch(wanted)
    assert result.stored == keys and result.missing == absent and not result.failed
    size = producer.layout.bytes_per_block
    for k in keys:
        assert consumer.get(k) == content(k, size)
    # Into caller buffers, one per segment.
    bufs = [[bytearray(s) for s in producer.layout.segment_sizes] for _ in wanted]
    into = consumer.fetch_into(peer, wanted, bufs)
    assert into.outcomes == result.outcomes
    for k, segs in zip(wanted, bufs, strict=True):
        if k in keys:
            assert b"".join(segs) == content(k, size)
    expect_packed = negotiated and packs(producer.layout.segment_sizes)
    assert proxy.packed_flags and set(proxy.packed_flags) == {expect_packed}
    assert not proxy.errors, proxy.errors
    assert consumer.store.stats().pinned == 0
    assert wait_until(lambda: producer.store.stats().pinned == 0, 10.0)


@pytest.mark.parametrize("spec", [LAYOUTS[0], LAYOUTS[3]], ids=_id)
def test_every_block_of_a_packed_message_is_checked(made: list[Any],
                                                    spec: dict[str, Any]) -> None:
    blocks = 30
    producer = _node(made, spec, blocks)
    keys = _fill(producer, blocks)
    consumer = _node(made, spec, blocks)
    proxy = CorruptingProxy(producer.address, every=4, first=3)
    made.append(proxy)
    peer = consumer.connect(proxy.address)
    assert CAP_PACKED_V1 in peer.capabilities
    result = peer.fetch(keys)
    bad = set(proxy.corrupted)
    assert len(bad) == (blocks - 3) // 4 + 1 and not proxy.errors
    for i, key in enumerate(keys):
        if key in bad:
            assert result.outcomes[i] is KeyOutcome.FAILED
            assert "checksum" in result.errors[i]
            assert consumer.get(key) is None
        else:
            assert result.outcomes[i] is KeyOutcome.STORED
            assert consumer.get(key) == content(key, producer.layout.bytes_per_block)
    assert consumer.stats().checksum_failures == len(bad)
    st_ = consumer.store.stats()
    assert st_.stored == st_.used == blocks - len(bad) and st_.pinned == 0


# ------------------------------------------------------------------ a hostile server

SMALL = LAYOUTS[3]


def _hostile_fetch(made: list[Any], answer: Any, *, offer: bool = True) -> tuple[Node, Any]:
    """A real consumer fetches 4 keys from a scripted server whose answer to the fetch is
    ``answer(fetch, bpb)`` (a list of frame lists); returns the consumer and the
    exception the fetch failed with (or its result)."""
    consumer = _node(made, SMALL, 8)
    hello = consumer.hello
    if not offer:  # the server does not offer packed-v1: it is not negotiated
        hello = proto.Hello(hello.node, hello.minor, hello.rc, hello.fp, hello.geo,
                            hello.khash, tuple(c for c in hello.caps if c != CAP_PACKED_V1),
                            hello.limits)
    bpb = consumer.layout.bytes_per_block

    server = FakeServer(hello, lambda msg: list(answer(msg, bpb)) if type(msg) is Fetch else [])
    made.append(server)
    peer = consumer.connect(server.address)
    assert (CAP_PACKED_V1 in peer.capabilities) == offer
    fut = consumer.fetch_async(peer, keys_for(4), timeout=10.0)
    try:
        outcome: Any = fut.result(15.0)
    except P2PKVError as exc:
        outcome = exc
    assert not server.errors, server.errors
    return consumer, outcome


def _head(req: int, idx: list[int], sums: list[int | None], **extra: Any) -> bytes:
    return msgpack.packb({"t": "block", "v": 1, "req": req, "idx": idx, "sums": sums,
                          **extra}, use_bin_type=True)


def _sums(data: bytes, n: int, bpb: int) -> list[int | None]:
    return [proto.block_checksum([data[i * bpb:(i + 1) * bpb]]) for i in range(n)]


def _done(req: int, n: int) -> list[bytes]:
    return proto.encode(Done(req, (0,) * n))  # type: ignore[return-value]


BROKEN = {
    "frame-too-short": lambda f, bpb, d: [[_head(f.req, [0, 1], _sums(d, 2, bpb), pk=True),
                                           d[:2 * bpb - 1]]],
    "frame-too-long": lambda f, bpb, d: [[_head(f.req, [0], _sums(d, 1, bpb), pk=True),
                                          d[:bpb + 1]]],
    "two-frames": lambda f, bpb, d: [[_head(f.req, [0, 1], _sums(d, 2, bpb), pk=True),
                                      d[:bpb], d[bpb:2 * bpb]]],
    "no-frame": lambda f, bpb, d: [[_head(f.req, [0], _sums(d, 1, bpb), pk=True)]],
    "pk-not-bool": lambda f, bpb, d: [[_head(f.req, [0], _sums(d, 1, bpb), pk=1), d[:bpb]]],
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_broken_packed_message_is_a_protocol_error(made: list[Any], how: str) -> None:
    data = bytes(range(256)) * 64

    def answer(f: Fetch, bpb: int) -> list[list[bytes]]:
        return [*BROKEN[how](f, bpb, data * (1 + 4 * bpb // len(data))), _done(f.req, 4)]

    consumer, outcome = _hostile_fetch(made, answer)
    assert isinstance(outcome, ProtocolError), outcome
    want = proto.Code.WRONG_TYPE if how == "pk-not-bool" else proto.Code.FRAME_COUNT
    assert outcome.code == want, outcome
    assert consumer.stats().protocol_violations == 1
    assert io_thread_alive(consumer) and consumer.store.stats().pinned == 0
    assert consumer.store.stats().stored == 0


def test_packed_without_the_capability_is_unexpected(made: list[Any]) -> None:
    def answer(f: Fetch, bpb: int) -> list[list[bytes]]:
        data = bytes(bpb)
        return [[_head(f.req, [0], _sums(data, 1, bpb), pk=True), data], _done(f.req, 4)]

    consumer, outcome = _hostile_fetch(made, answer, offer=False)
    assert isinstance(outcome, ProtocolError) and outcome.code == proto.Code.UNEXPECTED
    assert io_thread_alive(consumer) and consumer.store.stats().stored == 0


def test_a_valid_packed_answer_from_a_scripted_server_lands(made: list[Any]) -> None:
    """The scripted server itself is right: the same script with correct sizes lands."""
    def answer(f: Fetch, bpb: int) -> list[list[bytes]]:
        data = bytes(range(256)) * (4 * bpb // 256)
        return [[_head(f.req, [2, 0, 3, 1], [_sums(data, 4, bpb)[i] for i in range(4)],
                       pk=True), data], _done(f.req, 4)]

    consumer, result = _hostile_fetch(made, answer)
    assert not isinstance(result, Exception), result
    bpb = consumer.layout.bytes_per_block
    data = bytes(range(256)) * (4 * bpb // 256)
    keys = keys_for(4)
    for n, i in enumerate([2, 0, 3, 1]):
        assert consumer.get(keys[i]) == data[n * bpb:(n + 1) * bpb]


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
       st.integers(-3, 3), st.binary(max_size=64), st.booleans())
def test_random_packed_messages_fail_cleanly(made: list[Any], idx: list[int], skew: int,
                                             noise: bytes, true_sums: bool) -> None:
    """Random indices, a frame of the right size give or take a few bytes, random bytes
    and right or wrong checksums: the fetch ends with per-key outcomes or a protocol
    error, and nothing wrong ever becomes visible."""
    def answer(f: Fetch, bpb: int) -> list[list[bytes]]:
        body = (noise or b"\x00") * (len(idx) * bpb // max(1, len(noise)) + 1)
        body = body[:max(0, len(idx) * bpb + skew)]
        sums = (_sums(body, len(idx), bpb) if true_sums and skew == 0
                else [s ^ 1 for s in _sums(body.ljust(len(idx) * bpb, b"\0"), len(idx), bpb)])
        outcomes = tuple(0 if i in idx else 1 for i in range(4))
        return [[_head(f.req, idx, sums, pk=True), body],
                proto.encode(Done(f.req, outcomes))]  # type: ignore[list-item]

    consumer, outcome = _hostile_fetch(made, answer)
    assert io_thread_alive(consumer)
    if skew:
        assert isinstance(outcome, ProtocolError) and outcome.code == proto.Code.FRAME_COUNT
        assert consumer.store.stats().stored == 0
    else:
        assert not isinstance(outcome, Exception), outcome
        want = KeyOutcome.STORED if true_sums else KeyOutcome.FAILED
        assert [outcome.outcomes[i] for i in idx] == [want] * len(idx)
        assert consumer.store.stats().stored == (len(idx) if true_sums else 0)
    assert consumer.store.stats().pinned == 0
    for thing in made:
        if not isinstance(thing, Node):
            thing.close()
    made.clear()
    consumer.close(timeout=1.0)


# ------------------------------------------------------------------ vectors (SPEC §14.8)


@pytest.mark.parametrize("vector", PACKED_VECTORS["messages"],
                         ids=[v["name"] for v in PACKED_VECTORS["messages"]])
def test_packed_message_vector_decodes_and_reencodes(vector: dict[str, Any]) -> None:
    msg = proto.decode(frames_of(vector), vector["segments"])
    assert as_vector(msg) == vector["message"]
    again = proto.decode([bytes(f) for f in proto.encode(msg)], vector["segments"])
    assert as_vector(again) == vector["message"]


@pytest.mark.parametrize("vector", PACKED_VECTORS["errors"],
                         ids=[v["name"] for v in PACKED_VECTORS["errors"]])
def test_packed_error_vector_raises_its_code(vector: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        proto.decode(frames_of(vector), vector["segments"])
    assert excinfo.value.code == vector["code"], excinfo.value.message


def test_an_unpacked_block_keeps_its_bytes() -> None:
    """Without pk the header is byte for byte what a peer without packed-v1 sends."""
    plain = proto.encode_head(Block(9, (0, 2), (1, 2)))
    assert plain == msgpack.packb({"t": "block", "v": 1, "req": 9, "idx": [0, 2],
                                   "sums": [1, 2]}, use_bin_type=True)
    assert msgpack.unpackb(proto.encode_head(Block(9, (0,), (1,), pk=True)))["pk"] is True


# ------------------------------------------------------------------ the store's batches


def test_store_batches_take_slots_and_verify_each_block() -> None:
    from p2pkv.errors import StoreFullError
    from p2pkv.layout import Geometry, make_layout
    from p2pkv.store import ChecksumMismatch
    from p2pkv.store.pool import BlockPool

    layout = make_layout("v2", Geometry(num_layers=2, num_kv_heads=1, head_size=8))
    store = BlockStore(BlockPool(layout, 3))
    seg = layout.segment_sizes
    store.put(b"held", [bytes([7]) * s for s in seg])
    pin = store.acquire_read(b"held")  # pinned: never evicted for a new block
    first = store.begin_write(b"busy")
    assert first is not None
    out = store.begin_write_many([b"a", b"held", b"busy", b"a", b"b", b"c"])
    assert out[1] is None and out[2] is None and out[3] is None  # held, busy, repeated
    writers = [w for w in out if not isinstance(w, (StoreFullError, type(None)))]
    assert [w.key for w in writers] == [b"a"]  # the pool had one slot left
    assert isinstance(out[4], StoreFullError) and out[5] is out[4]
    good = [bytes([1]) * s for s in seg]
    for view, data in zip(writers[0].views, good, strict=True):
        view[:] = data
    assert store.commit_many(writers, [proto.block_checksum(good)]) == [None]
    assert store.get(b"a") == b"".join(good)
    first.views[0][:] = bytes(seg[0])
    (bad,) = store.commit_many([first], [12345])
    assert isinstance(bad, ChecksumMismatch) and store.get(b"busy") is None
    with pytest.raises(P2PKVError):
        store.commit_many([first], [None])  # already finished
    with pytest.raises(ValueError):
        store.commit_many([], [None])
    assert pin is not None
    pin.release()
    assert store.stats().pinned == 0 and store.stats().stored == 2


def test_packed_helper_picks_small_segment_layouts() -> None:
    assert packs([49152] * 12) and packs([16384])
    assert not packs([589824]) and not packs([65536] * 32)
    assert not packs([4096] * 1024)  # 4 MiB: more than one packed frame may carry
    block = Block(1, (0, 1), (None, None), pk=True)
    assert proto.segments_for(block, [8, 4]) == (24,)

"""The pure handshake decision: every reason at once, from the local node's view."""

from __future__ import annotations

import dataclasses

import pytest

from p2pkv.identity import ABSENT, RunConfig
from p2pkv.protocol import (
    CAP_CHECKSUM_XXH3_64,
    Code,
    Geometry,
    Hello,
    KeyHash,
    Refuse,
    decide,
    decode,
    encode,
    layout_label,
)

V1 = Hello.for_config("v1", RunConfig("m", parallel_agnostic=True), Geometry.of([589824]),
                      KeyHash("xxh3-128", 0))
V2 = Hello.for_config("v2", RunConfig("m"), Geometry.of([49152] * 12), KeyHash("xxh3-128", 0))


def fields(decision: object) -> dict[str, object]:
    return {r.field: r for r in decision.reasons}  # type: ignore[attr-defined]


def test_identical_greetings_accepted_with_negotiated_caps() -> None:
    other = dataclasses.replace(V1, node="other", caps=(CAP_CHECKSUM_XXH3_64, "x-new"))
    d = decide(V1, other)
    assert d.accepted and d.reasons == () and d.code == 0
    assert d.capabilities == frozenset({CAP_CHECKSUM_XXH3_64})
    assert d.summary() == "accepted"


def test_v1_vs_v2_refused_for_fingerprint_and_segments() -> None:
    d = decide(V1, V2)
    assert not d.accepted
    f = fields(d)
    assert [r.field for r in d.reasons] == [
        "fingerprint", "run_config.parallel_agnostic", "geometry.segments"]
    assert d.code == Code.FINGERPRINT_MISMATCH
    pa = d.reasons[1]
    assert (pa.ours, pa.theirs) == (ABSENT, False)
    seg = f["geometry.segments"]
    assert seg.code == Code.SEGMENTS_MISMATCH  # type: ignore[attr-defined]
    assert seg.meaning.startswith(  # type: ignore[attr-defined]
        "V1 cross-layer (one 589824-byte segment) vs V2 per-layer (12 × 49152-byte segments)")
    # Seen from the other side, values swap.
    back = decide(V2, V1)
    assert back.reasons[0].swapped() == d.reasons[0]


def test_reasons_survive_the_wire() -> None:
    d = decide(V1, V2)
    refuse = decode(encode(d.refusal(V1)))
    assert refuse == d.refusal(V1)
    assert isinstance(refuse, Refuse) and refuse.reasons[1].ours is ABSENT


def test_every_other_difference_is_reported_at_once() -> None:
    remote = dataclasses.replace(
        V1, v=2, geo=Geometry.of([1000, 24]), khash=KeyHash("xxh3-64", 7), caps=())
    d = decide(V1, remote, required=[CAP_CHECKSUM_XXH3_64])
    codes = [r.code for r in d.reasons]
    assert codes == [
        Code.PROTOCOL_MAJOR_MISMATCH, Code.BLOCK_BYTES_MISMATCH, Code.SEGMENTS_MISMATCH,
        Code.KEY_HASH_ALGO_MISMATCH, Code.KEY_HASH_SEED_MISMATCH, Code.CAPABILITY_MISSING]
    f = fields(d)
    assert (f["key_hash.seed"].ours, f["key_hash.seed"].theirs) == (0, 7)  # type: ignore
    assert (f["geometry.bytes_per_block"].ours,  # type: ignore[attr-defined]
            f["geometry.bytes_per_block"].theirs) == (589824, 1024)  # type: ignore
    assert "refused (6 reason(s))" in d.summary()


def test_forged_fingerprint() -> None:
    liar = dataclasses.replace(V1, rc=RunConfig("m2", parallel_agnostic=True).get_run_config())
    d = decide(V1, liar)
    f = fields(d)
    assert d.reasons[0].code == Code.FINGERPRINT_FORGED
    assert d.reasons[0].theirs == V1.fp
    assert d.reasons[0].ours == RunConfig("m2", parallel_agnostic=True).fingerprint
    assert "run_config.model_name" in f


@pytest.mark.parametrize(
    "rc",
    [
        {},
        {**RunConfig("m").get_run_config(), "tp_size": 0},
        {**RunConfig("m").get_run_config(), "parallel_agnostic": True},
        {**RunConfig("m").get_run_config(), "mystery": 1},
    ],
)
def test_invalid_run_config_refused(rc: dict[str, object]) -> None:
    d = decide(V2, dataclasses.replace(V2, rc=rc))
    assert d.reasons[0].code == Code.RUN_CONFIG_INVALID
    assert "identity rules" in d.reasons[0].meaning
    assert not d.accepted


def test_replicated_tp2_tp4_accepted_and_vs_agnostic_refused() -> None:
    def rep(tp: int) -> Hello:
        cfg = RunConfig.resolve("m", parallel_agnostic=True, is_parallelism_agnostic=False,
                                replicated_layout=True, tp_size=tp)
        return Hello.for_config(f"tp{tp}", cfg, Geometry.of([4096]), KeyHash("xxh3-128", 0))

    assert decide(rep(2), rep(4)).accepted
    plain = dataclasses.replace(V1, geo=Geometry.of([4096]))
    d = decide(rep(2), plain)
    assert [r.field for r in d.reasons] == ["fingerprint", "run_config.replicated_layout"]


def test_layout_label() -> None:
    assert layout_label(V1.rc) == "V1 cross-layer"
    assert layout_label(V2.rc) == "V2 per-layer"
    assert layout_label(None) == "unknown layout"


def test_geometry_describe() -> None:
    assert Geometry.of([5]).describe() == "one 5-byte segment"
    assert Geometry.of([3, 3]).describe() == "2 × 3-byte segments"
    assert Geometry.of([1, 2]).describe() == "2 segments (1, 2 bytes)"

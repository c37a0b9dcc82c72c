"""The run-config identity (BRIEF rules 1-6) against hand-built vectors, plus the diff."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from p2pkv.identity import ABSENT, FieldDiff, RunConfig, canonical_json, diff, fingerprint_of

VECTORS = json.loads(
    (Path(__file__).resolve().parent.parent / "protocol" / "vectors" / "identity.json")
    .read_text(encoding="utf-8")
)["vectors"]
BY_NAME = {v["name"]: v for v in VECTORS}


def build(vector: dict[str, Any]) -> RunConfig:
    args = dict(vector["args"])
    if vector["via"] == "resolve":
        return RunConfig.resolve(**args)
    return RunConfig(**args)


def test_vectors_are_many_and_self_consistent() -> None:
    assert len(VECTORS) >= 12
    for v in VECTORS:
        text = json.dumps(v["run_config"], sort_keys=True, separators=(",", ":"))
        assert text == v["canonical"]
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        assert digest == v["digest"] and v["fingerprint"] == digest[:16]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_run_config_matches_vector(vector: dict[str, Any]) -> None:
    config = build(vector)
    assert config.get_run_config() == vector["run_config"]
    assert canonical_json(config.get_run_config()) == vector["canonical"]
    assert config.digest == vector["digest"]
    assert config.fingerprint == vector["fingerprint"]
    assert config.namespace(vector["root"]) == vector["namespace"]
    assert fingerprint_of(vector["run_config"]) == vector["fingerprint"]


def test_brief_worked_example_string() -> None:
    assert BY_NAME["brief_worked_example"]["canonical"] == (
        '{"blocks_per_file":1,"dcp_size":1,"dtype":"float16","inference_engine":"vllm",'
        '"kv_cache_groups":[],"model_name":"m","parallel_agnostic":false,"pcp_size":1,'
        '"pp_size":1,"tokens_per_hash":16,"tp_size":1}'
    )


def test_rule1_agnostic_collapses_sizes_and_rank() -> None:
    config = RunConfig("m", parallel_agnostic=True, tp_size=8, pp_size=2, pcp_size=2,
                       dcp_size=4, rank=5)
    assert (config.tp_size, config.pp_size, config.pcp_size, config.dcp_size) == (1, 1, 1, 1)
    assert config.rank == 0
    assert config == RunConfig("m", parallel_agnostic=True)


def test_rule2_parallel_agnostic_key_absent_or_false() -> None:
    assert "parallel_agnostic" not in RunConfig("m", parallel_agnostic=True).get_run_config()
    assert RunConfig("m").get_run_config()["parallel_agnostic"] is False
    assert RunConfig("m") != RunConfig("m", parallel_agnostic=True)


def test_rule3_4_replicated_collapse_needs_opt_in() -> None:
    def rep(tp: int, opt_in: bool) -> RunConfig:
        return RunConfig.resolve("m", parallel_agnostic=opt_in, is_parallelism_agnostic=False,
                                 replicated_layout=True, tp_size=tp)

    assert rep(2, True).fingerprint == rep(4, True).fingerprint
    assert rep(2, True).get_run_config()["replicated_layout"] is True
    assert rep(2, False).fingerprint != rep(4, False).fingerprint
    assert "replicated_layout" not in rep(2, False).get_run_config()
    assert rep(2, False) == RunConfig("m", tp_size=2)
    plain = RunConfig.resolve("m", parallel_agnostic=True, is_parallelism_agnostic=True,
                              replicated_layout=False, tp_size=2)
    assert plain != rep(2, True)
    assert BY_NAME["replicated_opt_in_tp2"]["fingerprint"] == \
        BY_NAME["replicated_opt_in_tp4"]["fingerprint"]
    assert BY_NAME["plain_agnostic_via_resolve"]["fingerprint"] != \
        BY_NAME["replicated_opt_in_tp2"]["fingerprint"]


def test_rule3_replicated_never_written_false() -> None:
    assert "replicated_layout" not in RunConfig("m", parallel_agnostic=True).get_run_config()
    with pytest.raises(ValueError, match="replicated_layout"):
        RunConfig.from_run_config({**RunConfig("m").get_run_config(), "replicated_layout": False})


def test_rule5_optional_formats_only_when_set() -> None:
    base = RunConfig("m").get_run_config()
    assert "canonical_format" not in base and "storage_format" not in base
    assert RunConfig("m", canonical_format="x").get_run_config()["canonical_format"] == "x"
    assert RunConfig("m", storage_format="y").get_run_config()["storage_format"] == "y"


def test_rule6_rank_never_hashed() -> None:
    assert RunConfig("m", tp_size=2, rank=0) == RunConfig("m", tp_size=2, rank=1)
    assert BY_NAME["rank_never_hashed"]["fingerprint"] == \
        BY_NAME["not_agnostic_keeps_parallel_sizes"]["fingerprint"]
    assert "rank" not in RunConfig("m", rank=3).get_run_config()


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_from_run_config_round_trip(vector: dict[str, Any]) -> None:
    config = RunConfig.from_run_config(vector["run_config"])
    assert config.fingerprint == vector["fingerprint"]
    assert config.get_run_config() == vector["run_config"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"extra": 1}, "extra"),
        ({"parallel_agnostic": True}, "parallel_agnostic"),
        ({"tp_size": 2}, "tp_size"),  # agnostic configs must have size 1
        ({"storage_format": None}, "storage_format"),
        ({"tokens_per_hash": "16"}, "tokens_per_hash"),
        ({"dtype": 16}, "dtype"),
    ],
)
def test_from_run_config_is_strict(change: dict[str, Any], field: str) -> None:
    fields = {**RunConfig("m", parallel_agnostic=True).get_run_config(), **change}
    with pytest.raises(ValueError, match=field):
        RunConfig.from_run_config(fields)


def test_from_run_config_missing_field() -> None:
    fields = RunConfig("m").get_run_config()
    del fields["dtype"]
    with pytest.raises(ValueError, match="dtype"):
        RunConfig.from_run_config(fields)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"model_name": ""}, ["model_name"]),
        ({"model_name": "m", "tokens_per_hash": 0}, ["tokens_per_hash", "0"]),
        ({"model_name": "m", "blocks_per_file": -1}, ["blocks_per_file", "-1"]),
        ({"model_name": "m", "tp_size": 0}, ["tp_size", "0"]),
        ({"model_name": "m", "rank": -1}, ["rank", "-1"]),
        ({"model_name": "m", "tp_size": True}, ["tp_size", "True"]),
        ({"model_name": "m", "kv_cache_groups": "abc"}, ["kv_cache_groups"]),
        ({"model_name": "m", "kv_cache_groups": [{"tokens_per_block": 16}]},
         ["kv_cache_groups[0]"]),
        ({"model_name": "m", "kv_cache_groups": [
            {"tokens_per_block": 0, "layer_names": ["a"]}]},
         ["kv_cache_groups[0].tokens_per_block", "0"]),
        ({"model_name": "m", "kv_cache_groups": [
            {"tokens_per_block": 16, "layer_names": [1]}]},
         ["kv_cache_groups[0].layer_names[0]"]),
    ],
)
def test_bad_input_names_field_and_value(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as excinfo:
        RunConfig(**kwargs)
    for word in words:
        assert word in str(excinfo.value)


# ---------------------------------------------------------------- diff


def by_field(diffs: list[FieldDiff]) -> dict[str, FieldDiff]:
    return {d.field: d for d in diffs}


def test_diff_parallel_agnostic_absent_vs_false() -> None:
    v1 = RunConfig("m", parallel_agnostic=True).get_run_config()
    v2 = RunConfig("m").get_run_config()
    (d,) = diff(v1, v2)
    assert d.field == "parallel_agnostic" and d.local is ABSENT and d.remote is False
    assert d.meaning.startswith("V1 cross-layer") and "vs V2 per-layer" in d.meaning
    assert d.to_wire()["local"] == {"absent": True}
    assert FieldDiff.from_wire(d.to_wire()) == d
    assert diff(v2, v1)[0].meaning.startswith("V2 per-layer")


def test_diff_replicated_and_parallel_sizes() -> None:
    rep = RunConfig.resolve("m", parallel_agnostic=True, is_parallelism_agnostic=False,
                            replicated_layout=True).get_run_config()
    plain = RunConfig("m", parallel_agnostic=True).get_run_config()
    (d,) = diff(rep, plain)
    assert d.field == "replicated_layout" and (d.local, d.remote) == (True, ABSENT)
    assert "replicated" in d.meaning and "plain" in d.meaning
    tp = by_field(diff(RunConfig("m", tp_size=2).get_run_config(),
                       RunConfig("m", tp_size=4, pp_size=2).get_run_config()))
    assert set(tp) == {"tp_size", "pp_size"}
    assert (tp["tp_size"].local, tp["tp_size"].remote) == (2, 4)
    assert "tensor parallelism" in tp["tp_size"].meaning


def test_diff_dtype_and_groups() -> None:
    groups_a = [{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}]
    groups_b = [{"tokens_per_block": 32, "layer_names": ["l0", "l1"]}]
    d = by_field(diff(RunConfig("m", kv_cache_groups=groups_a).get_run_config(),
                      RunConfig("m", dtype="bfloat16", kv_cache_groups=groups_b)
                      .get_run_config()))
    assert set(d) == {"dtype", "kv_cache_groups[0].tokens_per_block"}
    assert (d["dtype"].local, d["dtype"].remote) == ("float16", "bfloat16")
    g = d["kv_cache_groups[0].tokens_per_block"]
    assert (g.local, g.remote) == (16, 32) and "group 0" in g.meaning
    more = by_field(diff(RunConfig("m", kv_cache_groups=groups_a).get_run_config(),
                         RunConfig("m", kv_cache_groups=groups_a * 2).get_run_config()))
    assert more["kv_cache_groups"].meaning.startswith("number of KV cache groups")


def test_diff_reports_unknown_extra_field() -> None:
    ours = RunConfig("m").get_run_config()
    theirs = {**ours, "attention_sink": 4}
    (d,) = diff(ours, theirs)
    assert d.field == "attention_sink" and d.local is ABSENT and d.remote == 4
    assert "unknown" in d.meaning


def test_diff_of_equal_configs_is_empty_and_types_matter() -> None:
    rc = RunConfig("m").get_run_config()
    assert diff(rc, RunConfig("m", rank=3).get_run_config()) == []
    (d,) = diff(rc, {**rc, "tp_size": True})
    assert d.field == "tp_size"

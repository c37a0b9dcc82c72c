"""Unit tests of p2pkv.settings: precedence, parsing, TOML files and error messages."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from p2pkv.errors import ConfigError
from p2pkv.settings import DEFAULT_MODEL, OPTIONS, Settings, load_settings

NO_FLAGS: dict[str, Any] = {}


def load(flags: dict[str, Any] | None = None, *, env: dict[str, str] | None = None,
         toml: str | None = None, tmp_path: Path | None = None) -> Settings:
    path = None
    if toml is not None:
        assert tmp_path is not None
        file = tmp_path / "node.toml"
        file.write_text(toml)
        path = str(file)
    return load_settings(flags or NO_FLAGS, config_file=path, environ=env or {})


def test_defaults_come_from_options() -> None:
    s = load()
    for opt in OPTIONS:
        assert s[opt.name] == opt.default, opt.name
        assert s.sources[opt.name] == "default"
    assert s["model"] == DEFAULT_MODEL
    assert s["layout"] == "v2"
    assert s["log_level"] == "warning"


def test_option_names_flags_and_env_vars() -> None:
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names))
    by_name = {o.name: o for o in OPTIONS}
    assert by_name["pool_blocks"].flag == "--pool-blocks"
    assert by_name["pool_blocks"].env == "P2PKV_POOL_BLOCKS"
    assert by_name["tp"].flag == "--tp"
    assert by_name["tp"].env == "P2PKV_TP"


def test_flag_beats_env_beats_toml(tmp_path: Path) -> None:
    toml = 'tp = 2\npp = 2\nrank = 2\nmodel = "from/toml"\n'
    env = {"P2PKV_TP": "3", "P2PKV_PP": "3"}
    s = load({"tp": "4"}, env=env, toml=toml, tmp_path=tmp_path)
    assert (s["tp"], s["pp"], s["rank"], s["model"]) == (4, 3, 2, "from/toml")
    assert s.sources["tp"] == "--tp"
    assert s.sources["pp"] == "P2PKV_PP"
    assert s.sources["rank"].endswith("node.toml:rank")
    assert s.sources["block_tokens"] == "default"


def test_empty_env_var_and_empty_flag_count_as_not_given(tmp_path: Path) -> None:
    s = load({"tp": None, "peer": []}, env={"P2PKV_TP": "", "P2PKV_PEER": ""},
             toml='tp = 2\npeer = ["tcp://10.0.0.1:5555"]\n', tmp_path=tmp_path)
    assert s["tp"] == 2
    assert s["peer"] == ("tcp://10.0.0.1:5555",)


def test_node_table_and_top_level_both_work(tmp_path: Path) -> None:
    top = load(toml='model = "a/b"\nlayout = "v1"\n', tmp_path=tmp_path)
    table = load(toml='[node]\nmodel = "a/b"\nlayout = "v1"\n', tmp_path=tmp_path)
    assert top["model"] == table["model"] == "a/b"
    assert top["layout"] == table["layout"] == "v1"
    assert top.run_config().fingerprint == table.run_config().fingerprint


def test_toml_keys_may_use_dashes(tmp_path: Path) -> None:
    assert load(toml="pool-blocks = 9\n", tmp_path=tmp_path)["pool_blocks"] == 9


def test_toml_typed_values(tmp_path: Path) -> None:
    s = load(toml=(
        "[node]\nparallel_agnostic = false\nhandshake_timeout = 1\nchecksums = false\n"
        'peer = ["tcp://a:1", "tcp://b:2"]\nmetrics_port = 0\ndtype = "bfloat16"\n'
    ), tmp_path=tmp_path)
    assert s["parallel_agnostic"] is False
    assert s["handshake_timeout"] == 1.0
    assert s["checksums"] is False
    assert s["peer"] == ("tcp://a:1", "tcp://b:2")
    assert s["metrics_port"] == 0
    assert s["dtype"] == "bfloat16"


def test_unknown_toml_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--config: unknown option 'pool_size'"):
        load(toml="pool_size = 3\n", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match=r"unknown option 'colour'"):
        load(toml='[node]\ncolour = "red"\n', tmp_path=tmp_path)


def test_key_outside_node_table_is_refused(tmp_path: Path) -> None:
    # Beside a [node] table a top-level key would otherwise be silently ignored.
    with pytest.raises(ConfigError, match=r"'model' outside the \[node\] table"):
        load(toml='model = "x"\n[node]\ntp = 2\n', tmp_path=tmp_path)


def test_node_must_be_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[node\] .* must be a table"):
        load(toml='node = "x"\n', tmp_path=tmp_path)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(toml="tp = = 2\n", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match="--config: cannot read"):
        load_settings({}, config_file=str(tmp_path / "missing.toml"), environ={})


def test_config_file_from_env_and_flag_wins(tmp_path: Path) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("tp = 2\n")
    b.write_text("tp = 3\n")
    assert load_settings({}, environ={"P2PKV_CONFIG": str(a)})["tp"] == 2
    assert load_settings({}, config_file=str(b), environ={"P2PKV_CONFIG": str(a)})["tp"] == 3


@pytest.mark.parametrize(("flags", "env", "message"), [
    ({"tp": "0"}, {}, r"^--tp: must be in \[1, 4096\], got 0 \(from --tp\)$"),
    ({}, {"P2PKV_TP": "x"}, r"^--tp: must be an integer, got 'x' \(from P2PKV_TP\)$"),
    ({"layout": "v3"}, {}, r"^--layout: must be one of v1, v2, replicated, got 'v3'"),
    ({"dtype": "int8"}, {}, r"^--dtype: must be one of float16, "),
    ({"handshake_timeout": "0"}, {}, r"^--handshake-timeout: must be a positive number"),
    ({"handshake_timeout": "nan"}, {}, r"^--handshake-timeout: must be a positive number"),
    ({}, {"P2PKV_FETCH_TIMEOUT": "soon"}, r"^--fetch-timeout: must be a number of seconds"),
    ({}, {"P2PKV_CHECKSUMS": "maybe"}, r"^--checksums: must be true or false"),
    ({"metrics_port": "65536"}, {}, r"^--metrics-port: must be in \[0, 65535\]"),
    ({"key_seed": "-1"}, {}, r"^--key-seed: must be in \[0, "),
    ({"model": "  "}, {}, r"^--model: must be a non-empty string"),
    ({"log_level": "loud"}, {}, r"^--log-level: must be one of debug, info, warning, error"),
])
def test_bad_values_name_the_option(flags: dict[str, Any], env: dict[str, str],
                                    message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(flags, env=env)


def test_bad_toml_value_names_option_and_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--tp: must be an integer, got 2\.5 \(from .*node"
                                          r"\.toml:tp\)$"):
        load(toml="tp = 2.5\n", tmp_path=tmp_path)
    with pytest.raises(ConfigError, match=r"^--pool-blocks: must be an integer, got True"):
        load(toml="pool_blocks = true\n", tmp_path=tmp_path)


def test_parsing_of_strings() -> None:
    s = load(env={"P2PKV_TP": " 0x2 ", "P2PKV_PARALLEL_AGNOSTIC": "off",
                  "P2PKV_PEER": "tcp://a:1, tcp://b:2,", "P2PKV_HANDSHAKE_TIMEOUT": "0.25",
                  "P2PKV_LOG_LEVEL": " INFO ", "P2PKV_LAYOUT": "V1"})
    assert s["tp"] == 2
    assert s["parallel_agnostic"] is False
    assert s["peer"] == ("tcp://a:1", "tcp://b:2")
    assert s["handshake_timeout"] == 0.25
    assert s["log_level"] == "info"
    assert s["layout"] == "v1"
    assert load({"checksums": False})["checksums"] is False  # a BooleanOptionalAction flag


def test_run_config_default_is_v2_parallel_specific() -> None:
    rc = load().run_config()
    fields = rc.get_run_config()
    assert fields["model_name"] == DEFAULT_MODEL
    assert fields["parallel_agnostic"] is False  # V2 per-layer cannot be shared across TP
    assert fields["kv_cache_groups"][0]["tokens_per_block"] == 16
    assert len(fields["kv_cache_groups"][0]["layer_names"]) == 12
    assert len(rc.fingerprint) == 16


def test_v1_is_parallel_agnostic_and_collapses_tp() -> None:
    tp1 = load({"layout": "v1"}).run_config()
    tp4 = load({"layout": "v1", "tp": "4", "rank": "3"}).run_config()
    assert "parallel_agnostic" not in tp1.get_run_config()
    assert tp1.fingerprint == tp4.fingerprint
    # Without the opt-in the parallel identity is kept.
    strict = load({"layout": "v1", "tp": "4", "parallel_agnostic": False}).run_config()
    assert strict.get_run_config()["tp_size"] == 4
    assert strict.fingerprint != tp4.fingerprint


def test_rank_is_never_hashed() -> None:
    a = load({"tp": "2", "rank": "0"}).run_config()
    b = load({"tp": "2", "rank": "1"}).run_config()
    assert a.fingerprint == b.fingerprint
    assert a.get_run_config()["tp_size"] == 2


def test_identity_changes_with_each_hashed_input() -> None:
    base = load().run_config().fingerprint
    for flags in ({"model": "other"}, {"dtype": "bfloat16"}, {"block_tokens": "32"},
                  {"tokens_per_hash": "32"}, {"layers": "6"}, {"tp": "2"}, {"pp": "2"},
                  {"layout": "v1"}):
        assert load(flags).run_config().fingerprint != base, flags


def test_geometry_overrides_and_presets() -> None:
    g = load({"preset": "llama-3-8b", "layers": "2", "block_tokens": "32"}).geometry()
    assert (g.num_layers, g.num_kv_heads, g.head_size, g.tokens_per_block, g.dtype) == \
        (2, 8, 128, 32, "bfloat16")
    g = load({"kv_heads": "4", "head_dim": "32", "dtype": "float32"}).geometry()
    assert (g.num_layers, g.num_kv_heads, g.head_size, g.dtype) == (12, 4, 32, "float32")


def test_replicated_needs_mla() -> None:
    with pytest.raises(ConfigError, match=r"^--layout replicated needs an MLA geometry"):
        load({"layout": "replicated"}).layout()
    layout = load({"layout": "replicated", "preset": "deepseek-v2-lite"}).layout()
    assert layout.name == "replicated"
    fields = load({"layout": "replicated", "preset": "deepseek-v2-lite"}).run_config(layout)
    assert fields.get_run_config()["replicated_layout"] is True


def test_mla_kv_heads_error_names_kv_heads() -> None:
    with pytest.raises(ConfigError, match=r"^--kv-heads: an MLA geometry has exactly 1 KV head"):
        load({"preset": "deepseek-v2-lite", "kv_heads": "2"}).geometry()


def test_unknown_preset_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"^--preset: .*'nope'.*deepseek-v2-lite.*llama-3-8b"):
        load({"preset": "nope"}).geometry()


def test_preset_and_model_config_are_exclusive(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    with pytest.raises(ConfigError, match="exclusive"):
        load({"preset": "seed", "model_config": str(cfg)}).geometry()


def test_model_config_errors_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--model-config: .*nonexistent"):
        load({"model_config": str(tmp_path / "nonexistent.json")}).geometry()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match=r"^--model-config: .*num_attention_heads"):
        load({"model_config": str(bad)}).geometry()


def test_model_config_geometry_and_dtype_override(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "hidden_size": 512, "torch_dtype": "bfloat16"}))
    g = load({"model_config": str(cfg)}).geometry()
    assert (g.num_layers, g.num_kv_heads, g.head_size, g.dtype) == (4, 4, 64, "bfloat16")
    assert load({"model_config": str(cfg), "tp": "2"}).geometry().num_kv_heads == 2
    # --dtype overrides the file, even when the file's dtype is one p2pkv does not know.
    cfg.write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512,
        "torch_dtype": "float64"}))
    assert load({"model_config": str(cfg), "dtype": "float16"}).geometry().dtype == "float16"
    with pytest.raises(ConfigError, match=r"^--model-config: .*float64"):
        load({"model_config": str(cfg)}).geometry()


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_configuration_doc_lists_every_option() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    rows = {cells(line)[2].strip("`"): line for line in doc.splitlines()
            if line.startswith("| `--") and "P2PKV_" in line}
    assert set(rows) == {o.name for o in OPTIONS}
    for opt in OPTIONS:
        row = cells(rows[opt.name])
        assert row[0].startswith(f"`{opt.flag}`"), row
        assert row[1] == f"`{opt.env}`", row
        if opt.default in (None, ()):
            assert row[4] == "(none)", row
        elif isinstance(opt.default, bool):
            assert row[4] == f"`{str(opt.default).lower()}`", row
        else:
            assert row[4] == f"`{opt.default}`", row
        assert row[5] == opt.help, row


def test_checkpoint_identities_are_kept_for_a_bounded_number_of_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import p2pkv.identity.checkpoint as checkpoint

    hashed: list[str] = []

    def fake_identity(path: str) -> str:
        hashed.append(path)
        return f"identity of {path}"

    monkeypatch.setattr(checkpoint, "checkpoint_identity", fake_identity)
    paths = [str(tmp_path / f"model-{i}") for i in range(64)]
    for path in paths:
        settings = load({"model_path": path})
        assert settings.checkpoint() == f"identity of {path}"
        assert settings.checkpoint() == f"identity of {path}"  # kept: not hashed again
    assert hashed == paths
    # The most recent path is still kept; the first one was let go (the cache is bounded).
    load({"model_path": paths[-1]}).checkpoint()
    assert hashed == paths
    load({"model_path": paths[0]}).checkpoint()
    assert hashed == [*paths, paths[0]]


def test_checkpoint_identities_from_many_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import p2pkv.identity.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "checkpoint_identity", lambda path: f"identity of {path}")
    paths = [str(tmp_path / f"model-{i % 6}") for i in range(48)]
    got: list[Any] = []
    barrier = threading.Barrier(8)

    def worker(mine: list[str]) -> None:
        barrier.wait()
        got.extend((p, load({"model_path": p}).checkpoint()) for p in mine)

    threads = [threading.Thread(target=worker, args=(paths[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == sorted((p, f"identity of {p}") for p in paths)

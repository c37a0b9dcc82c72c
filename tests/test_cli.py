"""``p2pkv-node`` as operators run it: every subcommand in a subprocess, with timeouts.

Checks output and exit codes (0 ok, 2 bad configuration, 3 refused, 4 unreachable).
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from clitools import (
    MODEL,
    Probe,
    Serve,
    clean_env,
    config_error,
    finish,
    read_metrics,
    run,
    start,
)

from p2pkv.bench.ports import free_port
from p2pkv.cli import _show, refusal_table

ENTRY_POINT = Path(sys.executable).parent / "p2pkv-node"
HEX16 = re.compile(r"^[0-9a-f]{16}$")


# ----------------------------------------------------------------------- fingerprint


def test_fingerprint_text() -> None:
    r = run("fingerprint", "--model", "org/m", "--root", "/data/kv")
    assert r.returncode == 0, r.stderr
    fields = dict(line.split(":", 1) for line in r.stdout.splitlines())
    fp = fields["fingerprint"].strip()
    assert HEX16.match(fp)
    assert fields["namespace"].strip() == f"/data/kv/org_m_{fp[:12]}"
    run_config = json.loads(fields["run config"])
    assert run_config["model_name"] == "org/m"
    assert fields["layout"].strip() == "v2 (12 segment(s), 589824 bytes/block)"
    assert "12 layers x 12 KV heads" in fields["geometry"]


def test_fingerprint_json_is_the_digest_of_the_run_config() -> None:
    r = run("fingerprint", "--json", "--model", "org/m")
    assert r.returncode == 0, r.stderr
    ident = json.loads(r.stdout)
    canonical = json.dumps(ident["run_config"], sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    assert ident["fingerprint"] == digest[:16]
    assert ident["namespace"] == f"/kvcache/org_m_{digest[:12]}"
    assert ident["layout"] == "v2"
    assert ident["segments"] == [49152] * 12
    assert ident["bytes_per_block"] == 589824


@pytest.mark.skipif(not ENTRY_POINT.exists(), reason="p2pkv-node entry point not installed")
def test_entry_point_matches_module() -> None:
    via_entry = subprocess.run([str(ENTRY_POINT), "fingerprint", "--json", "--tp", "2"],
                               capture_output=True, text=True, timeout=60, env=clean_env())
    assert via_entry.returncode == 0, via_entry.stderr
    assert json.loads(via_entry.stdout) == json.loads(run("fingerprint", "--json", "--tp",
                                                          "2").stdout)


def _tp(*args: str, env: dict[str, str]) -> int:
    r = run("fingerprint", "--json", *args, env=env)
    assert r.returncode == 0, r.stderr
    tp: int = json.loads(r.stdout)["run_config"]["tp_size"]
    return tp


def test_precedence_flag_env_toml(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('[node]\ntp = 2\nmodel = "from/toml"\n')
    assert _tp("--config", str(toml), env=clean_env()) == 2
    assert _tp("--config", str(toml), env=clean_env(P2PKV_TP="3")) == 3
    assert _tp("--config", str(toml), "--tp", "4", env=clean_env(P2PKV_TP="3")) == 4
    # P2PKV_CONFIG names the file when --config is not given.
    r = run("fingerprint", "--json", env=clean_env(P2PKV_CONFIG=str(toml)))
    assert json.loads(r.stdout)["run_config"]["model_name"] == "from/toml"


def test_toml_node_table_and_top_level_agree(tmp_path: Path) -> None:
    (tmp_path / "table.toml").write_text('[node]\nmodel = "a/b"\nlayout = "v1"\n')
    (tmp_path / "top.toml").write_text('model = "a/b"\nlayout = "v1"\n')
    a = run("fingerprint", "--json", "--config", str(tmp_path / "table.toml"))
    b = run("fingerprint", "--json", "--config", str(tmp_path / "top.toml"))
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout) == json.loads(b.stdout)
    assert json.loads(a.stdout)["layout"] == "v1"


def test_unknown_toml_key_exits_2_naming_it(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('[node]\nmodel = "a"\npool_size = 3\n')
    line = config_error(run("fingerprint", "--config", str(toml)))
    assert "unknown option 'pool_size'" in line


@pytest.mark.parametrize(("args", "env", "expect"), [
    (["--tp", "0"], {}, "--tp: must be in [1, 4096], got 0"),
    ([], {"P2PKV_TP": "x"}, "--tp: must be an integer, got 'x' (from P2PKV_TP)"),
    (["--layout", "v3"], {}, "--layout: must be one of v1, v2, replicated"),
    (["--model-config", "/nonexistent"], {}, "--model-config: /nonexistent"),
    (["--preset", "nope"], {},
     "--preset: unknown geometry preset 'nope'; valid presets: deepseek-v2-lite, "
     "llama-3-70b, llama-3-8b, seed"),
    (["--layout", "replicated"], {}, "--layout replicated needs an MLA geometry"),
    (["--handshake-timeout", "-1"], {}, "--handshake-timeout: must be a positive number"),
])
def test_bad_values_exit_2_naming_the_option(args: list[str], env: dict[str, str],
                                             expect: str) -> None:
    line = config_error(run("fingerprint", *args, env=clean_env(**env)))
    assert expect in line


LLAMA_LIKE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_MLA_LIKE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "hidden_size": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "torch_dtype": "bfloat16",
}


def _ident(*args: str) -> dict[str, Any]:
    r = run("fingerprint", "--json", *args)
    assert r.returncode == 0, r.stderr
    ident: dict[str, Any] = json.loads(r.stdout)
    return ident


def test_model_config_llama_like(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_LIKE))
    seed = _ident()
    llama = _ident("--model-config", str(cfg))
    assert llama["geometry"].startswith("32 layers x 8 KV heads x 16 tokens x 256 values (K+V)")
    assert "bfloat16" in llama["geometry"]
    assert llama["bytes_per_block"] == 32 * 8 * 16 * 256 * 2
    assert llama["segments"] == [8 * 16 * 256 * 2] * 32
    assert llama["run_config"]["dtype"] == "bfloat16"
    assert len(llama["run_config"]["kv_cache_groups"][0]["layer_names"]) == 32
    assert llama["fingerprint"] != seed["fingerprint"]
    tp2 = _ident("--model-config", str(cfg), "--tp", "2")
    assert tp2["geometry"].startswith("32 layers x 4 KV heads")
    assert tp2["run_config"]["tp_size"] == 2
    assert tp2["fingerprint"] != llama["fingerprint"]


def test_model_config_deepseek_mla_like(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DEEPSEEK_MLA_LIKE))
    plain = _ident("--model-config", str(cfg), "--layout", "v1")
    assert plain["geometry"].startswith(
        "27 layers x 1 KV heads x 16 tokens x 576 values (MLA latent)")
    assert plain["bytes_per_block"] == 27 * 16 * 576 * 2
    replicated = _ident("--model-config", str(cfg), "--layout", "replicated")
    assert replicated["layout"] == "replicated"
    assert replicated["run_config"]["replicated_layout"] is True
    assert replicated["bytes_per_block"] == plain["bytes_per_block"]
    assert replicated["fingerprint"] != plain["fingerprint"]
    # Replicated MLA rows are the same on every TP rank: TP=2 and TP=4 share one identity.
    tp4 = _ident("--model-config", str(cfg), "--layout", "replicated", "--tp", "4")
    assert tp4["fingerprint"] == replicated["fingerprint"]


def test_model_config_broken_file_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text("{not json")
    assert "--model-config:" in config_error(run("fingerprint", "--model-config", str(cfg)))


# ----------------------------------------------------------------------- serve & probe


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One V2 node for the probe and metrics tests; configured from all three sources."""
    toml = tmp_path_factory.mktemp("serve") / "node.toml"
    toml.write_text("[node]\npool_blocks = 8\nhandshake_timeout = 5\n")
    node = Serve("--json", "--config", str(toml), "--metrics-port", "0",
                 env=clean_env(P2PKV_MODEL=MODEL))
    try:
        info = node.event()
        info["proc"] = node
        yield info
    finally:
        node.kill()


def test_serve_listening_line(server: dict[str, Any]) -> None:
    assert server["event"] == "listening"
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", server["address"])
    assert HEX16.match(server["fingerprint"])
    assert server["run_config"]["model_name"] == MODEL
    assert server["namespace"] == f"/kvcache/test_cli-model_{server['fingerprint'][:12]}"
    assert isinstance(server["metrics_port"], int) and server["metrics_port"] > 0
    # The same identity as `fingerprint` computes for the same configuration.
    assert _ident("--model", MODEL)["fingerprint"] == server["fingerprint"]



@pytest.fixture(scope="module")
def probes(server: dict[str, Any]) -> dict[str, Any]:
    """Four probes of the server run at once (each process pays for importing torch),
    with a metrics scrape before and after."""
    address = server["address"]
    before = read_metrics(server["metrics_port"])
    runs = {
        # P2PKV_LOG_LEVEL must apply (not only the --log-level flag).
        "ok": start("probe", address, "--model", MODEL, env=clean_env(P2PKV_LOG_LEVEL="info")),
        # A shared config or P2PKV_LISTEN names the serving node's (taken) port: the
        # probe only connects out and must not try to listen there.
        "ok_json": start("probe", address, "--model", MODEL, "--json",
                         env=clean_env(P2PKV_LISTEN=address)),
        "v1": start("probe", address, "--model", MODEL, "--layout", "v1"),
        "dtype_json": start("probe", address, "--model", MODEL, "--dtype", "bfloat16",
                            "--json"),
    }
    results: dict[str, Any] = {name: Probe(*finish(proc)) for name, proc in runs.items()}
    results["before"] = before
    return results


def test_probe_compatible(server: dict[str, Any], probes: dict[str, Any]) -> None:
    p = probes["ok"]
    assert p.code == 0, p.err
    assert p.out.startswith(f"COMPATIBLE with {server['address']}")
    assert f"fingerprint:  {server['fingerprint']}" in p.out
    assert json.dumps(server["run_config"], sort_keys=True) in p.out
    assert " INFO " in p.err  # from P2PKV_LOG_LEVEL=info


def test_probe_compatible_json(server: dict[str, Any], probes: dict[str, Any]) -> None:
    p = probes["ok_json"]
    assert p.code == 0, (p.out, p.err)
    info = json.loads(p.out)
    assert info["verdict"] == "compatible"
    assert info["fingerprint"] == server["fingerprint"]
    assert info["run_config"] == server["run_config"]
    assert info["remote_node"]
    assert " INFO " not in p.err  # the default level is warning


def test_probe_refused_v1_vs_v2_table(server: dict[str, Any], probes: dict[str, Any]) -> None:
    p = probes["v1"]
    assert p.code == 3, p.err
    lines = p.out.splitlines()
    assert lines[0] == f"REFUSED by handshake with {server['address']}"
    assert f"remote fingerprint: {server['fingerprint']}" in p.out
    header = next(i for i, line in enumerate(lines) if line.startswith("FIELD"))
    assert lines[header].split() == ["FIELD", "LOCAL", "REMOTE", "MEANING"]
    rows = {line.split()[0]: line for line in lines[header + 1:]}
    assert "run_config.parallel_agnostic" in rows
    assert "(absent)" in rows["run_config.parallel_agnostic"]
    assert "false" in rows["run_config.parallel_agnostic"]
    segments = rows["geometry.segments"]
    assert "[589824]" in segments
    assert "12 × 49152" in segments  # the 12-entry V2 list, compact and not cut off
    assert "same bytes per block, different byte order" in segments


def test_probe_refused_dtype_json(server: dict[str, Any], probes: dict[str, Any]) -> None:
    p = probes["dtype_json"]
    assert p.code == 3, p.err
    verdict = json.loads(p.out)
    assert verdict["verdict"] == "refused"
    assert verdict["remote"]["fp"] == server["fingerprint"]
    reasons = {r["field"]: r for r in verdict["reasons"]}
    assert reasons["run_config.dtype"]["local"] == "bfloat16"
    assert reasons["run_config.dtype"]["remote"] == "float16"
    assert reasons["run_config.dtype"]["meaning"]
    assert reasons["fingerprint"]["remote"] == server["fingerprint"]
    assert "run_config.parallel_agnostic" not in reasons


def test_probe_unreachable_exits_4() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    code, out, err = finish(start("probe", address, "--handshake-timeout", "1", "--json"))
    assert code == 4, (out, err)
    verdict = json.loads(out)
    assert verdict["verdict"] == "unreachable"
    assert verdict["address"] == address
    assert verdict["error"]


def test_probe_bad_address_exits_2() -> None:
    assert "ADDRESS" in config_error(run("probe", "http://127.0.0.1:80"))


def _wait_for(port: int, sample: str, above: float) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while True:
        metrics = read_metrics(port)
        if metrics.get(sample, 0.0) > above or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_metrics_scrape_changes_after_probes(server: dict[str, Any],
                                             probes: dict[str, Any]) -> None:
    port = server["metrics_port"]
    before = probes["before"]
    accepted = 'p2pkv_handshakes_total{reason="",result="accepted"}'
    assert accepted in before
    assert before["p2pkv_pool_capacity_blocks"] == 8
    assert before["p2pkv_pool_used_blocks"] == 0
    for name in ("p2pkv_lookups_total", "p2pkv_blocks_sent_total", "p2pkv_bytes_sent_total",
                 'p2pkv_peers_connected{direction="inbound"}'):
        assert name in before, name
    after = _wait_for(port, accepted, before[accepted] + 1)
    assert after[accepted] >= before[accepted] + 2  # the two compatible probes
    fp = 'p2pkv_handshakes_total{reason="fingerprint_mismatch",result="refused"}'
    after = _wait_for(port, fp, before.get(fp, 0.0) + 1)
    assert after[fp] >= before.get(fp, 0.0) + 2  # the two refused probes


def test_serve_peers_at_start_and_sigint(server: dict[str, Any]) -> None:
    dead = f"tcp://127.0.0.1:{free_port()}"
    node = Serve("--json", "--model", MODEL, "--pool-blocks", "4", "--handshake-timeout", "1",
                 "--peer", server["address"], "--peer", dead)
    try:
        listening = node.event()
        assert listening["event"] == "listening"
        assert listening["metrics_port"] is None
        assert listening["fingerprint"] == server["fingerprint"]
        ok, failed = node.event(), node.event()
        assert ok == {"event": "peer", "address": server["address"], "ok": True,
                      "remote": ok["remote"]}
        assert ok["remote"]
        assert failed["event"] == "peer" and failed["address"] == dead
        assert failed["ok"] is False and failed["error"]
        code, rest = node.stop(signal.SIGINT)
        assert code == 0, node.stderr()
        assert [json.loads(line)["event"] for line in rest] == ["stopping", "stopped"]
    finally:
        node.kill()


def test_serve_text_and_sigterm() -> None:
    node = Serve("--model", MODEL, "--pool-blocks", "4", "--layout", "v1")
    try:
        first = node.line()
        assert re.fullmatch(r"p2pkv-node listening on tcp://127\.0\.0\.1:\d+", first), first
        assert node.line().strip().startswith("fingerprint ")
        code, rest = node.stop(signal.SIGTERM)
        assert code == 0, node.stderr()
        assert rest[-2:] == ["shutting down", "stopped"]
    finally:
        node.kill()


@pytest.mark.parametrize(("args", "expect"), [
    (["--tp", "0"], "--tp:"),
    (["--listen", "nonsense"], "--listen:"),
    (["--curve-authorized", "/tmp"], "--curve-authorized: needs --curve-secret-key"),
])
def test_serve_bad_configuration_exits_2(args: list[str], expect: str) -> None:
    assert expect in config_error(run("serve", "--json", *args))


def test_serve_on_a_taken_port_exits_2(server: dict[str, Any],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (a subprocess would pay seconds for importing torch again).
    from p2pkv.cli import main

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert main(["serve", "--json", "--listen", server["address"]]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("p2pkv-node: error: --listen: cannot listen on")
    # Nothing was left behind: the signal handlers are the ones before.
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


# ----------------------------------------------------------------------- demo, keygen


def test_demo_text_and_json() -> None:
    text = start("demo", "--blocks", "8")
    as_json = start("demo", "--blocks", "8", "--json")
    code, out, err = finish(text, timeout=90)
    assert code == 0, err
    assert "fetched 8 blocks" in out and "in one fetch of" in out
    assert "over the data stream beside ZeroMQ" in out and "p2pkv-node bench" in out
    assert "0 corrupt" in out
    assert "REFUSED at handshake" in out
    assert "geometry.segments: local [589824] vs remote 12 × 49152" in out
    assert "run_config.parallel_agnostic: local (absent) vs remote false" in out
    assert out.rstrip().endswith("demo OK")
    code, out, err = finish(as_json, timeout=90)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["ok"] is True
    assert summary["compatible"]["blocks"] == 8
    assert summary["compatible"]["corrupt"] == 0
    assert summary["compatible"]["path"] == "tcp-data"
    assert summary["incompatible"]["event"] == "refused"
    fields = {r["field"] for r in summary["incompatible"]["reasons"]}
    assert {"run_config.parallel_agnostic", "geometry.segments"} <= fields
    assert summary["producer"]["blocks_sent"] == 8


def test_demo_bad_blocks_exits_2() -> None:
    assert "--blocks" in config_error(run("demo", "--blocks", "0"))


def test_keygen_writes_key_pair(tmp_path: Path) -> None:
    import zmq.auth

    r = run("keygen", str(tmp_path / "keys"), "--name", "alpha")
    assert r.returncode == 0, r.stderr
    public, secret = tmp_path / "keys" / "alpha.key", tmp_path / "keys" / "alpha.key_secret"
    assert str(public) in r.stdout and str(secret) in r.stdout
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = zmq.auth.load_certificate(str(secret))
    assert sec is not None and len(sec) == 40
    assert zmq.auth.load_certificate(str(public)) == (pub, None)
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    # An existing pair is never replaced: that would lock the node out of its peers.
    again = config_error(run("keygen", str(tmp_path / "keys"), "--name", "alpha"))
    assert "alpha.key" in again and "exists" in again
    assert zmq.auth.load_certificate(str(secret)) == (pub, sec)


# ----------------------------------------------------------------------- refusal table


@dataclass
class FakeReason:
    field: str
    ours: Any
    theirs: Any
    meaning: str


def test_show_compacts_int_lists() -> None:
    assert _show([49152] * 12) == "12 × 49152"
    assert _show([589824]) == "[589824]"
    assert _show([4096, 4096, 512]) == "[2 × 4096, 512]"
    assert _show([1, 2]) == "[1, 2]"
    assert _show(["a", "a"]) == '["a", "a"]'
    assert _show([True, True]) == "[true, true]"
    assert _show({"absent": True}) == "(absent)"
    assert _show("float16") == '"float16"'


def test_refusal_table_marks_cut_values() -> None:
    long_value = {"layer_names": [f"model.layers.{i}.attn" for i in range(40)]}
    table = refusal_table([
        FakeReason("geometry.segments", [589824], [49152] * 12, "layout differs"),
        FakeReason("run_config.kv_cache_groups", long_value, [], "groups differ"),
        FakeReason("run_config.kv_cache_groups[0].tokens_per_block", 32, 16, "sizes differ"),
    ])
    lines = table.splitlines()
    assert lines[0].split() == ["FIELD", "LOCAL", "REMOTE", "MEANING"]
    assert "12 × 49152" in lines[1]
    assert lines[1].endswith("layout differs")
    assert "…" in lines[2]
    assert lines[2].endswith("groups differ")
    # Field names are never cut.
    assert lines[3].startswith("run_config.kv_cache_groups[0].tokens_per_block  32 ")
    # Columns line up: every MEANING starts at the same offset.
    meanings = ["MEANING", "layout differs", "groups differ", "sizes differ"]
    assert len({line.rindex(m) for line, m in zip(lines, meanings, strict=True)}) == 1

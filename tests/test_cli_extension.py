"""``p2pkv-node`` and the identity extension: flags, TOML and environment, ``fingerprint
--json``, probes that show each differing extension field, MLA geometry from flags."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clitools import Probe, Serve, clean_env, config_error, finish, read_metrics, run, start

MODEL = "test/ext-model"
OVERRIDES = '{"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}'
OVERRIDES_CANONICAL = '{"rope_scaling":{"factor":8,"rope_type":"llama3"},"rope_theta":500000}'


def sha16(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ident(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = run("fingerprint", "--json", "--model", MODEL, *args, env=env)
    assert r.returncode == 0, r.stderr
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def test_fingerprint_json_prints_the_extension_and_its_digest() -> None:
    plain = ident()
    assert plain["extension"] == {} and plain["extension_digest"] == sha16("{}")
    declared = ident("--kv-memory-layout", "lbhnc", "--model-revision", "5f2b1c0",
                     "--model-overrides", OVERRIDES)
    ext = {"kv_memory_layout": "HND", "model_revision": "5f2b1c0",
           "model_overrides": sha16(OVERRIDES_CANONICAL)}
    assert declared["extension"] == ext
    assert declared["model_overrides_canonical"] == OVERRIDES_CANONICAL
    assert declared["extension_digest"] == sha16(
        json.dumps(ext, sort_keys=True, separators=(",", ":")))
    # Never part of the FileMapper identity: the namespace stays vLLM's.
    assert declared["fingerprint"] == plain["fingerprint"]
    assert declared["namespace"] == plain["namespace"]
    assert declared["identity_policy"] == "strict"


def test_extension_from_toml_and_environment(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('[node]\nmodel_revision = "5f2b1c0"\nidentity_policy = "lenient"\n'
                    "[node.model_overrides]\nrope_theta = 500000\n"
                    '[node.model_overrides.rope_scaling]\nrope_type = "llama3"\nfactor = 8\n')
    from_files = ident("--config", str(toml),
                       env=clean_env(P2PKV_KV_MEMORY_LAYOUT="HND"))
    from_flags = ident("--kv-memory-layout", "HND", "--model-revision", "5f2b1c0",
                       "--model-overrides", OVERRIDES, "--identity-policy", "lenient")
    for key in ("extension", "extension_digest", "identity_policy"):
        assert from_files[key] == from_flags[key], key


@pytest.mark.parametrize(("args", "flag"), [
    (["--model-overrides", "[1, 2]"], "--model-overrides: must be a JSON object"),
    (["--model-overrides", "{nope"], "--model-overrides: must be a JSON object, got invalid"),
    (["--model-overrides", '{"rope_theta": NaN}'], "--model-overrides:"),
    (["--kv-memory-layout", "N H D"], "--kv-memory-layout: kv_memory_layout must be"),
    (["--identity-policy", "loose"], "--identity-policy: must be one of strict, lenient"),
    (["--kv-kind", "gqa"], "--kv-kind: must be one of mha, mla"),
])
def test_bad_extension_values_exit_2_naming_the_option(args: list[str], flag: str) -> None:
    assert flag in config_error(run("fingerprint", *args))


def test_mla_geometry_from_flags_allows_the_replicated_layout() -> None:
    assert "--kv-kind mla" in config_error(run("fingerprint", "--layout", "replicated"))
    tp2 = ident("--layout", "replicated", "--kv-kind", "mla", "--layers", "4",
                "--head-dim", "576", "--tp", "2")
    assert tp2["geometry"].startswith("4 layers x 1 KV heads x 16 tokens x 576 values "
                                      "(MLA latent)")
    assert tp2["run_config"]["replicated_layout"] is True
    tp4 = ident("--layout", "replicated", "--kv-kind", "mla", "--layers", "4",
                "--head-dim", "576", "--tp", "4")
    assert tp4["fingerprint"] == tp2["fingerprint"]
    assert "--kv-heads" in config_error(run("fingerprint", "--kv-kind", "mla", "--kv-heads", "2"))


# ----------------------------------------------------------------------- serve & probe


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, Any]]:
    """A lenient node that declares its layout (HND) and weights revision."""
    node = Serve("--json", "--model", MODEL, "--pool-blocks", "4", "--metrics-port", "0",
                 "--kv-memory-layout", "HND", "--model-revision", "5f2b1c0",
                 "--identity-policy", "lenient")
    try:
        info = node.event()
        yield info
    finally:
        node.kill()


@pytest.fixture(scope="module")
def probes(server: dict[str, Any]) -> dict[str, Any]:
    address = server["address"]
    same = ["--kv-memory-layout", "HND", "--model-revision", "5f2b1c0"]
    runs = {
        "nhd": start("probe", address, "--model", MODEL, "--kv-memory-layout", "NHD",
                     "--model-revision", "5f2b1c0"),
        "nhd_json": start("probe", address, "--model", MODEL, "--json",
                          "--kv-memory-layout", "NHD", "--model-revision", "5f2b1c0"),
        "bare_strict": start("probe", address, "--model", MODEL),
        "bare_lenient_json": start("probe", address, "--model", MODEL, "--json",
                                   "--identity-policy", "lenient"),
        "same": start("probe", address, "--model", MODEL, *same),
    }
    return {name: Probe(*finish(proc)) for name, proc in runs.items()}


def test_serve_announces_its_extension(server: dict[str, Any]) -> None:
    assert server["extension"] == {"kv_memory_layout": "HND", "model_revision": "5f2b1c0"}
    assert server["identity_policy"] == "lenient"
    assert server["fingerprint"] == ident()["fingerprint"]


def _rows(out: str) -> dict[str, str]:
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("FIELD"))
    return {line.split()[0]: line for line in lines[header + 1:]}


def test_probe_nhd_vs_hnd_refused_by_the_extension_alone(server: dict[str, Any],
                                                         probes: dict[str, Any]) -> None:
    p = probes["nhd"]
    assert p.code == 3, (p.out, p.err)
    assert f"remote fingerprint: {server['fingerprint']}" in p.out
    assert f"local fingerprint:  {server['fingerprint']}" in p.out
    rows = _rows(p.out)
    assert list(rows) == ["ext.kv_memory_layout"]
    assert '"NHD"' in rows["ext.kv_memory_layout"] and '"HND"' in rows["ext.kv_memory_layout"]
    assert "ordered differently in memory" in rows["ext.kv_memory_layout"]


def test_probe_refusal_json_has_the_extension_on_both_sides(server: dict[str, Any],
                                                            probes: dict[str, Any]) -> None:
    p = probes["nhd_json"]
    assert p.code == 3, (p.out, p.err)
    verdict = json.loads(p.out)
    assert verdict["remote"]["ext"] == server["extension"]
    (reason,) = verdict["reasons"]
    assert (reason["field"], reason["code"], reason["local"], reason["remote"]) == (
        "ext.kv_memory_layout", 109, "NHD", "HND")


def test_probe_strict_refuses_a_node_that_declares_more(probes: dict[str, Any]) -> None:
    p = probes["bare_strict"]
    assert p.code == 3, (p.out, p.err)
    rows = _rows(p.out)
    assert list(rows) == ["ext.kv_memory_layout", "ext.model_revision"]
    assert "(absent)" in rows["ext.model_revision"]
    assert "identity_policy" in rows["ext.model_revision"]


def test_probe_lenient_accepts_and_shows_the_differences(server: dict[str, Any],
                                                         probes: dict[str, Any]) -> None:
    p = probes["bare_lenient_json"]
    assert p.code == 0, (p.out, p.err)
    info = json.loads(p.out)
    assert info["verdict"] == "compatible"
    assert info["extension"] == server["extension"]
    assert [(d["field"], d["local_absent"], d["remote"]) for d in
            info["extension_differences"]] == [
        ("ext.kv_memory_layout", True, "HND"), ("ext.model_revision", True, "5f2b1c0")]
    assert "identity_policy=lenient" in p.err  # logged as a warning
    metrics = read_metrics(server["metrics_port"])
    # The lenient server counted it too (the strict probe was refused by the probe itself).
    assert metrics['p2pkv_identity_undeclared_total{field="kv_memory_layout"}'] >= 1


def test_probe_equal_extensions_compatible(probes: dict[str, Any]) -> None:
    p = probes["same"]
    assert p.code == 0, (p.out, p.err)
    assert "extension:    kv_memory_layout=HND, model_revision=5f2b1c0" in p.out
    assert "differences" not in p.out

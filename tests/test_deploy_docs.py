"""docs/deploy.md cannot drift from the code: every block on the page is read and checked.

- The systemd unit's ``p2pkv-node serve`` command line goes through the CLI's own parser,
  and with the TOML file and the environment it names through ``load_settings``: an
  unknown flag, variable, key or a bad value fails here as it would on the host.
- The Kubernetes manifests: the ``--kv-transfer-config`` JSON names the connector, the
  spec and tier classes that exist, only tier options the tier takes, ``$(VAR)``s the
  container defines, Secrets the page defines (whose directory URLs parse), CURVE paths
  the Secret volume provides, the tier's port among the container's ports, and a grace
  period that covers the drain it describes.
- The scrape configurations pass ``promtool check config`` (when promtool is installed)
  and scrape the ports the recipes open.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

from p2pkv.cli import build_parser
from p2pkv.cluster.redis_urls import parse_directory_url
from p2pkv.settings import OPTIONS, load_settings

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "deploy.md"
ENVS = {o.env for o in OPTIONS} | {"P2PKV_CONFIG"}


def blocks(lang: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def tier_options() -> set[str]:
    """The tier's keys (TIER_OPTIONS, from the one table of options; the module imports
    nothing of vLLM)."""
    from p2pkv.integrations.vllm.options import TIER_OPTIONS

    return set(TIER_OPTIONS)


def unit_lines(ini: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in ini.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_systemd_unit_and_its_files_are_what_serve_accepts(tmp_path: Path) -> None:
    (toml_text,) = blocks("toml")
    unit_text, env_file_text, cluster_env_text = blocks("ini")
    unit = unit_lines(unit_text)
    toml = tomllib.loads(toml_text)
    known = {o.name for o in OPTIONS}
    assert set(toml) <= known, set(toml) - known
    env = dict(v.split("=", 1) for v in unit["Environment"])
    for key, value in unit_lines(env_file_text).items():  # the EnvironmentFile
        env[key] = value[0]
    assert set(unit_lines(cluster_env_text)) <= ENVS
    assert set(env) <= ENVS, set(env) - ENVS
    for name in ("P2PKV_DIRECTORY",):
        assert parse_directory_url(env[name]).kind == "sentinel"
    assert parse_directory_url(unit_lines(cluster_env_text)["P2PKV_DIRECTORY"][0]).kind == \
        "cluster"
    (exec_start,) = unit["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/p2pkv-node") and argv[1] == "serve"
    args = build_parser().parse_args(argv[1:])  # an unknown flag exits here
    config = tmp_path / "node.toml"
    config.write_text(toml_text)
    env["P2PKV_CONFIG"] = str(config)
    settings = load_settings({o.name: getattr(args, o.name, None) for o in OPTIONS},
                             environ=env)
    assert settings["metrics_port"] == 9400 and settings["metrics_host"] == "0.0.0.0"
    assert settings["directory"].startswith("redis+sentinel://")
    assert settings["data_port"] == 5602 and settings["listen"].endswith(":5601")
    # systemd waits longer than the drain it sends SIGTERM for.
    assert unit["KillSignal"] == ["SIGTERM"]
    assert float(unit["TimeoutStopSec"][0]) > settings["drain_timeout"] + 5
    text = DOC.read_text()
    for port in (5601, 5602, 9400):
        assert str(port) in text.split("Ports:", 1)[1].split("\n\n", 1)[0]


def _manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for text in blocks("yaml"):
        docs += [d for d in yaml.safe_load_all(text) if isinstance(d, dict) and "kind" in d]
    return docs


def test_the_kubernetes_recipe_names_what_exists() -> None:
    docs = _manifests()
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    (raw,) = [a for a in container["args"] if a.startswith("--kv-transfer-config=")]
    used = set(re.findall(r"\$\((\w+)\)", raw))
    assert used <= set(env), used - set(env)
    config = json.loads(re.sub(r"\$\((\w+)\)", r"\1", raw.split("=", 1)[1]))
    assert (config["kv_connector"], config["kv_connector_module_path"]) == (
        "P2PKVConnector", "p2pkv.integrations.vllm")
    connector = ROOT / "p2pkv" / "integrations" / "vllm" / "connector.py"
    assert "class P2PKVConnector(OffloadingConnector)" in connector.read_text()
    extra = config["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "P2PKVTieringSpec", "p2pkv.integrations.vllm")
    spec_source = (ROOT / "p2pkv" / "integrations" / "vllm" / "__init__.py").read_text()
    assert "P2PKVTieringSpec" in spec_source and "P2PKVTier" in spec_source
    (tier,) = extra["secondary_tiers"]
    assert (tier["type"], tier["module_path"]) == ("P2PKVTier", "p2pkv.integrations.vllm")
    options = set(tier) - {"type", "module_path"}
    assert options <= tier_options(), options - tier_options()

    # The directory URL comes from a Secret of the page, and parses.
    ref = env["P2PKV_DIRECTORY"]["valueFrom"]["secretKeyRef"]
    url = secrets[ref["name"]]["stringData"][ref["key"]]
    assert tier["directory"] == "P2PKV_DIRECTORY" and parse_directory_url(url).kind
    # The tier listens on a port the container declares, and advertises that port.
    port = int(tier["listen"].rsplit(":", 1)[1])
    assert port in {p["containerPort"] for p in container["ports"]}
    assert tier["advertise"] == f"tcp://POD_IP:{port}"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # CURVE files: under the Secret volume's mount, one of its items each.
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = secrets[volume["secret"]["secretName"]]
    files = {f"{mount['mountPath']}/{i['path']}" for i in volume["secret"]["items"]}
    assert {i["key"] for i in volume["secret"]["items"]} <= set(secret["stringData"])
    for key in ("curve_secret_key", "curve_server_key"):
        assert tier[key] in files, (key, tier[key], files)
    assert any(f.startswith(tier["curve_authorized"] + "/") for f in files)
    # The grace period covers what the tier waits at shutdown (fetch_timeout and
    # drain_grace for the loads, drain_timeout for the node), with room for vLLM.
    waits = tier["fetch_timeout"] + tier["drain_grace"] + tier["drain_timeout"]
    assert pod["terminationGracePeriodSeconds"] >= waits + 15
    # vLLM's port is the one the scrape configuration reaches.
    assert "--port=8000" in container["args"]
    assert {"name": "http", "containerPort": 8000} in container["ports"]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["targetPort"] == 8000
    (scrape,) = [t for t in blocks("yaml") if "scrape_configs" in t]
    jobs = {j["job_name"]: j for j in yaml.safe_load(scrape)["scrape_configs"]}
    (sd,) = jobs["vllm"]["dns_sd_configs"]
    assert sd["port"] == 8000 and sd["names"][0].startswith(service["metadata"]["name"] + ".")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed "
                    "(make prometheus)")
def test_the_scrape_configurations_pass_promtool(tmp_path: Path) -> None:
    texts = [t for t in blocks("yaml") if "scrape_configs" in t]
    texts.append((ROOT / "deploy" / "prometheus" / "scrape.yml").read_text())
    shutil.copy(ROOT / "deploy" / "prometheus" / "p2pkv-alerts.yml", tmp_path)
    for i, text in enumerate(texts):
        path = tmp_path / f"scrape{i}.yml"
        path.write_text(text)
        out = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        doc = yaml.safe_load(text)
        jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
        assert "p2pkv" in jobs  # what the alert rules match
        targets = jobs["p2pkv"]["static_configs"][0]["targets"]
        assert all(t.endswith(":9400") for t in targets)  # serve's --metrics-port above

"""The Kubernetes recipe's ``--kv-transfer-config`` under serving traffic, and a LoRA adapter
updated in place on one engine while requests are in flight.

Two ``vllm serve`` engines (``python -m vllm.entrypoints.openai.api_server``) run the
``--kv-transfer-config`` of docs/deploy.md's Deployment, read from the page. Only what a
pod gets from Kubernetes is filled in here: ``$(POD_IP)`` is 127.0.0.1,
``$(P2PKV_DIRECTORY)`` a private redis-server, the CURVE files a fleet key pair made by
``p2pkv-node keygen`` laid out as the Secret volume lays them out, the tier's port a free
one, and the primary region scaled to this machine. Peers find each other through the
directory only (the recipe lists none), and every byte between them is sealed.

Both engines serve the LoRA adapter ``ad`` from ``adapters/ad`` relative to a working
directory of their own (as two hosts hold the same path):

- a prompt computed on one engine is loaded by the other, with the same text, for the
  base model and under the adapter while both hold the same files;
- then one engine's files are replaced by the next version (other weights, equal sizes)
  and vLLM reloads them in place (``/v1/load_lora_adapter`` with ``load_inplace``: same
  name, id and path), while requests keep coming through nginx: none fails;
- after that, a prompt the other engine computed under the old version is not loaded by
  the updated one (vLLM's peer-source counter does not move), the tier counts the chunks
  it refused as ``adapter_mismatch``, and the updated engine answers with its new weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from loraadapters import write_adapter
from vllmenv import ROOT, VLLM_PY, serve, skip_without_vllm, smollm2

from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.clients import complete
from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster

skip_without_vllm()

pytestmark = pytest.mark.timeout(900)

NAME = "smollm2"
ADAPTER = "ad"
ADAPTER_PATH = "adapters/ad"
CPU_BYTES = 512 * 2**20
#: Tokens per chunk in the recipe (``block_size``), checked below.
CHUNK = 64


def recipe() -> tuple[str, dict[str, Any]]:
    """The Deployment's raw ``--kv-transfer-config=`` value, and its container."""
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    docs = [d for block in re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)
            for d in yaml.safe_load_all(block) if isinstance(d, dict)]
    (deployment,) = [d for d in docs if d.get("kind") == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (raw,) = [a for a in container["args"] if a.startswith("--kv-transfer-config=")]
    return raw.split("=", 1)[1], container


def recipe_config(pod_ip: str, directory: str, port: int, curve: Path) -> dict[str, Any]:
    """The recipe's configuration as a pod gets it, on this machine."""
    raw, container = recipe()
    values = {"POD_IP": pod_ip, "P2PKV_DIRECTORY": directory}
    unknown = set(re.findall(r"\$\((\w+)\)", raw)) - set(values)
    assert not unknown, f"the recipe uses variables this test does not set: {unknown}"
    config: dict[str, Any] = json.loads(
        re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], raw))
    extra = config["kv_connector_extra_config"]
    assert extra["block_size"] == CHUNK, extra["block_size"]
    extra["cpu_bytes_to_use"] = CPU_BYTES
    (tier,) = extra["secondary_tiers"]
    # The pod listens on every interface; here only loopback is used.
    assert tier["listen"].startswith("tcp://0.0.0.0:"), tier["listen"]
    recipe_port = tier["listen"].rsplit(":", 1)[1]
    assert tier["advertise"] == f"tcp://{pod_ip}:{recipe_port}", tier["advertise"]
    tier["listen"] = tier["advertise"] = f"tcp://{pod_ip}:{port}"
    # The CURVE paths sit under the Secret volume's mount: the same layout, here.
    (mount,) = container["volumeMounts"]
    for key in ("curve_secret_key", "curve_server_key", "curve_authorized"):
        assert tier[key].startswith(mount["mountPath"] + "/"), (key, tier[key])
        tier[key] = str(curve / tier[key][len(mount["mountPath"]) + 1:])
    assert "peers" not in tier, "the recipe finds peers through the directory"
    return config


def fleet_keys(where: Path) -> Path:
    """A fleet key pair from ``p2pkv-node keygen``, laid out as the recipe's Secret
    volume lays it out (``fleet.key_secret``, ``authorized/fleet.key``)."""
    made = where / "made"
    cli = shutil.which("p2pkv-node", path=str(Path(sys.executable).parent))
    assert cli, "p2pkv-node is not installed next to this Python"
    subprocess.run([cli, "keygen", str(made), "--name", "fleet"], check=True, timeout=60,
                   capture_output=True)
    mount = where / "curve"
    (mount / "authorized").mkdir(parents=True)
    shutil.copy(made / "fleet.key_secret", mount / "fleet.key_secret")
    shutil.copy(made / "fleet.key", mount / "authorized" / "fleet.key")
    return mount


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Each engine's working directory, with the same adapter files at ``adapters/ad``."""
    root = tmp_path_factory.mktemp("homes")
    made = []
    for i in range(2):
        write_adapter(root / f"home-{i}" / ADAPTER_PATH, seed=1)
        made.append(root / f"home-{i}")
    return made


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_redis_url: str,
            homes: list[Path]) -> Iterator[ServingCluster]:
    work = tmp_path_factory.mktemp("recipe")
    curve = fleet_keys(work)
    cores = sorted(os.sched_getaffinity(0))
    specs = [EngineSpec(
        f"engine-{i}", free_port(),
        recipe_config("127.0.0.1", module_redis_url, free_port(), curve),
        str(cores[i % len(cores)]) if len(cores) >= 2 else "nobind",
        args=("--enable-lora", "--max-lora-rank", "8",
              "--lora-modules", f"{ADAPTER}={ADAPTER_PATH}"),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, cwd=homes[i])
        for i in range(2)]
    made = ServingCluster(smollm2(), specs, work, served_name=NAME, max_model_len=2048,
                          python=str(VLLM_PY))
    yield from serve(made)


def peer_tokens(cluster: ServingCluster, name: str) -> float:
    return cluster.metrics(name).get(
        "vllm:prompt_tokens_cached_by_source_total{source=p2p}", 0.0)


def mismatched(cluster: ServingCluster, name: str) -> float:
    return cluster.metrics(name).get(
        "vllm:p2pkv_adapter_unshared_blocks_total{reason=adapter_mismatch}", 0.0)


def document(topic: str, n: int = 60) -> str:
    return (" ".join(f"Entry {i} of the {topic} ledger: crate {i * 7 % 31} holds {topic}."
                     for i in range(n)) + f" Which crate holds the most {topic}?")


def computed_then_loaded(cluster: ServingCluster, model_name: str, prompt: str,
                         first: str, second: str) -> tuple[str, str, float]:
    """``prompt`` on ``first``, then on ``second``: both texts, and the prompt tokens
    ``second`` took from a peer meanwhile."""
    before = peer_tokens(cluster, second)
    computed = complete(cluster.engine_url(first), model_name, prompt, 24)
    loaded = complete(cluster.engine_url(second), model_name, prompt, 24)
    return computed, loaded, peer_tokens(cluster, second) - before


def test_the_recipe_shares_through_the_directory_under_curve(
        cluster: ServingCluster) -> None:
    a, b = (s.name for s in cluster.specs)
    computed, loaded, took = computed_then_loaded(cluster, NAME, document("copper"), a, b)
    assert took >= 4 * CHUNK, "nothing was loaded from the peer"
    assert loaded == computed
    # vLLM publishes the tier's metrics with its step statistics: after the requests.
    for name in (a, b):
        metrics = cluster.metrics(name)
        assert metrics["vllm:p2pkv_directory_registered"] == 1, metrics
        # A counter is exported once it counts: absent is 0.
        assert metrics.get("vllm:p2pkv_directory_errors_total", 0) == 0, metrics
    assert cluster.metrics(b)["vllm:p2pkv_directory_hits_total"] >= took // CHUNK
    # a announced the chunks it was computing to Redis (pending-v1). (What an engine
    # announces or withdraws before its registration in Redis is done is dropped and
    # counted, change=dropped. The node registers as soon as it can, before the first
    # request in the runs here, but a slow weights digest can still make the first
    # request come first; its renewals every 0.25 s go through once it is registered.)
    announced = "vllm:p2pkv_directory_pending_keys_total{change=announced}"
    assert cluster.metrics(a).get(announced, 0) >= 1


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


class Traffic:
    """Requests through the balancer, one after another on a thread of its own, for the
    base model and the adapter in turn, until :meth:`stop`: the statuses it got."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: list[tuple[str, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            model_name = (NAME, ADAPTER)[n % 2]
            status, body = _post(self.url + "/v1/completions", {
                "model": model_name, "prompt": f"Request {n}: name a river in {n} words.",
                "max_tokens": 4, "temperature": 0})
            self.statuses.append((model_name, status, body[:200]))
            n += 1

    def stop(self, timeout: float = 180.0) -> list[tuple[str, int, str]]:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a request through the balancer hangs"
        return self.statuses


def test_an_adapter_updated_in_place_mid_run_is_never_loaded_across_versions(
        cluster: ServingCluster, homes: list[Path]) -> None:
    a, b = (s.name for s in cluster.specs)
    # The same files on both engines: a prompt under the adapter is shared.
    computed, loaded, took = computed_then_loaded(cluster, ADAPTER, document("amber"), b, a)
    assert took >= 4 * CHUNK, "the adapter's chunks were not shared between equal files"
    assert loaded == computed

    # The next version replaces a's files (other weights, equal sizes), and vLLM reloads
    # it in place while requests keep coming through the balancer.
    traffic = Traffic(cluster.url)
    try:
        write_adapter(homes[0] / ADAPTER_PATH, seed=2)
        status, body = _post(cluster.engine_url(a) + "/v1/load_lora_adapter", {
            "lora_name": ADAPTER, "lora_path": ADAPTER_PATH, "load_inplace": True})
        assert status == 200, body
        # A few requests after the reload as well.
        complete(cluster.engine_url(a), ADAPTER, "Name a mountain.", 4)
    finally:
        statuses = traffic.stop()
    assert len(statuses) >= 2 and {m for m, _, _ in statuses} == {NAME, ADAPTER}, statuses
    assert [s for s in statuses if s[1] != 200] == [], statuses

    # b computes a prompt under the old version; a, now on the new one, must not take it.
    before = mismatched(cluster, a)
    held, answered, took = computed_then_loaded(cluster, ADAPTER, document("tin"), b, a)
    assert took == 0, f"{took} prompt tokens were loaded across adapter versions"
    assert mismatched(cluster, a) - before >= 4, "the refused chunks were not counted"
    # The new weights answer: had a kept the old ones, the texts would be equal.
    assert answered != held
    log = cluster.log_tail(a, 400)
    assert "adapter_mismatch: adapter ad@" in log, log[-3000:]

"""docs/deploy.md's router recipe with real parts: two ``vllm serve`` engines that share
through p2pkv, and ``vllm-router`` with ``cache_aware`` in front.

The recipe's commands are read from the page. Each engine runs its ``vllm serve`` line
as ``python -m vllm.entrypoints.openai.api_server`` with the real SmolLM2 chat model and
its flags and ``--kv-transfer-config`` as written; only what differs on one machine is
replaced: the hosts by 127.0.0.1, the ports by free ones, and the primary region scaled
to this machine. The router runs with the recipe's policy and every flag of its line but
the addresses (its host, port, workers and Prometheus endpoint).

- The recipe's router line passes the router's own parser (an unknown flag fails here).
- A request through the router that lands on the engine that did not compute its prefix
  loads it from the other engine (vLLM counts the prompt tokens as cached from the
  ``p2p`` source) and answers as the engine that computed it. To make the router send
  it there, the engine that computed the prefix is kept busy with a long request routed
  through the router: ``cache_aware`` sends a prompt it has not seen to the engine with
  the fewest requests in flight.
- When the cluster stops, none of its processes is left.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from vllmenv import ROOT, VLLM_PY, serve, skip_without_vllm, smollm2

from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.balancers import VllmRouter
from p2pkv.bench.serving.clients import complete
from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster

skip_without_vllm()

pytestmark = pytest.mark.timeout(900)

NAME = "smollm2"
CPU_BYTES = 512 * 2**20
PEER_TOKENS = "vllm:prompt_tokens_cached_by_source_total{source=p2p}"
#: The router's flags that name addresses of the recipe's hosts: the cluster sets them.
ADDRESS_FLAGS = {"--host": 1, "--port": 1, "--prometheus-host": 1, "--prometheus-port": 1}


def recipe_commands(block: int = 0) -> list[list[str]]:
    """The commands of an ``sh`` block of deploy.md's router section (the first: the
    recipe; the second: kv_aware), each as argv: continuation lines joined, a quoted
    argument over several lines kept whole, comments dropped."""
    text = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    section = text.split("## vLLM's router in front", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) > block, "deploy.md's router section lost an sh block"
    commands: list[list[str]] = []
    pending = ""
    for line in blocks[block].replace("\\\n", " ").splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        try:
            commands.append(shlex.split(pending))
        except ValueError:  # a quote still open: the command goes on
            continue
        pending = ""
    assert not pending, f"an unfinished command: {pending!r}"
    return commands


def engines_and_router() -> tuple[list[list[str]], list[str]]:
    commands = recipe_commands()
    engines = [c for c in commands if c[1:3] == ["vllm", "serve"]]
    (router,) = [c for c in commands if c[0] == "vllm-router"]
    assert len(engines) == 2 and all(c[0] == "PYTHONHASHSEED=0" for c in engines), engines
    return engines, router


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def engine_parts(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """An engine line's ``--kv-transfer-config`` and its other flags (not the model nor
    the port: the cluster sets those)."""
    rest = argv[4:]  # PYTHONHASHSEED=0 vllm serve MODEL
    config: dict[str, Any] = json.loads(flag(rest, "--kv-transfer-config"))
    skip = {rest.index(f) + k for f in ("--kv-transfer-config", "--port") for k in (0, 1)}
    return config, [a for i, a in enumerate(rest) if i not in skip]


def router_parts(argv: list[str]) -> tuple[str, list[str]]:
    """The router line's policy, and its flags but the policy, workers and addresses."""
    out, i = [], 1
    while i < len(argv):
        if argv[i] == "--worker-urls":
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        elif argv[i] in ADDRESS_FLAGS or argv[i] == "--policy":
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return flag(argv, "--policy"), out


def router_parse(argv: list[str]) -> dict[str, Any]:
    """``argv`` (a ``vllm-router`` command line) through the router's own parser and
    checks: an unknown flag or value fails here."""
    code = ("import json, sys; from vllm_router.launch_router import parse_router_args; "
            "a = parse_router_args(sys.argv[1:]); a._validate_router_args(); "
            "print(json.dumps({k: a.__dict__[k] for k in ('policy', 'worker_urls', "
            "'kv_event_source', 'kv_event_block_size')}))")
    done = subprocess.run([str(VLLM_PY), "-c", code, *argv[1:]], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    parsed: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return parsed


def test_the_recipe_is_what_the_router_and_the_engines_take() -> None:
    engines, router = engines_and_router()
    parsed = router_parse(router)
    assert parsed["policy"] == "cache_aware"
    hosts = []
    for argv in engines:
        config, rest = engine_parts(argv)
        # What cache_aware needs of every engine: the prompt's tokens.
        assert VllmRouter("cache_aware").engine_args() == ("--enable-scale-out",)
        assert "--enable-scale-out" in rest
        (tier,) = config["kv_connector_extra_config"]["secondary_tiers"]
        hosts.append(tier["peers"])
    # Each engine's peer is the other engine, and the router's workers are both.
    assert hosts == [["tcp://engine-b:5601"], ["tcp://engine-a:5601"]]
    workers = [f"http://engine-{h}:{flag(e, '--port')}"
               for h, e in zip("ab", engines, strict=True)]
    assert parsed["worker_urls"] == workers
    # kv_aware: one event source per worker, named as --worker-urls names it, and the
    # block size the engines' lines set.
    (additions, kv_router) = [c for c in recipe_commands(1)
                              if c[0] in ("--block-size", "vllm-router")]
    kv = router_parse(kv_router)
    assert kv["policy"] == "kv_aware" and kv["worker_urls"] == workers
    assert [s.split("=", 1)[0] for s in kv["kv_event_source"]] == workers
    assert kv["kv_event_block_size"] == int(flag(additions, "--block-size"))
    events = json.loads(flag(additions, "--kv-events-config"))
    port = events["endpoint"].rsplit(":", 1)[1]
    assert events["endpoint"] == f"tcp://*:{port}"
    assert all(s.endswith(f":{port}") for s in kv["kv_event_source"])


def engine_config(recipe: dict[str, Any], listen: str, peers: list[str]) -> dict[str, Any]:
    config = json.loads(json.dumps(recipe))
    extra = config["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = CPU_BYTES
    (tier,) = extra["secondary_tiers"]
    tier["listen"], tier["peers"] = listen, peers
    return config


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingCluster]:
    engines, router = engines_and_router()
    tiers = [f"tcp://127.0.0.1:{free_port()}" for _ in engines]
    cores = sorted(os.sched_getaffinity(0))
    specs = []
    for i, argv in enumerate(engines):
        recipe, rest = engine_parts(argv)
        specs.append(EngineSpec(
            f"engine-{'ab'[i]}", free_port(), engine_config(recipe, tiers[i], [tiers[1 - i]]),
            str(cores[i % len(cores)]) if len(cores) >= 2 else "nobind", args=rest))
    policy, args = router_parts(router)
    made = ServingCluster(smollm2(), specs, tmp_path_factory.mktemp("router"),
                          served_name=NAME, max_model_len=2048,
                          balancer=VllmRouter(policy, args), python=str(VLLM_PY))
    yield from serve(made)


class LongRequest:
    """One long completion through the router, on a thread of its own."""

    def __init__(self, url: str, max_tokens: int = 600) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, max_tokens),
                                        name="long-request", daemon=True)
        self._thread.start()

    def _run(self, url: str, max_tokens: int) -> None:
        try:
            complete(url, NAME, "Count from one to two hundred in words.", max_tokens)
        except BaseException as exc:  # reported by join()
            self.error = exc

    def in_flight(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float = 300.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the long request did not end"
        assert self.error is None, self.error


def pantry_prompt() -> str:
    return (" ".join(f"Line {i} of the pantry list: jar {i % 9} holds {w}." for i, w in
                     enumerate(["rice", "beans", "flour", "salt"] * 15))
            + " Which jar holds the most rice?")


def test_a_request_the_router_sends_to_the_other_engine_loads_from_the_peer(
        cluster: ServingCluster) -> None:
    names = [s.name for s in cluster.specs]
    # A long request through the router: the engine it lands on ("busy") keeps one in
    # flight while the rest of the test runs.
    before = cluster.requests_per_engine()
    long = LongRequest(cluster.url)
    try:
        deadline = time.monotonic() + 30
        while (after := cluster.requests_per_engine()) == before:
            assert time.monotonic() < deadline, "the router did not route the long request"
            time.sleep(0.2)
        (busy,) = [n for n in names if after[n] > before[n]]
        (idle,) = [n for n in names if n != busy]
        # The busy engine computes a prompt the router has not seen (asked directly).
        prompt = pantry_prompt()
        computed = complete(cluster.engine_url(busy), NAME, prompt, 24)
        peer_before = cluster.metrics(idle).get(PEER_TOKENS, 0.0)
        # Through the router: a prompt it has not seen goes to the engine with fewer
        # requests in flight, the idle one, which holds none of it; its peer does.
        loaded = complete(cluster.url, NAME, prompt, 24)
        routed = cluster.requests_per_engine()
        assert long.in_flight(), "the long request ended before the routed one: make it " \
            "longer, or the busy engine was not busy"
    finally:
        long.join()
    assert routed[idle] == after[idle] + 1, (after, routed)
    assert cluster.metrics(idle).get(PEER_TOKENS, 0.0) - peer_before >= 256, \
        "the idle engine did not load the prompt from its peer"
    assert loaded == computed

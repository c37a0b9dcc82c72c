"""p2pkv under serving traffic: two ``vllm serve`` engines behind nginx, driven by vLLM's
own benchmark client.

The engines run the README's ``--kv-transfer-config``, read from the README itself (only
the addresses, the primary region scaled to this machine, ``pending_wait``, see
:data:`PENDING_WAIT`, and the load policy, off, are replaced), each as
``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs), the real
SmolLM2 chat model, each bound to its own core. nginx balances them round-robin.

- ``vllm bench serve`` sends 16 ``prefix_repetition`` requests (4 prefixes of 512 tokens)
  at concurrency 4 through the balancer: none fails, both engines answer, and the engines
  load prompt tokens from each other (vLLM counts them as cached from the ``p2p``
  source; p2pkv counts the loaded chunks).
- One request at a time, a prompt nobody holds is computed by one engine and then loaded
  by the other: the greedy texts are equal (the first engine's is the no-sharing answer,
  since nothing was loaded for it).
- A long prompt nobody holds, sent to one engine and, once that engine announced its
  prefill (pending-v1), to the other: the second waits for the first and loads the
  prefix instead of computing it beside it, and both answer alike.
- The same with the first engine killed in the middle of its prefill: the second
  computes the prompt itself within the heartbeat deadline, and its request succeeds.
- When the cluster stops, none of its processes is left.

The full comparison (no sharing, the offloading connector alone, vLLM's ``fs`` tier,
one engine, p2pkv) is ``python -m p2pkv.bench.serving``; docs/serving.md has a sitting.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllmenv import ROOT, VLLM_PY, serve, skip_without_vllm, smollm2

from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.clients import BenchWorkload, complete, run_vllm_bench
from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster

skip_without_vllm()

pytestmark = pytest.mark.timeout(900)

NAME = "smollm2"
#: The primary region per engine here (the README says 8 GiB, sized for a GPU host).
CPU_BYTES = 512 * 2**20
#: How long a request here waits for a prefix its peer is computing (the default is
#: 10 s): a margin for a slow machine, where the holder's prefill of the long prompt
#: below takes several seconds on one core.
PENDING_WAIT = 30.0


def readme_kv_transfer_config() -> dict[str, Any]:
    """The JSON of the README's ``vllm serve ... --kv-transfer-config '...'`` line."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"--kv-transfer-config '(\{.*?\})'", text, re.S)
    assert m, "the README has no vllm serve --kv-transfer-config line"
    config: dict[str, Any] = json.loads(m.group(1))
    return config


def engine_config(readme: dict[str, Any], listen: str, peers: list[str]) -> dict[str, Any]:
    config = json.loads(json.dumps(readme))
    extra = config["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = CPU_BYTES
    (tier,) = extra["secondary_tiers"]
    assert set(tier) >= {"listen", "peers"}, tier
    tier["listen"], tier["peers"] = listen, peers
    tier["pending_wait"] = PENDING_WAIT
    # The engines share this machine's two cores with each other and the bench: a fetch
    # measured while both compute can be slow enough that the load policy recomputes
    # what a test below asserts is loaded. The policy has tests of its own
    # (test_loadpolicy.py, test_vllm.py's throttled link); here every hit is loaded.
    tier["load_policy"] = False
    return config


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServingCluster]:
    readme = readme_kv_transfer_config()
    tiers = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    cores = sorted(os.sched_getaffinity(0))
    specs = [EngineSpec(f"engine-{i}", free_port(),
                        engine_config(readme, tiers[i], [tiers[1 - i]]),
                        str(cores[i % len(cores)]) if len(cores) >= 2 else "nobind")
             for i in range(2)]
    made = ServingCluster(smollm2(), specs, tmp_path_factory.mktemp("serving"),
                          served_name=NAME, max_model_len=2048, python=str(VLLM_PY))
    yield from serve(made)


def peer_tokens(cluster: ServingCluster, name: str) -> float:
    return cluster.metrics(name).get(
        "vllm:prompt_tokens_cached_by_source_total{source=p2p}", 0.0)


def test_bench_serve_through_the_balancer_loads_from_the_peer(
        cluster: ServingCluster, tmp_path: Path) -> None:
    workload = BenchWorkload(prefix_len=512, suffix_len=64, num_prefixes=4, num_prompts=16,
                             output_len=8, concurrency=4)
    result = run_vllm_bench(cluster.url, NAME, smollm2(), workload, tmp_path, "p2pkv",
                            timeout=600, python=str(VLLM_PY))
    assert result["failed"] == 0, [e for e in result["errors"] if e]
    assert result["completed"] == 16
    # Round-robin: both engines answered.
    upstreams = {r["upstreams"][-1] for r in cluster.balancer_requests()}
    assert len(upstreams) == 2, upstreams
    loaded = {s.name: cluster.metrics(s.name) for s in cluster.specs}
    from_peer = sum(m.get("vllm:prompt_tokens_cached_by_source_total{source=p2p}", 0.0)
                    for m in loaded.values())
    chunks = sum(v for m in loaded.values() for k, v in m.items()
                 if k.startswith("vllm:p2pkv_loaded_blocks"))
    assert from_peer >= 512 and chunks >= 8, (from_peer, chunks)


def test_one_at_a_time_a_loaded_prompt_answers_as_the_one_that_computed_it(
        cluster: ServingCluster) -> None:
    first, second = (cluster.engine_url(s.name) for s in cluster.specs)
    prompts = [" ".join(f"Item {i} of list {n}: the {w} is on the table." for i in range(60))
               + f" Summarize list {n} in one sentence."
               for n, w in ((1, "lamp"), (2, "kettle"))]
    for n, prompt in enumerate(prompts):
        a, b = (first, second) if n % 2 == 0 else (second, first)
        b_name = cluster.specs[1].name if n % 2 == 0 else cluster.specs[0].name
        before = peer_tokens(cluster, b_name)
        computed = complete(a, NAME, prompt, 24)
        loaded = complete(b, NAME, prompt, 24)
        assert peer_tokens(cluster, b_name) - before >= 256, "nothing was loaded"
        assert loaded == computed


#: vLLM's counters (``_total`` in the Prometheus text) of the tier's lookups that waited
#: for a prefix a peer is computing, and of the chunks an engine announced as computing.
PENDING_STEPS = "vllm:p2pkv_lookup_steps_total{outcome=pending}"
ANNOUNCED = "vllm:p2pkv_pending_announced_blocks_total"
PAUSED = "vllm:p2pkv_idle_pause_seconds_total"
#: Scheduler steps a second at most, while an engine's only request waits for a prefix
#: a peer computes. vLLM's loop does not pause (about 170 steps a second here, each
#: re-asking the same answer); the tier's pause holds it near 1 / lookup_wait (20).
WAITING_STEPS_PER_S = 60


def long_prompt(tag: str) -> str:
    """About 1,500 tokens nobody holds: a prefill of seconds on one core."""
    return (" ".join(f"Entry {i} of ledger {tag}: the {w} went to shelf {i % 7}." for i, w in
                     enumerate(["cup", "map", "key", "pen"] * 20))
            + f" Which shelf holds the most keys in ledger {tag}?")


class Completion:
    """One completion on a thread of its own, timed."""

    def __init__(self, url: str, prompt: str) -> None:
        self.text: str | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, args=(url, prompt), daemon=True)
        self._thread.start()

    def _run(self, url: str, prompt: str) -> None:
        started = time.monotonic()
        try:
            self.text = complete(url, NAME, prompt, 8, timeout=120)
        except BaseException as exc:  # reported by result()
            self.error = exc
        self.seconds = time.monotonic() - started

    def result(self, timeout: float = 150.0) -> str:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the completion did not end"
        assert self.error is None and self.text is not None, self.error
        return self.text


@pytest.fixture(scope="module")
def prefill_seconds(cluster: ServingCluster) -> float:
    """Each engine computes a long prompt of its own (so both have measured their
    prefill rate at this length): the longer of the two times."""
    runs = [Completion(cluster.engine_url(s.name), long_prompt(f"warm-{s.name}"))
            for s in cluster.specs]
    for run in runs:
        run.result()
    return max(run.seconds for run in runs)


def one_prompt_to_both(cluster: ServingCluster, tag: str, prefill_seconds: float
                       ) -> tuple[str, str, dict[str, dict[str, float]], Completion,
                                  Completion]:
    """A long prompt nobody holds to the first engine, and the same prompt to the second
    a third of the way into the first one's prefill: the engines' names, their metrics
    before, and the two completions under way. vLLM publishes a step's counters when
    the step ends, so the first engine's announcement cannot be seen before its prefill
    is over: the second request is timed instead. Asked a third of the way in, waiting
    is shorter than computing (the load policy's rule); asked at the very start, the two
    would be level."""
    (a, b) = (s.name for s in cluster.specs)
    before = {n: cluster.metrics(n) for n in (a, b)}
    prompt = long_prompt(tag)
    first = Completion(cluster.engine_url(a), prompt)
    time.sleep(0.3 * prefill_seconds)
    return a, b, before, first, Completion(cluster.engine_url(b), prompt)


def test_a_prefix_a_peer_is_computing_is_waited_for_and_loaded(
        cluster: ServingCluster, prefill_seconds: float) -> None:
    """The second engine finds the prefix pending on the first (pending-v1), waits
    instead of computing it beside the first engine, and loads what the first stored."""
    a, b, before, first, second = one_prompt_to_both(cluster, "north", prefill_seconds)
    computed, loaded = first.result(), second.result()
    after = cluster.metrics(b)
    assert loaded == computed
    assert cluster.metrics(a).get(ANNOUNCED, 0.0) > before[a].get(ANNOUNCED, 0.0)
    waiting_steps = after.get(PENDING_STEPS, 0.0) - before[b].get(PENDING_STEPS, 0.0)
    assert waiting_steps > 0, cluster.log_tail(b)
    # While it waited, its scheduler slept instead of spinning.
    assert waiting_steps < WAITING_STEPS_PER_S * second.seconds, (waiting_steps,
                                                                 second.seconds)
    assert after.get(PAUSED, 0.0) > before[b].get(PAUSED, 0.0)
    # Nothing of the prompt was held when the second engine asked: what it loaded, it
    # waited for (the prompt is 25 chunks).
    assert peer_tokens(cluster, b) - before[b].get(
        "vllm:prompt_tokens_cached_by_source_total{source=p2p}", 0.0) >= 1024, \
        cluster.log_tail(b)


def test_a_holder_killed_mid_prefill_leaves_its_waiter_to_compute(
        cluster: ServingCluster, prefill_seconds: float) -> None:
    """Runs last in this module: it kills the first engine (the cluster is stopped after
    it). The waiter notices the holder gone within the heartbeat deadline and computes
    the prompt itself; its request succeeds."""
    a, b, before, first, second = one_prompt_to_both(cluster, "south", prefill_seconds)
    time.sleep(min(1.0, 0.1 * prefill_seconds))  # the second engine asked, and waits
    killed = time.monotonic()
    cluster.kill(a)
    second.result()
    after = cluster.metrics(b)
    assert peer_tokens(cluster, b) == before[b].get(
        "vllm:prompt_tokens_cached_by_source_total{source=p2p}", 0.0)
    # Its own prefill (a few seconds on one core) plus the heartbeat deadline, at most.
    assert time.monotonic() - killed < 30, cluster.log_tail(b)
    assert first.error is not None  # the killed engine's request failed, not the waiter's
    assert after.get(PENDING_STEPS, 0.0) > before[b].get(PENDING_STEPS, 0.0), \
        cluster.log_tail(b)

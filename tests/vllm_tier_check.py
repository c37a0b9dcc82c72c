"""Drive two P2PKVTier objects the way vLLM's tiering manager does (used by test_vllm.py).

Run with the vLLM environment's Python. No engine: two tiers over scratch primary
regions in this process, built from vLLM's own ``TieringOffloadingSpec``, each with its
own p2pkv node on 127.0.0.1. It plays the scheduler's calls (on_new_request, lookup until
it stops answering RETRY, on_schedule_end, submit_store/submit_load,
get_finished_jobs) and prints one JSON line per check for the test to assert on.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
from internals import request_adapter, start_tier_node

os.environ.setdefault("PYTHONHASHSEED", "0")


def free_address() -> str:
    from p2pkv.bench.ports import free_port

    return f"tcp://127.0.0.1:{free_port()}"


def lora_handover(spec: Any, view: Any, vllm_config: Any,
                  free_address: Any) -> dict[str, Any]:
    """A tier of a LoRA-enabled engine built outside p2pkv's connector (as vLLM's plain
    OffloadingConnector builds it, under a current config) says at start that requests
    under adapters are not shared; one built inside P2PKVConnector's constructor is
    registered with it and says nothing."""
    import logging
    from dataclasses import replace

    from vllm.config import LoRAConfig, set_current_vllm_config

    from p2pkv.integrations.vllm import P2PKVTier
    from p2pkv.integrations.vllm.connector import ConnectorContext, _building

    lora_config = replace(vllm_config, lora_config=LoRAConfig(max_lora_rank=8))
    records: list[str] = []

    here = threading.get_ident()

    class Keep(logging.Handler):
        """What the tiers built here say at start (not what other tiers' threads log
        meanwhile, such as a peer they cannot reach yet)."""

        def emit(self, record: logging.LogRecord) -> None:
            if record.thread == here:
                records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("vllm.p2pkv").addHandler(handler)
    try:
        with set_current_vllm_config(lora_config):
            plain = P2PKVTier(spec, view, "P2PKVTier", listen=free_address())
        plain_warnings = list(records)
        records.clear()
        context = ConnectorContext(lora_config)
        with _building(context):
            told = P2PKVTier(spec, view, "P2PKVTier", listen=free_address())
        told.begin_request("r1", None)
        result = {"plain_lora": plain.identity.lora_enabled, "plain_warnings": plain_warnings,
                  "connector_warnings": list(records),
                  "registered": [t is told for t in context.tiers],
                  "base_request_state": request_adapter(told, "r1"),
                  "untold_request_state": request_adapter(told, "r2")}
        plain.shutdown()
        told.shutdown()
        return result
    finally:
        logging.getLogger("vllm.p2pkv").removeHandler(handler)


def canonical_checks() -> dict[str, Any]:
    """What the CPU copy worker does with ``canonical_layout``: it takes a page whose
    canonical form is the page itself (MLA's latent rows: one run over the whole page,
    one writer, or several under a replicated layout) and refuses, naming why, a page
    vLLM could not certify or one whose heads are split across ranks."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        CanonicalPageMapping,
        CopyRun,
    )

    from p2pkv.integrations.vllm.spec import _canonical_is_direct

    page = 4096

    def caches(mapping: Any) -> Any:
        tensor = CanonicalKVCacheTensor(torch.zeros(4, page, dtype=torch.int8), page)
        return CanonicalKVCaches([tensor], [[CanonicalKVCacheRef(0, page, mapping)]])

    def mla(writers: int, index: int = 0) -> Any:
        return CanonicalPageMapping(page, page, (CopyRun(0, 0, page, 1, page, page),),
                                    writers, index, True)

    half = page // 2
    split = CanonicalPageMapping(2 * page, page, (CopyRun(0, half, half, 2, half, page),),
                                 1, 0, True)
    out: dict[str, Any] = {}
    for name, mapping, replicated in (("mla tp1", mla(1), False),
                                      ("mla tp2 replicated", mla(2, 1), True),
                                      ("mla tp2 not replicated", mla(2, 1), False),
                                      ("uncertified", None, False),
                                      ("heads split", split, False)):
        try:
            out[name] = _canonical_is_direct(caches(mapping), replicated=replicated)
        except RuntimeError as exc:
            out[name] = f"RuntimeError: {exc}"
    return out


def lookup_rules() -> dict[str, Any]:
    """The rules of the tier's lookups (lookups.py), with asks that answer when told:
    an arrival ask answered in the step it is asked, a wait bounded per step for all
    requests together, keys met later asked at the end of the step, a failed load never
    promised again, a failed ask a miss."""
    import threading

    from p2pkv.integrations.vllm.lookups import RequestLookups

    gates: dict[str, threading.Event] = {}
    asked: list[tuple[str, list[bytes], bool]] = []

    def ask(req_id: str, keys: list[bytes], first: bool) -> list[bool]:
        asked.append((req_id, keys, first))
        gate = gates.get(req_id)
        if gate is not None:
            gate.wait(10)
        if req_id == "broken":
            raise RuntimeError("peer answered garbage")
        return [k.startswith(b"held") for k in keys]

    out: dict[str, Any] = {}
    held, cold, later = b"held-1", b"cold-1", b"held-later"
    # The ask came back within the wait: answered in the first call.
    lookups = RequestLookups(ask, wait=2.0)
    lookups.begin("r1", [held, cold])
    started = time.monotonic()
    out["arrival"] = [lookups.lookup("r1", k, lambda: False) for k in (held, cold)]
    out["arrival_seconds"] = time.monotonic() - started
    # A key the arrival ask did not cover: RETRY, asked at the step's end, answered next.
    out["later_first_step"] = lookups.lookup("r1", later, lambda: False)
    lookups.flush()
    deadline = time.monotonic() + 10
    while lookups.lookup("r1", later, lambda: False) is None and time.monotonic() < deadline:
        lookups.flush()
        time.sleep(0.01)
    out["later_next_step"] = lookups.lookup("r1", later, lambda: False)
    out["asked"] = [[r, [k.decode() for k in keys], first] for r, keys, first in asked]
    # The load of a key answered HIT failed: MISS from now on.
    lookups.mark_miss([held])
    out["after_failed_load"] = lookups.lookup("r1", held, lambda: False)
    lookups.flush()
    out["steps"] = lookups.take_counts().steps
    # Two slow asks in one step: the scheduler waits at most `wait` for both together.
    slow = RequestLookups(ask, wait=0.2)
    gates["s1"], gates["s2"] = threading.Event(), threading.Event()
    slow.begin("s1", [held])
    slow.begin("s2", [held])
    started = time.monotonic()
    out["slow"] = [slow.lookup("s1", held, lambda: True), slow.lookup("s2", held, lambda: True)]
    out["slow_seconds"] = time.monotonic() - started
    gates["s1"].set()
    gates["s2"].set()
    slow.flush()
    deadline = time.monotonic() + 10
    while slow.lookup("s1", held, lambda: True) is None and time.monotonic() < deadline:
        slow.flush()
    out["slow_next_step"] = slow.lookup("s1", held, lambda: True)
    slow.flush()
    out["slow_steps"] = slow.take_counts().steps
    # wait 0: never blocks the scheduler.
    never = RequestLookups(ask, wait=0.0)
    gates["n1"] = threading.Event()
    never.begin("n1", [held])
    out["no_wait"] = never.lookup("n1", held, lambda: True)
    gates["n1"].set()
    # A failed ask: misses.
    lookups.begin("broken", [held])
    out["broken"] = lookups.lookup("broken", held, lambda: True)
    # A finished request is forgotten: its keys are asked anew.
    lookups.finished("r1")
    asked.clear()
    lookups.lookup("r1", held, lambda: True)
    lookups.flush()
    out["asked_after_finish"] = len(asked) > 0 or lookups.lookup("r1", held, lambda: True) \
        is not None
    for m in (lookups, slow, never):
        m.shutdown()
    return out


def pending_checks(a: Any, b: Any, row: int, raw_a: bytearray,
                   wait_finished: Any, announced: Any = lambda keys: None) -> dict[str, Any]:
    """pending-v1 between two tiers: a prefix A computes (scheduled, not stored yet) is
    waited for by B (RETRY, not MISS) and loaded once A stores it; withdrawn, or on A's
    own engine, the wait ends in a MISS; the first request of a prefix never waits.
    ``announced(keys)`` returns once A's announcement of ``keys`` reached where B asks
    (through a directory it is written by A's registration's thread)."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    def prompt(tag: int) -> tuple[list[bytes], list[bytes]]:
        keys = [bytes([tag, i]) * 16 + (0).to_bytes(4, "big") for i in range(3)]
        return keys, [h for k in keys for h in (b"\x03" * 32, k[:-4])]

    def scan(tier: Any, req: Any, keys: list[bytes]) -> list[str]:
        """As vLLM's scheduler asks: in order, on past RETRY, stopping at the first MISS."""
        answers = []
        for k in keys:
            answers.append(tier.lookup(k, req).name)
            if answers[-1] == "MISS":
                break
        return answers

    def start(tier: Any, req_id: str, tag: int) -> tuple[Any, list[bytes], list[str]]:
        keys, hashes = prompt(tag)
        tier.begin_request(req_id, None, hashes)
        req = ReqContext(req_id=req_id)
        tier.on_new_request(req)
        return req, keys, scan(tier, req, keys)

    def settle(tier: Any, req: Any, keys: list[bytes], limit: float = 15.0) -> list[str]:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            answers = scan(tier, req, keys)
            if "RETRY" not in answers:
                return answers
            tier.on_schedule_end(ScheduleEndContext((), ()))
            time.sleep(0.02)
        return ["RETRY"]

    def computing(id_a: str, id_b: str, tag: int) -> tuple[Any, list[bytes], Any, list[str]]:
        """A schedules a prompt nobody holds (and announces it), then B meets it: A's
        request, the keys, B's request and B's first answers."""
        req_a, keys, _ = start(a, id_a, tag)
        a.on_schedule_end(ScheduleEndContext((id_a,), ()))
        announced(keys)
        req_b, _, answers = start(b, id_b, tag)
        return req_a, keys, req_b, answers

    out: dict[str, Any] = {}
    # A is first: nobody holds or computes the prefix, so it computes it (MISS).
    req_a, keys, out["first"] = start(a, "pa", 7)
    a.on_schedule_end(ScheduleEndContext(("pa",), ()))
    announced(keys)
    # B meets it while A computes it: RETRY, not MISS.
    req_b, _, out["while_computing"] = start(b, "pb", 7)
    b.on_schedule_end(ScheduleEndContext((), ()))
    # A stores it: B's next ask finds it held, and loads it.
    for cid in range(3):
        raw_a[cid * row:(cid + 1) * row] = bytes([cid + 40]) * row
    a.submit_store(TransferJob(50, keys, np.arange(3), False, req_a))
    out["stored"] = wait_finished(a, 50).success
    started = time.monotonic()
    out["after_store"] = settle(b, req_b, keys)
    out["waited_s"] = time.monotonic() - started
    a.on_request_finished(req_a)
    b.on_request_finished(req_b)
    # A stores the chunks of one prefill in any order: B, waiting, keeps waiting for the
    # whole run (held or not yet), not only for the first chunk still missing.
    req_a, keys, req_b, _ = computing("pk", "pl", 13)
    a.submit_store(TransferJob(53, [keys[0], keys[2]], np.array([0, 2]), False, req_a))
    wait_finished(a, 53)
    deadline = time.monotonic() + 10
    while (answers := scan(b, req_b, keys)) == ["RETRY"] * 3 and time.monotonic() < deadline:
        b.on_schedule_end(ScheduleEndContext((), ()))
        time.sleep(0.05)
    out["out_of_order"] = answers
    a.submit_store(TransferJob(54, [keys[1]], np.array([1]), False, req_a))
    wait_finished(a, 54)
    out["out_of_order_after"] = settle(b, req_b, keys)
    a.on_request_finished(req_a)
    b.on_request_finished(req_b)
    # Withdrawn: A's request is preempted before storing; B stops waiting and computes.
    req_a, keys, req_b, out["withdrawn_before"] = computing("pc", "pd", 8)
    a.on_schedule_end(ScheduleEndContext((), ("pc",)))
    started = time.monotonic()
    out["withdrawn_after"] = settle(b, req_b, keys)
    out["withdrawn_s"] = time.monotonic() - started
    a.on_request_finished(req_a)
    b.on_request_finished(req_b)
    # vLLM finishes a request before its chunks reach the tier: they stay announced a
    # moment longer, and B, still waiting, loads them once they arrive.
    req_a, keys, req_b, _ = computing("pg", "ph", 11)
    a.on_request_finished(req_a)
    out["finished_before_store"] = scan(b, req_b, keys)
    a.submit_store(TransferJob(52, keys, np.arange(3), False, req_a))
    out["finished_stored"] = wait_finished(a, 52).success
    out["finished_after_store"] = settle(b, req_b, keys)
    b.on_request_finished(req_b)
    # Finished without storing: withdrawn once the grace is over.
    req_a, keys, req_b, _ = computing("pi", "pj", 12)
    a.on_request_finished(req_a)
    started = time.monotonic()
    out["finished_unstored"] = settle(b, req_b, keys)
    out["finished_unstored_s"] = time.monotonic() - started
    b.on_request_finished(req_b)
    # The holder dies while B waits: B computes within a lookup's deadline.
    req_a, keys, req_b, out["dying_before"] = computing("pe", "pf", 10)
    a.shutdown()  # (the caller's cleanup shuts it down again: a no-op)
    started = time.monotonic()
    out["dying_after"] = settle(b, req_b, keys)
    out["dying_s"] = time.monotonic() - started
    # The same engine: B computes a prefix for one request; another waits for it, and
    # computes nothing twice; once stored (here: vLLM's own cache has it), MISS.
    req_1, keys, _ = start(b, "l1", 9)
    b.on_schedule_end(ScheduleEndContext(("l1",), ()))
    req_2, _, out["local_before"] = start(b, "l2", 9)
    b.submit_store(TransferJob(51, keys, np.arange(3), False, req_1))
    wait_finished(b, 51)
    out["local_after"] = settle(b, req_2, keys)
    for req in (req_1, req_2):
        b.on_request_finished(req)
    out["decisions"] = sorted(f"{k}={v}" for k, v in b.get_stats().reduce().items()
                              if "load_decisions" in str(k) or "lookup_steps" in str(k))
    return out


def directory_pending(spec: Any, vllm_config: Any, region: Any, row: int,
                      wait_finished: Any, static: dict[str, Any]) -> dict[str, Any]:
    """The pending checks again, with two tiers that find each other only through a Redis
    directory (no peers): the same answers as between static peers, or an
    AssertionError that shows both."""
    from redisprocs import LocalRedis, find_redis_server
    from vllm.config import set_current_vllm_config

    from p2pkv.integrations.vllm import P2PKVTier

    if find_redis_server() is None:
        return {"skipped": "redis-server is not installed"}
    server = LocalRedis().start()
    tiers: list[Any] = []
    try:
        raw_a, view_a = region()
        _raw_b, view_b = region()
        with set_current_vllm_config(vllm_config):
            for view in (view_a, view_b):
                tiers.append(P2PKVTier(spec, view, "P2PKVTier", listen=free_address(),
                                       model_revision="r1", lookup_timeout=2.0,
                                       directory=server.url))
        for tier in tiers:
            assert tier.identity.wait(60) and start_tier_node(tier, 60) is not None
            assert tier.cluster.wait_registered(15), "not registered"
        cluster_b = tiers[1].cluster

        def announced(keys: list[bytes]) -> None:
            deadline = time.monotonic() + 10
            while not all(cluster_b.lookup_prefix(keys).due or [0.0]):
                assert time.monotonic() < deadline, "announcements not written in 10 s"
                time.sleep(0.01)

        out = pending_checks(*tiers, row, raw_a, wait_finished, announced)
        stats_a, stats_b = (t.cluster.stats() for t in tiers)
        out["through"] = {"lookups_b": stats_b.lookups, "announced_a": stats_a.pending_announced,
                          "withdrawn_a": stats_a.pending_withdrawn,
                          "announced_b": stats_b.pending_announced}
    finally:
        for tier in reversed(tiers):
            tier.drain_jobs()
            tier.shutdown()
        server.close()
    same = ("first", "while_computing", "stored", "after_store", "out_of_order",
            "out_of_order_after", "withdrawn_before", "withdrawn_after",
            "finished_before_store", "finished_stored", "finished_after_store",
            "finished_unstored", "dying_before", "dying_after", "local_before",
            "local_after")
    differ = {k: (static.get(k), out.get(k)) for k in same if static.get(k) != out.get(k)}
    assert not differ and out["waited_s"] < 2.0 and out["dying_s"] < 3.0, (differ, out)
    through = out["through"]  # A's chunks went through Redis, and so did B's lookups
    assert through["lookups_b"] > 0 and through["announced_a"] >= 9, out
    assert through["withdrawn_a"] >= 3 and through["announced_b"] >= 3, out
    return out


def main() -> int:
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.base import TransferJob
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from p2pkv.bench.tinymodel import write_tiny_llama
    from p2pkv.errors import ConfigError
    from p2pkv.integrations.vllm import P2PKVTier

    scratch = tempfile.mkdtemp(prefix="p2pkv-tier-check-")
    model_dir = os.path.join(scratch, "model")
    write_tiny_llama(model_dir)
    init_none_hash(sha256)  # what the engine core does once its scheduler exists
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(64, ("model.layers.0.self_attn.attn",), 0),),
        worker_kv_bytes_per_block=8192, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 1 << 20}, engine_id="tier-check",
        model=OffloadingModelConfig(name="org/m", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=64, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
    )
    spec = TieringOffloadingSpec(config)
    row = spec.kv_bytes_per_chunk
    chunks = 8

    def region() -> tuple[bytearray, memoryview]:
        raw = bytearray(chunks * row)
        return raw, memoryview(raw).cast("B", shape=[chunks, row])

    def wait_finished(tier: P2PKVTier, job_id: int, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for result in tier.get_finished_jobs():
                if result.job_id == job_id:
                    return result
            time.sleep(0.01)
        raise AssertionError(f"job {job_id} did not finish within {timeout}s")

    def look(tier: P2PKVTier, keys: list[bytes], req: ReqContext) -> list[str]:
        """Ask until no key answers RETRY, ending each round as a scheduler step does."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            answers = [tier.lookup(k, req) for k in keys]
            if LookupResult.RETRY not in answers:
                return [a.name for a in answers]
            tier.on_schedule_end(ScheduleEndContext((), ()))
            time.sleep(0.01)
        raise AssertionError("lookups kept answering RETRY")

    def report(check: str, **fields: Any) -> None:
        print(json.dumps({"check": check, **fields}), flush=True)

    addr_a, addr_b, addr_c = free_address(), free_address(), free_address()
    raw_a, view_a = region()
    raw_b, view_b = region()
    _raw_c, view_c = region()
    shm = "--shm" in sys.argv  # same-host engines: the pool in shared memory
    # One-sided NIXL reads (nixl-v1): the node's option, nothing else to set.
    nixl = {"nixl": "on"} if "--nixl" in sys.argv else {}

    def refused_at_start(model: str | None = None, **params: Any) -> str:
        """The error a tier gives at start (with ``model``: under another checkpoint)."""
        try:
            if model is None:
                P2PKVTier(spec, view_c, "P2PKVTier", listen=free_address(), **params)
            else:
                other = VllmConfig(model_config=ModelConfig(
                    model=model_dir, skip_tokenizer_init=True, dtype="float32"))
                other.model_config.model = model
                with set_current_vllm_config(other):
                    P2PKVTier(spec, view_c, "P2PKVTier", listen=free_address(), **params)
        except ConfigError as exc:
            return str(exc)
        return "(started)"

    # No engine configuration anywhere yet: the tier cannot see the engine, so it
    # refuses to start. Then it gets one, as the offloading connector holds it when it
    # builds its tiers, and derives its identity from it and from the checkpoint.
    unreachable = refused_at_start()
    vllm_config = VllmConfig(model_config=ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float32"))
    no_weights = os.path.join(scratch, "no-weights")
    os.makedirs(no_weights)
    shutil.copy(os.path.join(model_dir, "config.json"), no_weights)
    dangling = os.path.join(scratch, "dangling")
    os.makedirs(dangling)
    os.symlink(os.path.join(scratch, "gone.safetensors"),
               os.path.join(dangling, "model.safetensors"))
    errors = {"unreachable": unreachable, "no weights": refused_at_start(no_weights),
              "unreadable": refused_at_start(dangling),
              "missing": refused_at_start(os.path.join(scratch, "nowhere")),
              "bad peer": refused_at_start(peers=[5])}
    with set_current_vllm_config(vllm_config):
        errors["curve key"] = refused_at_start(
            model_dir, curve_secret_key=os.path.join(scratch, "no-such.key_secret"))
        errors["layout declared"] = refused_at_start(model_dir, kv_memory_layout="NHD")
        errors["overrides declared"] = refused_at_start(
            model_dir, model_overrides={"rope_theta": 10000.0})
        a = P2PKVTier(spec, view_a, "P2PKVTier", listen=addr_a, model_revision="r1", shm=shm,
                      **nixl)
        b = P2PKVTier(spec, view_b, "P2PKVTier", listen=addr_b, peers=[addr_a],
                      model_revision="r1", lookup_timeout=2.0, shm=shm, **nixl)
        c = P2PKVTier(spec, view_c, "P2PKVTier", listen=addr_c, peers=[addr_a],
                      model_revision="r2", lookup_timeout=2.0)
    report("identity_errors", **errors)
    report("lora_handover", **lora_handover(spec, view_c, vllm_config, free_address))
    report("canonical", **canonical_checks())
    report("lookup_rules", **lookup_rules())
    # Until its weights digest is known a tier shares nothing (lookups miss); the
    # checks below start once it is.
    for tier in (a, b, c):
        assert tier.identity.wait(60), "the weights digest took over 60 s"
    # No request yet: each node starts by itself, and B reaches A (C, of another
    # revision, is refused), so that the first request finds them running and connected.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            all(t.node is not None for t in (a, b, c))
            and b.stats()["peers"][addr_a]["connected"] and c.stats()["handshakes_refused"]):
        time.sleep(0.05)
    report("started", nodes=[t.node is not None for t in (a, b, c)],
           b_to_a=b.stats()["peers"][addr_a], c_refused=c.stats()["handshakes_refused"],
           hooks=b.stats()["hooks"])
    try:
        # A stores four chunks out of its primary region (random bytes per chunk).
        rng = np.random.default_rng(0)
        keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(1, 5)]
        for cid in range(4):
            raw_a[cid * row:(cid + 1) * row] = rng.bytes(row)
        req_a = ReqContext(req_id="a")
        a.on_new_request(req_a)
        a.submit_store(TransferJob(1, keys, np.arange(4), False, req_a))
        stored = wait_finished(a, 1)
        # The store job ended: vLLM may now reuse those primary slots. Overwrite them;
        # what A serves must be what it stored, not the region's new content.
        original = bytes(raw_a[:4 * row])
        raw_a[:4 * row] = bytes(4 * row)
        report("store", success=stored.success, stats=a.stats()["node"].store.used,
               extension=a.stats()["extension"], identity=a.stats()["identity"],
               hooks=a.stats()["hooks"])

        req_b = ReqContext(req_id="b")
        b.on_new_request(req_b)
        absent = b"\x77" * 32 + (0).to_bytes(4, "big")
        answers = look(b, [*keys, absent], req_b)
        report("lookup", answers=answers)

        # B loads the four chunks into primary slots 4..7 (not the same slots as A).
        b.submit_load(TransferJob(2, keys, np.arange(4, 8), True, req_b))
        loaded = wait_finished(b, 2)
        node_b = b.node
        assert node_b is not None
        report("load", success=loaded.success, successful_keys=loaded.successful_keys,
               equal=bytes(raw_b[4 * row:8 * row]) == original,
               transfer_bytes=loaded.transfer_bytes,
               data_path=[p.data_path for p in node_b.peers()],
               received_shm=node_b.stats().blocks_received_shm,
               received_nixl=node_b.stats().paths["nixl"].blocks_received)

        # A load of a key nobody said it holds fails that key only.
        b.submit_load(TransferJob(3, [keys[0], absent], np.array([0, 1]), True, req_b))
        partial = wait_finished(b, 3)
        report("partial", success=partial.success,
               successful=[k.hex()[:8] for k in partial.successful_keys or ()],
               equal=bytes(raw_b[:row]) == original[:row])
        b.on_request_finished(req_b)

        # C declares another model revision: refused on both sides, reasons in stats().
        req_c = ReqContext(req_id="c")
        c.on_new_request(req_c)
        answers_c = look(c, keys, req_c)
        deadline = time.monotonic() + 10
        while not c.stats()["handshakes_refused"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats_c = c.stats()
        metrics_c = c.get_stats()
        metrics_a = a.get_stats()
        report("refused", answers=answers_c, refusals=stats_c["handshakes_refused"],
               peer=stats_c["peers"][addr_a],
               metrics=sorted(str(k) for k in metrics_c.reduce()),
               server_metrics=sorted(str(k) for k in metrics_a.reduce()))
        report("metrics", b=sorted(f"{k}={v}" for k, v in b.get_stats().reduce().items()),
               policy=b.stats()["load_policy"], address_a=addr_a)

        # Under P2PKVConnector the tier hears of a request when it arrives, with its
        # block hashes (two per chunk here): its first lookups answer at once.
        hashes = [h for k in keys for h in (b"\x01" * 32, k[:-4])]
        b.begin_request("e", None, [*hashes, b"\x02" * 32, absent[:-4]])
        req_e = ReqContext(req_id="e")
        b.on_new_request(req_e)
        first_step = [b.lookup(k, req_e).name for k in [*keys, absent]]
        b.on_schedule_end(ScheduleEndContext((), ()))
        b.on_request_finished(req_e)
        report("early", first_step=first_step,
               metrics=sorted(f"{k}={v}" for k, v in b.get_stats().reduce().items()
                              if "lookup_steps" in str(k)))
        static = pending_checks(a, b, row, raw_a, wait_finished)
        report("pending", **static)
        report("pending_directory", **directory_pending(spec, vllm_config, region, row,
                                                        wait_finished, static))
    finally:
        for tier in (c, b, a):
            tier.drain_jobs()
            tier.shutdown()
    report("shutdown", has_pending=[t.has_pending_work() for t in (a, b, c)])
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

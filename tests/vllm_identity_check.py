"""Compare P2PKVTier's identity with the installed vLLM's FileMapper (used by test_vllm.py).

Run with the vLLM environment's Python. For several offloading configurations it builds
vLLM's own ``TieringOffloadingSpec`` and ``FileMapper.from_offloading_spec`` (with the
options vLLM's P2P tier uses) next to a ``P2PKVTier`` over a scratch primary region, and
prints one JSON line per case with both run configs and both digests. It also prints the
errors the tier raises for bad tier options.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import replace
from typing import Any


def main() -> int:

    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from p2pkv.bench.tinymodel import write_tiny_llama
    from p2pkv.integrations.vllm import P2PKVTier

    # The tier derives the rest of its identity from the engine's configuration and
    # checkpoint, which the offloading connector holds while it builds its tiers.
    scratch = tempfile.mkdtemp(prefix="p2pkv-identity-check-")
    write_tiny_llama(os.path.join(scratch, "model"))
    engine = VllmConfig(model_config=ModelConfig(
        model=os.path.join(scratch, "model"), skip_tokenizer_init=True, dtype="float32"))
    with set_current_vllm_config(engine):
        check(P2PKVTier)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def check(tier_class: Any) -> None:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    P2PKVTier = tier_class

    base = OffloadingConfig(
        groups=(OffloadingGroupConfig(64, ("model.layers.0.self_attn.attn",
                                           "model.layers.1.self_attn.attn"), 0),),
        worker_kv_bytes_per_block=32768,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 16 << 20},
        engine_id="identity-check",
        model=OffloadingModelConfig(name="org/tiny-llama", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
        kv_cache_layout="NHD",
    )
    two_groups = (OffloadingGroupConfig(32, ("a.0", "a.1"), 0),
                  OffloadingGroupConfig(64, ("b.0",), 1))
    tp4 = replace(base.parallel, rank=3, world_size=4, tp_size=4)
    cases: dict[str, OffloadingConfig] = {
        "plain": base,
        "agnostic": replace(base, parallel=replace(base.parallel, is_parallelism_agnostic=True)),
        "tp4 specific": replace(base, parallel=tp4),
        "tp4 agnostic": replace(base, parallel=replace(tp4, is_parallelism_agnostic=True)),
        "replicated tp4": replace(base, parallel=tp4, replicated_layout=True),
        "two groups, bf16": replace(base, groups=two_groups,
                                    model=OffloadingModelConfig("m/n", "bfloat16")),
        "4 blocks per chunk": replace(base, cache=OffloadingCacheConfig(16, 4)),
    }
    for name, config in cases.items():
        spec = TieringOffloadingSpec(config)
        mapper = FileMapper.from_offloading_spec(root_dir="", offloading_spec=spec,
                                                 blocks_per_file=spec.blocks_per_chunk,
                                                 parallel_agnostic=True)
        row = spec.kv_bytes_per_chunk
        region = memoryview(bytearray(4 * row)).cast("B", shape=[4, row])
        tier = P2PKVTier(spec, region, "P2PKVTier", listen="tcp://127.0.0.1:0")
        print(json.dumps({
            "case": name,
            "vllm_run_config": mapper.get_run_config(),
            "vllm_namespace_digest": mapper.base_path.rsplit("_", 1)[1],
            "p2pkv_run_config": tier.run_config.get_run_config(),
            "p2pkv_digest": tier.run_config.digest,
            "p2pkv_fingerprint": tier.fingerprint,
        }))
        tier.shutdown()

    spec = TieringOffloadingSpec(base)
    row = spec.kv_bytes_per_chunk
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    bad: dict[str, dict[str, Any]] = {
        "unknown option": {"lisen": "tcp://127.0.0.1:0"},
        "identity option": {"model": "other"},
        "peers not a list": {"peers": "tcp://127.0.0.1:1"},
        "bad peer address": {"peers": ["127.0.0.1:5601"]},
        "negative timeout": {"lookup_timeout": -1},
        "load policy not a flag": {"load_policy": "yes"},
        "zero speedup": {"load_min_speedup": 0},
        "nine data streams": {"data_streams": 9},
        "negative lookup wait": {"lookup_wait": -0.1},
        "pending wait not a number": {"pending_wait": "10s"},
        "unknown encryption": {"data_encryption": "rot13"},
        "listen taken": {"listen": f"tcp://127.0.0.1:{taken.getsockname()[1]}"},
    }
    for name, params in bad.items():
        region = memoryview(bytearray(4 * row)).cast("B", shape=[4, row])
        try:
            P2PKVTier(spec, region, "P2PKVTier", **params).shutdown()
            error = None
        except Exception as exc:  # the test checks the type and the message
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"bad": name, "error": error}))


if __name__ == "__main__":
    sys.exit(main())

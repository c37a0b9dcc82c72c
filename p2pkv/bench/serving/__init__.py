"""Serving traffic: ``vllm serve`` engines behind nginx, driven by vLLM's own benchmark
client, each configuration side by side on the same requests.

Run it with the vLLM environment (``make vllm-env real-model`` builds it and the model)::

    .venv-vllm/bin/python -m p2pkv.bench.serving [--configs none,offload,p2pkv,fs,single]
        [--engines 2] [--model .models/smollm2] [--json out.json] [--plot out.png]

Every configuration (see :mod:`p2pkv.bench.serving.configs`) starts fresh engines, runs
the same two workloads, collects each engine's counters, and stops everything:

1. ``vllm bench serve``'s ``prefix_repetition`` workload against the balancer;
2. multi-turn conversations whose every turn goes to another engine than the last.

The table compares TTFT (p50, p99), ITL, request and output-token throughput, failed
requests, prompt tokens served from another tier by source, and, for every
configuration, the share of greedy texts that differ from the ``none`` run of the same
requests. ``--repeat-none`` runs ``none`` twice to measure how often two runs without any
sharing differ (CPU batching can change fp32 results).
"""

from __future__ import annotations

from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster, ServingStartError

__all__ = ["EngineSpec", "ServingCluster", "ServingStartError"]

"""Serving traffic: ``vllm serve`` engines behind a load balancer (nginx round-robin, or
vLLM's router with one of its policies), driven by vLLM's own benchmark client, each
configuration side by side on the same requests.

Run it with the vLLM environment (``make vllm-env real-model`` builds it and the model)::

    .venv-vllm/bin/python -m p2pkv.bench.serving [--configs none,offload,p2pkv,fs,single]
        [--balancer nginx,router:cache_aware] [--prefix-skew 1.2 --prefix-len 960]
        [--engines 2] [--model .models/smollm2] [--json out.json] [--plot out.png]

Every configuration (see :mod:`p2pkv.bench.serving.configs`) behind every balancer (see
:mod:`p2pkv.bench.serving.balancers`) starts fresh engines, runs the same two workloads,
collects each engine's counters, and stops everything:

1. ``vllm bench serve``'s shared-prefix workload against the balancer:
   ``prefix_repetition``, or with ``--prefix-skew`` a few hot prefixes taking most
   requests (:mod:`p2pkv.bench.serving.skew`);
2. multi-turn conversations: behind nginx every turn goes to another engine than the
   last; behind vLLM's router every turn goes through the router.

The table compares TTFT (p50, p99), ITL, request and output-token throughput, failed
requests, prompt tokens served from another tier by source, and, for every
configuration, the share of greedy texts that differ from the ``none`` run of the same
requests. ``--repeat-none`` runs ``none`` twice to measure how often two runs without any
sharing differ (CPU batching can change fp32 results).
"""

from __future__ import annotations

from p2pkv.bench.serving.balancers import Balancer, parse_balancer
from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster, ServingStartError

__all__ = ["Balancer", "EngineSpec", "ServingCluster", "ServingStartError", "parse_balancer"]

"""The configurations the serving benchmark compares, as the engines they start.

- ``none``: no KV connector; each engine has its own prefix cache only.
- ``offload``: vLLM's offloading connector with the same CPU primary region as ``p2pkv``
  and no secondary tier (so a gain of ``p2pkv`` over it is the peers', not the region's).
- ``p2pkv``: p2pkv's connector (the offloading connector that hands the tier each
  request's adapter) with the p2pkv tier; peers given by address.
- ``fs``: the offloading connector with vLLM's own ``fs`` tier on one directory every
  engine reads and writes (what a user would set up instead of peer sharing). The
  directory is a local one: on engines that are processes of one host, a page-cache
  copy; on emulated hosts (:mod:`p2pkv.bench.hosts`) it is what no two real hosts
  could share, and stands as the one-host ceiling of ``fs``.
- ``fs-net``: the same tier on a directory of a real network filesystem (GlusterFS,
  :mod:`~p2pkv.bench.serving.glusterfs`) that every engine host mounts over its own
  link: what ``fs`` is across hosts. Only on emulated hosts.
- ``single``: one engine that gets all the traffic, with every core (the locality
  ceiling: every repeat of a prefix finds it in that engine's own cache).

Engines split the machine's cores between them (``VLLM_CPU_OMP_THREADS_BIND``), so every
configuration computes with the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pkv.bench.hosts import Host
from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.cluster import EngineSpec

__all__ = ["CONFIGS", "OFFLOAD_BLOCK_TOKENS", "core_sets", "engine_specs", "offloading_config",
           "parse_tier_option", "tier_options"]

CONFIGS = ("none", "offload", "p2pkv", "fs", "fs-net", "single")
#: Tokens per offloaded chunk (vLLM's block size is 32 here).
OFFLOAD_BLOCK_TOKENS = 64


#: Tier options the bench sets itself (each engine's address and its peers').
_BENCH_OWNED = ("listen", "peers", "directory")


def parse_tier_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` of ``--tier-option``: a p2pkv tier option for every p2pkv engine,
    VALUE as JSON (``false``, ``0.5``, ``[...]``), else as a string. Raises ValueError
    naming what is wrong; load-policy values are checked here, the others when the
    engines start."""
    from p2pkv.errors import ConfigError
    from p2pkv.integrations.vllm.options import TIER_OPTIONS, load_policy_config

    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"--tier-option {text!r}: expected NAME=VALUE, e.g. "
                         "load_policy=false")
    if name not in TIER_OPTIONS or name in _BENCH_OWNED:
        settable = sorted(set(TIER_OPTIONS) - set(_BENCH_OWNED))
        raise ValueError(f"--tier-option: {name!r} is not a tier option the bench lets "
                         f"you set; choose from {', '.join(settable)}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    if name.startswith("load_"):
        try:
            load_policy_config({name: value})
        except ConfigError as exc:
            raise ValueError(f"--tier-option {text!r}: {exc}") from None
    return name, value


def tier_options(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """The p2pkv tier options of every p2pkv engine of a sitting: the bench's deadlines,
    ``--pending-wait``, ``--tier-option`` (last wins) and ``extra``."""
    options: dict[str, Any] = {"lookup_timeout": args.lookup_timeout,
                               "fetch_timeout": 30.0}
    if args.pending_wait is not None:
        options["pending_wait"] = args.pending_wait
    options.update(parse_tier_option(text) for text in args.tier_option)
    options.update(extra)
    return options


def offloading_config(cpu_bytes: int, tiers: list[dict[str, Any]], *,
                      p2pkv: bool = False) -> dict[str, Any]:
    """``--kv-transfer-config``: vLLM's offloading connector (p2pkv's, with ``p2pkv``),
    p2pkv's tiering spec (vLLM's own stops on CPU-only builds) and these secondary
    tiers."""
    connector: dict[str, str] = {"kv_connector": "OffloadingConnector"}
    if p2pkv:  # needs vLLM installed, as every engine here does
        from p2pkv.integrations.vllm.options import CONNECTOR_CONFIG

        connector = dict(CONNECTOR_CONFIG)
    return {**connector, "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "P2PKVTieringSpec", "spec_module_path": "p2pkv.integrations.vllm",
                "cpu_bytes_to_use": cpu_bytes, "block_size": OFFLOAD_BLOCK_TOKENS,
                "secondary_tiers": tiers}}


def core_sets(engines: int) -> list[str]:
    """The cores of each of ``engines`` engines (``VLLM_CPU_OMP_THREADS_BIND``): this
    machine's cores split evenly, or ``nobind`` when there are more engines than cores."""
    cores = sorted(os.sched_getaffinity(0))
    if engines > len(cores):
        return ["nobind"] * engines
    share = len(cores) // engines
    out = []
    for i in range(engines):
        mine = cores[i * share:(i + 1) * share]
        out.append(",".join(str(c) for c in mine))
    return out


def engine_specs(config: str, engines: int, *, cpu_bytes: int, workdir: Path,
                 tier_options: dict[str, Any] | None = None,
                 hosts: Sequence[Host] | None = None,
                 fs_net_roots: Sequence[Path] | None = None,
                 directory: str | None = None) -> list[EngineSpec]:
    """The engines of one configuration (``single`` is always one engine). ``workdir``
    is the run's own (the ``fs`` tier's directory is made in it, empty). With ``hosts``,
    engine ``i`` runs on ``hosts[i]`` and p2pkv's peers find each other at the hosts'
    addresses; ``fs-net`` needs, per engine, its host's mount of the shared volume
    (``fs_net_roots``, an empty directory of it for this run). p2pkv's engines find
    each other through the Redis ``directory`` (a ``redis://`` URL) when one is given,
    else by address (static peers)."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; choose from {', '.join(CONFIGS)}")
    count = 1 if config == "single" else engines
    if hosts is not None and len(hosts) < count:
        raise ValueError(f"{count} engine(s) need as many hosts, got {len(hosts)}")
    if config == "fs-net" and (hosts is None or fs_net_roots is None
                               or len(fs_net_roots) < count):
        raise ValueError("fs-net is vLLM's fs tier on a network filesystem across hosts: "
                         "it runs only on emulated hosts (--hosts), each with its mount")
    placed = list(hosts[:count]) if hosts is not None else [None] * count
    cores = core_sets(count)
    names = [f"{config}-{i}" for i in range(count)]
    ports = [free_port() for _ in names]

    def spec(i: int, kv: dict[str, Any] | None) -> EngineSpec:
        return EngineSpec(names[i], ports[i], kv, cores[i], host=placed[i])

    if config in ("none", "single"):
        return [spec(i, None) for i in range(count)]
    if config == "offload":
        return [spec(i, offloading_config(cpu_bytes, [])) for i in range(count)]
    if config in ("fs", "fs-net"):
        if config == "fs":
            root = workdir / "fs-tier"
            root.mkdir(parents=True, exist_ok=True)
            roots = [root] * count
        else:
            roots = list(fs_net_roots or ())[:count]
        return [spec(i, offloading_config(cpu_bytes, [{"type": "fs",
                                                        "root_dir": str(roots[i])}]))
                for i in range(count)]
    tiers = [f"tcp://{'127.0.0.1' if h is None else h.address}:{free_port()}"
             for h in placed]
    specs = []
    for i in range(count):
        found = ({"directory": directory} if directory is not None
                 else {"peers": [t for j, t in enumerate(tiers) if j != i]})
        tier = {"type": "P2PKVTier", "module_path": "p2pkv.integrations.vllm",
                "listen": tiers[i], **found, **(tier_options or {})}
        specs.append(spec(i, offloading_config(cpu_bytes, [tier], p2pkv=True)))
    return specs

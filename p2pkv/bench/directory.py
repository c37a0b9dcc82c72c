"""``p2pkv-node cluster-bench``: how far one Redis directory goes, and what it costs.

Two parts, both against a private ``redis-server`` started for the run (127.0.0.1, a free
port, no persistence):

* **Scale.** 64 simulated members of one partition announce 1,000,000 block entries
  (each 1,000-key prefix chain is held by two members, so 500,000 distinct keys).
  Rows: blocks/s one member announces (batched script calls), Redis memory per entry,
  and the latency of looking up a 1,000-key prefix (p50/p99), every answer checked.
* **Static fan-out vs Redis.** 1, 8 and 32 real p2pkv nodes, hosted by one child
  process, each registered in the directory and holding a 1,000-key chain (two of them
  hold the chain that is asked for). A consumer node in this process looks up that
  1,000-key prefix through the static backend (one lookup per peer, in parallel) and
  through the Redis backend (one round trip), alternating, every answer checked.

* **One hot identity on 1 vs 3 masters.** A Redis Cluster of one master, then one of
  three (no replicas), 16 members of one partition holding 100,000 entries, a member
  announcing and withdrawing blocks all along. Lookups of a 1,000-key prefix from 1, 2,
  4 and 8 client threads; the row is the highest rate whose p99 stays within
  ``HOT_P99_MS``, with the Redis time per lookup and the load per shard (the busiest
  master's script time over the mean).
* **Static fan-out vs Redis vs Redis Cluster.** As above, the Redis Cluster of three
  masters as a third backend.

Absolute numbers move with the machine and whatever else runs on it; compare rows of
one run. Run as ``python -m p2pkv.bench.directory host N URLS_JSON NAMESPACE`` the module
is the child that hosts the nodes, each registered in every directory of the JSON list
(JSON lines on stdout; closing stdin stops it).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["run_cluster_bench"]

_PARTITION_FP = "0123456789abcdef"
_CHAIN = 1000
#: The p99 (ms) a lookup rate of the hot-identity rows must stay within.
HOT_P99_MS = 50.0


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _fake_record(i: int) -> Any:
    from p2pkv.cluster import NodeRecord

    return NodeRecord(
        node_id=f"sim-{i:03d}", address=f"tcp://10.0.{i // 250}.{i % 250 + 1}:5555",
        fingerprint=_PARTITION_FP, extension="", rank=0,
        capabilities=("checksum-xxh3-64",), pool_blocks=65536,
        run_config={"model_name": "bench/scale"}, bytes_per_block=589824,
        segments=(49152,) * 12, key_hash_algo="xxh3-128", key_hash_seed=0, protocol=(1, 0))


def scale_rows(url: str, *, members: int, entries: int, lookups: int) -> list[dict[str, Any]]:
    """The scale part against the Redis at ``url`` (flushed first)."""
    from p2pkv.bench.fleet import chains_held, timed_prefix_lookups
    from p2pkv.cluster import RedisDirectory

    directory = RedisDirectory(url, namespace="bench", socket_timeout=30.0)
    try:
        chains = entries // (2 * _CHAIN)
        rng = np.random.default_rng(7)
        keys, held = chains_held(chains, members, rng)
        regs = [directory.register(_fake_record(i), ttl=3600.0) for i in range(members)]
        before = directory.memory()
        rates = []
        t_all = time.perf_counter()
        for member, blocks in zip(regs, held, strict=True):
            t0 = time.perf_counter()
            if not directory.announce(member, blocks):
                raise RuntimeError("a simulated member lost its registration")
            rates.append(len(blocks) / (time.perf_counter() - t0))
        total_s = time.perf_counter() - t_all
        after = directory.memory()
        total = sum(len(b) for b in held)
        distinct = chains * _CHAIN
        directory.client.config_resetstat()
        lat, bad = timed_prefix_lookups(directory, regs[0].partition, keys, chains,
                                        lambda i: f"sim-{i % members:03d}", lookups, rng)
        stats = directory.client.info("commandstats").get("cmdstat_evalsha", {})
        server_ms = float(stats.get("usec_per_call", float("nan"))) / 1e3
        ok = "yes" if bad == 0 else f"NO ({bad} wrong)"
        case = f"{members} members, {total:,} entries ({distinct:,} keys)"
        return [
            {"case": case, "metric": "announce blocks/s (one member)",
             "value": statistics.median(rates), "ok": "yes"},
            {"case": case, "metric": "announce blocks/s (all, one client)",
             "value": total / total_s, "ok": "yes"},
            {"case": case, "metric": "Redis bytes per entry",
             "value": (after - before) / total, "ok": "yes"},
            {"case": case, "metric": "Redis bytes per distinct key",
             "value": (after - before) / distinct, "ok": "yes"},
            {"case": case, "metric": "lookup 1,000-key prefix p50 ms",
             "value": _percentile(lat, 50), "ok": ok},
            {"case": case, "metric": "lookup 1,000-key prefix p99 ms",
             "value": _percentile(lat, 99), "ok": ok},
            {"case": case, "metric": "lookup script time in Redis, mean ms",
             "value": server_ms, "ok": ok},
        ]
    finally:
        directory.close()


# -- static fan-out vs Redis ------------------------------------------------------------


def _make_node(pool: int) -> Any:
    from p2pkv.identity import RunConfig
    from p2pkv.layout import Geometry, make_layout
    from p2pkv.node import Node, NodeConfig

    layout = make_layout("v1", Geometry(num_layers=2, num_kv_heads=1, head_size=16,
                                        tokens_per_block=16))
    rc = RunConfig.resolve("bench/fanout", parallel_agnostic=True, dtype="float16",
                           **layout.identity_flags())
    return Node(rc, layout, pool_blocks=pool, config=NodeConfig())


def _chain_keys(chain: int) -> list[bytes]:
    from p2pkv.keys import block_keys

    rng = np.random.default_rng(1000 + chain)
    tokens = rng.integers(0, 50000, size=_CHAIN * 16).tolist()
    return block_keys(tokens, tokens_per_block=16, seed=0)


def _readline(child: subprocess.Popen[str], timeout: float) -> str:
    """The child's first stdout line, or "" if none comes within ``timeout``."""
    line: list[str] = []
    assert child.stdout is not None
    stdout = child.stdout
    reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


def host_main(count: int, urls: list[str], namespace: str) -> int:
    """Child: ``count`` nodes, node i holding chain max(0, i - 1), each registered in
    every directory of ``urls``."""
    from p2pkv.cluster import Cluster, ClusterConfig

    nodes, clusters = [], []
    try:
        chains: dict[int, list[bytes]] = {}
        for i in range(count):
            node = _make_node(_CHAIN + 8)
            chain = max(0, i - 1)
            keys = chains.setdefault(chain, _chain_keys(chain))
            block = bytes(node.layout.bytes_per_block)
            for k in keys:
                node.put(k, block)
            nodes.append(node)
            clusters += [Cluster(node, directory=url,
                                 config=ClusterConfig(ttl=30.0, namespace=namespace))
                         for url in urls]
        for c in clusters:
            if not c.wait_registered(30.0):
                raise RuntimeError("a hosted node did not register")
        print(json.dumps({"addresses": [n.address for n in nodes]}), flush=True)
        sys.stdin.read()
    finally:
        for c in clusters:
            c.close(deregister=False)
        for n in nodes:
            n.close(timeout=1.0)
    return 0


def fanout_rows(url: str, counts: Sequence[int], rounds: int,
                cluster_url: str | None = None) -> list[dict[str, Any]]:
    from p2pkv.cluster import Cluster, ClusterConfig

    urls = [url] + ([cluster_url] if cluster_url else [])

    rows: list[dict[str, Any]] = []
    keys = _chain_keys(0)
    for count in counts:
        namespace = f"fanout{count}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen(
            [sys.executable, "-m", "p2pkv.bench.directory", "host", str(count),
             json.dumps(urls), namespace],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        node = _make_node(8)
        static: Cluster | None = None
        backends: dict[str, Cluster] = {}
        try:
            first = _readline(child, 120.0)
            if not first:
                raise RuntimeError(f"the node host for {count} peers did not start")
            addresses = json.loads(first)["addresses"]
            static = Cluster(node, peers=addresses,
                             config=ClusterConfig(lookup_timeout=10.0))
            backends["static"] = static
            for name, u in zip(("redis", "redis cluster"), urls, strict=False):
                backends[name] = Cluster(node, directory=u, config=ClusterConfig(
                    ttl=30.0, namespace=namespace, lookup_timeout=10.0))
            want = {0, 1} if count > 1 else {0}
            by_address = {a: i for i, a in enumerate(addresses)}
            lat: dict[str, list[float]] = {name: [] for name in backends}
            bad = dict.fromkeys(lat, 0)
            order = list(backends.items())
            for _, cluster in order:  # warm up: connections, script cache
                cluster.lookup_prefix(keys)
            for r in range(rounds):
                for name, cluster in order if r % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    found = cluster.lookup_prefix(keys)
                    lat[name].append((time.perf_counter() - t0) * 1e3)
                    if (found.length != _CHAIN or found.source != (
                            "peers" if name == "static" else "redis")
                            or {by_address.get(h.address) for h in found.holders[0]} != want):
                        bad[name] += 1
            for backend in backends:
                ok = "yes" if bad[backend] == 0 else f"NO ({bad[backend]} wrong)"
                for q in (50, 99):
                    rows.append({"case": f"{count} peer(s), 1,000-key prefix",
                                 "metric": f"{backend} lookup p{q} ms",
                                 "value": _percentile(lat[backend], q), "ok": ok})
        finally:
            for c in backends.values():
                c.close(deregister=False)
            if static is not None:
                static.close(deregister=False)
            node.close(timeout=1.0)
            if child.stdin:
                child.stdin.close()
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
    return rows


def _shard_script_usec(directory: Any) -> dict[str, float]:
    from redis.cluster import RedisCluster

    stats = directory.client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
    if "cmdstat_evalsha" in stats or not all(isinstance(v, dict) for v in stats.values()):
        stats = {"only": stats}  # one master: redis-py returns its reply as is
    return {node: float(s.get("cmdstat_evalsha", {}).get("usec", 0.0))
            for node, s in stats.items()}


def hot_identity_rows(url: str, masters: int, *, seconds: float,
                      threads: Sequence[int] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
    """One partition on the cluster at ``url``: the best lookup rate within HOT_P99_MS."""
    from p2pkv.cluster import RedisDirectory

    directory = RedisDirectory(url, namespace="hot", socket_timeout=30.0)
    stop = threading.Event()
    churner: threading.Thread | None = None
    try:
        rng = np.random.default_rng(11)
        chains = 50
        keys = [rng.bytes(20) for _ in range(chains * _CHAIN)]
        regs = [directory.register(_fake_record(i), ttl=3600.0) for i in range(16)]
        for c in range(chains):
            chain = keys[c * _CHAIN:(c + 1) * _CHAIN]
            for m in (regs[c % 15], regs[(c + 1) % 15]):
                if not directory.announce(m, chain):
                    raise RuntimeError("a simulated member lost its registration")
        churn = [rng.bytes(20) for _ in range(2000)]
        announced = [0]

        def announce() -> None:  # a member storing and evicting blocks all along
            n = 0
            while not stop.is_set():
                add = churn[(n % 2) * 1000:(n % 2 + 1) * 1000]
                drop = churn[((n + 1) % 2) * 1000:((n + 1) % 2 + 1) * 1000]
                directory.announce(regs[15], add, drop)
                announced[0] += len(add) + len(drop)
                n += 1
                stop.wait(0.05)

        churner = threading.Thread(target=announce, daemon=True)
        churner.start()
        partition = regs[0].partition
        runs: list[tuple[float, float, int, float, float]] = []
        bad = 0
        t_churn = time.perf_counter()
        for n in threads:
            lat: list[list[float]] = [[] for _ in range(n)]
            errors: list[int] = [0] * n
            before = _shard_script_usec(directory)
            end = time.perf_counter() + seconds

            def client(i: int, lat: list[list[float]] = lat, end: float = end,
                       errors: list[int] = errors) -> None:
                r = np.random.default_rng(100 + i)
                while time.perf_counter() < end:
                    c = int(r.integers(0, chains))
                    t0 = time.perf_counter()
                    found = directory.lookup(partition, keys[c * _CHAIN:(c + 1) * _CHAIN])
                    lat[i].append((time.perf_counter() - t0) * 1e3)
                    if len(found) != _CHAIN:
                        errors[i] += 1

            t_start = time.perf_counter()
            workers = [threading.Thread(target=client, args=(i,)) for i in range(n)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(seconds + 60)
            elapsed = time.perf_counter() - t_start
            after = _shard_script_usec(directory)
            bad += sum(errors)
            every = [x for per in lat for x in per]
            load = [after[k] - before.get(k, 0.0) for k in after]
            p99 = _percentile(every, 99)
            rate = len(every) / elapsed
            mean_load = statistics.mean(load) if load else 0.0
            imbalance = max(load) / mean_load if mean_load else float("nan")
            server_ms = sum(load) / 1e3 / max(1, len(every))
            runs.append((rate, p99, n, imbalance, server_ms))
        churn_rate = announced[0] / (time.perf_counter() - t_churn)
        within = [r for r in runs if r[1] <= HOT_P99_MS]
        # None within the target (a loaded machine): the run with the lowest p99.
        best = max(within) if within else min(runs, key=lambda r: r[1])
        ok = "yes" if bad == 0 else f"NO ({bad} wrong)"
        case = f"hot identity, {masters} master(s), 1,000-key prefix"
        rate, p99, n, imbalance, server_ms = best
        return [
            {"case": case, "metric": f"lookups/s at p99 <= {HOT_P99_MS:g} ms", "value": rate,
             "ok": ok},
            {"case": case, "metric": f"p99 ms at that rate ({n} client threads)",
             "value": p99, "ok": ok},
            {"case": case, "metric": "Redis script ms per lookup, all shards",
             "value": server_ms, "ok": ok},
            {"case": case, "metric": "load per shard, max / mean", "value": imbalance,
             "ok": ok},
            {"case": case, "metric": "announcements meanwhile, blocks/s", "value": churn_rate,
             "ok": "yes"},
        ]
    finally:
        stop.set()
        if churner is not None:
            churner.join(30)
        directory.close()


def run_cluster_bench(*, quick: bool = False, json_path: str | None = None,
                      fleet: bool = True) -> int:
    from p2pkv.bench.redis_servers import LocalRedis, LocalRedisCluster

    members, entries, lookups = (64, 100_000, 100) if quick else (64, 1_000_000, 500)
    counts, rounds = ((1, 8), 30) if quick else ((1, 8, 32), 200)
    seconds = 1.0 if quick else 3.0
    rows: list[dict[str, Any]] = []
    with LocalRedis() as server:
        version = subprocess.run([server.executable, "--version"], capture_output=True,
                                 text=True, timeout=10).stdout.split()[2]
        rows += scale_rows(server.url, members=members, entries=entries, lookups=lookups)
        if fleet:
            from p2pkv.bench.fleet import fleet_rows

            engines, fleet_entries = (100, 200_000) if quick else (1000, 10_000_000)
            rows += fleet_rows(server.url, engines=engines, entries=fleet_entries,
                               lookups=lookups, label="one Redis")
            with LocalRedisCluster(masters=3, replicas=0) as cluster:
                rows += fleet_rows(cluster.url, engines=engines, entries=fleet_entries,
                                   lookups=lookups, label="Redis Cluster, 3 masters")
        for masters in (1, 3):
            with LocalRedisCluster(masters=masters, replicas=0) as cluster:
                rows += hot_identity_rows(cluster.url, masters, seconds=seconds)
        with LocalRedisCluster(masters=3, replicas=0) as cluster:
            rows += fanout_rows(server.url, counts, rounds, cluster_url=cluster.url)

    width = [max(len(str(r[k])) for r in rows) for k in ("case", "metric")]
    print(f"{'case':<{width[0]}}  {'metric':<{width[1]}}  {'value':>12}  answers ok")
    print(f"{'-' * width[0]}  {'-' * width[1]}  {'-' * 12}  ----------")
    for r in rows:
        print(f"{r['case']:<{width[0]}}  {r['metric']:<{width[1]}}  {r['value']:>12.3f}  "
              f"{r['ok']}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"redis_server": version, "python": platform.python_version(),
                       "cpus": os.cpu_count(), "quick": quick, "rows": rows}, fh, indent=2)
    return 0 if all(r["ok"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "host":
        sys.exit(host_main(int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]))
    sys.exit(run_cluster_bench(quick="--quick" in sys.argv))

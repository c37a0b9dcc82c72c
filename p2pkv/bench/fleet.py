"""A simulated fleet in one directory: ``engines`` registrations of one identity holding
``entries`` block entries in all (each 1,000-key prefix chain held by two engines), as
1,000 engines behind one model would hold them.

It measures, against the Redis (or Redis Cluster) at ``url``:

- Redis memory per entry, once the fleet announced everything;
- a 1,000-key prefix lookup, p50 and p99 (plus one absent key, so the prefix ends);
- what the directory costs an engine: announce CPU per block in the announcing process;
- the time for the whole fleet to register and re-announce everything after the
  directory lost its data (a full restart, or a master failover that lost writes): one
  announcing client, as a lower bound on how fast the fleet comes back; engines
  re-announce in parallel, each its own share.

Every answer is checked against what was announced. Part of ``p2pkv-node cluster-bench``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["chains_held", "fleet_rows", "timed_prefix_lookups"]

_CHAIN = 1000
_FP = "fedcba9876543210"


def _record(i: int) -> Any:
    from p2pkv.cluster import NodeRecord

    return NodeRecord(
        node_id=f"eng-{i:04d}", address=f"tcp://10.{i // 62500}.{i // 250 % 250}."
        f"{i % 250 + 1}:5555", fingerprint=_FP, extension="", rank=0,
        capabilities=("checksum-xxh3-64",), pool_blocks=65536,
        run_config={"model_name": "bench/fleet"}, bytes_per_block=589824,
        segments=(49152,) * 12, key_hash_algo="xxh3-128", key_hash_seed=0, protocol=(1, 2))


def chains_held(chains: int, members: int,
                rng: np.random.Generator) -> tuple[list[bytes], list[list[bytes]]]:
    """``chains`` random 1,000-key prefix chains (20-byte keys), chain ``c`` held by
    members ``c`` and ``c + 1`` (mod ``members``): all keys, and each member's keys."""
    raw = rng.bytes(chains * _CHAIN * 20)
    keys = [raw[i * 20:(i + 1) * 20] for i in range(chains * _CHAIN)]
    held: list[list[bytes]] = [[] for _ in range(members)]
    for c in range(chains):
        chain = keys[c * _CHAIN:(c + 1) * _CHAIN]
        held[c % members].extend(chain)
        held[(c + 1) % members].extend(chain)
    return keys, held


def timed_prefix_lookups(directory: Any, partition: str, keys: list[bytes], chains: int,
                         names: Callable[[int], str], lookups: int,
                         rng: np.random.Generator) -> tuple[list[float], int]:
    """``lookups`` lookups of a random chain plus one absent key: the latencies in ms,
    sorted, and how many answers differed from the chain's two holders (``names(i)``
    is member ``i``'s node id)."""
    lat, bad = [], 0
    for n in range(lookups):
        c = int(rng.integers(0, chains))
        ask = [*keys[c * _CHAIN:(c + 1) * _CHAIN], b"absent-%013d" % n]
        t0 = time.perf_counter()
        found = directory.lookup(partition, ask)
        lat.append((time.perf_counter() - t0) * 1e3)
        want = {names(c), names(c + 1)}
        if len(found) != _CHAIN or any({h.node_id for h in f} != want for f in found):
            bad += 1
    return sorted(lat), bad


def _announce_all(directory: Any, held: list[list[bytes]]) -> tuple[list[Any], float, float]:
    """Register every engine and announce its blocks: registrations, seconds, CPU s."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    regs = [directory.register(_record(i), ttl=3600.0) for i in range(len(held))]
    for member, blocks in zip(regs, held, strict=True):
        for start in range(0, len(blocks), 20_000):
            if not directory.announce(member, blocks[start:start + 20_000]):
                raise RuntimeError("a simulated engine lost its registration")
    return regs, time.perf_counter() - t0, time.process_time() - cpu0


def fleet_rows(url: str, *, engines: int, entries: int, lookups: int,
               label: str) -> list[dict[str, Any]]:
    """The fleet's rows against ``url`` (its data is flushed first and last)."""
    from p2pkv.cluster import RedisDirectory

    directory = RedisDirectory(url, namespace="fleet", socket_timeout=60.0)
    try:
        _flush(directory)
        chains = max(1, entries // (2 * _CHAIN))
        rng = np.random.default_rng(11)
        keys, held = chains_held(chains, engines, rng)
        total = sum(len(b) for b in held)
        before = directory.memory()
        regs, first_s, cpu_s = _announce_all(directory, held)
        used = directory.memory() - before
        lat, bad = timed_prefix_lookups(directory, regs[0].partition, keys, chains,
                                        lambda i: f"eng-{i % engines:04d}", lookups, rng)
        # The directory loses everything (a restart without persistence, or a failover
        # that dropped writes): the fleet registers again and re-announces its blocks.
        _flush(directory)
        _, again_s, _ = _announce_all(directory, held)
        c = int(rng.integers(0, chains))
        back = directory.lookup(regs[0].partition, keys[c * _CHAIN:(c + 1) * _CHAIN])
        if len(back) != _CHAIN:
            bad += 1
        ok = "yes" if bad == 0 else f"NO ({bad} wrong)"
        case = f"{label}: fleet of {engines:,} engines, {total:,} entries"
        return [
            {"case": case, "metric": "Redis bytes per entry", "value": used / total, "ok": ok},
            {"case": case, "metric": "lookup 1,000-key prefix p50 ms",
             "value": statistics.median(lat), "ok": ok},
            {"case": case, "metric": "lookup 1,000-key prefix p99 ms",
             "value": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "ok": ok},
            {"case": case, "metric": "announce CPU per block, us (announcing process)",
             "value": cpu_s / total * 1e6, "ok": ok},
            {"case": case, "metric": "first announce of the fleet, s (one client)",
             "value": first_s, "ok": ok},
            {"case": case, "metric": "re-announce after the directory lost it, s "
             "(one client)", "value": again_s, "ok": ok},
        ]
    finally:
        _flush(directory)
        directory.close()


def _flush(directory: Any) -> None:
    """Empty every master behind ``directory`` (one server or each shard)."""
    client = directory.client
    if directory.kind == "cluster":
        from redis.cluster import RedisCluster

        client.flushall(target_nodes=RedisCluster.PRIMARIES)
    else:
        client.flushall()

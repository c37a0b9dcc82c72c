"""``p2pkv-node chaos``: holders, a Redis directory, verifying consumers and faults.

Holders are ``serve --fill`` processes (two plain, one behind a :class:`FaultProxy`;
as root that one runs in a network namespace of its own, behind a veth link the
partition fault cuts, see :mod:`p2pkv.bench.chaos.netns`); the directory is a 3-master,
3-replica Redis Cluster (one server when a cluster cannot be started, said in the
output). Consumer threads of this process fetch prefixes of the fill keys through one
:class:`~p2pkv.cluster.Cluster` with a deadline and compare every stored block with
:func:`~p2pkv.fill.fill_block`. Faults drawn from the seed run one at a time; after
each, the run waits (bounded) until three fetches in a row found their whole prefix:
that is the recovery time. A fault kind that cannot be made here (the partition without
root) is skipped, and the output says so and why.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import json
import os
import random
import re
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pkv.bench.chaos.faults import KINDS, Fault, Injector
from p2pkv.bench.chaos.holders import Holder, Resources, shm_segments
from p2pkv.bench.chaos.netns import NetnsLink, Unavailable
from p2pkv.bench.chaos.proxy import FaultProxy
from p2pkv.bench.redis_servers import LocalRedis, LocalRedisCluster, free_port

__all__ = ["run_chaos"]

FILL = 24
DEADLINE = 2.5  #: each fetch's timeout, lookup included
GRACE = 1.0  #: a future later than DEADLINE + GRACE missed its deadline
RECOVERY_BOUND = 12.0
CONSUMERS = 2


@dataclass(frozen=True)
class Fetched:
    start: float
    end: float
    asked: int
    stored: int
    verified: int
    corrupt: int
    missed: bool
    error: str | None
    #: Why keys of the prefix were not fetched (one entry per such key; see _reason).
    unfetched: tuple[str, ...] = ()


_HOLDER = re.compile(r"^\S+ at tcp://\S+?: ")
_NUMBERS = re.compile(r"tcp://\S+|\d+(\.\d+)?")


def _reason(error: str) -> str:
    """A FAILED key's error without the holder and numbers, so that equal causes count
    together: ``PeerGone: could not connect to ADDR (refused, ...)``."""
    text = _NUMBERS.sub("N", _HOLDER.sub("", error))
    return text if len(text) <= 100 else text[:97] + "..."


class Consumers:
    """``CONSUMERS`` threads fetching prefixes through one cluster, recording each fetch."""

    def __init__(self, url: str, seed: int) -> None:
        from p2pkv.cluster import Cluster, ClusterConfig
        from p2pkv.cluster.health import HealthConfig
        from p2pkv.fill import fill_block, fill_keys
        from p2pkv.node import Node
        from p2pkv.settings import load_settings, node_config

        settings = load_settings({"heartbeat_timeout": "1.5", "shm": "true"}, environ={})
        layout = settings.layout()
        rc = settings.run_config(layout)
        self.keys = fill_keys(FILL, seed=0, tokens_per_hash=rc.tokens_per_hash)
        self.expected = {k: fill_block(k, layout.bytes_per_block) for k in self.keys}
        self.segments = layout.segment_sizes
        self.node = Node(rc, layout, pool_blocks=8, config=node_config(settings))
        self.cluster = Cluster(self.node, directory=url, config=ClusterConfig(
            ttl=3, redis_timeout=0.5, fetch_workers=CONSUMERS + 2,
            health=HealthConfig(ramp=5.0)))
        self.log: list[Fetched] = []
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seed = seed
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True,
                                          name=f"p2pkv-chaos-consumer-{i}")
                         for i in range(CONSUMERS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _loop(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        while not self._stop.is_set():
            self._one(rng.randint(2, FILL))

    def _one(self, n: int) -> None:
        from p2pkv.runtime.public import KeyOutcome

        keys = self.keys[:n]
        bufs = [[memoryview(bytearray(s)) for s in self.segments] for _ in keys]
        t0 = time.monotonic()
        missed, error, answer = False, None, None
        future = self.cluster.fetch_prefix_async(keys, bufs, timeout=DEADLINE)
        try:
            answer = future.result(timeout=DEADLINE + GRACE)
        except concurrent.futures.TimeoutError:
            missed = True
            error = "missed its deadline"
            # The buffers stay ours until it has let go of them (bounded); how it ends
            # does not matter, the deadline was missed.
            concurrent.futures.wait([future], timeout=30)
        except Exception as exc:  # every failure is a figure
            error = f"{type(exc).__name__}: {exc}"
        t1 = time.monotonic()
        stored = verified = corrupt = 0
        unfetched: list[str] = []
        if answer is not None:
            unfetched = [_reason(e) for e in answer.result.errors.values()]
            short = n - answer.lookup.length  # keys the lookup found no holder for
            unfetched += [f"no holder found (lookup source {answer.lookup.source})"] * short
            for i, outcome in enumerate(answer.result.outcomes):
                if outcome is KeyOutcome.STORED:
                    stored += 1
                    got = b"".join(bytes(m) for m in bufs[i])
                    if got == self.expected[keys[i]]:
                        verified += 1
                    else:
                        corrupt += 1
        with self._lock:
            self.log.append(Fetched(t0, t1, n, stored, verified, corrupt, missed, error,
                                    tuple(unfetched)))

    def since(self, t: float) -> list[Fetched]:
        with self._lock:
            return sorted((f for f in self.log if f.start >= t), key=lambda f: f.start)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(DEADLINE + GRACE + 35)

    def close(self) -> int:
        """Close the cluster and the node; the node's pins just before (must be 0)."""
        stats = self.node.stats()
        pins = int(stats.shm_pinned)
        c = self.cluster.stats()
        self.counters = {"failovers": c.failovers, "stale_entries": c.stale_entries,
                         "quarantines": c.quarantines, "directory_errors": c.directory_errors,
                         "lookups": c.lookups}
        self.cluster.close()
        self.node.close()
        return pins


def _recovered(consumers: Consumers, since: float, bound: float) -> float | None:
    """Seconds from ``since`` to the first of three complete fetches in a row."""
    deadline = since + bound
    while time.monotonic() < deadline:
        run: list[Fetched] = []
        for f in consumers.since(since):
            run = [*run, f] if f.stored == f.asked and f.error is None else []
            if len(run) == 3:
                return round(max(0.0, run[0].start - since), 3)
        time.sleep(0.05)
    return None


def _directory(log: list[str]) -> LocalRedisCluster | LocalRedis:
    try:
        return LocalRedisCluster(masters=3, replicas=1, node_timeout=1000).start(60)
    except (OSError, RuntimeError, ValueError) as exc:
        log.append(f"Redis Cluster did not start ({exc}); one Redis server instead")
        return LocalRedis().start()


def _figures(faults: list[Fault], fetched: list[Fetched],
             skipped: dict[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind]
        during = [x for x in fetched if any(f.on <= x.start <= f.off for f in mine)]
        times = [f.recovery for f in mine if f.recovery is not None]
        asked = sum(x.asked for x in during)
        out[kind] = {
            "injected": len(mine), "fetches": len(during),
            "blocks_verified": sum(x.verified for x in during),
            "hit_rate": round(sum(x.stored for x in during) / asked, 3) if asked else None,
            "corrupt_visible": sum(x.corrupt for x in during),
            "missed_deadlines": sum(x.missed for x in during),
            "recovery_s": times, "recovery_max_s": max(times) if times else None,
            "unrecovered": len(mine) - len(times),
            "unfetched_reasons": dict(collections.Counter(
                r for x in during for r in x.unfetched).most_common(5)),
            **({"skipped": skipped[kind]} if kind in skipped else {}),
        }
    return out


def _link(redis: LocalRedisCluster | LocalRedis, metrics_port: int, holder_port: int,
          skipped: dict[str, str]) -> NetnsLink | None:
    """The partition's link, or None with the reason in ``skipped``."""
    ports = ([n.port for n in redis.nodes] if isinstance(redis, LocalRedisCluster)
             else [redis.port])
    try:
        return NetnsLink(ports, metrics_port, holder_port)
    except (Unavailable, RuntimeError, OSError) as exc:
        skipped["partition"] = str(exc)
        return None


def run_chaos(seconds: float, *, seed: int = 0, json_path: str | None = None) -> int:
    """The chaos run; 0 when no corrupt block, no missed deadline and nothing leaked."""
    from p2pkv.node import Node  # noqa: F401 - imported before the baseline is taken

    rng = random.Random(seed)
    notes: list[str] = []
    skipped: dict[str, str] = {}
    gc.collect()
    baseline = Resources()
    tmp = tempfile.TemporaryDirectory(prefix="p2pkv-chaos-")
    redis = _directory(notes)
    url = redis.url
    holders: list[Holder] = []
    proxy: FaultProxy | None = None
    link: NetnsLink | None = None
    consumers: Consumers | None = None
    faults: list[Fault] = []
    report: dict[str, Any] = {}
    try:
        behind, metrics = free_port(), free_port()
        link = _link(redis, metrics, behind, skipped)
        proxy = FaultProxy(free_port(), behind, seed=seed,
                           dial=link.dial if link is not None else None)
        for i in range(2):
            holders.append(Holder(f"h{i}", directory=url, fill=FILL, port=free_port(),
                                  metrics_port=free_port(), log_dir=Path(tmp.name), shm=True))
        holders.append(Holder("h2-proxied", directory=url, fill=FILL, port=behind,
                              metrics_port=metrics, log_dir=Path(tmp.name),
                              advertise=proxy.address,
                              listen=link.listen if link is not None else None,
                              prefix=link.prefix if link is not None else ()))
        if link is not None:
            notes.append(f"h2-proxied runs in network namespace {link.a}, behind a veth "
                         f"link the partition cuts")
        notes += [f"{kind}: skipped ({why})" for kind, why in skipped.items()]
        for h in holders:
            h.start()
        if not all(h.wait_ready(90) for h in holders):
            raise RuntimeError("a holder did not start: " + "; ".join(
                h.log.read_text(errors="replace")[-500:] for h in holders))
        consumers = Consumers(url, seed)
        consumers.start()
        names = {f"tcp://127.0.0.1:{h.port}": h.name for h in holders[:2]}
        names[proxy.address] = holders[2].name

        def quarantined() -> list[str]:
            """The holders the consumers keep in quarantine now, by name."""
            assert consumers is not None
            return sorted(names.get(a, a) for a in consumers.cluster.stats().quarantined)

        t_start = time.monotonic()
        warm = _recovered(consumers, t_start, 30)
        injector = Injector(rng, holders[:2], proxy, redis, link)
        kinds = [k for k in KINDS if k not in skipped]
        order = list(kinds)
        rng.shuffle(order)
        end = t_start + seconds
        while time.monotonic() < end - 4:
            kind = order.pop(0) if order else rng.choice(kinds)
            failovers = consumers.cluster.stats().failovers
            before = quarantined()
            fault = injector.inject(kind)
            after = quarantined()
            fault.recovery = _recovered(consumers, fault.off, RECOVERY_BOUND)
            fault.notes.update(failovers=consumers.cluster.stats().failovers - failovers,
                               quarantined_before=before, quarantined_after=after)
            faults.append(fault)
            print(f"  {time.monotonic() - t_start:7.1f}s {fault.kind:<13} {fault.target:<12} "
                  f"on {fault.off - fault.on:5.2f}s  recovered "
                  f"{'never' if fault.recovery is None else f'{fault.recovery:.2f}s'}",
                  flush=True)
            time.sleep(rng.uniform(0.2, 0.8))
        consumers.stop()
        fetched = list(consumers.log)
        pins = {h.name: h.pinned() for h in holders}
        pins["consumer"] = consumers.close()
        counters = consumers.counters
        consumers = None
        report = {
            "seed": seed, "seconds": seconds, "ran_s": round(time.monotonic() - t_start, 1),
            "directory": ("redis-cluster 3 masters + 3 replicas"
                          if isinstance(redis, LocalRedisCluster) else "one redis"),
            "notes": notes, "warmup_s": warm, "deadline_s": DEADLINE, "grace_s": GRACE,
            "kinds": _figures(faults, fetched, skipped), "skipped": skipped,
            "faults": [{"kind": f.kind, "target": f.target, "on_s": round(f.off - f.on, 3),
                        "recovery_s": f.recovery, **f.notes} for f in faults],
            "totals": {"fetches": len(fetched),
                       "blocks_verified": sum(x.verified for x in fetched),
                       "corrupt_visible": sum(x.corrupt for x in fetched),
                       "missed_deadlines": sum(x.missed for x in fetched),
                       "errors": sum(x.error is not None for x in fetched)},
            "pins": pins, "cluster": counters,
        }
    finally:
        if consumers is not None:
            consumers.stop()
            consumers.close()
        for h in holders:
            h.signal(signal.SIGCONT)
            h.signal(signal.SIGTERM)
        for h in holders:
            h.wait_exit(15)
        if proxy is not None:
            proxy.close()
        if link is not None:
            link.close()
        redis.close()
        tmp.cleanup()
    return _finish(report, holders, baseline, json_path)


def _finish(report: dict[str, Any], holders: list[Holder], baseline: Resources,
            json_path: str | None) -> int:
    pids = {os.getpid(), *(p for h in holders for p in h.pids)}
    gc.collect()
    time.sleep(0.2)
    pins = report["pins"]
    leaks = {"pins": int(sum(v for v in pins.values() if v) + sum(v is None for v in
                                                                    pins.values())),
             "shm_segments": len(shm_segments(pids)), **baseline.leaked()}
    report["leaks"] = leaks
    t = report["totals"]
    report["ok"] = bool(t["corrupt_visible"] == 0 and t["missed_deadlines"] == 0
                        and not any(leaks.values()) and t["blocks_verified"] > 0)
    print(render(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0 if report["ok"] else 1


def render(report: dict[str, Any]) -> str:
    head = (f"{'fault':<13}{'injected':>9}{'fetches':>9}{'verified':>10}{'hit rate':>9}"
            f"{'corrupt':>9}{'missed':>8}{'recovery max s':>16}")
    lines = [f"chaos run: {report['ran_s']} s, seed {report['seed']}, {report['directory']}",
             *(f"  note: {n}" for n in report["notes"]), head]
    for kind, k in report["kinds"].items():
        rec = "-" if k["recovery_max_s"] is None else f"{k['recovery_max_s']:.2f}"
        hit = "-" if k["hit_rate"] is None else f"{k['hit_rate']:.3f}"
        lines.append(f"{kind:<13}{k['injected']:>9}{k['fetches']:>9}{k['blocks_verified']:>10}"
                     f"{hit:>9}{k['corrupt_visible']:>9}{k['missed_deadlines']:>8}{rec:>16}"
                     + (f"  ({k['unrecovered']} unrecovered)" if k["unrecovered"] else "")
                     + ("  (skipped)" if "skipped" in k else ""))
    for kind, k in report["kinds"].items():
        for why, count in k.get("unfetched_reasons", {}).items():
            lines.append(f"  {kind}: {count} key(s) not fetched: {why}")
    t = report["totals"]
    lines.append(f"all fetches: {t['fetches']}, blocks verified {t['blocks_verified']}, "
                 f"corrupt visible {t['corrupt_visible']}, missed deadlines "
                 f"{t['missed_deadlines']}, failed fetches {t['errors']}")
    lines.append("consumer's cluster: " + ", ".join(
        f"{k} {v}" for k, v in report.get("cluster", {}).items()))
    lines.append("leaked: " + ", ".join(f"{k} {v}" for k, v in report["leaks"].items()))
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)

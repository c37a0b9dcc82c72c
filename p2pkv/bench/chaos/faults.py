"""The fault kinds of a chaos run and how each is put on and taken off.

Every fault has an *on* interval (from the moment it is injected until it has been
undone: the holder restarted and serving again, the process continued, the proxy back
to relaying, the Redis master restarted as a replica); fetches that start in it are
counted as "during the fault". Every wait in here is bounded.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from p2pkv.bench.chaos.holders import Holder
from p2pkv.bench.chaos.netns import NetnsLink
from p2pkv.bench.chaos.proxy import FaultProxy
from p2pkv.bench.redis_servers import LocalRedis, LocalRedisCluster

__all__ = ["KINDS", "Fault", "Injector"]

KINDS = ("kill9", "sigstop", "drain", "redis_master", "proxy_flip", "proxy_stall",
         "partition")
"""kill -9 and restart of a holder; SIGSTOP then SIGCONT; SIGTERM (a graceful drain)
and restart; a Redis master killed and restarted (as a replica, after its replica took
over); the proxy in front of one holder flipping bits in what it relays; and stalling;
the network link between that holder and its consumers cut, then healed (root only:
:mod:`p2pkv.bench.chaos.netns`)."""


@dataclass
class Fault:
    kind: str
    target: str
    on: float
    off: float = 0.0
    recovery: float | None = None
    notes: dict[str, object] = field(default_factory=dict)


class Injector:
    """Puts faults on and takes them off. ``plain``: holders that process faults hit
    (one at a time, so another always serves); ``proxy``: the relay of the last one;
    ``link``: the network link to that one (None: no partition can be made)."""

    def __init__(self, rng: random.Random, plain: list[Holder], proxy: FaultProxy,
                 redis: LocalRedisCluster | LocalRedis, link: NetnsLink | None = None) -> None:
        self.rng = rng
        self.plain = plain
        self.proxy = proxy
        self.redis = redis
        self.link = link

    def inject(self, kind: str) -> Fault:
        hold = self.rng.uniform(1.0, 2.0)
        run: Callable[[float], tuple[str, dict[str, object]]] = getattr(self, f"_{kind}")
        on = time.monotonic()
        target, notes = run(hold)
        return Fault(kind, target, on, time.monotonic(), notes=notes)

    def _restart(self, holder: Holder) -> dict[str, object]:
        holder.start()
        return {"restarted": holder.wait_ready(60)}

    def _kill9(self, hold: float) -> tuple[str, dict[str, object]]:
        victim = self.rng.choice(self.plain)
        victim.kill()
        time.sleep(hold)
        return victim.name, self._restart(victim)

    def _sigstop(self, hold: float) -> tuple[str, dict[str, object]]:
        victim = self.rng.choice(self.plain)
        victim.signal(signal.SIGSTOP)
        time.sleep(hold)
        victim.signal(signal.SIGCONT)
        return victim.name, {}

    def _drain(self, hold: float) -> tuple[str, dict[str, object]]:
        victim = self.rng.choice(self.plain)
        victim.signal(signal.SIGTERM)
        status = victim.wait_exit(15)
        time.sleep(hold / 2)
        return victim.name, {"exit": status, **self._restart(victim)}

    def _redis_master(self, hold: float) -> tuple[str, dict[str, object]]:
        if isinstance(self.redis, LocalRedis):  # the fallback: one server, no replica
            self.redis.kill()
            time.sleep(hold)
            self.redis.start()
            return f"redis:{self.redis.port}", {}
        cluster = self.redis
        victim = self.rng.choice(cluster.master_ports())
        cluster.node(victim).kill()
        deadline = time.monotonic() + 30
        promoted = False
        while time.monotonic() < deadline:
            masters = cluster.master_ports()
            if victim not in masters and len(masters) == cluster.masters:
                promoted = True
                break
            time.sleep(0.1)
        promotion = time.monotonic()
        cluster.node(victim).start()  # its nodes.conf makes it rejoin as a replica
        return f"redis:{victim}", {"promoted": promoted,
                                   "rejoined_s": round(time.monotonic() - promotion, 3)}

    def _proxy_flip(self, hold: float) -> tuple[str, dict[str, object]]:
        before = self.proxy.flipped
        self.proxy.set_mode("flip")
        time.sleep(hold)
        self.proxy.set_mode("pass")
        return f"proxy:{self.proxy.port}", {"chunks_flipped": self.proxy.flipped - before}

    def _proxy_stall(self, hold: float) -> tuple[str, dict[str, object]]:
        self.proxy.set_mode("stall")
        time.sleep(hold)
        self.proxy.set_mode("pass")
        return f"proxy:{self.proxy.port}", {}

    def _partition(self, hold: float) -> tuple[str, dict[str, object]]:
        if self.link is None:
            raise ValueError("no network-namespace link: the partition cannot be injected")
        down = self.link.cut()
        try:
            before = self.link.received()
            time.sleep(hold)
            crossed = self.link.received() - before
        finally:
            self.link.heal()
        return f"netns:{self.link.a}", {"link_down": down, "bytes_crossed": crossed}

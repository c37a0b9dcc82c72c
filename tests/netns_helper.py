"""Two network namespaces joined by a veth pair, for network-fault tests (root only).

The addresses live in a private /30 (10.201.N.0/30) that exists only inside the two
namespaces this module creates; :meth:`NetnsPair.close` deletes both namespaces (which
also destroys the veth pair), and is safe to call after a partial setup.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from procs import NodeProcess


class Unavailable(Exception):
    """Namespaces (or a needed tool) cannot be used here; the message says why."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


class NetnsPair:
    """Namespaces ``a`` (address ``ip_a``) and ``b`` (``ip_b``), veths ``veth_a``/``veth_b``."""

    def __init__(self, mtu: int = 64000) -> None:
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise Unavailable("iproute2 'ip' is not installed")
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"p2pkv-{tag}-a", f"p2pkv-{tag}-b"
        self.veth_a, self.veth_b = f"p2kA{tag}", f"p2kB{tag}"
        subnet = 4 * (os.getpid() % 60)
        self.ip_a, self.ip_b = f"10.201.7.{subnet + 1}", f"10.201.7.{subnet + 2}"
        self._created: list[str] = []
        added = _run("ip", "netns", "add", self.a, check=False)
        if added.returncode != 0:
            raise Unavailable(f"'ip netns add' failed: {added.stderr.strip()}")
        self._created.append(self.a)
        try:
            _run("ip", "netns", "add", self.b)
            self._created.append(self.b)
            _run("ip", "link", "add", self.veth_a, "netns", self.a, "type", "veth",
                 "peer", "name", self.veth_b, "netns", self.b)
            for ns, dev, ip in ((self.a, self.veth_a, self.ip_a),
                                (self.b, self.veth_b, self.ip_b)):
                _run("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "mtu", str(mtu))
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def sh(self, ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", ns, *cmd, check=check)

    def cut(self) -> None:
        """Pull the cable: the producer-side veth goes down (no FIN, no RST)."""
        _run("ip", "-n", self.a, "link", "set", self.veth_a, "down")

    def rate_limit(self, ns: str, dev: str, rate: str) -> bool:
        """A token-bucket rate limit on ``dev`` (True when the kernel has tbf)."""
        done = self.sh(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                       "burst", "256kb", "latency", "100ms", check=False)
        return done.returncode == 0

    def impair(self, loss_pct: float, delay_ms: int) -> str:
        """Loss (and delay) on both ends; netem when the kernel has it, else nftables
        random drops (no delay). Returns what was applied; raises Unavailable."""
        applied = []
        for ns, dev in ((self.a, self.veth_a), (self.b, self.veth_b)):
            if shutil.which("tc") is not None:
                done = self.sh(ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                               "loss", f"{loss_pct}%", "delay", f"{delay_ms}ms", check=False)
                if done.returncode == 0:
                    applied.append(f"{ns}: netem loss {loss_pct}% delay {delay_ms}ms")
                    continue
            if shutil.which("nft") is None:
                raise Unavailable("neither tc netem (kernel sch_netem) nor nft is available")
            per_mille = max(1, round(loss_pct * 10))
            self.sh(ns, "nft", "add", "table", "inet", "p2pkvloss")
            self.sh(ns, "nft", "add", "chain", "inet", "p2pkvloss", "out",
                    "{ type filter hook output priority 0; }")
            self.sh(ns, "nft", "add", "rule", "inet", "p2pkvloss", "out", "numgen", "random",
                    "mod", "1000", "<", str(per_mille), "drop")
            applied.append(f"{ns}: nft random drop {per_mille}/1000 (no netem: no delay)")
        return "; ".join(applied)

    def close(self) -> None:
        for ns in reversed(self._created):
            _run("ip", "netns", "del", ns, check=False)
        self._created.clear()

    def __enter__(self) -> NetnsPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NsProcess(NodeProcess):
    """``tests/nodeproc.py ROLE SPEC [ADDRESS]`` inside namespace ``ns``; JSON events."""

    def __init__(self, ns: str, role: str, spec: dict[str, Any], *extra: str) -> None:
        super().__init__(role, spec, *extra, prefix=("ip", "netns", "exec", ns))

"""Hosts on one machine: each a network namespace of its own with a private address, all
on one switch, their links shaped by ``tc`` (root only; Linux).

::

    host "front"  10.78.0.1  eth0 ==veth== h0 ┐
    host "a"      10.78.0.2  eth0 ==veth== h1 ├─ br0, the switch (a namespace of its own)
    host "b"      10.78.0.3  eth0 ==veth== h2 ┘

What runs on a host (an engine, a balancer, a filesystem server) reaches another host
only over the two links between them, so a p2pkv fetch, a Redis call or a network
filesystem's traffic crosses real veth links and their queues; loopback and shared
memory stay inside a host (p2pkv proves a same-host peer by boot id *and* network
namespace, so engines on two hosts never map each other's pools). The switch has a
namespace of its own, so the machine's own network (its interfaces, routes, addresses)
does not change at all. A process runs on a host with :meth:`Host.command` (``ip netns
exec``); a thread joins one with :meth:`Hosts.entered`.

:meth:`Hosts.shape` sets a host's link to a rate in both directions (a token bucket,
``tbf``, on each end of the veth: what the host sends, and what the switch sends it).
The kernel here has no ``netem``, so no delay is added: a datacenter's 50-200 µs is
small beside the tens of milliseconds a prefix takes to move. :meth:`Hosts.cut` pulls a
host's cable (its port on the switch goes down: no FIN, no RST) and :meth:`Hosts.heal`
plugs it back.

:meth:`Hosts.close` deletes every namespace (the veths and the bridge go with them); it
runs on ``with`` exit whatever the reason, and a run killed before it is cleaned up by
the next one (the namespaces' names carry the run's pid). Where namespaces cannot be
made, the constructor raises :class:`~p2pkv.bench.netns.Unavailable` with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from p2pkv.bench.netns import Unavailable, check_available, entered, ip, remove_stale, run

__all__ = ["PREFIX", "Host", "Hosts", "Unavailable", "tbf_args"]

#: Every namespace of a run is named ``PREFIX<pid>-<host>``.
PREFIX = "p2pkv-hosts-"
#: The hosts' /24 (private; it exists only inside the run's namespaces).
SUBNET = "10.78.0"
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,15}$")
#: Queueing a token bucket allows before it drops (``tbf latency``): deep enough for
#: TCP to fill the link, shallow enough to stay a link, not a buffer.
TBF_LATENCY_MS = 50


@dataclass(frozen=True)
class Host:
    """One emulated host: its name, network namespace, address, and its port on the
    switch (the veth end in the switch's namespace)."""

    name: str
    netns: str
    address: str
    port: str

    def command(self, *argv: str) -> list[str]:
        """``argv`` as a command that runs on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]


def tbf_args(rate_bits: int) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``rate_bits`` per second: a bucket of at least
    one timer tick's worth of bytes (HZ may be as low as 100) and of a whole GSO packet
    (veths pass 64 KiB segments), so that the rate holds at any speed."""
    if rate_bits <= 0:
        raise ValueError(f"a link's rate must be > 0 bits/s, got {rate_bits}")
    burst = max(128 * 1024, rate_bits // 8 // 100)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst),
            "latency", f"{TBF_LATENCY_MS}ms"]


class Hosts:
    """The hosts ``names`` (in order, addresses ``SUBNET.1``, ``.2``, ...) on one switch.
    Names are short lowercase words (``front``, ``engine-0``)."""

    def __init__(self, names: Sequence[str]) -> None:
        bad = [n for n in names if not _NAME.match(n)]
        if bad or not names or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct lowercase words of at most 16 "
                             f"characters (letters, digits, '-'); got {list(names)}")
        if len(names) > 250:
            raise ValueError(f"at most 250 hosts on one /24, got {len(names)}")
        check_available()
        remove_stale(PREFIX)
        self._tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self._tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._shaped: dict[str, int] = {}
        self._made: list[str] = []
        made = ip("netns", "add", self.switch, check=False)
        if made.returncode != 0:
            raise Unavailable(f"'ip netns add' failed: {made.stderr.strip()}")
        self._made.append(self.switch)
        try:
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                self._add(i, name)
        except BaseException:
            self.close()
            raise

    def _add(self, index: int, name: str) -> None:
        host = Host(name, f"{self._tag}-{name}",
                    f"{SUBNET}.{index + 1}", f"h{index}")
        ip("netns", "add", host.netns)
        self._made.append(host.netns)
        # Made straight in the two namespaces: no name is ever taken in the machine's own.
        ip("link", "add", "eth0", "netns", host.netns, "type", "veth", "peer", "name",
           host.port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", host.port, "master", "br0")
        ip("-n", self.switch, "link", "set", host.port, "up")
        ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.netns, "link", "set", "eth0", "up")
        ip("-n", host.netns, "link", "set", "lo", "up")
        self.hosts[name] = host

    def __getitem__(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r}; hosts: {', '.join(self.hosts)}") from None

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entered(self, name: str) -> contextlib.AbstractContextManager[None]:
        """The calling thread on host ``name`` for a ``with`` block (what it starts
        there stays there): :func:`p2pkv.bench.netns.entered`."""
        return entered(self[name].netns)

    # -- links ---------------------------------------------------------------------------

    def shape(self, name: str, rate_bits: int | None) -> None:
        """Host ``name``'s link at ``rate_bits`` per second each way (``None``: as the
        veth is, unshaped). Replaces what was set before; takes effect at once, also
        under traffic."""
        host = self[name]
        ends = (host.command("tc", "qdisc"), ["ip", "netns", "exec", self.switch, "tc",
                                              "qdisc"])
        for tc, dev in zip(ends, ("eth0", host.port), strict=True):
            if rate_bits is None:
                if name in self._shaped:
                    run([*tc, "del", "dev", dev, "root"])
            else:
                done = run([*tc, "replace", "dev", dev, "root", *tbf_args(rate_bits)],
                           check=False)
                if done.returncode != 0:
                    raise Unavailable(f"tc tbf on {name}'s link failed: "
                                      f"{done.stderr.strip()} (the kernel needs sch_tbf)")
        if rate_bits is None:
            self._shaped.pop(name, None)
        else:
            self._shaped[name] = rate_bits

    def rate(self, name: str) -> int | None:
        """The rate :meth:`shape` set on host ``name``'s link (``None``: unshaped)."""
        self[name]
        return self._shaped.get(name)

    def cut(self, name: str) -> None:
        """Pull host ``name``'s cable: its port on the switch goes down, and nothing it
        sends or is sent arrives (no FIN, no RST) until :meth:`heal`."""
        ip("-n", self.switch, "link", "set", self[name].port, "down")

    def heal(self, name: str) -> None:
        ip("-n", self.switch, "link", "set", self[name].port, "up")

    def received(self, name: str) -> int:
        """Bytes host ``name`` has received over its link so far (the kernel's count)."""
        host = self[name]
        shown = ip("-j", "-s", "-n", host.netns, "link", "show", "dev", "eth0").stdout
        return int(json.loads(shown)[0]["stats64"]["rx"]["bytes"])

    def describe(self) -> dict[str, dict[str, object]]:
        """Each host's address and link rate (bits/s; ``None``: unshaped)."""
        return {n: {"address": h.address, "netns": h.netns, "rate_bits": self.rate(n)}
                for n, h in self.hosts.items()}

    def close(self) -> None:
        """Delete every namespace of the run (their veths and the bridge go with them).
        Safe to call twice and after a partial start."""
        for ns in reversed(self._made):
            with contextlib.suppress(OSError, RuntimeError):
                ip("netns", "del", ns, check=False)
        self._made.clear()
        self.hosts.clear()
        self._shaped.clear()

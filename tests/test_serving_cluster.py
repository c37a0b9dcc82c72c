"""The serving cluster's lifecycle, in seconds: start, balance, kill, stop, fail to start.

The engines here are small HTTP servers that answer ``/health``, ``/metrics`` and
``/v1/completions`` with their own name, installed as the module the cluster runs
(``vllm.entrypoints.openai.api_server``) on a path of the test's own. Like vLLM, they
answer ``/v1/completions/render`` (the prompt's tokens, which vLLM's router asks for)
only with ``--enable-scale-out``, and 403 otherwise. The balancers in front are the real
ones: nginx, and ``vllm-router`` from the vLLM environment (those tests skip without it).
``tests/test_serving.py`` runs the same cluster with real vLLM engines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from vllmenv import REQUIRED, VLLM_PY

from p2pkv.bench.ports import free_port
from p2pkv.bench.serving.balancers import RequestLogUnavailable, VllmRouter
from p2pkv.bench.serving.clients import complete
from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster, ServingStartError

needs_nginx = pytest.mark.skipif(
    shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
    reason="nginx is not installed (make nginx)")
#: The router is looked for next to the engines' Python: the fake engines run on the
#: vLLM environment's Python when a test puts the router in front. Under make test
#: (P2PKV_REQUIRE_VLLM=1) a missing router fails instead.
needs_router = pytest.mark.skipif(
    not REQUIRED and not os.access(VLLM_PY.parent / "vllm-router", os.X_OK),
    reason=f"no vllm-router next to {VLLM_PY} (make vllm-env installs it)")

SERVER = '''
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--served-model-name")
p.add_argument("--enable-scale-out", action="store_true")
args, _ = p.parse_known_args()
if os.environ.get("FAKE_ENGINE_FAIL"):
    sys.exit("fake engine: failing at start as asked")
name = os.environ["FAKE_ENGINE_NAME"]
served = 0
rendered = 0

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, body, kind="application/json", status=200):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self.reply("")
        elif self.path == "/metrics":
            self.reply(f'vllm:prompt_tokens_cached_by_source_total{{engine="0",'
                       f'model_name="m",source="p2p"}} {served}.0\\n'
                       f'fake_rendered_total {rendered}.0\\n', "text/plain")
        else:
            self.send_error(404)
    def do_POST(self):
        global served, rendered
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path.endswith("/render"):
            if not args.enable_scale_out:
                return self.reply('{"error": "Scale-out endpoints are disabled"}', status=403)
            rendered += 1
            tokens = [ord(c) % 32000 for c in body.get("prompt", "")]
            return self.reply(json.dumps([{"request_id": "cmpl-0", "token_ids": tokens,
                                           "sampling_params": {}, "model": "m"}]))
        served += 1
        self.reply(json.dumps({"choices": [{"text": name}]}))

ThreadingHTTPServer(("127.0.0.1", args.port), H).serve_forever()
'''


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    pkg = tmp_path / "fakesite" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(textwrap.dedent(SERVER))
    return tmp_path / "fakesite"


def specs(site: Path, count: int, **env: str) -> list[EngineSpec]:
    return [EngineSpec(f"e{i}", free_port(),
                       env={"PYTHONPATH": str(site), "FAKE_ENGINE_NAME": f"e{i}", **env})
            for i in range(count)]


def gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@needs_nginx
def test_round_robin_through_nginx_and_nothing_left_after_stop(
        fake_vllm: Path, tmp_path: Path) -> None:
    cluster = ServingCluster(tmp_path, specs(fake_vllm, 2), tmp_path / "work",
                             start_timeout=30)
    with cluster:
        answers = [complete(cluster.url, "m", "hi", 1, timeout=10) for _ in range(6)]
        assert sorted(answers) == ["e0"] * 3 + ["e1"] * 3
        deadline = time.monotonic() + 5  # nginx logs a request after its answer went out
        while len(log := cluster.balancer_requests()) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(log) == 6 and {r["status"] for r in log} == {200}
        assert cluster.metrics("e0")[
            "vllm:prompt_tokens_cached_by_source_total{source=p2p}"] == 3.0
        pids = cluster.pids()
    assert all(gone(p) for p in pids)


@needs_nginx
def test_a_killed_engine_is_taken_out_and_a_restarted_one_back_in(
        fake_vllm: Path, tmp_path: Path) -> None:
    cluster = ServingCluster(tmp_path, specs(fake_vllm, 2), tmp_path / "work",
                             start_timeout=30)
    with cluster:
        cluster.kill("e1")
        answers = [complete(cluster.url, "m", "hi", 1, timeout=10) for _ in range(4)]
        assert answers == ["e0"] * 4
        cluster.start_engine("e1")
        time.sleep(5.5)  # nginx's fail_timeout: the engine is tried again after it
        answers = [complete(cluster.url, "m", "hi", 1, timeout=10) for _ in range(4)]
        assert set(answers) == {"e0", "e1"}


def test_an_engine_that_does_not_start_stops_everything_and_says_why(
        fake_vllm: Path, tmp_path: Path) -> None:
    bad = specs(fake_vllm, 2)
    bad[1].env = {**bad[1].env, "FAKE_ENGINE_FAIL": "1"}
    cluster = ServingCluster(tmp_path, bad, tmp_path / "work", start_timeout=30)
    with pytest.raises(ServingStartError, match=r"(?s)engine e1 exited .*failing at start"):
        cluster.start()
    assert all(gone(p) for p in cluster.pids())


@needs_nginx
def test_ctrl_c_on_the_command_stops_every_engine(fake_vllm: Path, tmp_path: Path) -> None:
    """The benchmark command, interrupted while its engines run, leaves none behind."""
    script = tmp_path / "drive.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from p2pkv.bench.ports import free_port
        from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster
        specs = [EngineSpec(f"e{{i}}", free_port(), env={{"PYTHONPATH": {str(fake_vllm)!r},
                 "FAKE_ENGINE_NAME": f"e{{i}}"}}) for i in range(2)]
        with ServingCluster(Path({str(tmp_path)!r}), specs, Path({str(tmp_path / "w")!r}),
                            start_timeout=30) as c:
            print(json.dumps(c.pids()), flush=True)
            time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 3 and not any(gone(p) for p in pids)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(40) != 0
        assert all(gone(p) for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def router_cluster(site: Path, work: Path, balancer: str | VllmRouter) -> ServingCluster:
    return ServingCluster(work, specs(site, 2), work / "work", balancer=balancer,
                          start_timeout=30, balancer_timeout=30, python=str(VLLM_PY))


@needs_router
def test_round_robin_through_vllm_router_and_nothing_left_after_stop(
        fake_vllm: Path, tmp_path: Path) -> None:
    cluster = router_cluster(fake_vllm, tmp_path, "router:round_robin")
    # round_robin does not route on tokens: the engines run without the render endpoint.
    assert not any("--enable-scale-out" in cluster.engine_command(s) for s in cluster.specs)
    with cluster:
        answers = [complete(cluster.url, "m", "hi", 1, timeout=10) for _ in range(6)]
        assert sorted(answers) == ["e0"] * 3 + ["e1"] * 3
        # From the router's own /metrics; it keeps no log of single requests.
        assert cluster.requests_per_engine() == {"e0": 3, "e1": 3}
        with pytest.raises(RequestLogUnavailable, match="requests_per_engine"):
            cluster.balancer_requests()
        pids = cluster.pids()
    assert len(pids) == 3 and all(gone(p) for p in pids)


@needs_router
def test_cache_aware_router_reads_the_tokens_and_keeps_a_prefix_on_one_engine(
        fake_vllm: Path, tmp_path: Path) -> None:
    cluster = router_cluster(fake_vllm, tmp_path, "router:cache_aware")
    assert all("--enable-scale-out" in cluster.engine_command(s) for s in cluster.specs)
    with cluster:
        document = "The same long document, line after line. " * 40
        answers = {complete(cluster.url, "m", f"{document} Question {i}?", 1, timeout=10)
                   for i in range(4)}
        assert len(answers) == 1, answers  # every request of the prefix on one engine
        rendered = sum(cluster.metrics(s.name)["fake_rendered_total"] for s in cluster.specs)
        assert rendered >= 4
        assert sum(cluster.requests_per_engine().values()) == 4


@needs_router
def test_kv_aware_router_subscribes_to_each_engines_kv_events(
        fake_vllm: Path, tmp_path: Path) -> None:
    cluster = router_cluster(fake_vllm, tmp_path, "router:kv_aware")
    ports = [s.kv_events_port for s in cluster.specs]
    assert None not in ports and len(set(ports)) == 2
    for spec in cluster.specs:
        cmd = cluster.engine_command(spec)
        assert "--enable-scale-out" in cmd
        events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
        assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{spec.kv_events_port}"}
    with cluster:
        assert cluster.balancer is not None and cluster.balancer.process is not None
        router = cluster.balancer.process.cmd
        sources = [router[i + 1] for i, a in enumerate(router) if a == "--kv-event-source"]
        assert sources == [f"http://127.0.0.1:{s.port}=tcp://127.0.0.1:{s.kv_events_port}"
                           for s in cluster.specs]
        assert router[router.index("--kv-event-block-size") + 1] == "32"
        assert complete(cluster.url, "m", "hello", 1, timeout=10) in {"e0", "e1"}
    assert all(gone(p) for p in cluster.pids())


def test_a_missing_router_stops_the_engines_and_says_so(
        fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engines' Python (this one) has no vllm-router beside it, and PATH holds none.
    if (Path(sys.executable).parent / "vllm-router").exists():
        pytest.skip("vllm-router is installed next to this Python")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cluster = ServingCluster(tmp_path, specs(fake_vllm, 2), tmp_path / "work",
                             balancer="router:round_robin", start_timeout=30)
    with pytest.raises(ServingStartError,
                       match="router:round_robin: vllm-router not found; make vllm-env"):
        cluster.start()
    assert len(cluster.pids()) == 2 and all(gone(p) for p in cluster.pids())


@needs_router
def test_a_router_that_exits_stops_everything_and_says_why(
        fake_vllm: Path, tmp_path: Path) -> None:
    cluster = router_cluster(fake_vllm, tmp_path,
                             VllmRouter("round_robin", args=["--no-such-flag"]))
    with pytest.raises(ServingStartError, match=r"(?s)router:round_robin exited with 2 "
                       r".*unrecognized arguments: --no-such-flag"):
        cluster.start()
    assert len(cluster.pids()) == 3 and all(gone(p) for p in cluster.pids())

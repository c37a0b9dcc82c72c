"""The serving cluster's lifecycle, in seconds: start, balance, kill, stop, fail to start.

The engines here are small HTTP servers that answer ``/health``, ``/metrics`` and
``/v1/completions`` with their own name, installed as the module the cluster runs
(``vllm.entrypoints.openai.api_server``) on a path of the test's own; nginx in front is
the real one. ``tests/test_serving.py`` runs the same cluster with real vLLM engines.
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

from p2pkv.bench.serving.clients import complete
from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster, ServingStartError, free_port

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
    reason="nginx is not installed (make nginx)")

SERVER = '''
import argparse, json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
p.add_argument("--served-model-name")
args, _ = p.parse_known_args()
if os.environ.get("FAKE_ENGINE_FAIL"):
    sys.exit("fake engine: failing at start as asked")
name = os.environ["FAKE_ENGINE_NAME"]
served = 0

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, body, kind="application/json"):
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self.reply("")
        elif self.path == "/metrics":
            self.reply(f'vllm:prompt_tokens_cached_by_source_total{{engine="0",'
                       f'model_name="m",source="p2p"}} {served}.0\\n', "text/plain")
        else:
            self.send_error(404)
    def do_POST(self):
        global served
        self.rfile.read(int(self.headers["Content-Length"]))
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


def test_ctrl_c_on_the_command_stops_every_engine(fake_vllm: Path, tmp_path: Path) -> None:
    """The benchmark command, interrupted while its engines run, leaves none behind."""
    script = tmp_path / "drive.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from p2pkv.bench.serving.cluster import EngineSpec, ServingCluster, free_port
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

"""The dashboard (deploy/grafana/p2pkv.json) and the alerts (deploy/prometheus/) against a
real Prometheus: Debian's ``prometheus`` and ``promtool`` (``make prometheus`` installs
them as root).

- ``promtool check rules`` and ``promtool test rules`` (the alerts' unit tests, one fire
  and one quiet scenario each, ``for`` included).
- A real cluster scraped by a Prometheus of the test's own (1 s scrapes, file-based
  targets): holders and consumers in a Redis directory, each serving ``/metrics``. A quiet
  phase (fetches that hit) where every alert expression is silent; then faults: a
  holder behind a proxy that corrupts every block (the consumer fails over and
  quarantines it), a refused handshake, a consumer whose lookups never hit, a holder
  killed with SIGKILL. Each alert's expression fires in its scenario; every panel's query
  returns data, and every metric a panel or an alert names is one the nodes export.
- The vLLM tier's series (``vllm:p2pkv_*``) are checked by name against the tier's own
  metric definitions: an offline engine serves no ``/metrics`` to scrape here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clitools import finish, start
from rawpeer import CorruptingProxy
from redisprocs import free_port

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "p2pkv.json"
RULES = ROOT / "deploy" / "prometheus" / "p2pkv-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "p2pkv-alerts.test.yml"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
REQUIRED = os.environ.get("P2PKV_REQUIRE_VLLM") == "1"  # set by make test

if (PROMETHEUS is None or PROMTOOL is None) and not REQUIRED:
    pytest.skip("prometheus/promtool not installed (make prometheus installs them)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(300)
SCRAPE_S = 1.0
#: What ``$__rate_interval`` stands for in the panels' queries here (Grafana: at least
#: four scrape intervals).
RATE_INTERVAL = "1m"
#: vLLM's own metrics that a panel may name beside the tier's (``vllm:p2pkv_*``).
VLLM_OWN = {"vllm:prompt_tokens_cached_by_source"}


def panel_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", ()):
            out.append((panel["title"], target["expr"]))
    return out


def alert_rules() -> dict[str, str]:
    """Alert name -> expression, as the rules file gives them."""
    import yaml

    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return {rule["alert"]: " ".join(rule["expr"].split())
            for group in doc["groups"] for rule in group["rules"] if "alert" in rule}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once label matchers,
    ranges, offsets, grouping clauses, functions and keywords are taken out."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|on|without|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+\w+", " ", text)
    words = re.findall(r"(?<![\w:$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", text)
    return {w for w in words if w not in {"and", "or", "unless", "bool"}}


def tier_metric_names() -> set[str]:
    """The tier's metric names, from its definitions (no vLLM import needed)."""
    text = (ROOT / "p2pkv" / "integrations" / "vllm" / "metrics.py").read_text()
    return set(re.findall(r'"(vllm:p2pkv_[a-z_]+)"', text))


def counter_base(name: str) -> str:
    return name[:-len("_total")] if name.endswith("_total") else name


def test_the_alert_rules_pass_promtool() -> None:
    assert PROMTOOL is not None, "promtool is not installed (make prometheus)"
    check = subprocess.run([str(PROMTOOL), "check", "rules", str(RULES)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 8 rules found" in check.stdout, \
        check.stdout + check.stderr
    unit = subprocess.run([str(PROMTOOL), "test", "rules", RULE_TESTS.name],
                          capture_output=True, text=True, timeout=120, cwd=RULE_TESTS.parent)
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_every_alert_has_a_runbook_entry() -> None:
    """Each alert's ``runbook`` annotation names a section of docs/operations.md."""
    import yaml

    doc = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    anchors = {h.lower() for h in re.findall(r"^### (\w+)", doc, re.M)}
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(rules) == 8
    for rule in rules:
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/operations.md" and anchor in anchors, rule["alert"]


def test_the_tier_series_the_dashboard_and_alerts_name_exist() -> None:
    known = tier_metric_names() | VLLM_OWN
    assert "vllm:p2pkv_loaded_bytes" in known
    named = {counter_base(m) for _, expr in panel_targets() for m in metric_names(expr)}
    named |= {counter_base(m) for expr in alert_rules().values() for m in metric_names(expr)}
    vllm = {m for m in named if m.startswith("vllm:")}
    assert vllm, "the dashboard covers no vLLM tier series"
    assert vllm <= known, sorted(vllm - known)


class Prometheus:
    """A Prometheus of the test's own: 1 s scrapes of the targets in a JSON file it
    watches, the p2pkv alert rules loaded, its API on a free port."""

    def __init__(self, workdir: Path) -> None:
        assert PROMETHEUS is not None, "prometheus is not installed (make prometheus)"
        self.port = free_port()
        self.targets = workdir / "targets.json"
        self.write_targets([])
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": f"{SCRAPE_S:g}s",
                       "evaluation_interval": f"{SCRAPE_S:g}s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{
                "job_name": "p2pkv", "scrape_timeout": "900ms",
                "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}],
            }],
        }))
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                if r.status == 200:
                    break
            assert self.proc.poll() is None, (workdir / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus was not ready within 60 s"
            time.sleep(0.2)

    def write_targets(self, ports: list[int]) -> None:
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [f"127.0.0.1:{p}" for p in ports]}]))
        os.replace(tmp, self.targets)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", (expr, doc)
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def wait_for(self, expr: str, what: str, timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            assert time.monotonic() < deadline, f"{what}: {expr} empty after {timeout:.0f} s"
            time.sleep(0.5)

    def scraped(self, instance: str, samples_after: float) -> None:
        """Wait until ``instance`` was scraped after time ``samples_after`` (twice)."""
        self.wait_for(f'count_over_time(up{{instance="{instance}"}}[1m]) >= 2 and '
                      f'timestamp(up{{instance="{instance}"}}) > {samples_after + SCRAPE_S}',
                      f"scrapes of {instance}")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path)
    try:
        yield prom
    finally:
        prom.close()


def test_dashboard_and_alerts_against_a_real_cluster(prometheus: Prometheus,
                                                     redis_url: str) -> None:
    from test_cluster import FAST, SMALL, ClusterProcess

    rules = alert_rules()
    base = {**SMALL, "directory": redis_url, "cluster": FAST, "metrics": True}
    procs: list[ClusterProcess] = []
    proxy: CorruptingProxy | None = None

    def started(spec: dict[str, Any]) -> tuple[ClusterProcess, str]:
        proc = ClusterProcess({**base, **spec})
        procs.append(proc)
        proc.await_ready()
        return proc, f"127.0.0.1:{proc.ready['metrics_port']}"

    def firing() -> set[str]:
        return {name for name, expr in rules.items() if prometheus.query(expr)}

    try:
        good, good_at = started({"count": 80, "pool": 88})
        consumer, consumer_at = started({"count": 0, "pool": 48, "cluster": {
            **FAST, "health": {"after": 2, "base": 60.0, "longest": 120.0, "ramp": 0}}})
        targets = [int(good_at.rsplit(":", 1)[1]), int(consumer_at.rsplit(":", 1)[1])]
        prometheus.write_targets(targets)
        t0 = time.time()
        prometheus.scraped(good_at, t0)
        prometheus.scraped(consumer_at, t0)

        # Quiet: fetches that hit, from the one holder. Nothing fires.
        for r in range(2):
            fetched = consumer.send(op="fetch", count=20, offset=20 * r)
            assert fetched["outcomes"] == ["LANDED"] * 20
        t1 = time.time()
        prometheus.scraped(consumer_at, t1)
        prometheus.scraped(good_at, t1)
        assert firing() == set(), "alerts fire on a quiet cluster"

        # A holder behind a proxy that corrupts every block it relays: the consumer's
        # fetches fail over to the good holder, and it quarantines the corrupting one.
        port = free_port()
        proxy = CorruptingProxy(f"tcp://127.0.0.1:{port}", every=1, first=1)
        _sick, sick_at = started({"count": 80, "pool": 88, "advertise": proxy.address,
                                 "config": {"listen": f"tcp://127.0.0.1:{port}"}})
        targets.append(int(sick_at.rsplit(":", 1)[1]))
        # A consumer whose lookups never find anything (keys nobody holds).
        lost, lost_at = started({"count": 0, "pool": 16, "key_offset": 0})
        targets.append(int(lost_at.rsplit(":", 1)[1]))
        prometheus.write_targets(targets)
        t2 = time.time()
        prometheus.scraped(sick_at, t2)
        prometheus.scraped(lost_at, t2)
        for r in range(2, 6):
            consumer.send(op="fetch", count=20, offset=20 * (r % 4))
        assert consumer.send(op="stats")["quarantines"] >= 1
        for r in range(3):
            missed = lost.send(op="fetch", count=8, offset=5000 + 8 * r)
            assert "LANDED" not in missed["outcomes"]
        # A peer with another identity: refused at the handshake by the good holder.
        code, out, err = finish(start("probe", good.ready["address"], "--handshake-timeout",
                                      "5", "--json"))
        assert code != 0 and "refused" in out + err, out + err
        t3 = time.time()
        for at in (good_at, consumer_at, lost_at):
            prometheus.scraped(at, t3)
        expected = {"P2PKVRefusalsAppeared", "P2PKVZeroHitRate", "P2PKVHolderQuarantined",
                    "P2PKVDirectoryTrouble"}
        fired = firing()
        assert fired == expected, (fired, {n: prometheus.query(rules[n]) for n in rules})
        lost_instances = {r["metric"]["instance"] for r in prometheus.query(
            rules["P2PKVZeroHitRate"])}
        assert lost_instances == {lost_at}, lost_instances

        # Every panel returns data now; every metric it names is one the nodes export.
        exported = {counter_base(r["metric"]["__name__"]) for r in prometheus.query(
            '{__name__=~"p2pkv_.+"}')}
        for title, expr in panel_targets():
            names = metric_names(expr)
            if all(n.startswith("vllm:") for n in names):
                continue  # the tier's series: checked by name above
            assert {counter_base(n) for n in names} <= exported, (title, expr)
            assert prometheus.query(expr.replace("$__rate_interval", RATE_INTERVAL)), \
                f"panel {title!r}: no data for {expr}"
        for name, expr in rules.items():
            names = {counter_base(n) for n in metric_names(expr)}
            assert {n for n in names if not n.startswith(("vllm:", "up"))} <= exported, \
                (name, names - exported)

        # A holder killed with SIGKILL: its scrape fails.
        os.kill(good.proc.pid, signal.SIGKILL)
        good.proc.wait(10)
        prometheus.wait_for(f'up{{instance="{good_at}"}} == 0', "the killed holder's up")
        down = prometheus.query(rules["P2PKVNodeDown"])
        assert {r["metric"]["instance"] for r in down} == {good_at}, down
    finally:
        for proc in procs:
            proc.kill()
        if proxy is not None:
            proxy.close()

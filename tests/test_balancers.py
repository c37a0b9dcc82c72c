"""The serving bench's balancer choices, command lines and workloads, with no process
started: what ``--balancer`` accepts, what each balancer asks of the engines and runs,
how rows are named and compared, and the skewed workload's draw.

``tests/test_serving_cluster.py`` starts the balancers for real in front of small fake
engines; ``tests/test_serving_router.py`` puts vLLM's router in front of real ones.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from p2pkv.bench.serving.balancers import (
    ROUTER_POLICIES,
    Launch,
    Nginx,
    RequestLogUnavailable,
    Upstream,
    VllmRouter,
    parse_balancer,
    parse_balancers,
)
from p2pkv.bench.serving.clients import BenchWorkload, prefix_ids
from p2pkv.bench.serving.cluster import BLOCK_SIZE, EngineSpec, ServingCluster
from p2pkv.bench.serving.configs import engine_specs, tier_options
from p2pkv.bench.serving.run import _parser, _problem
from p2pkv.bench.serving.skew import MAX_PROMPT_TOKENS, prefix_order, zipf_weights
from p2pkv.bench.serving.tables import ratios, run_label


def test_balancer_choices_parse_and_name_themselves() -> None:
    assert parse_balancer("nginx").label == "nginx"
    assert parse_balancer("router").label == "router:cache_aware"
    assert [b.label for b in parse_balancers("nginx, router:kv_aware,")] == [
        "nginx", "router:kv_aware"]
    for policy in ROUTER_POLICIES:
        assert parse_balancer(f"router:{policy}").label == f"router:{policy}"
    for bad in ("haproxy", "nginx:round_robin"):
        with pytest.raises(ValueError, match="choose nginx or router:POLICY"):
            parse_balancer(bad)
    with pytest.raises(ValueError, match="unknown vllm-router policy 'fastest'; choose"):
        parse_balancer("router:fastest")
    # Each parse is a balancer of its own: one per cluster.
    assert parse_balancer("nginx") is not parse_balancer("nginx")


def test_token_policies_ask_the_engines_for_the_render_endpoint() -> None:
    assert Nginx().engine_args() == ()
    assert VllmRouter("round_robin").engine_args() == ()
    assert VllmRouter("cache_aware").engine_args() == ("--enable-scale-out",)
    assert VllmRouter("kv_aware").engine_args() == ("--enable-scale-out",)
    assert [VllmRouter(p).wants_kv_events for p in ("cache_aware", "kv_aware")] == [
        False, True]


def launch(tmp_path: Path, events: bool = True) -> Launch:
    ups = tuple(Upstream(f"e{i}", 8101 + i, 5601 + i if events else None) for i in range(2))
    return Launch(tmp_path, 8100, ups, "smollm2", BLOCK_SIZE, 30.0)


def test_the_router_command_line(tmp_path: Path) -> None:
    router = VllmRouter("kv_aware", args=["--balance-abs-threshold", "4"])
    cmd = router.command("/venv/bin/vllm-router", launch(tmp_path))
    assert cmd[:5] == ["/venv/bin/vllm-router", "--host", "127.0.0.1", "--port", "8100"]
    at = cmd.index("--worker-urls")
    assert cmd[at + 1:at + 3] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert cmd[cmd.index("--policy") + 1] == "kv_aware"
    # Its Prometheus endpoint on a free port of loopback, not the default 29000.
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--prometheus-port") + 1] == str(router.metrics_port) != "29000"
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    assert sources == ["http://127.0.0.1:8101=tcp://127.0.0.1:5601",
                       "http://127.0.0.1:8102=tcp://127.0.0.1:5602"]
    assert cmd[cmd.index("--kv-event-model") + 1] == "smollm2"
    assert cmd[cmd.index("--kv-event-block-size") + 1] == str(BLOCK_SIZE)
    assert cmd[-2:] == ["--balance-abs-threshold", "4"]
    assert "--kv-event-source" not in VllmRouter("cache_aware").command("r", launch(tmp_path))


def test_kv_aware_refuses_engines_without_events(tmp_path: Path) -> None:
    from p2pkv.bench.serving.processes import ServingStartError

    with pytest.raises(ServingStartError, match=r"e0.*e1|publish none"):
        VllmRouter("kv_aware").command("r", launch(tmp_path, events=False))


def test_nginx_runs_round_robin_from_its_own_config(tmp_path: Path) -> None:
    cmd = Nginx().command("/usr/sbin/nginx", launch(tmp_path))
    assert cmd == ["/usr/sbin/nginx", "-e", "stderr", "-c", str(tmp_path / "nginx.conf"),
                   "-g", "daemon off;"]
    conf = (tmp_path / "nginx.conf").read_text()
    assert "listen 127.0.0.1:8100;" in conf
    assert conf.count("server 127.0.0.1:81") == 2


def test_request_logs_and_counts_per_engine(tmp_path: Path) -> None:
    nginx = Nginx()
    nginx.launch = launch(tmp_path)
    (tmp_path / "nginx-access.log").write_text(
        '1.0 200 0.5 "127.0.0.1:8101" "POST /v1/completions HTTP/1.1"\n'
        '2.0 200 0.5 "127.0.0.1:8101, 127.0.0.1:8102" "POST /v1/completions HTTP/1.1"\n'
        '3.0 200 0.1 "127.0.0.1:8102" "GET /health HTTP/1.1"\n')
    log = nginx.request_log()
    assert [r["upstreams"][-1] for r in log] == ["127.0.0.1:8101", "127.0.0.1:8102"]
    assert nginx.requests_per_engine() == {"e0": 1, "e1": 1}
    with pytest.raises(RequestLogUnavailable, match="router:cache_aware keeps no"):
        VllmRouter().request_log()


def test_the_cluster_wires_the_balancer_into_the_engines(tmp_path: Path) -> None:
    specs = [EngineSpec(f"e{i}", 8101 + i) for i in range(2)]
    plain = ServingCluster(tmp_path, specs, tmp_path / "w")
    assert plain.balancer is not None and plain.balancer.label == "nginx"
    cmd = plain.engine_command(plain.specs[0])
    assert "--kv-events-config" not in cmd and "--enable-scale-out" not in cmd
    assert cmd[cmd.index("--block-size") + 1] == str(BLOCK_SIZE)
    kv = ServingCluster(tmp_path, specs, tmp_path / "w", balancer="router:kv_aware")
    assert [s.kv_events_port is not None for s in kv.specs] == [True, True]
    assert all(s.kv_events_port is None for s in specs)  # the caller's specs are kept
    cmd = kv.engine_command(kv.specs[1])
    assert cmd.count("--enable-scale-out") == 1
    assert json.loads(cmd[cmd.index("--kv-events-config") + 1])["endpoint"] == \
        f"tcp://*:{kv.specs[1].kv_events_port}"
    alone = ServingCluster(tmp_path, specs, tmp_path / "w", balancer=None)
    assert alone.url == "http://127.0.0.1:8101"
    assert alone.requests_per_engine() == {} and alone.balancer_requests() == []


def test_rows_are_named_and_compared_per_balancer() -> None:
    assert run_label("p2pkv", "nginx") == "p2pkv"
    assert run_label("none#2", "router:cache_aware") == "none#2@router:cache_aware"

    def row(config: str, balancer: str, ttft: float) -> dict[str, object]:
        return {"config": run_label(config, balancer), "balancer": balancer,
                "ttft_p50_ms": ttft, "ttft_p99_ms": ttft, "req_per_s": 1.0}

    out = ratios([row("none", "nginx", 100), row("p2pkv", "nginx", 50),
                  row("none", "router:cache_aware", 80),
                  row("p2pkv", "router:cache_aware", 40)])
    assert out["ttft_p50 p2pkv/none"] == 0.5
    assert out["ttft_p50 p2pkv/none @router:cache_aware"] == 0.5
    assert not any("router" in k and "nginx" in k for k in out)


def test_faults_need_nginx_and_unknown_balancers_are_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["--model", str(model)]
    assert _problem(_parser().parse_args(base)) is None
    assert _problem(_parser().parse_args([*base, "--balancer", "nginx,router"])) is None
    assert "unknown vllm-router policy 'best'" in (
        _problem(_parser().parse_args([*base, "--balancer", "router:best"])) or "")
    assert "--balancer nginx" in (_problem(_parser().parse_args(
        [*base, "--faults", "--balancer", "router:cache_aware"])) or "")


def test_tier_options_reach_every_p2pkv_engine_and_bad_ones_are_named(
        tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["--model", str(model)]
    args = _parser().parse_args([*base, "--pending-wait", "0", "--tier-option",
                                 "load_policy=false", "--tier-option", "lookup_wait=0.2"])
    assert _problem(args) is None
    options = tier_options(args, heartbeat_timeout=5.0)
    assert options == {"lookup_timeout": 1.0, "fetch_timeout": 30.0, "pending_wait": 0.0,
                       "load_policy": False, "lookup_wait": 0.2, "heartbeat_timeout": 5.0}
    spec = engine_specs("p2pkv", 2, cpu_bytes=2**28, workdir=tmp_path,
                        tier_options=options)[0]
    assert spec.kv_transfer_config is not None
    (tier,) = spec.kv_transfer_config["kv_connector_extra_config"]["secondary_tiers"]
    assert tier["load_policy"] is False and tier["pending_wait"] == 0.0
    for bad, says in (("load_policy", "expected NAME=VALUE"),
                      ("peers=[]", "'peers' is not a tier option the bench lets you set"),
                      ("colour=red", "'colour' is not a tier option"),
                      ("load_policy=sometimes", "load_policy must be true or false"),
                      ("load_min_speedup=-1", "load_min_speedup must be a positive")):
        assert says in (_problem(_parser().parse_args([*base, "--tier-option", bad]))
                        or ""), bad


def test_the_skewed_workload_draws_hot_prefixes() -> None:
    weights = zipf_weights(16, 1.5)
    assert abs(sum(weights) - 1) < 1e-9 and weights == sorted(weights, reverse=True)
    assert zipf_weights(4, 0) == [0.25] * 4
    order = prefix_order(16, 400, 1.5, seed=0)
    assert order == prefix_order(16, 400, 1.5, seed=0) != prefix_order(16, 400, 1.5, seed=1)
    top3 = sum(n for _, n in Counter(order).most_common(3))
    assert top3 > 0.6 * len(order)  # a few hot prefixes take most requests
    w = BenchWorkload(prefix_len=960, suffix_len=64, num_prompts=48, prefix_skew=1.5)
    assert prefix_ids(w, Path("unused")) == prefix_order(16, 48, 1.5, 0)  # no vLLM needed
    args = w.args(Path("/tmp/prompts.json"))
    assert args[:4] == ["--dataset-name", "sharegpt", "--dataset-path", "/tmp/prompts.json"]
    assert {"--disable-shuffle", "--no-oversample"} <= set(args)
    assert args[args.index("--sharegpt-output-len") + 1] == "16"
    assert w.describe()["prefix_skew"] == 1.5 and w.name.startswith("skewed")
    with pytest.raises(ValueError, match="needs its prompts' file"):
        w.args()
    with pytest.raises(ValueError, match=str(MAX_PROMPT_TOKENS)):
        BenchWorkload(prefix_len=1024, suffix_len=64, prefix_skew=1.0)
    uniform = BenchWorkload()
    assert uniform.args()[:2] == ["--dataset-name", "prefix_repetition"]
    assert uniform.name == "prefix_repetition"


def test_engines_on_hosts_listen_and_find_each_other_at_their_hosts_addresses(
        tmp_path: Path) -> None:
    """On emulated hosts (no namespace is made here): each engine runs on its host
    (``ip netns exec``), listens on the host's address, p2pkv's peers are the other
    hosts' addresses (or the Redis directory instead), the balancer reaches each engine
    at its host, and ``fs-net`` needs a mount per host."""
    from p2pkv.bench.hosts import Host

    hosts = [Host(f"engine-{i}", f"ns-{i}", f"10.78.0.{i + 2}", f"h{i}") for i in range(2)]
    specs = engine_specs("p2pkv", 2, cpu_bytes=2**28, workdir=tmp_path, hosts=hosts)
    tiers = [s.kv_transfer_config["kv_connector_extra_config"]["secondary_tiers"][0]
             for s in specs if s.kv_transfer_config is not None]
    assert [t["listen"].rsplit(":", 1)[0] for t in tiers] == ["tcp://10.78.0.2",
                                                              "tcp://10.78.0.3"]
    assert tiers[0]["peers"] == [tiers[1]["listen"]] and tiers[1]["peers"] == [
        tiers[0]["listen"]]
    cluster = ServingCluster(tmp_path, specs, tmp_path / "w")
    cmd = cluster.engine_command(cluster.specs[1])
    assert cmd[:4] == ["ip", "netns", "exec", "ns-1"]
    assert cmd[cmd.index("--host") + 1] == "10.78.0.3"
    assert cluster.engine_url(specs[1].name) == f"http://10.78.0.3:{specs[1].port}"
    ups = tuple(Upstream(s.name, s.port, None, s.address) for s in specs)
    Nginx().command("nginx", Launch(tmp_path, 8100, ups, "m", BLOCK_SIZE, 30.0))
    conf = (tmp_path / "nginx.conf").read_text()
    assert f"server 10.78.0.2:{specs[0].port} " in conf
    via = engine_specs("p2pkv", 2, cpu_bytes=2**28, workdir=tmp_path, hosts=hosts,
                       directory="redis://10.78.0.1:7000/0")
    (tier,) = via[0].kv_transfer_config["kv_connector_extra_config"][  # type: ignore[index]
        "secondary_tiers"]
    assert tier["directory"] == "redis://10.78.0.1:7000/0" and "peers" not in tier
    with pytest.raises(ValueError, match=r"fs-net .* only on emulated hosts"):
        engine_specs("fs-net", 2, cpu_bytes=2**28, workdir=tmp_path)
    roots = [tmp_path / "mnt-0" / "run", tmp_path / "mnt-1" / "run"]
    fs = engine_specs("fs-net", 2, cpu_bytes=2**28, workdir=tmp_path, hosts=hosts,
                      fs_net_roots=roots)
    assert [s.kv_transfer_config["kv_connector_extra_config"][  # type: ignore[index]
        "secondary_tiers"][0]["root_dir"] for s in fs] == [str(r) for r in roots]


def test_rows_are_compared_per_link_profile_and_trace_rows_against_none() -> None:
    from p2pkv.bench.serving.tables import trace_row

    assert run_label("p2pkv", "router:cache_aware", "25G") == "p2pkv@router:cache_aware/25G"

    def row(config: str, profile: str, ttft: float) -> dict[str, object]:
        return {"config": run_label(config, "nginx", profile), "balancer": "nginx",
                "profile": profile, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft,
                "req_per_s": 1.0, "trace_ttft_p50_ms": ttft / 10}

    out = ratios([row("none", "100G", 100), row("p2pkv", "100G", 50),
                  row("none", "slow", 100), row("p2pkv", "slow", 200)])
    assert out["ttft_p50 p2pkv/none /100G"] == 0.5
    assert out["ttft_p50 p2pkv/none /slow"] == 2.0
    assert out["trace ttft_p50 p2pkv/none /slow"] == 2.0

    def replay(texts: list[str | None]) -> dict[str, object]:
        ms = {"p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0, "mean_ms": 1.5}
        return {"summary": {"ttft": ms, "failed": texts.count(None),
                            "schedule_lag": {"p99_ms": 4.0},
                            "goodput": {"ttft<=1000ms": 0.5}},
                "counters": {"cached_tokens[p2p]": 64.0},
                "records": [{"text": t or "", "error": None if t is not None else "timeout"}
                            for t in texts]}

    fields = trace_row(replay(["a", "b", None, "d"]), replay(["a", "x", "c", "d"]))
    # The failed request is not compared; of the other three one differs.
    assert fields["trace_text_mismatch_vs_none"] == 1 / 3
    assert fields["trace_failed"] == 1 and fields["trace_tokens_from_peer"] == 64.0
    assert fields["trace_goodput[ttft<=1000ms]"] == 0.5
    assert trace_row(None, None) == {}


def test_host_options_need_hosts_and_name_what_is_wrong(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["--model", str(model)]
    for extra in (["--links", "25G"], ["--kv-rate", "1e6"], ["--configs", "none,fs-net"]):
        assert "need --hosts" in (_problem(_parser().parse_args([*base, *extra])) or "")
    assert _problem(_parser().parse_args([*base, "--hosts", "--links", "100G,25G,slow"])) \
        is None
    assert "unknown link profile(s) ['40G']" in (_problem(_parser().parse_args(
        [*base, "--hosts", "--links", "100G,40G"])) or "")
    assert "--kv-rate must be" in (_problem(_parser().parse_args(
        [*base, "--hosts", "--kv-rate", "nan"])) or "")
    assert "give a shaped profile first" in (_problem(_parser().parse_args(
        [*base, "--hosts", "--faults"])) or "")
    missing = tmp_path / "missing.jsonl"
    assert f"--trace {missing}" in (_problem(_parser().parse_args(
        [*base, "--trace", str(missing)])) or "")
    assert _problem(_parser().parse_args([*base, "--trace", "none"])) is None

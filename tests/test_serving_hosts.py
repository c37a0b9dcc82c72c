"""p2pkv across hosts: two ``vllm serve`` engines, each on an emulated host of its own (a
network namespace on a bridge, :mod:`p2pkv.bench.hosts`), their links shaped by ``tc``
(root only; skipped with the reason where namespaces cannot be made).

- A prompt computed by the engine on one host and then sent to the engine on the other
  is loaded from the first over the link, found through a Redis directory on a third
  host: the holder's address is its host's, not loopback; the bytes the loading host
  received over its link cover the bytes p2pkv loaded (no shared memory between hosts);
  and the greedy texts are equal.
- The link profiles follow the measured KV rate (``100G`` 4x, ``25G`` 1x, ``slow`` 0.5x)
  and the shaped rate holds on a real transfer across a link.
- When the hosts close, none of their namespaces is left.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from vllmenv import VLLM_PY, serve, skip_without_vllm, smollm2

from p2pkv.bench.hosts import PREFIX, Hosts
from p2pkv.bench.netns import Unavailable
from p2pkv.bench.redis_servers import LocalRedis, find_redis_server
from p2pkv.bench.serving.clients import complete
from p2pkv.bench.serving.cluster import ServingCluster
from p2pkv.bench.serving.configs import engine_specs
from p2pkv.bench.serving.links import PROFILES, KvRate, kv_bytes_per_token, parse_profiles

pytestmark = [pytest.mark.netns, pytest.mark.slow]

NAME = "smollm2"
#: Each engine's link (both ways): 400 Mb/s, about 50 MB/s, several times what one
#: engine here makes of KV, so a load beats computing, as on a "100G" profile.
RATE_BITS = 400_000_000


def _hosts(names: list[str]) -> Hosts:
    try:
        return Hosts(names)
    except Unavailable as exc:
        pytest.skip(str(exc))


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=20).stdout.split()
    return {n for n in listed if n.startswith(PREFIX)}


def test_profiles_are_multiples_of_the_measured_kv_rate() -> None:
    rate = KvRate.measured(1000, (2.0, 1.0, 4.0), bytes_per_token=46_080)
    assert rate.tokens_per_s == 500  # the median prompt's time
    assert rate.bytes_per_s == 500 * 46_080
    bits = {p.name: p.rate_bits(rate.bytes_per_s) for p in PROFILES.values()}
    assert bits == {"100G": 4 * 8 * 500 * 46_080, "25G": 8 * 500 * 46_080,
                    "slow": 4 * 500 * 46_080, "unshaped": None}
    assert kv_bytes_per_token(smollm2()) == 30 * 2 * 3 * 64 * 4  # SmolLM2, fp32
    assert KvRate.given(2e7, 46_080).bytes_per_s == pytest.approx(2e7)
    with pytest.raises(ValueError, match=r"unknown link profile.*'40G'.*choose from"):
        parse_profiles("100G,40G")


def test_a_shaped_link_holds_its_rate_and_a_cut_one_carries_nothing() -> None:
    before = _namespaces()
    with _hosts(["a", "b"]) as hosts:
        hosts.shape("b", 80_000_000)  # 10 MB/s
        server = subprocess.Popen(hosts["b"].command(
            "python3", "-c",
            "import socket\ns = socket.create_server(('0.0.0.0', 5001))\n"
            "s.settimeout(30)\nc, _ = s.accept()\nc.settimeout(30)\n"
            "while c.recv(1 << 20): pass\n"), stdout=subprocess.DEVNULL)
        try:
            with hosts.entered("a"):
                sock = _connect(hosts["b"].address, 5001)
                started = time.monotonic()
                for _ in range(20):
                    sock.sendall(b"x" * 2**20)
                sock.close()
            server.wait(30)
            seconds = time.monotonic() - started
            # 20 MiB at 10 MB/s: about 2 s (the bucket's first burst and the queue a
            # little less); far more than the unshaped veth's hundreds of MB/s allow.
            assert 1.5 < seconds < 10, seconds
            assert hosts.received("b") >= 20 * 2**20
            hosts.cut("b")
            with hosts.entered("a"), pytest.raises(OSError):
                socket.create_connection((hosts["b"].address, 5001), timeout=1)
            hosts.heal("b")
        finally:
            server.kill()
            server.wait(10)
    assert _namespaces() == before


def _connect(address: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection((address, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def on_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hosts,
                                                                         ServingCluster]]:
    """Two engines on hosts of their own that find each other through a Redis directory
    on a third host (``front``, where this test's requests come from too)."""
    skip_without_vllm()
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed (make test installs it as root)")
    workdir = tmp_path_factory.mktemp("hosts")
    with _hosts(["front", "engine-0", "engine-1"]) as hosts:
        for name in ("engine-0", "engine-1"):
            hosts.shape(name, RATE_BITS)
        front = hosts["front"].address
        with hosts.entered("front"), LocalRedis(args=["--bind", "127.0.0.1", front]) as redis:
            specs = engine_specs("p2pkv", 2, cpu_bytes=512 * 2**20, workdir=workdir,
                                 tier_options={"pending_wait": 30.0},
                                 hosts=[hosts["engine-0"], hosts["engine-1"]],
                                 directory=f"redis://{front}:{redis.port}/0")
            cluster = ServingCluster(smollm2(), specs, workdir, served_name=NAME,
                                     max_model_len=2048, balancer=None,
                                     python=str(VLLM_PY))
            yield from ((hosts, c) for c in serve(cluster))


def _metric(cluster: ServingCluster, engine: str, prefix: str) -> float:
    """The sum of an engine's samples named ``prefix...`` (counters' ``_created``
    timestamps left out)."""
    return sum(v for k, v in cluster.metrics(engine).items()
               if k.startswith(prefix) and "_created" not in k)


def _wait_stored(cluster: ServingCluster, engine: str, chunks: int) -> None:
    deadline = time.monotonic() + 60
    while _metric(cluster, engine, "vllm:p2pkv_stored_blocks") < chunks:
        assert time.monotonic() < deadline, "the holder's chunks never reached its tier"
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_a_prompt_computed_on_one_host_is_loaded_over_the_link_by_the_other(
        on_hosts: tuple[Hosts, ServingCluster]) -> None:
    hosts, cluster = on_hosts
    holder, loader = (s.name for s in cluster.specs)
    for spec, host in zip(cluster.specs, ("engine-0", "engine-1"), strict=True):
        tier = spec.kv_transfer_config["kv_connector_extra_config"][  # type: ignore[index]
            "secondary_tiers"][0]
        assert tier["listen"].startswith(f"tcp://{hosts[host].address}:"), tier
        assert tier["directory"].startswith(f"redis://{hosts['front'].address}:"), tier
    prompt = " ".join(f"Line {i}: the harbor lantern {i * 7} glows over the quay."
                      for i in range(70))
    first = complete(cluster.engine_url(holder), NAME, prompt, 24)
    _wait_stored(cluster, holder, 8)
    received = hosts.received("engine-1")
    second = complete(cluster.engine_url(loader), NAME, prompt, 24)
    crossed = hosts.received("engine-1") - received
    from_peer = _metric(cluster, loader,
                        "vllm:prompt_tokens_cached_by_source_total{source=p2p}")
    loaded = _metric(cluster, loader, "vllm:p2pkv_loaded_bytes")
    assert from_peer >= 512, from_peer
    assert loaded >= 512 * kv_bytes_per_token(smollm2()), loaded
    # Everything the loader loaded came in over its link (its engine's request and the
    # p2pkv lookups are a few KB beside it): no shared memory between hosts.
    assert crossed >= loaded, (crossed, loaded)
    assert second == first, (first, second)
    # The loader found the holder through the directory on the front host.
    assert _metric(cluster, loader, "vllm:p2pkv_directory_hits") >= 8
    assert _metric(cluster, loader, "vllm:p2pkv_directory_errors") == 0

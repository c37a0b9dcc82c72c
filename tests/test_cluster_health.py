"""Operations a cluster needs: holders that keep failing are quarantined (no retry storm),
a node a consumer has just met takes a small share first (slow start), and a node that
leaves drains (new fetches declined so consumers fail over, in-flight ones finish).

Real nodes on 127.0.0.1, a real corrupting proxy, and ``p2pkv-node serve`` processes with
a real Redis for the drain on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from nodeproc import content, keys_for, make_node
from rawpeer import CorruptingProxy, ThrottlingProxy
from test_cluster import FAST, SMALL, ClusterProcess, wait_for

from p2pkv.cluster import Cluster, ClusterConfig
from p2pkv.cluster.health import HealthConfig, HolderHealth
from p2pkv.errors import ConfigError, TransferFailed
from p2pkv.node import KeyOutcome

pytestmark = pytest.mark.timeout(180)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------- bookkeeping


def test_quarantine_follows_failures_backs_off_and_is_bounded() -> None:
    clock = Clock()
    health = HolderHealth(HealthConfig(after=2, base=2.0, longest=5.0), clock=clock)
    assert not health.failed("a", "PeerTimeout")  # one failure is not a pattern
    assert health.failed("a", "PeerTimeout")
    assert health.quarantined("a") and not health.quarantined("b")
    assert health.snapshot()["a"].reason == "PeerTimeout"
    clock.now += 2.01
    assert not health.quarantined("a")
    # Out again and failing again: twice as long, then never more than `longest`.
    health.failed("a", "failed blocks")
    assert health.failed("a", "failed blocks")
    clock.now += 3.9
    assert health.quarantined("a")
    clock.now += 0.2
    health.failed("a", "x")
    health.failed("a", "x")
    assert health.snapshot()["a"].until - clock.now == pytest.approx(5.0)
    assert health.quarantines == 3
    # One good fetch starts the count over.
    clock.now += 6
    health.failed("a", "x")
    health.succeeded("a")
    assert not health.failed("a", "x")


def test_slow_start_ramps_a_new_holder_and_a_restarted_one() -> None:
    clock = Clock()
    health = HolderHealth(HealthConfig(ramp=10.0, floor=0.1), clock=clock)
    assert health.weight("a", "node-1") == pytest.approx(0.1)
    clock.now += 5
    assert health.weight("a", "node-1") == pytest.approx(0.5)
    clock.now += 10
    assert health.weight("a", "node-1") == 1.0
    # Another node id at the same address: a restart, it starts slow again.
    assert health.weight("a", "node-2") == pytest.approx(0.1)
    assert HolderHealth(HealthConfig(ramp=0)).weight("b", "n") == 1.0


def test_a_restarted_node_is_not_held_to_the_old_one_s_quarantine() -> None:
    """Quarantine judges a node, not a port: a node id that never failed at the address
    (the old node restarted) ends the quarantine and starts slow; the old id, still in
    an unexpired directory entry, does not lift a later quarantine of the new one."""
    clock = Clock()
    health = HolderHealth(HealthConfig(after=2, base=2.0, longest=60.0, ramp=10.0,
                                       floor=0.1), clock=clock)
    health.weight("a", "old")
    for _ in range(2):  # down for a while: quarantined twice in a row, 2 s then 4 s
        health.failed("a", "PeerGone", "old")
        assert health.failed("a", "PeerGone", "old")
        clock.now += 2.01
    assert health.quarantined("a", "old") and health.quarantined("a")
    assert health.snapshot()["a"].times == 2
    assert not health.quarantined("a", "new")  # the restarted node
    assert not health.quarantined("a", "old") and health.snapshot() == {}
    assert health.weight("a", "new") == pytest.approx(0.1)  # slow start
    # The new node fails in its turn: a first quarantine (2 s), which the old id does
    # not lift.
    health.failed("a", "failed blocks", "new")
    assert health.failed("a", "failed blocks", "new")
    assert health.snapshot()["a"].until - clock.now == pytest.approx(2.0)
    assert health.quarantined("a", "old") and health.quarantined("a", "new")


@pytest.mark.parametrize("bad", [{"after": 0}, {"base": -1}, {"longest": 1.0, "base": 2.0},
                                 {"ramp": -1}, {"floor": 0}, {"floor": 1.5}])
def test_health_settings_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HealthConfig(**bad)


# ----------------------------------------------------------------------- real nodes


@pytest.fixture
def built() -> Iterator[list[Any]]:
    """Nodes and clusters made by a test, closed at teardown (clusters first)."""
    made: list[Any] = []
    yield made
    for thing in reversed(made):
        thing.close()


def holders(built: list[Any], count: int, keys: list[bytes]) -> list[Any]:
    out = []
    for _ in range(count):
        node = make_node({**SMALL, "pool": len(keys) + 8})
        built.append(node)
        for k in keys:
            node.put(k, content(k, node.layout.bytes_per_block))
        out.append(node)
    return out


def consumer(built: list[Any], peers: tuple[str, ...], health: HealthConfig) -> Cluster:
    node = make_node({**SMALL, "pool": 256})
    built.append(node)
    cluster = Cluster(node, peers=peers, config=ClusterConfig(health=health))
    built.append(cluster)
    return cluster


def test_a_holder_that_keeps_sending_corrupt_blocks_is_quarantined(built: list[Any]) -> None:
    """Round 1 and 2: the corrupt holder's blocks fail their checksums and those keys
    fail over to the good holder. After the second failure it is quarantined: round 3
    sends it nothing at all, and lookups no longer name it."""
    keys = keys_for(60)
    good, sick = holders(built, 2, keys)
    proxy = CorruptingProxy(sick.address, every=1, first=1)
    built.append(proxy)
    cluster = consumer(built, (good.address, proxy.address), HealthConfig(after=2, ramp=0))
    for r in range(2):
        part = keys[r * 20:(r + 1) * 20]
        fetched = cluster.fetch_prefix(part, timeout=30)
        assert fetched.result.outcomes == (KeyOutcome.STORED,) * 20
        assert {s.address for s in fetched.sources if s} == {good.address}
        assert fetched.failovers > 0
    stats = cluster.stats()
    assert stats.quarantines == 1 and list(stats.quarantined) == [proxy.address]
    assert stats.quarantined[proxy.address][2] == "failed blocks"
    seen = len(proxy.corrupted)
    part = keys[40:60]
    found = cluster.lookup_prefix(part, timeout=10)
    assert all({h.address for h in hs} == {good.address} for hs in found.holders)
    fetched = cluster.fetch_prefix(part, timeout=30, lookup=found)
    assert fetched.result.outcomes == (KeyOutcome.STORED,) * 20
    assert fetched.failovers == 0
    assert len(proxy.corrupted) == seen  # not a single block asked of it
    assert cluster.node.get(part[0]) == content(part[0], cluster.node.layout.bytes_per_block)


def test_a_holder_met_late_takes_a_small_share_first(built: list[Any]) -> None:
    """The consumer has fetched from A for a while; B (a node that just came back) holds
    the same blocks. B's share starts near the slow-start floor; with slow start off,
    the two split the keys evenly."""
    keys = keys_for(60)
    a, b = holders(built, 2, keys)
    shares = {}
    for ramp in (30.0, 0.0):
        cluster = consumer(built, (a.address, b.address), HealthConfig(ramp=ramp, floor=0.1))
        clock = Clock()
        cluster.health = HolderHealth(cluster.config.health, clock=clock)
        cluster.health.weight(a.address, a.node_id)  # A has been a holder for a while
        clock.now += 60
        fetched = cluster.fetch_prefix(keys[:40], timeout=30)
        assert fetched.result.outcomes == (KeyOutcome.STORED,) * 40
        shares[ramp] = sum(1 for s in fetched.sources if s and s.address == b.address)
    assert shares[0.0] == 20
    assert 1 <= shares[30.0] <= 5, shares


def test_a_draining_node_finishes_in_flight_sends_and_declines_new_ones(
        built: list[Any]) -> None:
    keys = keys_for(48)
    (server,) = holders(built, 1, keys)
    size = server.layout.bytes_per_block
    # A fetch that takes a known while: 24 blocks through a throttled link, to a
    # consumer whose credit window holds two blocks, so the server keeps sending.
    proxy = ThrottlingProxy(server.address, rate=24 * size / 1.5, upstream_rcvbuf=size,
                            deliver_on_close=True)
    built.append(proxy)
    slow = make_node({**SMALL, "pool": 64}, window_bytes=2 * size)
    other = make_node({**SMALL, "pool": 64})
    built.extend([slow, other])
    running = slow.fetch_async(slow.connect(proxy.address), keys[:24], timeout=60)
    peer = other.connect(server.address)
    deadline = time.monotonic() + 30
    while server.stats().blocks_sent == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # until the fetch is under way
    assert not running.done()
    drained = threading.Thread(target=server.drain, args=(30.0,))
    started = time.monotonic()
    drained.start()
    deadline = time.monotonic() + 10
    while not server.stats().draining and time.monotonic() < deadline:
        time.sleep(0.01)
    # New work is turned away at once, not left to time out.
    assert other.lookup(peer, keys[24:28], timeout=10) == [False] * 4
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="draining"):
        other.fetch(peer, keys[24:28], timeout=10)
    assert time.monotonic() - t0 < 5
    result = running.result(timeout=60)
    assert result.outcomes == (KeyOutcome.STORED,) * 24
    assert all(slow.get(k) == content(k, size) for k in keys[:24])
    drained.join(60)
    assert not drained.is_alive() and time.monotonic() - started < 30
    assert server.stats().fetches_declined_draining == 1


def test_serve_drains_on_sigterm_and_consumers_fail_over(built: list[Any],
                                                         redis_url: str) -> None:
    """Two ``serve`` processes hold the same known blocks in a Redis directory. One gets
    SIGTERM while a consumer keeps fetching: it leaves the directory, declines new
    fetches and exits 0; every fetch completes (from the other holder), none waits for
    its deadline."""
    common = ["--json", "--directory", redis_url, "--fill", "64", "--pool-blocks", "80",
              "--directory-ttl", "3", "--drain-timeout", "5"]
    procs = [subprocess.Popen([sys.executable, "-m", "p2pkv.cli", "serve", *common],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        infos = [_events_until(p, "directory") for p in procs]
        from p2pkv.fill import fill_block, fill_keys
        from p2pkv.node import Node
        from p2pkv.settings import load_settings, node_config

        # The consumer runs serve's own defaults: the same identity as the holders.
        settings = load_settings({}, environ={})
        layout = settings.layout()
        rc = settings.run_config(layout)
        keys = fill_keys(64, seed=0, tokens_per_hash=rc.tokens_per_hash)
        node = Node(rc, layout, pool_blocks=8, config=node_config(settings))
        built.append(node)
        cluster = Cluster(node, directory=redis_url, config=ClusterConfig(
            health=HealthConfig(ramp=0)))
        built.append(cluster)
        found = cluster.lookup_prefix(keys, timeout=10)
        assert found.length == 64, found.errors
        procs[0].send_signal(signal.SIGTERM)
        slowest = 0.0
        for r in range(6):
            bufs = [[memoryview(bytearray(s)) for s in node.layout.segment_sizes]
                    for _ in keys]
            t0 = time.monotonic()
            fetched = cluster.fetch_prefix(keys, bufs, timeout=20)
            slowest = max(slowest, time.monotonic() - t0)
            assert fetched.result.outcomes == (KeyOutcome.STORED,) * 64, fetched.result.errors
            size = node.layout.bytes_per_block
            assert all(b"".join(bytes(m) for m in bufs[i]) == fill_block(k, size)
                       for i, k in enumerate(keys)), f"round {r}: wrong bytes"
        assert slowest < 10, slowest
        out, _ = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 0
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [e["event"] for e in events[-2:]] == ["stopping", "stopped"], events
        assert events[-2]["drain_seconds"] == 5.0
        assert infos[0]["registered"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def test_a_holder_killed_and_restarted_is_asked_again_at_once(redis_url: str,
                                                               built: list[Any]) -> None:
    """A holder process is killed with kill -9; its consumer's fetches fail until it
    quarantines the address (for 20 s). The holder comes back on the same port under a
    new node id: the consumer finds and fetches from it at once (slowly at first),
    instead of waiting out the dead node's quarantine."""
    from redisprocs import free_port

    port = free_port()
    spec = {**SMALL, "directory": redis_url, "cluster": FAST, "count": 16, "pool": 24,
            "config": {"listen": f"tcp://127.0.0.1:{port}"}}
    first = ClusterProcess(spec)
    second: ClusterProcess | None = None
    try:
        first.await_ready()
        node = make_node({**SMALL, "pool": 32})
        built.append(node)
        cluster = Cluster(node, directory=redis_url, config=ClusterConfig(**{
            **FAST, "health": HealthConfig(after=2, base=20.0, longest=60.0, ramp=5.0)}))
        built.append(cluster)
        keys = keys_for(16)
        bufs = [[memoryview(bytearray(n)) for n in node.layout.segment_sizes] for _ in keys]
        assert cluster.fetch_prefix(keys, bufs, timeout=10).complete == 16
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        for _ in range(10):  # its entry outlives it for a TTL: fetches fail, then ...
            fetched = cluster.fetch_prefix(keys, bufs, timeout=5)
            if cluster.stats().quarantined:
                break
            assert fetched.complete == 0
        (left, times, _), = cluster.stats().quarantined.values()  # ... quarantined
        assert left > 10.0 and times == 1
        assert cluster.lookup_prefix(keys, timeout=5).length == 0
        second = ClusterProcess(spec)
        second.await_ready()
        assert second.ready["node_id"] != first.ready["node_id"]
        found = cluster.lookup_prefix(keys, timeout=10)
        assert found.length == 16 and second.ready["node_id"] in {
            h.node_id for h in found.holders[0]}, found
        fetched = cluster.fetch_prefix(keys, bufs, timeout=10, lookup=found)
        assert fetched.result.outcomes == (KeyOutcome.LANDED,) * 16, fetched.result.errors
        size = node.layout.bytes_per_block
        assert all(b"".join(bytes(m) for m in bufs[i]) == content(k, size)
                   for i, k in enumerate(keys))
        assert cluster.stats().quarantined == {}
    finally:
        first.kill()
        if second is not None:
            second.kill()


def _cluster_command(url: str, *extra: str) -> str:
    """``p2pkv-node cluster --directory URL`` in its own process; its stdout."""
    done = subprocess.run([sys.executable, "-m", "p2pkv.cli", "cluster", "--directory", url,
                           *extra], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _verdicts(url: str, partition: str) -> dict[int, list[Any]]:
    """Reporting member -> the quarantine verdicts the directory shows for it now."""
    from p2pkv.cluster import RedisDirectory

    directory = RedisDirectory(url)
    try:
        members = directory.view().partitions.get(partition, [])
    finally:
        directory.close()
    return {m.member: list(m.reports) for m in members if m.reports}


def test_cluster_command_shows_who_quarantines_a_corrupting_holder(redis_url: str) -> None:
    """Three processes in one Redis directory: a good holder, a holder behind a proxy
    that corrupts every block it relays (the address it registered), and a consumer that
    fetches through the directory. Once the consumer has quarantined the corrupting
    holder, ``p2pkv-node cluster`` (JSON and text, its own process) shows that holder
    quarantined by the consumer's member, with the reason, the count and the time left
    the consumer's own stats give; the verdict goes when the backoff ends (the consumer
    withdraws it), comes back counted twice, and goes when the consumer dies (kill -9:
    invisible once its TTL passed, then swept out of Redis)."""
    import redis as redis_py
    from redisprocs import free_port

    port = free_port()
    proxy = CorruptingProxy(f"tcp://127.0.0.1:{port}", every=1, first=1)
    base = {**SMALL, "directory": redis_url, "cluster": FAST}
    procs = [ClusterProcess({**base, "count": 80, "pool": 88}),
             ClusterProcess({**base, "count": 80, "pool": 88, "advertise": proxy.address,
                             "config": {"listen": f"tcp://127.0.0.1:{port}"}}),
             ClusterProcess({**base, "count": 0, "pool": 48, "cluster": {
                 **FAST, "health": {"after": 2, "base": 10.0, "longest": 60.0, "ramp": 0}}})]
    try:
        for p in procs:
            p.await_ready()
        good, sick, reporter = procs
        me = reporter.ready["member"]
        for r in range(2):  # two rounds with failed blocks from it: quarantined
            fetched = reporter.send(op="fetch", count=20, offset=20 * r)
            assert fetched["outcomes"] == ["LANDED"] * 20 and fetched["corrupt"] == 0
            assert set(fetched["sources"]) == {good.ready["address"]}
        stats = reporter.send(op="stats")
        seen = time.monotonic()
        assert stats["quarantines"] == 1
        assert list(stats["quarantined"]) == [proxy.address]
        left, times, reason = stats["quarantined"][proxy.address]
        assert (times, reason) == (1, "failed blocks") and 0 < left <= 10.0
        partition = stats["partition"]
        # Published at the next registration round (20 ms); on a loaded machine that can
        # take seconds, so the wait is bounded by the verdict's own life, not a guess.
        (verdict,) = wait_for(lambda: _verdicts(redis_url, partition).get(me), left,
                               "the verdict in the directory")
        assert (verdict.address, verdict.node_id, verdict.reason, verdict.times) == (
            proxy.address, sick.ready["node_id"], "failed blocks", 1)
        assert abs(verdict.expires_in - (left - (time.monotonic() - seen))) < 1.0

        doc = json.loads(_cluster_command(redis_url, "--json"))
        (group,) = doc["groups"]
        nodes = {n["node_id"]: n for n in group["nodes"]}
        (shown,) = nodes[sick.ready["node_id"]]["quarantined_by"]
        assert (shown["member"], shown["reporter_node_id"], shown["reason"],
                shown["times"]) == (me, reporter.ready["node_id"], "failed blocks", 1)
        assert 0 < shown["expires_in"] <= 10.0
        assert nodes[good.ready["node_id"]]["quarantined_by"] == []
        assert nodes[reporter.ready["node_id"]]["quarantined_by"] == []
        assert group["quarantined"] == 1 and doc["quarantined_unregistered"] == []
        text = _cluster_command(redis_url)
        (row,) = [line for line in text.splitlines() if proxy.address in line]
        assert f"member {me} (failed blocks, 1x, " in row, text
        assert "1 quarantined" in text

        # The backoff ends: the consumer withdraws its verdict; nothing is left in Redis.
        client = redis_py.Redis.from_url(redis_url)
        key = f"p2pkv:{{{partition}}}:quarantine"
        wait_for(lambda: not _verdicts(redis_url, partition) and client.hlen(key) == 0, 15,
                  "the verdict withdrawn after the backoff")
        assert reporter.send(op="stats")["quarantined"] == {}

        # Quarantined again (the second time in a row), then the consumer dies.
        for r in range(2, 4):
            fetched = reporter.send(op="fetch", count=20, offset=20 * r)
            assert fetched["outcomes"] == ["LANDED"] * 20 and fetched["corrupt"] == 0
        (verdict,) = wait_for(lambda: _verdicts(redis_url, partition).get(me), 10.0,
                               "the second verdict")
        assert verdict.times == 2 and 10.0 < verdict.expires_in <= 20.0
        os.kill(reporter.proc.pid, signal.SIGKILL)  # no goodbye: it cannot deregister
        reporter.proc.wait(10)
        killed = time.monotonic()
        wait_for(lambda: not _verdicts(redis_url, partition), FAST["ttl"] + 5,
                  "a dead reporter's verdict hidden")
        # Before its verdict would have ended.
        assert time.monotonic() - killed < verdict.expires_in
        wait_for(lambda: client.hlen(key) == 0, 15, "a dead reporter's verdict swept")
        doc = json.loads(_cluster_command(redis_url, "--json"))
        assert all(n["quarantined_by"] == [] for g in doc["groups"] for n in g["nodes"])
        client.close()
    finally:
        for p in procs:
            p.kill()
        proxy.close()


def _events_until(proc: subprocess.Popen[str], wanted: str) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{") and json.loads(line).get("event") == wanted:
            event: dict[str, Any] = json.loads(line)
            return event
    raise AssertionError(f"serve never printed a {wanted!r} event; stderr: "
                         f"{proc.stderr.read() if proc.stderr else ''}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))

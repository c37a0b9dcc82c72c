"""The cluster layer against a real redis-server (started per test on a free port) and
real node processes where a holder has to die with ``kill -9``.

Timing bounds asserted here are behavioural (a dead holder disappears after its TTL,
not never); speed is measured by ``p2pkv-node cluster-bench``, not here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from nodeproc import content, keys_for, make_node
from procs import ROOT, TESTS, NodeProcess, child_env
from redisprocs import LocalRedis, find_redis_server, free_port

from p2pkv.cluster import (
    Cluster,
    ClusterConfig,
    DirectoryError,
    NodeRecord,
    RedisDirectory,
    longest_prefix,
    partition_key,
)
from p2pkv.errors import ConfigError
from p2pkv.node import KeyOutcome
from p2pkv.workers import JsonLineProcess

pytestmark = pytest.mark.timeout(180)

SMALL = {"layout": "v2", "geometry": "small"}
# Short TTLs keep the tests fast; heartbeats every ttl / 3.
FAST = {"ttl": 1.5, "announce_interval": 0.02, "redis_timeout": 0.5}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout}s")
        time.sleep(0.02)


# ----------------------------------------------------------------------- fixtures


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    pytest.importorskip("redis", reason="the Redis client is missing: pip install "
                        "'p2pkv[cluster]'")
    if find_redis_server() is None:
        if os.geteuid() == 0:
            pytest.fail("redis-server is not installed; `make test` installs it when run "
                        "as root (apt-get install redis-server)")
        pytest.skip("redis-server is not installed (apt-get install redis-server; "
                    "`make test` installs it when run as root)")
    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.close()


class ClusterProcess(NodeProcess):
    """``tests/clusterproc.py``: a node holding blocks, registered in the directory."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._child = JsonLineProcess(
            [sys.executable, str(TESTS / "clusterproc.py"), json.dumps(spec)],
            env=child_env(), cwd=ROOT, stderr_lines=400)
        self.proc = self._child.proc
        self.ready: dict[str, Any] = {}

    def await_ready(self, timeout: float = 60) -> dict[str, Any]:
        """Wait for its ``ready`` event (kept in :attr:`ready`)."""
        self.ready = self.event(timeout)
        assert self.ready["event"] == "ready", self.ready
        return self.ready

    def send(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.event(30)


def start_holders(procs: list[Any], url: str, *specs: dict[str, Any]) -> list[ClusterProcess]:
    """Start holder processes in directory ``url`` (all started first, then all awaited),
    each added to ``procs`` as it starts (the caller kills them)."""
    started = []
    for spec in specs:
        full = {**SMALL, "directory": url, "cluster": FAST, **spec}
        full.setdefault("pool", full["count"] + 8)
        proc = ClusterProcess(full)
        procs.append(proc)
        started.append(proc)
    for proc in started:
        proc.await_ready()
    return started


@pytest.fixture
def holders(redis_server: LocalRedis) -> Iterator[Callable[..., list[ClusterProcess]]]:
    """Start holder processes (all started first, then all awaited); killed at teardown."""
    procs: list[ClusterProcess] = []
    yield lambda *specs: start_holders(procs, redis_server.url, *specs)
    for p in procs:
        p.kill()


@pytest.fixture
def consumer(redis_server: LocalRedis) -> Iterator[Callable[..., tuple[Any, Cluster]]]:
    """In-process nodes with a Cluster each; clusters closed before their nodes."""
    built: list[tuple[Any, Cluster]] = []

    def build(spec: dict[str, Any] | None = None, *, directory: str | None = "redis",
              peers: tuple[str, ...] = (), **cluster: Any) -> tuple[Any, Cluster]:
        node = make_node({**SMALL, "pool": 64, **(spec or {})})
        try:
            url = redis_server.url if directory == "redis" else directory
            c = Cluster(node, directory=url, peers=peers,
                        config=ClusterConfig(**{**FAST, **cluster}))
        except BaseException:
            node.close(timeout=1.0)
            raise
        built.append((node, c))
        if directory == "redis":
            assert c.wait_registered(10)
        return node, c

    yield build
    for node, c in built:
        c.close()
        node.close(timeout=1.0)


def holder_ids(found: Any) -> list[set[str]]:
    return [{h.node_id for h in hs} for hs in found.holders]


def verify(node: Any, keys: list[bytes]) -> None:
    size = node.layout.bytes_per_block
    bad = [i for i, k in enumerate(keys) if node.get(k) != content(k, size)]
    assert not bad, f"blocks {bad} are missing or differ"


# ----------------------------------------------------------------------- pure parts


def test_partition_key_joins_fingerprint_and_extension() -> None:
    assert partition_key("0123456789abcdef") == "0123456789abcdef"
    assert partition_key("0123456789abcdef", "d1e5") == "0123456789abcdef+d1e5"
    with pytest.raises(ValueError, match="fingerprint"):
        partition_key("XYZ")
    with pytest.raises(ValueError, match="identity-extension"):
        partition_key("0123456789abcdef", "a}b")


def test_longest_prefix_stops_at_the_first_key_nobody_holds() -> None:
    from p2pkv.cluster import Holder

    h = Holder("n", "tcp://127.0.0.1:1")
    assert longest_prefix([(h,), (h,), (), (h,)]) == 2
    assert longest_prefix([]) == 0
    assert longest_prefix([(h,)]) == 1


def test_node_records_round_trip_and_bad_ones_are_named(nodes: Any) -> None:
    node = nodes(SMALL)
    record = NodeRecord.for_node(node, extension="ab12")
    assert NodeRecord.from_json(record.to_json()) == record
    assert record.partition == f"{node.fingerprint}+ab12"
    for bad in ("[]", "{}", '{"node_id": 1}', "not json"):
        with pytest.raises(DirectoryError, match="malformed node record"):
            NodeRecord.from_json(bad)


def test_bad_directory_urls_and_settings_are_config_errors(nodes: Any) -> None:
    node = nodes(SMALL)
    with pytest.raises(ConfigError, match="--directory"):
        Cluster(node, directory="http://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="ttl"):
        ClusterConfig(ttl=0)
    with pytest.raises(ConfigError, match="heartbeat"):
        ClusterConfig(ttl=1.0, heartbeat=2.0)
    with pytest.raises(ConfigError, match="identity extension"):
        Cluster(node, extension="not a digest")


# ----------------------------------------------------------------------- static backend


def test_static_fan_out_finds_the_prefix_and_fetches_it_into_buffers(
        nodes: Any, consumer: Any) -> None:
    keys = keys_for(80)
    a = nodes({**SMALL, "pool": 40})
    b = nodes({**SMALL, "pool": 56})
    other = nodes({**SMALL, "layout": "v1", "pool": 40})  # same bytes, other layout
    size = a.layout.bytes_per_block
    for k in keys[:32]:
        a.put(k, content(k, size))
        other.put(k, content(k, size))
    for k in keys[16:64]:
        b.put(k, content(k, size))
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    node, cluster = consumer(directory=None, peers=(a.address, b.address, other.address,
                                                    nowhere))
    found = cluster.lookup_prefix(keys, timeout=5)
    assert found.source == "peers" and found.length == 64
    ids = holder_ids(found)
    assert ids[:16] == [{a.node_id}] * 16
    assert ids[16:32] == [{a.node_id, b.node_id}] * 16
    assert ids[32:] == [{b.node_id}] * 32
    assert "PeerIncompatible" in found.errors[other.address]
    assert nowhere in found.errors

    segments = node.layout.segment_sizes
    bufs = [[bytearray(s) for s in segments] for _ in keys]
    fetched = cluster.fetch_prefix(keys, [[memoryview(b) for b in kb] for kb in bufs],
                                   lookup=found)
    assert fetched.result.outcomes == (KeyOutcome.STORED,) * 64
    assert [b"".join(kb) for kb in bufs[:64]] == [content(k, size) for k in keys[:64]]
    assert len(node.store) == 0  # fetch_into never touches the store
    sources = [s.node_id if s else None for s in fetched.sources]
    # Striped: each key from one of its holders, the shared keys evening out the load.
    assert sources.count(a.node_id) == 32 and sources.count(b.node_id) == 32
    assert set(sources[:16]) == {a.node_id} and set(sources[32:]) == {b.node_id}
    assert fetched.stale == 0 and fetched.failovers == 0
    assert cluster.stats().backend == "static" and not cluster.stats().registered


# ----------------------------------------------------------------------- redis backend


def test_three_nodes_and_a_consumer_find_and_fetch_a_prefix_over_two_holders(
        redis_server: LocalRedis, holders: Any, consumer: Any) -> None:
    a, b, c = holders({"count": 32}, {"count": 48, "key_offset": 16},
                      {"count": 32, "key_offset": 200})
    node, cluster = consumer()
    keys = keys_for(80)
    found = cluster.lookup_prefix(keys)
    assert found.source == "redis" and found.length == 64, found.errors
    ids = holder_ids(found)
    ida, idb = a.ready["node_id"], b.ready["node_id"]
    assert ids[:16] == [{ida}] * 16 and ids[16:32] == [{ida, idb}] * 16
    assert ids[32:] == [{idb}] * 32
    assert c.ready["node_id"] not in set().union(*ids)

    fetched = cluster.fetch_prefix(keys)
    assert fetched.result.outcomes == (KeyOutcome.STORED,) * 64
    assert fetched.complete == 64
    verify(node, keys[:64])
    sources = [s.node_id for s in fetched.sources if s]
    assert sources.count(ida) == 32 and sources.count(idb) == 32
    stats = cluster.stats()
    assert stats.backend == "redis" and stats.registered and stats.hits >= 64
    # The consumer now holds the prefix too and says so: the next consumer sees three.
    cluster.flush()
    directory = RedisDirectory(redis_server.url)
    wait_for(lambda: len(directory.lookup(cluster.partition, keys[16:17])[0]) == 3, 10,
             "the consumer's blocks announced")
    directory.close()


@pytest.mark.slow
def test_holder_killed_mid_fetch_the_rest_comes_from_another(
        holders: Any, consumer: Any) -> None:
    count = 192  # 576 KiB blocks: about 110 MB, split between the two holders
    seed = {"layout": "v2", "geometry": "seed", "count": count}
    a, b = holders(seed, seed)
    node, cluster = consumer({"layout": "v2", "geometry": "seed", "pool": count + 8})
    keys = keys_for(count)
    found = cluster.lookup_prefix(keys)
    assert found.length == count and all(len(h) == 2 for h in found.holders)
    future = cluster.fetch_prefix_async(keys, lookup=found, timeout=60)
    wait_for(lambda: future.done() or node.store.stats().stored >= 4, 60, "blocks flowing")
    assert not future.done(), "the fetch finished before the holder could be killed"
    os.kill(a.proc.pid, signal.SIGKILL)
    fetched = future.result(timeout=90)
    assert fetched.result.outcomes == (KeyOutcome.STORED,) * count, fetched.result.errors
    verify(node, keys)
    assert fetched.failovers >= 1
    ida, idb = a.ready["node_id"], b.ready["node_id"]
    sources = [s.node_id for s in fetched.sources if s]
    assert sources.count(idb) > count // 2 and set(sources) <= {ida, idb}
    assert cluster.stats().failovers >= 1
    assert b.proc.poll() is None


def test_stale_entry_of_an_evicted_block_is_missing_there_and_fetched_elsewhere(
        holders: Any, consumer: Any) -> None:
    slow = {**FAST, "announce_interval": 60.0}  # its evictions stay unannounced
    a, b = holders({"count": 32, "cluster": slow}, {"count": 32})
    assert a.send(op="discard", indices=list(range(32)))["stored"] == 0
    node, cluster = consumer()
    keys = keys_for(32)
    found = cluster.lookup_prefix(keys)
    ida, idb = a.ready["node_id"], b.ready["node_id"]
    assert holder_ids(found) == [{ida, idb}] * 32  # the directory still lists a
    fetched = cluster.fetch_prefix(keys, lookup=found)
    assert fetched.result.outcomes == (KeyOutcome.STORED,) * 32
    verify(node, keys)
    assert {s.node_id for s in fetched.sources if s} == {idb}
    assert fetched.stale >= 1 and fetched.failovers == fetched.stale
    assert cluster.stats().stale_entries == fetched.stale


def test_redis_restarted_nodes_register_again_and_lookups_work(
        redis_server: LocalRedis, holders: Any, consumer: Any) -> None:
    (a,) = holders({"count": 32})
    _, cluster = consumer()
    keys = keys_for(32)
    assert cluster.fetch_prefix(keys).complete == 32  # connected to a
    redis_server.kill()
    # Redis is gone: the node serves on, lookups fall back to the connected peers.
    found = cluster.lookup_prefix(keys)
    assert found.source == "peers" and "directory" in found.errors
    assert holder_ids(found) == [{a.ready["node_id"]}] * 32
    assert a.proc.poll() is None
    redis_server.start()  # empty: no persistence

    def back() -> bool:
        f = cluster.lookup_prefix(keys)
        return f.source == "redis" and f.length == 32 and holder_ids(f)[0] == {
            a.ready["node_id"]}

    wait_for(back, 20, "lookups through Redis again")
    wait_for(lambda: cluster.member is not None, 10, "the consumer registered again")
    stats = a.send(op="stats")
    assert stats["registrations"] >= 2 and stats["registrations_lost"] >= 1
    # Both republished their whole block set (the consumer holds the 32 blocks too).
    view = RedisDirectory(redis_server.url).view()
    counts = sorted(m.blocks for m in view.partitions[cluster.partition] if m.alive)
    assert counts == [32, 32]


def test_another_identity_in_the_same_redis_is_never_a_holder(
        redis_server: LocalRedis, holders: Any, consumer: Any) -> None:
    v2, v1 = holders({"count": 16}, {"count": 16, "layout": "v1"})
    _, cluster = consumer()
    keys = keys_for(16)
    found = cluster.lookup_prefix(keys)
    assert holder_ids(found) == [{v2.ready["node_id"]}] * 16
    _, other = consumer({"layout": "v1"})
    assert holder_ids(other.lookup_prefix(keys)) == [{v1.ready["node_id"]}] * 16
    # The cluster command groups them and says why the groups refuse each other.
    out = subprocess.run([sys.executable, "-m", "p2pkv.cli", "cluster", "--directory",
                          redis_server.url, "--json"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    groups = {g["partition"]: g for g in doc["groups"]}
    assert set(groups) == {cluster.partition, other.partition}
    assert groups[cluster.partition]["blocks"] == 16 and groups[cluster.partition]["alive"] == 2
    (pair,) = doc["refusals"]
    assert not pair["compatible"]
    fields = {r["field"] for r in pair["reasons"]}
    assert {"fingerprint", "run_config.parallel_agnostic", "geometry.segments"} <= fields
    text = subprocess.run([sys.executable, "-m", "p2pkv.cli", "cluster", "--directory",
                           redis_server.url], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert text.returncode == 0 and "would refuse" in text.stdout
    assert "geometry.segments" in text.stdout and v1.ready["node_id"] in text.stdout


def test_a_lying_directory_entry_is_refused_at_the_handshake(
        redis_server: LocalRedis, holders: Any, consumer: Any, nodes: Any) -> None:
    (honest,) = holders({"count": 16})
    liar = nodes({**SMALL, "layout": "v1"})
    node, cluster = consumer()
    keys = keys_for(16)
    # A record in the consumer's partition for a node whose identity differs.
    forged = NodeRecord.for_node(liar)
    forged = NodeRecord(**{**forged.__dict__, "fingerprint": node.fingerprint})
    directory = RedisDirectory(redis_server.url)
    member = directory.register(forged, ttl=30)
    assert directory.announce(member, keys)
    found = cluster.lookup_prefix(keys)
    assert holder_ids(found) == [{honest.ready["node_id"], liar.node_id}] * 16
    fetched = cluster.fetch_prefix(keys, lookup=found)
    assert fetched.result.outcomes == (KeyOutcome.STORED,) * 16
    verify(node, keys)
    assert {s.node_id for s in fetched.sources if s} == {honest.ready["node_id"]}
    assert fetched.failovers >= 1
    assert liar.stats().blocks_sent == 0
    directory.close()


def test_a_node_that_dies_without_deregistering_disappears_after_its_ttl(
        redis_server: LocalRedis, holders: Any, consumer: Any) -> None:
    (a,) = holders({"count": 16})
    _, cluster = consumer()
    keys = keys_for(16)
    assert cluster.lookup_prefix(keys).length == 16
    os.kill(a.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: cluster.lookup_prefix(keys).length == 0, FAST["ttl"] + 5,
             "the dead holder gone from lookups")
    assert time.monotonic() - killed >= 0  # gone: its claims expired with its TTL
    directory = RedisDirectory(redis_server.url)
    # A live member of the partition sweeps the dead one's entries and records out.
    wait_for(lambda: [m.member for m in directory.view().partitions[cluster.partition]]
             == [cluster.stats().member], 15, "the dead member swept")
    directory.close()


def test_serve_with_a_redis_directory_registers_and_reports_metrics(
        redis_server: LocalRedis) -> None:
    from clitools import Serve, clean_env, read_metrics

    port = free_port()
    serve = Serve("--directory", redis_server.url, "--directory-ttl", "1.5", "--json",
                  "--metrics-port", str(port), env=clean_env())
    lost = Serve("--directory", f"redis://127.0.0.1:{free_port()}/0", "--json",
                 env=clean_env())
    try:
        listening = serve.event()
        assert listening["event"] == "listening"
        event = serve.event()
        assert event["event"] == "directory" and event["registered"] is True
        assert event["partition"] == listening["fingerprint"]
        metrics = read_metrics(port)
        assert metrics['p2pkv_directory_registered{backend="redis"}'] == 1.0
        assert "p2pkv_directory_lookups_total" in metrics
        assert "p2pkv_directory_stale_entries_total" in metrics
        assert "p2pkv_directory_failovers_total" in metrics
        # Without a reachable Redis the node still serves, and says so.
        assert lost.event()["event"] == "listening"
        assert lost.event()["registered"] is False
        view = RedisDirectory(redis_server.url).view()
        (member,) = view.partitions[listening["fingerprint"]]
        assert member.alive and member.record is not None
        assert member.record.address == listening["address"]
        code, _ = serve.stop(signal.SIGTERM)
        assert code == 0
        # A clean stop deregisters at once (no waiting for the TTL).
        assert listening["fingerprint"] not in RedisDirectory(redis_server.url).view().partitions
        code, _ = lost.stop(signal.SIGTERM)
        assert code == 0
    finally:
        serve.kill()
        lost.kill()


def test_cluster_bench_rows_check_every_answer(redis_server: LocalRedis) -> None:
    from p2pkv.bench.directory import fanout_rows, scale_rows

    rows = scale_rows(redis_server.url, members=8, entries=16_000, lookups=5)
    rows += fanout_rows(redis_server.url, (1, 2), rounds=3)
    metrics = {(r["case"], r["metric"]) for r in rows}
    assert ("8 members, 16,000 entries (8,000 keys)", "Redis bytes per entry") in metrics
    assert ("2 peer(s), 1,000-key prefix", "static lookup p50 ms") in metrics
    assert ("2 peer(s), 1,000-key prefix", "redis lookup p99 ms") in metrics
    assert all(r["ok"] == "yes" for r in rows), rows


def test_a_wildcard_listen_address_is_registered_as_a_reachable_one() -> None:
    """A node bound to tcp://0.0.0.0:P must not tell other hosts to dial 0.0.0.0."""
    from p2pkv.cluster import advertised_address

    assert advertised_address("tcp://0.0.0.0:5601", host="10.1.2.3") == "tcp://10.1.2.3:5601"
    assert advertised_address("tcp://*:5601", host="10.1.2.3") == "tcp://10.1.2.3:5601"
    assert advertised_address("tcp://[::]:5601", host="fd00::7") == "tcp://[fd00::7]:5601"
    assert advertised_address("tcp://10.9.9.9:5601", host="10.1.2.3") == "tcp://10.9.9.9:5601"
    guessed = advertised_address("tcp://0.0.0.0:5601")
    assert guessed.endswith(":5601") and "0.0.0.0" not in guessed


def test_waiting_for_the_registration_wakes_on_it_and_never_waits_for_nothing(
        redis_server: LocalRedis, nodes: Any) -> None:
    """``wait_registered`` returns when the registration lands (woken by it, not by a
    poll), at once for a static cluster (nothing will ever register it), and as soon as
    the cluster closes, not at its timeout."""
    with Cluster(nodes({**SMALL, "pool": 8})) as static:
        t0 = time.monotonic()
        assert not static.wait_registered(30)
        assert time.monotonic() - t0 < 1.0
    with Cluster(nodes({**SMALL, "pool": 8}), directory=redis_server.url) as c:
        assert c.wait_registered(10) and c.member is not None
    # A directory nobody answers: the wait ends when the cluster is closed.
    silent = f"redis://127.0.0.1:{free_port()}/0"
    c = Cluster(nodes({**SMALL, "pool": 8}), directory=silent,
                config=ClusterConfig(redis_timeout=0.2))
    waited: list[float] = []

    def wait() -> None:
        t = time.monotonic()
        assert not c.wait_registered(30)
        waited.append(time.monotonic() - t)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    c.close()
    waiter.join(10)
    assert waited and waited[0] < 5.0, waited


def test_advertise_must_be_an_address(redis_server: LocalRedis) -> None:
    node = make_node({**SMALL, "pool": 8})
    try:
        with pytest.raises(ConfigError, match="advertise"):
            Cluster(node, directory=redis_server.url, advertise="10.1.2.3:5601")
        with Cluster(node, directory=redis_server.url, advertise="tcp://10.1.2.3:7") as c:
            assert c.wait_registered(10)
            assert c.address == "tcp://10.1.2.3:7"
            assert c.member is not None
    finally:
        node.close(timeout=1.0)

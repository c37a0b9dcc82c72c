"""pending-v1 through the Redis directory: members announce the keys they compute, with
a lease, and other members' lookups report them after the held prefix.

Against a real redis-server and a real 3-master Redis Cluster (one each for the module,
every test in its own namespace), all on 127.0.0.1; every wait bounded.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from internals import publisher_stalled
from nodeproc import content, keys_for, make_node
from redisprocs import LocalRedis, LocalRedisCluster, find_redis_server, find_tool, free_port
from test_cluster import SMALL, wait_for

from p2pkv.bench.directory import _fake_record
from p2pkv.cluster import Cluster, ClusterConfig, Member, RedisDirectory

pytestmark = pytest.mark.timeout(120)

FAST = {"ttl": 3.0, "announce_interval": 0.02, "redis_timeout": 0.5}
_namespaces = itertools.count()


def _need_redis(*tools: str) -> None:
    pytest.importorskip("redis", reason="the Redis client is missing: pip install "
                        "'p2pkv[cluster]'")
    missing = [t for t in tools if find_tool(t) is None]
    if missing or find_redis_server() is None:
        why = f"redis-server {' '.join(missing)} not installed (apt-get install redis-server)"
        if os.geteuid() == 0:
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def single() -> Iterator[str]:
    _need_redis()
    server = LocalRedis().start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture(scope="module")
def sharded() -> Iterator[str]:
    _need_redis("redis-cli")
    with LocalRedisCluster(masters=3, replicas=0) as cluster:
        yield cluster.url


@pytest.fixture(params=["redis", "cluster"])
def directory(request: pytest.FixtureRequest) -> Iterator[RedisDirectory]:
    """A directory on one Redis, then on a Redis Cluster, in a namespace of its own."""
    url = request.getfixturevalue("single" if request.param == "redis" else "sharded")
    d = RedisDirectory(url, namespace=f"pend{next(_namespaces)}")
    try:
        yield d
    finally:
        d.close()


def members(d: RedisDirectory, n: int) -> list[Member]:
    return [d.register(_fake_record(i), ttl=60) for i in range(n)]


KEYS = [bytes([i]) * 16 for i in range(8)]


def dues(d: RedisDirectory, asker: Member, keys: Sequence[bytes] = KEYS) -> list[float]:
    return d.lookup_pending(asker.partition, keys, exclude=asker)[1]


class CountCalls:
    """Counts the directory's calls to Redis: one ``eval`` or one ``pipelined`` is one
    round trip (a pipeline sends every shard's calls before reading any answer)."""

    def __init__(self, d: RedisDirectory, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in ("eval", "pipelined"):
            real = getattr(d.redis, name)

            def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                self.calls.append(_name)
                return _real(*args, **kw)

            monkeypatch.setattr(d.redis, name, counted)

    def of(self, fn: Any) -> list[str]:
        self.calls.clear()
        fn()
        return list(self.calls)


# ----------------------------------------------------------------------- directory


def test_pending_keys_are_reported_to_other_members_after_the_held_prefix(
        directory: RedisDirectory, monkeypatch: pytest.MonkeyPatch) -> None:
    d = directory
    a, b, c = members(d, 3)  # a and c compute, b holds
    p = a.partition
    assert d.announce(b, KEYS[:2])
    assert d.announce_pending(a, KEYS[1:6], [5.0] * 5)
    assert d.announce_pending(c, KEYS[3:4], [2.0])
    holders, due = d.lookup_pending(p, KEYS, exclude=c)
    assert [[h.node_id for h in hs] for hs in holders] == [["sim-001"]] * 2
    # Nothing reported for the held prefix (KEYS[1] is pending too, but held); c's own
    # announcement is not reported to c.
    assert due[:2] == [0.0, 0.0] and due[6:] == [0.0, 0.0]
    assert all(4.0 < x <= 5.0 for x in due[2:6]), due
    # b holds the prefix but is not its own holder: every pending key is reported, the
    # earliest announcer's estimate where two compute the same key.
    due = dues(d, b)
    assert due[0] == 0.0 and due[6:] == [0.0, 0.0]
    assert 1.0 < due[3] <= 2.0 and all(4.0 < due[i] <= 5.0 for i in (1, 2, 4, 5)), due
    # The announcer never sees its own entries.
    due = dues(d, a)
    assert due[2] == 0.0 and 1.0 < due[3] <= 2.0 and due[4:] == [0.0] * 4
    # The old lookup is unchanged; no key pending: all zeros.
    assert d.lookup(p, KEYS, exclude=c) == holders
    assert dues(d, c, [b"nobody" * 3]) == [0.0]
    # The same round trips with the pending entries as without: one script on one
    # Redis; on a cluster one pipeline (the pending entries ride in it), plus the
    # liveness of the holders found, as before.
    count = CountCalls(d, monkeypatch)
    for keys in (KEYS, KEYS[2:]):
        with_pending = count.of(lambda k=keys: d.lookup_pending(p, k, exclude=c))
        assert with_pending == count.of(lambda k=keys: d.lookup(p, k, exclude=c))
        if d.kind == "redis":
            assert with_pending == ["eval"]
        else:
            assert with_pending == (["pipelined", "eval"] if keys is KEYS else ["pipelined"])


def test_withdrawn_deregistered_and_dead_members_entries_are_not_reported(
        directory: RedisDirectory) -> None:
    d = directory
    a, c, x = members(d, 3)
    p = a.partition
    assert d.announce_pending(a, KEYS[:4], [5.0] * 4)
    assert d.withdraw_pending(a, KEYS[1:2])
    assert [v > 0 for v in dues(d, c, KEYS[:4])] == [True, False, True, True]
    # Deregistering takes the member's entries with it.
    d.deregister(a, (), KEYS[:4])
    assert dues(d, c, KEYS[:4]) == [0.0] * 4
    assert not d.client.hexists(d.keys.key(p, "pending"), KEYS[0])
    # A member whose registration lapsed: its entry stays until its lease ends, but is
    # not reported; it can neither announce nor (with another nonce) withdraw.
    assert d.announce_pending(x, KEYS[4:5], [5.0])
    assert dues(d, c, KEYS[4:5])[0] > 0
    d.client.zadd(d.keys.key(p, "live"), {x.token: 1})
    assert dues(d, c, KEYS[4:5]) == [0.0]
    assert d.client.hexists(d.keys.key(p, "pending"), KEYS[4])
    assert not d.announce_pending(x, KEYS[5:6], [5.0])
    assert not d.withdraw_pending(Member(p, x.token, b"\x00" * 16), KEYS[4:5])
    with pytest.raises(ValueError, match="shorter"):
        d.announce_pending(c, KEYS[:2], [1.0])


def test_an_entry_ends_with_its_lease_and_so_do_the_keys(
        directory: RedisDirectory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease ends at due + max(due, MIN_OVERDUE); MIN_OVERDUE is 0.3 s here."""
    import p2pkv.cluster.pending as pending

    monkeypatch.setattr(pending, "MIN_OVERDUE", 0.3)
    d = directory
    a, c = members(d, 2)
    p = a.partition
    hash_key, expiries = d.pending.keys(p)
    started = time.monotonic()
    assert d.announce_pending(a, KEYS[:1], [0.1])
    first = dues(d, c, KEYS[:1])[0]
    assert 0.0 < first <= 0.1
    # Overdue but within its lease: "about now" (1 ms), as a node answers.
    time.sleep(max(0.0, started + 0.15 - time.monotonic()))
    if time.monotonic() - started < 0.35:
        assert dues(d, c, KEYS[:1]) == [0.001]
    wait_for(lambda: dues(d, c, KEYS[:1]) == [0.0], 5, "the lease to end")
    assert time.monotonic() - started >= 0.35
    # Nobody wrote since: the keys expire by themselves with the longest lease in them.
    wait_for(lambda: not d.client.exists(hash_key, expiries), 5, "the keys to expire")
    # An ended entry beside a running one: not reported, and the next write deletes it.
    assert d.announce_pending(a, [KEYS[0], KEYS[3]], [0.1, 1.0])
    wait_for(lambda: dues(d, c, KEYS[:4]) == [0.0, 0.0, 0.0, dues(d, c, KEYS[3:4])[0]], 5,
             "the short lease to end")
    assert dues(d, c, KEYS[3:4])[0] > 0
    assert d.client.hexists(hash_key, KEYS[0])
    assert d.announce_pending(a, KEYS[1:2], [0.05])
    assert not d.client.hexists(hash_key, KEYS[0])
    assert d.client.zscore(expiries, KEYS[0]) is None
    assert d.client.zscore(expiries, KEYS[3]) is not None
    assert 0 < d.client.pttl(hash_key) <= 2000 and 0 < d.client.pttl(expiries) <= 2000
    # A renewal replaces the member's entry (one entry per member and key).
    assert d.announce_pending(a, KEYS[2:3], [5.0])
    assert d.announce_pending(a, KEYS[2:3], [3.0])
    assert len(d.client.hget(hash_key, KEYS[2])) == pending.ENTRY_BYTES
    assert 2.0 < dues(d, c, KEYS[2:3])[0] <= 3.0


# ----------------------------------------------------------------------- Cluster


@pytest.fixture
def nodes(single: str) -> Iterator[list[tuple[Any, Cluster]]]:
    built: list[tuple[Any, Cluster]] = []
    yield built
    for node, c in reversed(built):
        c.close()
        node.close(timeout=1.0)


def start(built: list[tuple[Any, Cluster]], url: str, namespace: str) -> tuple[Any, Cluster]:
    node = make_node({**SMALL, "pool": 64})
    try:
        c = Cluster(node, directory=url, config=ClusterConfig(**FAST, namespace=namespace))
    except BaseException:
        node.close(timeout=1.0)
        raise
    built.append((node, c))
    assert c.wait_registered(15)
    return node, c


def due_of(c: Cluster, keys: Sequence[bytes]) -> list[float]:
    found = c.lookup_prefix(keys)
    assert found.source == "redis", found.errors
    return list(found.due) or [0.0] * len(keys)


def test_a_cluster_announces_through_its_registration_and_withdraws_when_stored_or_closed(
        single: str, nodes: list[tuple[Any, Cluster]]) -> None:
    namespace = f"pend{next(_namespaces)}"
    node_a, a = start(nodes, single, namespace)
    _node_b, b = start(nodes, single, namespace)
    keys = keys_for(6)
    a.announce_pending(keys[2:5], [4.0] * 3)
    due = wait_for(lambda: any(due_of(b, keys)) and due_of(b, keys), 10,
                   "the announcement to reach the directory")
    assert [d > 0 for d in due] == [False, False, True, True, True, False], due
    assert all(d <= 4.0 for d in due)
    assert a.lookup_prefix(keys).due == ()  # its own
    # A stores keys[2]: its claim goes out, and with it the entry is withdrawn.
    node_a.put(keys[2], content(keys[2], node_a.layout.bytes_per_block))
    wait_for(lambda: due_of(b, keys)[2] == 0.0, 10, "the stored key's withdrawal")
    assert b.lookup_prefix(keys[2:]).length == 1
    assert due_of(b, keys[2:])[1:3] != [0.0, 0.0]  # after the held prefix: reported
    a.withdraw_pending(keys[3:4])
    wait_for(lambda: due_of(b, keys)[3] == 0.0, 10, "the withdrawal")
    # The registration's thread counts a write once Redis answered it, which can be
    # after another client already sees it.
    stats = wait_for(lambda: (s := a.stats()).pending_withdrawn == 2 and s, 10,
                     "the withdrawals counted")
    assert stats.pending_announced == 3
    assert stats.pending_dropped == 0
    assert pending_metrics(a) == {"announced": 3.0, "withdrawn": 2.0, "dropped": 0.0}
    # Closing deregisters: keys[4] is no longer reported.
    assert due_of(b, keys)[4] > 0
    a.close()
    assert b.lookup_prefix(keys).due == ()


def test_announcements_never_block_and_past_the_queue_bound_are_dropped(
        single: str, nodes: list[tuple[Any, Cluster]], monkeypatch: pytest.MonkeyPatch) -> None:
    import p2pkv.cluster.registration as registration

    monkeypatch.setattr(registration, "MAX_PENDING_QUEUE", 4)
    namespace = f"pend{next(_namespaces)}"
    _node_a, a = start(nodes, single, namespace)
    _node_b, b = start(nodes, single, namespace)
    keys = keys_for(10)
    # Its thread writes nothing for now: the announcements stay queued, up to the bound.
    with publisher_stalled(a, monkeypatch):
        a.announce_pending(keys, [3.0] * 10)
        assert a.stats().pending_dropped == 6
    a.flush()
    wait_for(lambda: sum(d > 0 for d in due_of(b, keys)) == 4, 10, "the 4 queued keys")
    # Not registered: dropped at once.
    a.close()
    a.announce_pending(keys[:3], [1.0] * 3)
    assert a.stats().pending_dropped == 9


def pending_metrics(c: Cluster) -> dict[str, float]:
    """``p2pkv_directory_pending_keys_total`` by change, as Prometheus scrapes it."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from p2pkv.cluster.metrics import ClusterCollector

    registry = prometheus_client.CollectorRegistry()
    registry.register(ClusterCollector(c))
    return {change: registry.get_sample_value("p2pkv_directory_pending_keys_total",
                                              {"change": change}) or 0.0
            for change in ("announced", "withdrawn", "dropped")}


@pytest.mark.parametrize("directory", ["unreachable", "static"])
def test_a_lookup_answered_by_the_peers_reports_what_they_compute(
        directory: str, nodes: list[tuple[Any, Cluster]]) -> None:
    peer = make_node({**SMALL, "pool": 64})
    try:
        keys = keys_for(6)
        peer.put(keys[0], content(keys[0], peer.layout.bytes_per_block))
        peer.announce_pending(keys[2:4], [4.0, 4.0])
        node = make_node({**SMALL, "pool": 64})
        url = f"redis://127.0.0.1:{free_port()}/0" if directory == "unreachable" else None
        c = Cluster(node, directory=url, peers=[peer.address],
                    config=ClusterConfig(**FAST, namespace=f"pend{next(_namespaces)}"))
        nodes.append((node, c))
        found = c.lookup_prefix(keys)
        assert found.source == "peers"
        assert ("directory" in found.errors) == (directory == "unreachable")
        assert found.length == 1
        assert [d > 0 for d in found.due] == [False, False, True, True, False, False]
        assert all(d <= 4.0 for d in found.due)
        # Withdrawn on the peer: nothing pending any more.
        peer.withdraw_pending(keys[2:4])
        assert c.lookup_prefix(keys).due == ()
    finally:
        peer.close(timeout=1.0)


# ----------------------------------------------------------------------- the tier


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []

    def announce_pending(self, keys: Sequence[bytes], seconds: Sequence[float]) -> None:
        assert len(keys) == len(seconds)
        self.calls.append(("announce", list(keys)))

    def withdraw_pending(self, keys: Sequence[bytes]) -> None:
        self.calls.append(("withdraw", list(keys)))


def test_computing_announces_renews_and_withdraws_to_the_directory_as_to_the_node() -> None:
    # computing.py needs no vLLM (where the package's __init__ imports it lazily).
    Computing = pytest.importorskip("p2pkv.integrations.vllm.computing",
                                    exc_type=ImportError).Computing
    node, directory = Sink(), Sink()
    computing = Computing(lambda: node, threading.Lock(),  # type: ignore[arg-type,return-value]
                          directory=lambda: directory)
    try:
        computing.announce("r1", [b"e1", b"e2"], [b"k1", b"k2"], 0.0)
        computing.renew()  # overdue at once: renewed
        computing.stored("r1", [b"e1"])
        computing.withdraw("r1")
    finally:
        computing.close()
    assert node.calls[:2] == [("announce", [b"k1", b"k2"])] * 2
    assert node.calls[-1] == ("withdraw", [b"k2"])
    assert directory.calls == node.calls
    # Without a directory only the node hears of it.
    alone = Sink()
    computing = Computing(lambda: alone, threading.Lock())  # type: ignore[arg-type,return-value]
    try:
        computing.announce("r2", [b"e"], [b"k"], 1.0)
    finally:
        computing.close()
    assert alone.calls == [("announce", [b"k"])]


def test_computing_announces_what_came_before_the_start_to_the_directory_too(
        single: str, nodes: list[tuple[Any, Cluster]]) -> None:
    """A request scheduled before the tier's node ran is announced when it starts, to
    the node's peers and through the directory alike (once registered, as the tier's
    ``on_start`` comes): another member's lookup through Redis reports it."""
    Computing = pytest.importorskip("p2pkv.integrations.vllm.computing",
                                    exc_type=ImportError).Computing
    namespace = f"pend{next(_namespaces)}"
    started: list[tuple[Any, Cluster]] = []
    computing = Computing(lambda: started[0][0] if started else None, threading.Lock(),
                          directory=lambda: started[0][1] if started else None,
                          coming=lambda: True)
    try:
        keys = keys_for(4)
        computing.announce("early", [b"e%d" % i for i in range(4)], keys, 6.0)
        computing.stored("early", [b"e0"])
        _node_b, b = start(nodes, single, namespace)
        assert due_of(b, keys) == [0.0] * 4  # nothing reached Redis before the start
        started.append(start(nodes, single, namespace))  # registered
        computing.started()
        due = wait_for(lambda: any(due_of(b, keys)) and due_of(b, keys), 10,
                       "the late announcement to reach the directory")
        assert [d > 0 for d in due] == [False, True, True, True], due
        assert all(d <= 6.0 for d in due), due
        computing.withdraw("early")
        wait_for(lambda: not any(due_of(b, keys)), 10, "the withdrawal")
    finally:
        computing.close()

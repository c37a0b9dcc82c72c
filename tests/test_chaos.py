"""The chaos run, short: ``p2pkv-node chaos --seconds 40 --seed 1`` against its own
holders (``serve`` processes), a real 3-master, 3-replica Redis Cluster, a bit-flipping,
stalling proxy and (as root) a veth link between two network namespaces that the
partition cuts. Every fault kind is injected at least once (the partition only where
namespaces can be made: elsewhere the run says it skipped it, and why); no corrupt block
reaches a consumer, no future misses its deadline, nothing leaks, and the hit rate comes
back after every fault. The tool owns and stops every process it starts; this test
bounds it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2pkv.bench.chaos.faults import KINDS
from p2pkv.bench.redis_servers import find_redis_server, find_tool


def test_a_short_chaos_run_shows_no_corruption_no_missed_deadline_no_leak(
        tmp_path: Path) -> None:
    if find_redis_server() is None or find_tool("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not installed")
    out = tmp_path / "chaos.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2pkv.cli", "chaos", "--seconds", "40", "--seed", "1",
         "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:  # its whole session: holders and Redis servers too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert out.exists(), text[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0, text[-3000:]
    assert report["ok"], text[-3000:]
    assert report["directory"].startswith("redis-cluster"), report["notes"]
    if os.geteuid() == 0 and shutil.which("ip"):
        assert report["skipped"] == {}, report["skipped"]
    else:
        assert set(report["skipped"]) == {"partition"}, report["skipped"]
        assert any("partition: skipped (" in n for n in report["notes"]), report["notes"]
    for kind in KINDS:
        figures = report["kinds"][kind]
        if kind in report["skipped"]:
            assert figures["injected"] == 0 and figures["skipped"], figures
            continue
        assert figures["injected"] >= 1, (kind, report["faults"])
        assert figures["corrupt_visible"] == 0, kind
        assert figures["missed_deadlines"] == 0, kind
        assert figures["recovery_s"] and figures["unrecovered"] == 0, (kind, figures)
    totals = report["totals"]
    assert totals["blocks_verified"] > 0
    assert totals["corrupt_visible"] == 0 and totals["missed_deadlines"] == 0
    assert report["leaks"] == {"pins": 0, "shm_segments": 0, "fds": 0, "threads": 0,
                               "os_threads": 0}, report["leaks"]
    # The faults were real: the proxy flipped bits, the drained holder exited 0, the
    # Redis master's replica took over.
    faults = report["faults"]
    assert sum(f["chunks_flipped"] for f in faults if f["kind"] == "proxy_flip") > 0
    assert all(f["exit"] == 0 for f in faults if f["kind"] == "drain")
    assert all(f["promoted"] for f in faults if f["kind"] == "redis_master")
    # The link was down for every partition (the kernel said so) and not a byte crossed.
    assert all(f["link_down"] and f["bytes_crossed"] == 0
               for f in faults if f["kind"] == "partition")


def test_where_namespaces_cannot_be_made_the_partition_is_skipped_with_its_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without root, or without iproute2's ``ip`` (here: not on the PATH), the run gets
    no link: the partition goes into ``skipped`` with the reason, and nothing is made."""
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed")
    from p2pkv.bench.chaos.run import _link
    from p2pkv.bench.redis_servers import LocalRedis

    monkeypatch.setenv("PATH", "/nonexistent")
    redis = LocalRedis()
    try:
        skipped: dict[str, str] = {}
        assert _link(redis, 1, 2, skipped) is None
    finally:
        redis.close()
    want = ("iproute2's 'ip' is not installed" if os.geteuid() == 0
            else "network namespaces need root")
    assert skipped == {"partition": want}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))


def test_the_proxy_limits_each_direction_to_its_rate() -> None:
    """``FaultProxy.set_rate``: a slow link each way (the vLLM load-policy tests use it);
    bytes still arrive intact and in order, and without a rate they are not held."""
    import socket
    import threading
    import time

    from p2pkv.bench.chaos.proxy import FaultProxy

    size = 400_000
    upstream = socket.create_server(("127.0.0.1", 0))
    received = bytearray()
    first_done = threading.Event()
    all_done = threading.Event()

    def sink() -> None:
        conn, _ = upstream.accept()
        conn.settimeout(10)
        with conn:
            while len(received) < 2 * size:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                received.extend(chunk)
                if len(received) >= size:
                    first_done.set()
        all_done.set()

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proxy = FaultProxy(port, upstream.getsockname()[1], seed=0, rate=2e6)
    threading.Thread(target=sink, daemon=True).start()
    try:
        with pytest.raises(ValueError, match="positive"):
            proxy.set_rate(0)
        payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            started = time.monotonic()
            client.sendall(payload)
            assert first_done.wait(20)
            elapsed = time.monotonic() - started
            proxy.set_rate(None)
            client.sendall(payload)
            assert all_done.wait(20)
        assert bytes(received) == payload + payload
        # 400 kB at 2 MB/s cannot arrive in less than 0.2 s (the first 64 KiB chunk may
        # pass before the link is busy).
        assert elapsed >= 0.15, elapsed
    finally:
        proxy.close()
        upstream.close()

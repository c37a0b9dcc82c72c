"""A GlusterFS volume across network namespaces (p2pkv/bench/serving/glusterfs.py; root
and Debian's glusterfs-server/glusterfs-client, skipped otherwise with the reason).

glusterd and the brick run in namespace A at its private address; one FUSE client runs
in namespace B (its traffic crosses the veth), another in A itself (a client on the
storage host: NetnsPair has two namespaces, and a third host would need a bridge). A
block is written from a process in one client's namespace the way vLLM's fs tier
writes (a temporary file renamed to its final name) and read byte-exact from the other,
which looked it up before it existed (no stale negative lookup). After close() nothing
is left: no mount, no glusterd, brick or client, no state, and the namespaces go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_helper import NetnsPair
from netns_helper import Unavailable as NetnsUnavailable

from p2pkv.bench.serving.glusterfs import (
    OWNER_FILE,
    GlusterVolume,
    Unavailable,
    check_available,
    remove_stale,
)

GLUSTER = ("glusterd", "glusterfsd", "glusterfs")
#: Bigger than write-behind's 1 MB window and the FUSE client's 128 KiB reads.
BLOCK = 3 * 1024 * 1024 + 4096


@pytest.fixture
def netns() -> Iterator[NetnsPair]:
    try:
        check_available()
        pair = NetnsPair(mtu=1500)
    except (Unavailable, NetnsUnavailable) as exc:
        pytest.skip(str(exc))
    try:
        yield pair
    finally:
        pair.close()


def gluster_pids() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True,
                         check=True).stdout
    return {int(pid) for pid, stat, comm in (line.split(None, 2) for line in out.splitlines())
            if comm.strip() in GLUSTER and not stat.startswith("Z")}


def netns_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                          text=True, timeout=10).stdout.strip()


def tx_bytes(ns: str, dev: str) -> int:
    shown = subprocess.run(["ip", "-j", "-s", "-n", ns, "link", "show", "dev", dev],
                           capture_output=True, text=True, timeout=10, check=True).stdout
    return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])


def put_block(netns: NetnsPair, ns: str, src: Path, dest: Path) -> None:
    """Copy ``src`` to ``dest`` from a process in ``ns``, as the fs tier stores a block:
    into a temporary file, then renamed."""
    netns.sh(ns, "sh", "-c", 'cp "$1" "$2.tmp" && mv "$2.tmp" "$2"', "sh", str(src), str(dest))


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_volume_shared_across_namespaces(netns: NetnsPair, tmp_path: Path) -> None:
    before = gluster_pids()
    started = time.monotonic()
    vol = GlusterVolume(netns.a, netns.ip_a, tmp_path / "gluster")
    try:
        mnt_b = vol.mount(netns.b, tmp_path / "mnt-b")
        mnt_a = vol.mount(netns.a, tmp_path / "mnt-a")
        clients = vol.client_pids()
        assert netns_of(clients[mnt_b]) == netns.b and netns_of(clients[mnt_a]) == netns.a
        servers = [pid for pid, argv in vol.processes().items() if pid not in clients.values()]
        assert len(servers) == 2, vol.processes()  # glusterd and the brick
        assert {netns_of(pid) for pid in servers} == {netns.a}

        block = tmp_path / "block"
        block.write_bytes(os.urandom(BLOCK))
        for writer, reader, name in ((netns.b, netns.a, "one"), (netns.a, netns.b, "two")):
            into, out_of = (mnt_b, mnt_a) if writer == netns.b else (mnt_a, mnt_b)
            absent = netns.sh(reader, "test", "-e", str(out_of / name), check=False)
            assert absent.returncode == 1, absent
            sent = tx_bytes(netns.b, netns.veth_b)
            put_block(netns, writer, block, into / name)
            netns.sh(reader, "cmp", str(block), str(out_of / name))
            # Client B's writes and reads both cross the veth (A's are local).
            assert tx_bytes(netns.b, netns.veth_b) - sent >= (BLOCK if writer == netns.b
                                                              else 0)
        assert (tmp_path / "gluster" / "brick" / "one").read_bytes() == block.read_bytes()
    finally:
        vol.close()
    assert vol.leftovers() == []
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()
    assert gluster_pids() - before == set()
    assert not (tmp_path / "gluster" / "state").exists()
    assert not (tmp_path / "gluster" / "brick").exists()
    assert (tmp_path / "gluster" / "log" / "glusterd.log").exists()
    netns.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netns.a not in listed and netns.b not in listed
    assert time.monotonic() - started < 60


def test_remove_stale_only_touches_dead_owners(tmp_path: Path) -> None:
    """A process named like a GlusterFS one under a workdir whose owner is gone is
    stopped; one whose owner lives, and one of no workdir, are left alone."""
    # A Python process that names itself "glusterd" (prctl PR_SET_NAME: its comm).
    fake = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'glusterd', 0, 0, 0); "
            "print(flush=True); time.sleep(60)")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    procs = {}
    for name, owner in (("dead", f"{dead} 1"), ("alive", None), ("none", "")):
        root = tmp_path / name
        (root / "run").mkdir(parents=True)
        if owner is None:
            stat = Path(f"/proc/{os.getpid()}/stat").read_text()
            owner = f"{os.getpid()} {stat.rsplit(')', 1)[1].split()[19]}"
        if owner:
            (root / OWNER_FILE).write_text(owner + "\n")
        procs[name] = subprocess.Popen([sys.executable, "-c", fake, str(root / "run/x")],
                                       stdout=subprocess.PIPE)
    try:
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline() == b"\n"  # named
        removed = remove_stale()
        pids = [int(r.split()[0]) for r in removed]  # (and any real leftovers of dead runs)
        assert procs["dead"].pid in pids
        assert procs["alive"].pid not in pids and procs["none"].pid not in pids
        assert procs["dead"].wait(5) is not None
        assert procs["alive"].poll() is None and procs["none"].poll() is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
            assert p.stdout is not None
            p.stdout.close()

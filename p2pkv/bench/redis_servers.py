"""Private Redis servers on 127.0.0.1, for the benchmarks and the tests.

:class:`LocalRedis` starts the real server binary (Debian's ``redis-server``) on a free
port with a temporary directory, no persistence and no eviction, waits until it answers
and stops it (or kills it) on request. :class:`LocalRedisCluster` starts several of them
in cluster mode and joins them with ``redis-cli --cluster create``. Nothing about them
is simulated. Every subprocess and every wait is bounded. Not part of the runtime
package: a user of :mod:`p2pkv.cluster` never imports this.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from p2pkv.bench import ports

__all__ = ["LocalRedis", "LocalRedisCluster", "command", "find_redis_server",
           "find_tool", "free_port"]


def find_tool(name: str) -> str | None:
    """An executable of the Redis packages (``redis-server``, ``redis-cli``, ...)."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in (f"/usr/bin/{name}", f"/usr/sbin/{name}", f"/usr/local/bin/{name}"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def find_redis_server() -> str | None:
    """The ``redis-server`` executable, or None when it is not installed."""
    return find_tool("redis-server")


#: A Redis Cluster node's bus port is its port plus this.
CLUSTER_BUS_OFFSET = 10000


def free_port(*, cluster: bool = False) -> int:
    """A free TCP port on 127.0.0.1 outside the kernel's ephemeral range; with
    ``cluster``, one whose cluster bus port (10000 higher) is free too."""
    return ports.free_port(also=CLUSTER_BUS_OFFSET if cluster else 0)


def _resp(*args: str) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(
        b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args)


def _node_port(fields: list[str]) -> int:
    """The port of a ``CLUSTER NODES`` row (``ID HOST:PORT@BUS FLAGS ...``)."""
    return int(fields[1].split("@")[0].rsplit(":", 1)[1])


def command(port: int, *args: str, timeout: float = 2.0,
            auth: tuple[str, ...] = ()) -> bytes:
    """One plain-text RESP command to 127.0.0.1:``port``; the raw reply (b"" if none).

    Enough for readiness checks and ``CLUSTER INFO``/``NODES``: it reads until the reply
    is complete or the socket is quiet, it does not parse nested replies. ``auth``: the
    arguments of an ``AUTH`` sent first (``(PASSWORD,)`` or ``(USER, PASSWORD)``); when
    it is refused, that refusal is the reply.
    """
    out = (_resp("AUTH", *auth) if auth else b"") + _resp(*args)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(out)
            data = s.recv(65536)
            if auth:
                while b"\r\n" not in data:
                    more = s.recv(65536)
                    if not more:
                        return data
                    data += more
                if not data.startswith(b"+OK\r\n"):
                    return data[:data.index(b"\r\n") + 2]
                data = data[len(b"+OK\r\n"):] or s.recv(65536)
            if data.startswith(b"$"):
                want = int(data[1:data.index(b"\r\n")])
                while want >= 0 and len(data) < want + len(b"$%d\r\n\r\n" % want):
                    more = s.recv(65536)
                    if not more:
                        break
                    data += more
            return data
    except (OSError, ValueError):
        return b""


class LocalRedis:
    """One ``redis-server`` process; use as a context manager or start()/stop().

    ``args``: extra configuration (``["--cluster-enabled", "yes"]``); ``tls``: the
    ``(certificate, key, CA certificate)`` files, which make the server speak TLS only
    (on :attr:`port`); ``sentinel``: run as a Sentinel with ``config`` as its file.
    """

    def __init__(self, port: int | None = None, *, executable: str | None = None,
                 args: Sequence[str] = (), tls: tuple[str, str, str] | None = None,
                 sentinel: bool = False, config: str = "") -> None:
        exe = executable or find_redis_server()
        if exe is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install "
                                    "redis-server; `make test` installs it when run as root)")
        self.executable = exe
        self.port = port or free_port()
        self.args = list(args)
        self.tls = tls
        self.sentinel = sentinel
        self._tmp = tempfile.TemporaryDirectory(prefix="p2pkv-redis-")
        self.directory = Path(self._tmp.name)
        if config or sentinel:
            (self.directory / "redis.conf").write_text(config)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        conf = self.directory / "redis.conf"
        head = [self.executable, *([str(conf)] if conf.exists() else [])]
        if self.sentinel:
            return [*head, "--sentinel", "--port", str(self.port), "--bind", "127.0.0.1",
                    "--dir", str(self.directory), "--daemonize", "no", *self.args]
        ports = ["--port", str(self.port)]
        if self.tls:
            cert, key, ca = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                     "--tls-key-file", key, "--tls-ca-cert-file", ca,
                     "--tls-auth-clients", "no", "--tls-replication", "yes"]
        return [*head, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.directory), "--daemonize", "no", "--protected-mode", "no",
                "--databases", "16", "--maxmemory-policy", "noeviction", *self.args]

    def _answers(self) -> bool:
        if self.tls:  # a TLS server: accepting connections is enough here
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return True
            except OSError:
                return False
        return command(self.port, "PING", timeout=0.5) != b""

    def start(self, timeout: float = 15.0) -> LocalRedis:
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            self.proc = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {tail}")
            time.sleep(0.02)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "redis.log").read_text(errors="replace")[-2000:]
        return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL (a crash: no shutdown, no save)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRedisCluster:
    """``masters`` × (1 + ``replicas``) cluster-mode servers joined by ``redis-cli``.

    ``node_timeout`` (ms) is the cluster's ``cluster-node-timeout``: how long a master
    may be silent before its replica takes over.
    """

    def __init__(self, masters: int = 3, replicas: int = 1, *, node_timeout: int = 1000,
                 args: Sequence[str] = ()) -> None:
        cli = find_tool("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not installed (Debian: apt-get install "
                                    "redis-tools; `make test` installs it when run as root)")
        self.cli = cli
        self.masters = masters
        self.replicas = replicas
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(node_timeout),
                 "--cluster-replica-validity-factor", "0",
                 "--cluster-require-full-coverage", "no", *args]
        self.nodes = [LocalRedis(free_port(cluster=True), args=extra)
                      for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 60.0) -> LocalRedisCluster:
        try:
            for n in self.nodes:
                n.start()
            if self.masters < 3:  # below redis-cli's minimum: slots and meets by hand
                if self.replicas:
                    raise ValueError("fewer than 3 masters: only without replicas")
                self._assign_by_hand()
                self.wait_ok(timeout)
                return self
            argv = [self.cli, "--cluster", "create",
                    *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: "
                                   f"{(done.stdout + done.stderr)[-2000:]}")
            self.wait_ok(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _assign_by_hand(self) -> None:
        for i, n in enumerate(self.nodes):
            lo, hi = i * 16384 // self.masters, (i + 1) * 16384 // self.masters - 1
            reply = command(n.port, "CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))
            if not reply.startswith(b"+OK"):
                raise RuntimeError(f"CLUSTER ADDSLOTSRANGE on {n.port}: {reply!r}")
            if i:
                command(n.port, "CLUSTER", "MEET", "127.0.0.1", str(self.nodes[0].port))

    def _nodes(self) -> list[list[str]]:
        """The rows of ``CLUSTER NODES`` (split into their fields) as the first live node
        that answers sees them; none when no node answers."""
        for n in self.nodes:
            if not n.running:
                continue
            raw = command(n.port, "CLUSTER", "NODES")
            if not raw.startswith(b"$"):
                continue
            rows = [line.split() for line in raw.split(b"\r\n", 1)[1].decode().splitlines()]
            return [f for f in rows if len(f) >= 8]
        return []

    def topology(self) -> list[tuple[int, str, bool, list[tuple[int, int]]]]:
        """``(port, node id, is a master, slot ranges)`` of every node a live one knows."""
        out = []
        for f in self._nodes():
            flags = f[2].split(",")
            ranges = []
            for r in f[8:]:
                if r.startswith("["):
                    continue
                lo, _, hi = r.partition("-")
                ranges.append((int(lo), int(hi or lo)))
            alive = "fail" not in flags and "fail?" not in flags
            out.append((_node_port(f), f[0], "master" in flags and alive, ranges))
        return out

    def replicas_of(self, port: int) -> list[int]:
        """The ports of the live replicas of the master on ``port``."""
        rows = self._nodes()
        ids = {_node_port(f): f[0] for f in rows}
        return sorted(_node_port(f) for f in rows
                      if f[3] == ids.get(port) and "fail" not in f[2])

    def master_ports(self) -> list[int]:
        return sorted(p for p, _, master, ranges in self.topology() if master and ranges)

    def master_of(self, slot: int) -> int:
        for port, _, master, ranges in self.topology():
            if master and any(lo <= slot <= hi for lo, hi in ranges):
                return port
        raise LookupError(f"no live master serves slot {slot}")

    def node(self, port: int) -> LocalRedis:
        return next(n for n in self.nodes if n.port == port)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and every slot has a master."""
        deadline = time.monotonic() + timeout
        while True:
            states = [command(n.port, "CLUSTER", "INFO") for n in self.nodes if n.running]
            if states and all(b"cluster_state:ok" in s for s in states):
                covered = sum(hi - lo + 1 for _, _, master, ranges in self.topology()
                              if master for lo, hi in ranges)
                if covered == 16384:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not ok after {timeout}s: {states!r:.400}")
            time.sleep(0.05)

    def close(self) -> None:
        for n in self.nodes:
            n.close()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

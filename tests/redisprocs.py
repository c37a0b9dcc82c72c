"""Real Redis deployments for the tests: one server, a cluster, a Sentinel set, TLS.

The single server and the cluster come from :mod:`p2pkv.bench.redis_servers` (the
benchmark uses them too); the Sentinel set and the test certificates live here. All on
127.0.0.1, free ports, every subprocess and wait bounded, every process stopped by
``close``.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from p2pkv.bench.redis_servers import (
    LocalRedis,
    LocalRedisCluster,
    command,
    find_redis_server,
    find_tool,
    free_port,
)

__all__ = ["LocalRedis", "LocalRedisCluster", "SentinelSet", "TestCertificates",
           "command", "find_redis_server", "find_tool", "free_port"]


class TestCertificates:
    """A throw-away CA and a server certificate for 127.0.0.1 (``openssl`` CLI, EC keys)."""

    __test__ = False  # not a test class

    def __init__(self) -> None:
        openssl = find_tool("openssl")
        if openssl is None:
            raise FileNotFoundError("openssl is not installed (apt-get install openssl)")
        self._tmp = tempfile.TemporaryDirectory(prefix="p2pkv-tls-")
        d = Path(self._tmp.name)
        self.ca, self.cert, self.key = str(d / "ca.crt"), str(d / "server.crt"), str(
            d / "server.key")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
        for argv in (
            [openssl, "req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", self.ca,
             "-subj", "/CN=p2pkv test CA", "-days", "2"],
            [openssl, "req", *ec, "-keyout", self.key, "-out", str(d / "server.csr"),
             "-subj", "/CN=127.0.0.1"],
            [openssl, "x509", "-req", "-in", str(d / "server.csr"), "-CA", self.ca,
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-out", self.cert,
             "-days", "2", "-extfile", str(d / "san.cnf")],
        ):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv[:3])} failed: {done.stderr[-1000:]}")
        # A second CA that signed nothing of ours: a client trusting it must be refused.
        self.other_ca = str(d / "other.crt")
        subprocess.run([openssl, "req", "-x509", *ec, "-keyout", str(d / "other.key"),
                        "-out", self.other_ca, "-subj", "/CN=someone else", "-days", "2"],
                       capture_output=True, timeout=30, check=True, stdin=subprocess.DEVNULL)

    @property
    def files(self) -> tuple[str, str, str]:
        return self.cert, self.key, self.ca

    def close(self) -> None:
        self._tmp.cleanup()


class SentinelSet:
    """A primary, ``replicas`` replicas and ``sentinels`` Sentinels watching it as
    ``service`` (quorum: a majority), with a fast failover (``down_after`` ms).

    ``acl``: ``(USER, PASSWORD, SENTINEL_PASSWORD)`` turns the default user of the data
    nodes off and gives them only USER (all commands; replicas and Sentinels use it too),
    and protects the Sentinels with SENTINEL_PASSWORD (``requirepass``)."""

    def __init__(self, *, replicas: int = 1, sentinels: int = 3, service: str = "p2pkv",
                 down_after: int = 1000, acl: tuple[str, str, str] | None = None) -> None:
        self.service = service
        self.acl = acl
        data = ""
        quorum = sentinels // 2 + 1
        conf = (f"sentinel monitor {service} 127.0.0.1 {{port}} {quorum}\n"
                f"sentinel down-after-milliseconds {service} {down_after}\n"
                f"sentinel failover-timeout {service} {max(3 * down_after, 3000)}\n"
                f"sentinel parallel-syncs {service} 1\n")
        if acl is not None:
            user, password, sentinel_password = acl
            data = (f"user default off\nuser {user} on >{password} ~* &* +@all\n"
                    f"masteruser {user}\nmasterauth {password}\n")
            conf += (f"sentinel auth-user {service} {user}\n"
                     f"sentinel auth-pass {service} {password}\n"
                     f"requirepass {sentinel_password}\n"
                     f"sentinel sentinel-pass {sentinel_password}\n")
        self.primary = LocalRedis(config=data)
        self.replicas = [LocalRedis(args=["--replicaof", "127.0.0.1", str(self.primary.port)],
                                    config=data) for _ in range(replicas)]
        conf = conf.replace("{port}", str(self.primary.port))
        self.sentinels = [LocalRedis(sentinel=True, config=conf) for _ in range(sentinels)]

    @property
    def data_auth(self) -> tuple[str, ...]:
        return self.acl[:2] if self.acl else ()

    @property
    def sentinel_auth(self) -> tuple[str, ...]:
        return self.acl[2:] if self.acl else ()

    @property
    def servers(self) -> list[LocalRedis]:
        return [self.primary, *self.replicas]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        if self.acl is None:
            return f"redis+sentinel://{hosts}/{self.service}"
        user, password, sentinel_password = self.acl
        return (f"redis+sentinel://{user}:{password}@{hosts}/{self.service}"
                f"?sentinel_password={sentinel_password}")

    def start(self, timeout: float = 30.0) -> SentinelSet:
        try:
            for s in [*self.servers, *self.sentinels]:
                s.start()
            deadline = time.monotonic() + timeout
            while self.primary_port() != self.primary.port or not all(
                    b"master_link_status:up" in command(r.port, "INFO", "replication",
                                                        auth=self.data_auth)
                    for r in self.replicas):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Sentinel set did not settle")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def primary_port(self) -> int | None:
        """The primary's port as the first answering Sentinel names it."""
        for s in self.sentinels:
            if not s.running:
                continue
            raw = command(s.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service,
                          auth=self.sentinel_auth)
            parts = raw.split(b"\r\n")
            if raw.startswith(b"*2") and len(parts) >= 5:
                return int(parts[4])
        return None

    def server(self, port: int) -> LocalRedis:
        return next(s for s in self.servers if s.port == port)

    def close(self) -> None:
        for s in [*self.sentinels, *self.servers]:
            s.close()

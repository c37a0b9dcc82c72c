"""Directory URLs: which Redis deployment a URL names, and a client for it.

Four forms (``rediss`` instead of ``redis`` means TLS in each; user and password are
optional, for Redis ACL users or ``requirepass``)::

    redis://[USER:PASSWORD@]HOST:PORT[/DB][?OPTIONS]        one Redis server
    unix://[USER:PASSWORD@]/PATH[?db=DB&OPTIONS]            one Redis server, local socket
    redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][?OPTIONS]
                                                            a Redis Cluster (any nodes of it)
    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]
                                                            the primary that Sentinel names

The single-server forms are redis-py's own (``redis.Redis.from_url``). For the cluster
and sentinel forms the options are ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs`` (``required``, ``optional``, ``none``) and ``ssl_check_hostname``
(``true``/``false``); sentinel also takes ``sentinel_username`` and
``sentinel_password`` (the Sentinels' own credentials, when they differ from the data
nodes'); cluster takes ``subpartitions`` (how many hash-tagged sub-partitions one
partition's block keys are split into; every node of a namespace must agree).

Nothing here touches the network: a Redis Cluster client connects when first used.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

from p2pkv.errors import ConfigError

__all__ = ["DEFAULT_SUBPARTITIONS", "DirectoryURL", "parse_directory_url",
           "validate_redis_url"]

#: Sub-partitions per partition on a Redis Cluster: a multiple of 1, 2, 3, 4, 6, 8, 12,
#: 16 and 24, so that many masters of equal slot ranges each get the same share.
DEFAULT_SUBPARTITIONS = 48
MAX_SUBPARTITIONS = 1024

_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster",
            "redis+sentinel", "rediss+sentinel")
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                "ssl_check_hostname")
_CERT_REQS = ("required", "optional", "none")
_SERVICE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_USAGE = ("expected redis://HOST:PORT/DB, rediss://..., unix://PATH, "
          "redis+cluster://HOST:PORT[,HOST:PORT...] or "
          "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE")


@dataclass(frozen=True)
class DirectoryURL:
    """A parsed directory URL. ``kind``: ``"redis"``, ``"cluster"`` or ``"sentinel"``."""

    url: str
    kind: str
    tls: bool
    hosts: tuple[tuple[str, int], ...] = ()
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    service: str = ""
    db: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    subpartitions: int = DEFAULT_SUBPARTITIONS

    @property
    def redacted(self) -> str:
        """The URL without its password (for messages and logs)."""
        return _redact(self.url)

    def connector(self, socket_timeout: float) -> Callable[[], Any]:
        """A function that builds the redis-py client (called on first use)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        common: dict[str, Any] = {
            "socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout,
            "username": self.username, "password": self.password}
        tls = dict(self.options)
        tls.pop("subpartitions", None)
        sentinel_auth = {k[len("sentinel_"):]: tls.pop(k) for k in
                         ("sentinel_username", "sentinel_password") if k in tls}
        if self.tls:
            tls["ssl"] = True
        if self.kind == "redis":
            def single() -> Any:
                try:
                    return redis.Redis.from_url(
                        self.url, socket_timeout=socket_timeout,
                        socket_connect_timeout=socket_timeout, retry=Retry(NoBackoff(), 0),
                        health_check_interval=0)
                except ValueError as exc:
                    raise ConfigError(f"--directory: {exc}") from exc
            return single
        if self.kind == "sentinel":
            def sentinel() -> Any:
                from redis import sentinel as redis_sentinel

                # Typed as Any: redis-py types these calls in some releases and not in
                # others, and the module must check clean under either.
                sentinel_type: Any = redis_sentinel.Sentinel
                manager = sentinel_type(
                    list(self.hosts),
                    # No retries of its own: a Sentinel that refuses the password would
                    # otherwise cost seconds of backoff per Sentinel on every call.
                    sentinel_kwargs={"socket_timeout": socket_timeout,
                                     "socket_connect_timeout": socket_timeout,
                                     "retry": Retry(NoBackoff(), 0),
                                     **tls, **sentinel_auth},
                    **common, **tls)
                return manager.master_for(
                    self.service, db=self.db, retry=Retry(NoBackoff(), 0), **common, **tls)
            return sentinel

        def cluster() -> Any:
            from redis.cluster import ClusterNode, RedisCluster

            # One retry: a command that meets a dead master asks the others for the new
            # topology once, then fails (the caller's own retry loop takes over).
            return RedisCluster(
                startup_nodes=[ClusterNode(h, p)  # type: ignore[no-untyped-call]
                               for h, p in self.hosts],
                retry=Retry(NoBackoff(), 1), require_full_coverage=False, **common, **tls)
        return cluster


def validate_redis_url(url: str) -> str:
    """``url`` if it is a directory URL this module understands (ConfigError if not)."""
    parse_directory_url(url)
    return url


def parse_directory_url(url: str) -> DirectoryURL:
    """Parse ``url``; :class:`~p2pkv.errors.ConfigError` names what is wrong with it."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"--directory: {_USAGE}, got {url!r}")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _SCHEMES:
        raise ConfigError(f"--directory: unknown scheme {scheme!r}: {_USAGE}")
    if scheme in ("redis", "rediss", "unix"):
        return DirectoryURL(url=url, kind="redis", tls=scheme == "rediss")
    kind = scheme.split("+", 1)[1]
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    hosts = tuple(_host_port(h, url) for h in hostlist.split(","))
    options = _options(parse_qs(query, keep_blank_values=True), kind, url)
    service, db = "", 0
    if kind == "sentinel":
        parts = [p for p in path.split("/") if p]
        if not parts or not _SERVICE.fullmatch(parts[0]):
            raise ConfigError(f"--directory {_redact(url)}: a sentinel URL names the "
                              f"service after the hosts: redis+sentinel://HOST:PORT/SERVICE")
        service = parts[0]
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise ConfigError(f"--directory {_redact(url)}: expected /SERVICE or "
                              f"/SERVICE/DB after the hosts, got /{path}")
        db = int(parts[1]) if len(parts) == 2 else 0
    elif path.strip("/"):
        raise ConfigError(f"--directory {_redact(url)}: a Redis Cluster has one database; "
                          f"drop /{path}")
    sub = options.get("subpartitions", DEFAULT_SUBPARTITIONS)
    return DirectoryURL(url=url, kind=kind, tls=scheme.startswith("rediss"), hosts=hosts,
                        username=username, password=password, service=service, db=db,
                        options=options, subpartitions=sub)


def _redact(url: str) -> str:
    """``url`` with the password of its user and of any ``*password=`` option hidden."""
    url = re.sub(r"(://[^:@/]*:)[^@]*@", r"\1***@", url, count=1)
    return re.sub(r"([?&][A-Za-z_]*password=)[^&#]*", r"\1***", url)


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = text, "6379"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--directory {_redact(url)}: expected HOST:PORT, got {text!r}")
    return host, int(port)


def _options(query: dict[str, list[str]], kind: str, url: str) -> dict[str, Any]:
    allowed = set(_TLS_OPTIONS)
    allowed |= {"subpartitions"} if kind == "cluster" else {
        "sentinel_username", "sentinel_password"}
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise ConfigError(f"--directory {_redact(url)}: unknown option(s) "
                          f"{', '.join(unknown)}; a {kind} URL takes {', '.join(sorted(allowed))}")
    out: dict[str, Any] = {}
    for name, values in query.items():
        value = values[-1]
        if name == "subpartitions":
            if not value.isdigit() or not 1 <= int(value) <= MAX_SUBPARTITIONS:
                raise ConfigError(f"--directory: subpartitions must be 1..{MAX_SUBPARTITIONS}, "
                                  f"got {value!r}")
            out[name] = int(value)
        elif name == "ssl_cert_reqs":
            if value not in _CERT_REQS:
                raise ConfigError(f"--directory: ssl_cert_reqs must be one of "
                                  f"{', '.join(_CERT_REQS)}, got {value!r}")
            out[name] = value
        elif name == "ssl_check_hostname":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"--directory: ssl_check_hostname must be true or false, "
                                  f"got {value!r}")
            out[name] = value.lower() in ("true", "1", "yes")
        else:
            out[name] = value
    return out


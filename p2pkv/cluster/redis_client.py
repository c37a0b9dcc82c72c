"""The Redis connection under a directory: one redis-py client, its scripts and errors.

:class:`RedisConnection` turns a directory URL (any form of
:mod:`p2pkv.cluster.redis_urls`) into one redis-py client, created when first used, and
runs Lua scripts on it by ``EVALSHA``, one at a time or pipelined, loading a script
again where a server answers ``NOSCRIPT`` (a restart, a failover to a replica that never
saw it). Every failure to reach Redis, to authenticate or to make sense of its answer
becomes a :class:`~p2pkv.cluster.records.DirectoryError` that names the (redacted) URL
and the operation.

It knows nothing of the directory's data model: that is
:class:`~p2pkv.cluster.redis_directory.RedisDirectory`, and, on a Redis Cluster,
:class:`~p2pkv.cluster.sharded.Subpartitions`, which both run their scripts here.
:class:`KeySpace` names the keys they (and the directory's other helpers) use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from p2pkv.cluster.records import DirectoryError, Lua
from p2pkv.cluster.redis_urls import parse_directory_url
from p2pkv.errors import ConfigError

__all__ = ["DirectoryParts", "KeySpace", "RedisConnection"]


class KeySpace:
    """The names of a directory's Redis keys under one ``namespace`` (the data model of
    :mod:`p2pkv.cluster.redis_directory`). Raises :class:`~p2pkv.errors.ConfigError`
    for an empty namespace or one with braces or blanks (they would break a hash tag).
    """

    def __init__(self, namespace: str) -> None:
        if not namespace or any(c in namespace for c in "{} "):
            raise ConfigError(f"directory namespace must be non-empty without braces or "
                              f"blanks, got {namespace!r}")
        self.namespace = namespace

    def key(self, partition: str, what: str) -> str:
        """``NS:{partition}:what``: the key ``what`` of ``partition`` (or of any other
        hash tag, e.g. a sub-partition's), in the Redis Cluster slot of that tag."""
        return f"{self.namespace}:{{{partition}}}:{what}"

    def shared(self, what: str) -> str:
        """``NS:what``: a key of the whole namespace (``seq``, ``partitions``)."""
        return f"{self.namespace}:{what}"


class DirectoryParts(Protocol):
    """What the helpers of a :class:`~p2pkv.cluster.RedisDirectory` use of it (its
    sharded keys, :mod:`p2pkv.cluster.sharded`, and its verdicts,
    :mod:`p2pkv.cluster.verdicts`): its connection, URL and key names. Named by what
    they use, so that they do not import the directory's module, which imports them."""

    @property
    def redis(self) -> RedisConnection: ...

    @property
    def url(self) -> str: ...

    @property
    def keys(self) -> KeySpace: ...


class RedisConnection:
    """One redis-py client for a directory URL (thread-safe; one connection pool).

    ``kind`` is the URL's (``"redis"``, ``"cluster"`` or ``"sentinel"``), ``url`` the
    URL without its password, ``subpartitions`` a cluster URL's sub-partition count.
    A cluster or Sentinel client is created on first use: making one asks the network.
    Raises :class:`~p2pkv.errors.ConfigError` for a bad URL or without redis-py.
    """

    def __init__(self, url: str, socket_timeout: float) -> None:
        try:
            import redis
            from redis.exceptions import NoScriptError
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ConfigError("--directory redis://... needs the Redis client: "
                              "pip install 'p2pkv[cluster]'") from exc
        parsed = parse_directory_url(url)
        self.url = parsed.redacted
        self.kind = parsed.kind
        self.subpartitions = parsed.subpartitions
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._noscript = NoScriptError
        self._connect = parsed.connector(socket_timeout)
        self._client: Any = None
        self._client_lock = threading.Lock()
        if parsed.kind == "redis":
            self._client = self._connect()  # redis-py connects lazily by itself

    @property
    def client(self) -> Any:
        """The redis-py client (``redis.Redis`` or ``RedisCluster``), created once."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def eval(self, script: Lua, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """One script call (``EVALSHA``; the script is loaded on ``NOSCRIPT``)."""
        client = self.client
        try:
            return client.evalsha(script.sha, len(keys), *keys, *args)
        except self._noscript:
            client.script_load(script.text)
            return client.evalsha(script.sha, len(keys), *keys, *args)

    def pipelined(self, calls: Sequence[tuple[Lua, Sequence[Any], Sequence[Any]]]
                  ) -> list[Any]:
        """Script calls in one non-transactional pipeline (on a cluster: the calls for
        each shard go out together, to every shard at once, before any answer is read).
        A call answered ``NOSCRIPT`` loads its script and runs again."""
        client = self.client
        pipe = client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        results = list(pipe.execute(raise_on_error=False))
        again = [i for i, r in enumerate(results) if isinstance(r, self._noscript)]
        if again:
            for text in {calls[i][0].text for i in again}:
                client.script_load(text)
            pipe = client.pipeline(transaction=False)
            for i in again:
                script, keys, args = calls[i]
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            for i, r in zip(again, pipe.execute(raise_on_error=False), strict=True):
                results[i] = r
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, with any failure of Redis as a DirectoryError about ``what``."""
        try:
            return fn()
        except DirectoryError:
            raise
        except self._errors as exc:
            raise DirectoryError(f"redis directory {self.url}: {what}: {exc}") from exc
        except Exception as exc:
            # redis-py's cluster client raises RedisClusterException (not a RedisError)
            # when no startup node answers or a slot has no master.
            if type(exc).__module__.startswith("redis"):
                raise DirectoryError(f"redis directory {self.url}: {what}: {exc}") from exc
            raise

    def memory(self) -> int:
        """Redis ``used_memory`` in bytes, summed over a cluster's masters."""
        if self.kind == "cluster":
            from redis.cluster import RedisCluster

            info = self.call("info", lambda: self.client.info(
                "memory", target_nodes=RedisCluster.PRIMARIES))
        else:
            info = self.call("info", lambda: self.client.info("memory"))
        if "used_memory" in info:
            return int(info["used_memory"])
        return sum(int(v["used_memory"]) for v in info.values())

    def ping(self) -> bool:
        try:
            return bool(self.call("ping", lambda: self.client.ping()))
        except DirectoryError:
            return False

    def close(self) -> None:
        """Close the client's connections. A Redis that is gone already is no error
        here: closing is what the caller wanted, and nothing is left to tell it."""
        if self._client is not None:
            with contextlib.suppress(DirectoryError):
                self.call("close", self._client.close)

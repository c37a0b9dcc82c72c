"""Shared fixtures: node processes and in-process nodes, always cleaned up."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import NodeProcess


@pytest.fixture
def spawn() -> Iterator[Any]:
    """Start node processes (``tests/nodeproc.py``); every one is killed at teardown."""
    procs: list[NodeProcess] = []

    def start(role: str, spec: dict[str, Any], *extra: str) -> NodeProcess:
        p = NodeProcess(role, spec, *extra)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


@pytest.fixture
def nodes() -> Iterator[Any]:
    """Build in-process nodes from a nodeproc spec; every one is closed at teardown."""
    from nodeproc import make_node  # imports torch: only for the tests that use it

    built: list[Any] = []

    def build(spec: dict[str, Any], **config: Any) -> Any:
        node = make_node(spec, **config)
        built.append(node)
        return node

    yield build
    for node in built:
        node.close(timeout=1.0)


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Whatever a test appends (nodes, proxies, raw peers) is closed at teardown, last
    first."""
    from p2pkv.node import Node

    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Node):
            thing.close(timeout=1.0)
        else:
            thing.close()


def _local_redis(*, optional: bool = False) -> Iterator[str | None]:
    """A private redis-server's URL. Where none is installed: None when ``optional``,
    else a skip; under ``make test`` (``P2PKV_REQUIRE_VLLM=1``) a failure either way."""
    import os

    from redisprocs import LocalRedis, find_redis_server

    if find_redis_server() is None:
        if os.environ.get("P2PKV_REQUIRE_VLLM") == "1":
            pytest.fail("redis-server is not installed (make redis installs it)")
        if optional:
            yield None
            return
        pytest.skip("redis-server is not installed (make redis installs it)")
    server = LocalRedis().start()
    try:
        yield server.url
    finally:
        server.close()


def _required_redis() -> Iterator[str]:
    for url in _local_redis():
        assert url is not None
        yield url


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A private redis-server on a free port, closed after the test. Under ``make test``
    (``P2PKV_REQUIRE_VLLM=1``) a missing server fails instead of skipping: CI must not
    pass by testing nothing."""
    yield from _required_redis()


@pytest.fixture(scope="module")
def module_redis_url() -> Iterator[str]:
    """:func:`redis_url` for every test of a module (engines that outlive one test)."""
    yield from _required_redis()


@pytest.fixture(scope="module")
def module_redis_url_if_installed() -> Iterator[str | None]:
    """:func:`module_redis_url`, or None where redis-server is missing outside ``make
    test``: a module whose engines use a directory only in some tests runs the others."""
    yield from _local_redis(optional=True)

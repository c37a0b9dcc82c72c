"""The internal state some tests need, in one place, each with why no public API gives it.

A library user has stats(), describe() and the documented properties; these tests need
more. They break a part on purpose (cut one data stream, stall a publisher thread, make a
data port pin another certificate), check that abuse left a part alive that no stats
report (a node's IO thread), or check a bound that is a private detail (the ZeroMQ
``MAXMSGSIZE`` of a node's sockets, the sizes a sealed stream's buffers grew to). None
of that belongs in the public API, so every reach-in is here: a renamed attribute breaks
one function, not many tests, and a reader sees what the tests rely on.

Nothing here changes what a test asserts: each function reads (or, where it says so,
breaks) exactly what the test did inline before.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

__all__ = [
    "break_data_port_pin",
    "inbound_connections",
    "io_thread_alive",
    "max_message_bytes",
    "plaintext_bytes",
    "publisher_stalled",
    "request_adapter",
    "staging_bytes",
    "start_tier_node",
    "stream_socket",
]


def io_thread_alive(node: Any) -> bool:
    """Whether the :class:`~p2pkv.Node`'s IO thread still runs: hostile-input tests
    check it survived (a node whose IO thread died answers nothing, and no stats say
    so, since stats are read by other threads)."""
    return bool(node._thread.is_alive())


def max_message_bytes(node: Any) -> int:
    """The ZeroMQ ``MAXMSGSIZE`` of the node's sockets (its wiring derives it from the
    layout): a test sends one byte more to see libzmq drop the connection."""
    return int(node._rt.max_message)


def inbound_connections(node: Any) -> list[Any]:
    """The node's inbound connections (one per peer): data-stream tests look at the
    streams each bound (``.streams``, index -> the serving half) and cut one."""
    return list(node._server._inbound.values())


def stream_socket(served: Any) -> socket.socket:
    """The socket under one served data stream (an item of an inbound connection's
    ``streams``): tests shut it down to break the stream mid-fetch, or check it is TLS."""
    sock: socket.socket = served.stream._sock
    return sock


def break_data_port_pin(node: Any, pin: bytes) -> None:
    """Make the node's data port pin ``pin`` in every welcome from now on instead of its
    certificate's digest: the dialing side must refuse the stream and fall back. Breaks
    the node on purpose; no API may offer that."""
    listener = node._rt.data_listener
    assert listener is not None and listener._tls is not None
    listener._tls.pin = pin


def staging_bytes(sock: Any) -> int:
    """The size of a sealing :class:`~p2pkv.transport.sealed.SealedSocket`'s staging
    buffer (plaintext gathered into one record): a test checks it grows only as far as
    the records it held."""
    return int(sock._stagev.nbytes)


def plaintext_bytes(sock: Any) -> int:
    """The size of an opening :class:`~p2pkv.transport.sealed.SealedSocket`'s plaintext
    buffer (records opened for reads smaller than them), checked as
    :func:`staging_bytes`."""
    return int(sock._plainv.nbytes)


@contextlib.contextmanager
def publisher_stalled(cluster: Any, monkeypatch: Any) -> Iterator[Any]:
    """While inside, the :class:`~p2pkv.cluster.Cluster`'s registration thread writes
    no pending entries, so announcements stay queued up to their bound; yields the
    registration (``flush()`` it after). Stalls the thread on purpose."""
    reg = cluster._registration
    assert reg is not None
    real = reg._publish_pending
    monkeypatch.setattr(reg, "_publish_pending", lambda: None)
    try:
        yield reg
    finally:
        monkeypatch.setattr(reg, "_publish_pending", real)


def start_tier_node(tier: Any, wait: float) -> Any:
    """Start a :class:`~p2pkv.integrations.vllm.P2PKVTier`'s node now and wait up to
    ``wait`` seconds for it (a request that comes before the tier's own early start
    does that, which a test without an engine has none of); the node, or None."""
    return tier._ensure_node(wait)


def request_adapter(tier: Any, req_id: str) -> Any:
    """What a tier recorded for request ``req_id``'s LoRA adapter (its per-request
    state, which only the tier's own lookups read)."""
    return tier._adapters.state(req_id)

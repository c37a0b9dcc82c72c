"""Prometheus metrics for a node (optional extra: ``pip install 'p2pkv[metrics]'``).

Metrics are read from :meth:`p2pkv.node.Node.stats` at scrape time by a custom collector,
so the data path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.runtime.tuning import STOP_WAIT_S

__all__ = ["MetricsServer", "NodeCollector", "serve_metrics"]


class NodeCollector:
    """A ``prometheus_client`` collector over one node's stats snapshot."""

    def __init__(self, node: Any) -> None:
        self._node = node

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        s = self._node.stats()
        hs = CounterMetricFamily("p2pkv_handshakes", "Handshakes served, by result and reason",
                                 labels=["result", "reason"])
        hs.add_metric(["accepted", ""], s.handshakes_accepted)
        for reason, n in sorted(s.handshakes_refused.items()):
            hs.add_metric(["refused", reason], n)
        yield hs
        undeclared = CounterMetricFamily(
            "p2pkv_identity_undeclared",
            "Handshakes accepted under identity_policy=lenient although only one side "
            "declared this identity-extension field", labels=["field"])
        for name, n in sorted(getattr(s, "identity_undeclared", {}).items()):
            undeclared.add_metric([name], n)
        yield undeclared
        for name, value, doc in (
            ("p2pkv_lookups", s.lookups_served, "Lookup requests served"),
            ("p2pkv_lookup_keys", s.lookup_keys_served, "Keys asked in served lookups"),
            ("p2pkv_lookup_hits", s.lookup_hits_served, "Keys found in served lookups"),
            ("p2pkv_blocks_sent", s.blocks_sent, "Blocks sent to peers"),
            ("p2pkv_bytes_sent", s.bytes_sent, "Block bytes sent to peers"),
            ("p2pkv_blocks_received", s.blocks_received, "Blocks received from peers"),
            ("p2pkv_bytes_received", s.bytes_received, "Block bytes received from peers"),
            ("p2pkv_checksum_failures", s.checksum_failures, "Blocks dropped on bad checksum"),
            ("p2pkv_protocol_violations", s.protocol_violations, "Peers dropped for violations"),
            ("p2pkv_nixl_read_failures", s.nixl_read_failures,
             "NIXL reads that did not complete (deadline or disconnect): their blocks "
             "failed, the connection stayed"),
            ("p2pkv_data_records_refused", s.data_records_refused,
             "Sealed data streams ended by a record that failed authentication (changed, "
             "replayed, dropped or cut in flight)"),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield from _by_path(s)
        yield CounterMetricFamily(
            "p2pkv_data_streams_stalled", "Peers whose data stream took no bytes for "
            "send_timeout while blocks waited (session ended, blocks released)",
            value=s.data_streams_stalled)
        st = s.store
        yield GaugeMetricFamily("p2pkv_pool_capacity_blocks", "Blocks the pool holds",
                                value=st.capacity)
        yield GaugeMetricFamily("p2pkv_pool_used_blocks", "Blocks in use", value=st.used)
        yield GaugeMetricFamily("p2pkv_pool_pinned_blocks", "Blocks pinned by transfers",
                                value=st.pinned)
        yield CounterMetricFamily("p2pkv_pool_evictions", "Blocks evicted (LRU)",
                                  value=st.evictions)
        nixl = GaugeMetricFamily("p2pkv_nixl", "Whether this node reads and serves one-sided "
                                 "through NIXL (nixl-v1): 1 on, 0 off, with why", labels=["state"])
        nixl.add_metric([s.nixl], 1.0 if s.nixl.startswith("on") else 0.0)
        yield nixl
        peers = GaugeMetricFamily("p2pkv_peers_connected", "Connected peers", labels=["direction"])
        peers.add_metric(["outbound"], s.peers_out)
        peers.add_metric(["inbound"], s.peers_in)
        yield peers
        # The latency histogram only when the node records one: an exception here would
        # turn every scrape into an HTTP 500 and hide all the other metrics.
        latency = getattr(s, "fetch_latency_buckets", None)
        if latency is not None:
            buckets = [(f"{le:g}" if le != float("inf") else "+Inf", n) for le, n in latency]
            yield HistogramMetricFamily("p2pkv_fetch_seconds",
                                        "Fetch latency (issued by this node)", buckets=buckets,
                                        sum_value=getattr(s, "fetch_latency_sum", 0.0))


def _by_path(s: Any) -> Iterator[Any]:
    """Bytes and stalled readers by the path they took (p2pkv.runtime.paths): ZeroMQ
    frames, packed frames (packed-v1), shared memory (shm-v1), the data stream
    (tcp-data-v1), one-sided NIXL reads (nixl-v1)."""
    from prometheus_client.core import CounterMetricFamily

    for direction in ("sent", "received"):
        by_path = CounterMetricFamily(f"p2pkv_bytes_{direction}_by_path",
                                      f"Block bytes {direction}, by the path they took",
                                      labels=["path"])
        for kind, moved in sorted(s.paths.items()):
            by_path.add_metric([kind], getattr(moved, f"bytes_{direction}"))
        yield by_path
    stalled = CounterMetricFamily(
        "p2pkv_readers_stalled", "Peers cut at the send deadline for taking nothing "
        "of what waited for them on a data path (session ended, blocks released)",
        labels=["path"])
    for kind, moved in sorted(s.paths.items()):
        stalled.add_metric([kind], moved.readers_stalled)
    yield stalled


@dataclass
class MetricsServer:
    port: int
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(STOP_WAIT_S)


def serve_metrics(node: Any, port: int, host: str = "127.0.0.1",
                  collectors: Sequence[Any] = ()) -> MetricsServer:
    """Serve ``/metrics`` for ``node`` on ``host:port`` (0 = ephemeral) in a thread.

    ``collectors``: more ``prometheus_client`` collectors to serve beside the node's
    (the cluster layer's, for example).
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ConfigError("--metrics-port needs prometheus-client: "
                          "pip install 'p2pkv[metrics]'") from exc
    registry = CollectorRegistry()
    registry.register(NodeCollector(node))
    for collector in collectors:
        registry.register(collector)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"--metrics-port: cannot listen on {host}:{port}: {exc}") from exc
    return MetricsServer(server.server_port, server, thread)

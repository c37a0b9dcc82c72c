"""``p2pkv-node serve``: one node serving blocks until SIGINT or SIGTERM.

The whole configuration is resolved before the node (and torch) is imported, so a bad
value exits 2 with nothing started. Then, in this order: the node starts (its ``--fill``
blocks put before anything is announced), the directory registration and the metrics
endpoint, the "listening" event, the ``--peer`` connections. A signal at any point
after the handlers are in means a clean stop: the node leaves the directory first, then
declines new fetches and lets those in flight finish (the drain), and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

from p2pkv.commands.common import EXIT_OK, emit, settings_of
from p2pkv.errors import ConfigError, P2PKVError
from p2pkv.fill import fill_block, fill_keys
from p2pkv.settings import Settings, node_config

__all__ = ["cmd_serve"]

# The command line's logger: serve's lines read as p2pkv-node's.
log = logging.getLogger("p2pkv.cli")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 after a clean stop (see the module docstring)."""
    # Resolve the whole configuration before importing the node (and torch): a bad
    # value exits 2 at once, with nothing started.
    settings = settings_of(args)
    layout = settings.layout()
    rc = settings.run_config(layout)
    ext = settings.extension()
    config = node_config(settings)
    fill = _checked_fill(settings, rc)
    from p2pkv.node import Node

    # Handlers go in before anything starts, so a signal that arrives while the node
    # starts or connects to its peers still means a clean stop (exit 0).
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    metrics = None
    cluster = None
    try:
        node = Node(rc, layout, pool_blocks=settings["pool_blocks"], config=config,
                    extension=ext)
    except BaseException as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, ConfigError) and exc.option == "listen" and not exc.named:
            raise ConfigError(str(exc), option="listen") from exc
        raise
    try:
        # Filled before the listening line: whoever reads it finds the content there.
        for key in fill_keys(fill, seed=settings["key_seed"], tokens_per_hash=rc.tokens_per_hash):
            node.put(key, fill_block(key, layout.bytes_per_block))
        collectors: list[Any] = []
        if settings["directory"] != "static":
            from p2pkv.cluster import Cluster, ClusterConfig
            from p2pkv.cluster.metrics import ClusterCollector

            cluster = Cluster(node, directory=settings["directory"], peers=settings["peer"],
                              config=ClusterConfig(ttl=settings["directory_ttl"]),
                              advertise=settings["advertise"],
                              extension="" if ext.is_empty else ext.digest)
            collectors.append(ClusterCollector(cluster))
        if settings["metrics_port"] is not None:
            from p2pkv.metrics import serve_metrics

            metrics = serve_metrics(node, settings["metrics_port"], settings["metrics_host"],
                                    collectors=collectors)
        _say_listening(args, settings, node, metrics.port if metrics else None)
        if cluster is not None:
            registered = cluster.wait_registered(min(2.0, settings["directory_ttl"]))
            emit(args, {"event": "directory", "url": settings["directory"],
                         "registered": registered, "partition": cluster.partition},
                  f"directory {settings['directory']}: "
                  + ("registered" if registered else "unreachable, serving on and retrying")
                  + f" (partition {cluster.partition})")
        _connect_peers(args, node, settings["peer"], stop)
        # The handlers set ``stop``; a signal interrupts the wait (Python retries it
        # after running them), so nothing needs to poll.
        stop.wait()
        # A signal means a drain (below); the stopping event says for how long at most.
        emit(args, {"event": "stopping", "drain_seconds": settings["drain_timeout"]},
              "shutting down")
    finally:
        if metrics is not None:
            metrics.close()
        # Leave the directory first, so that lookups stop pointing here; then decline
        # new fetches and let those in flight finish (a consumer fails over at once).
        if cluster is not None:
            cluster.close()
        if stop.is_set():
            log.info("draining: new fetches declined, up to %gs for those in flight",
                     settings["drain_timeout"])
            node.drain(settings["drain_timeout"])
        else:
            node.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    emit(args, {"event": "stopped"}, "stopped")
    return EXIT_OK


def _checked_fill(settings: Settings, rc: Any) -> int:
    """``--fill``'s block count, refused when the pool cannot hold it or its keys
    cannot be made."""
    fill: int = settings["fill"]
    if fill > settings["pool_blocks"]:
        raise ConfigError(f"--fill: {fill} blocks do not fit a pool of "
                          f"{settings['pool_blocks']} blocks (raise --pool-blocks)")
    try:
        fill_keys(fill, seed=settings["key_seed"], tokens_per_hash=rc.tokens_per_hash)
    except ValueError as exc:
        raise ConfigError(f"--fill: {exc}") from exc
    return fill


def _say_listening(args: argparse.Namespace, settings: Settings, node: Any,
                   metrics_port: int | None) -> None:
    """The ``listening`` event: address, identity, layout, pool, what it was filled with."""
    rc, layout, ext, fill = node.run_config, node.layout, node.extension, settings["fill"]
    info = {
        "event": "listening", "address": node.address, "fingerprint": rc.fingerprint,
        "namespace": rc.namespace("/kvcache"), "run_config": rc.get_run_config(),
        "layout": layout.name, "pool": node.store.stats().memory_kind,
        "metrics_port": metrics_port, "fill": fill,
        "extension": ext.to_wire(), "identity_policy": settings["identity_policy"],
        "identity_sources": settings.identity_sources(),
    }
    emit(args, info, f"p2pkv-node listening on {node.address}\n"
          f"  fingerprint {rc.fingerprint}  namespace {info['namespace']}\n"
          f"  run config  {json.dumps(rc.get_run_config(), sort_keys=True)}\n"
          f"  extension   {ext.describe()}, identity policy "
          f"{settings['identity_policy']}\n"
          + "".join(f"    {name} from {source}\n"
                    for name, source in info["identity_sources"].items()) +
          f"  layout {layout.name}, {layout.bytes_per_block} bytes/block, "
          f"pool {settings['pool_blocks']} blocks ({info['pool']})"
          + (f"\n  filled with {fill} blocks of known content (SPEC appendix A)"
             if fill else ""))


def _connect_peers(args: argparse.Namespace, node: Any, peers: Sequence[str],
                   stop: threading.Event) -> None:
    """Connect to each ``--peer`` in turn (until a signal), saying how each went."""
    for address in peers:
        if stop.is_set():
            break
        try:
            peer = node.connect(address)
            emit(args, {"event": "peer", "address": address, "ok": True,
                         "remote": peer.remote_node_id},
                  f"connected to peer {address} ({peer.remote_node_id})")
        except (P2PKVError, OSError) as exc:
            emit(args, {"event": "peer", "address": address, "ok": False,
                         "error": str(exc)}, f"peer {address}: {exc}")

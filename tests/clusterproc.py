"""A p2pkv node in a cluster directory, in its own process (for kill -9 tests).

Usage: ``python tests/clusterproc.py SPEC_JSON`` where SPEC is a ``nodeproc`` spec plus
``directory`` (the Redis URL), ``cluster`` (ClusterConfig keyword arguments; ``health``
holds HealthConfig's), ``advertise`` (the address it registers, default its own),
``count`` and ``key_offset`` (which of ``nodeproc.keys_for`` it holds), and ``metrics``
(true: serve ``/metrics``, the node's and the cluster's, on an ephemeral port). It stores
its blocks, waits until it is registered, prints ``{"event": "ready", "address",
"node_id", "metrics_port"}`` and then answers one JSON command per stdin line:

* ``{"op": "discard", "indices": [...]}``: drop those of its keys from the store (the
  directory hears of it at the next announce interval) -> ``{"event": "discarded"}``;
* ``{"op": "stats"}`` -> ``{"event": "stats", "registered", "registrations", ...}``;
* ``{"op": "fetch", "count": N, "offset": K}``: ``fetch_prefix`` of those ``keys_for``
  keys through the directory -> ``{"event": "fetched", "outcomes", "sources",
  "corrupt"}`` (``corrupt``: stored blocks whose bytes differ from ``content``).

EOF on stdin: deregister, close, print ``{"event": "stopped"}`` and exit 0.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nodeproc import content, keys_for, make_node, say

from p2pkv.cluster import Cluster, ClusterConfig
from p2pkv.cluster.health import HealthConfig
from p2pkv.node import KeyOutcome


def main(spec: dict[str, Any]) -> int:
    node = make_node(spec, **spec.get("config", {}))
    cluster = None
    metrics = None
    try:
        keys = keys_for(spec["count"], spec.get("key_offset", 0))
        size = node.layout.bytes_per_block
        for key in keys:
            node.put(key, content(key, size))
        options = dict(spec.get("cluster", {}))
        if "health" in options:
            options["health"] = HealthConfig(**options["health"])
        cluster = Cluster(node, directory=spec["directory"], advertise=spec.get("advertise"),
                          config=ClusterConfig(**options))
        if not cluster.wait_registered(30):
            say({"event": "error", "error": "not registered within 30 s"})
            return 1
        if spec.get("metrics"):
            from p2pkv.cluster.metrics import ClusterCollector
            from p2pkv.metrics import serve_metrics

            metrics = serve_metrics(node, 0, collectors=[ClusterCollector(cluster)])
        say({"event": "ready", "address": node.address, "node_id": node.node_id,
             "member": cluster.stats().member,
             "metrics_port": metrics.port if metrics is not None else None})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "discard":
                for i in cmd["indices"]:
                    node.store.discard(keys[i])
                say({"event": "discarded", "stored": len(node.store)})
            elif cmd["op"] == "stats":
                s = cluster.stats()
                say({"event": "stats", **s.__dict__})
            elif cmd["op"] == "fetch":
                wanted = keys_for(cmd["count"], cmd.get("offset", 0))
                fetched = cluster.fetch_prefix(wanted, timeout=30)
                stored = [k for k, o in zip(fetched.lookup.prefix, fetched.result.outcomes,
                                            strict=True) if o is KeyOutcome.LANDED]
                say({"event": "fetched", "outcomes": [o.name for o in fetched.result.outcomes],
                     "sources": [s.address if s else None for s in fetched.sources],
                     "corrupt": sum(node.get(k) != content(k, size) for k in stored)})
                for k in stored:  # fetched again next time
                    node.store.discard(k)
        cluster.close()
        cluster = None
        say({"event": "stopped"})
    finally:
        if metrics is not None:
            metrics.close()
        if cluster is not None:
            cluster.close(deregister=False)
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))

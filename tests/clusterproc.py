"""A p2pkv node in a cluster directory, in its own process (for kill -9 tests).

Usage: ``python tests/clusterproc.py SPEC_JSON`` where SPEC is a ``nodeproc`` spec plus
``directory`` (the Redis URL), ``cluster`` (ClusterConfig keyword arguments), ``count``
and ``key_offset`` (which of ``nodeproc.keys_for`` it holds). It stores its blocks,
waits until it is registered, prints ``{"event": "ready", "address", "node_id"}`` and
then answers one JSON command per stdin line:

* ``{"op": "discard", "indices": [...]}``: drop those of its keys from the store (the
  directory hears of it at the next announce interval) -> ``{"event": "discarded"}``;
* ``{"op": "stats"}`` -> ``{"event": "stats", "registered", "registrations", ...}``.

EOF on stdin: deregister, close, print ``{"event": "stopped"}`` and exit 0.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nodeproc import content, keys_for, make_node, say

from p2pkv.cluster import Cluster, ClusterConfig


def main(spec: dict[str, Any]) -> int:
    node = make_node(spec, **spec.get("config", {}))
    cluster = None
    try:
        keys = keys_for(spec["count"], spec.get("key_offset", 0))
        size = node.layout.bytes_per_block
        for key in keys:
            node.put(key, content(key, size))
        cluster = Cluster(node, directory=spec["directory"],
                          config=ClusterConfig(**spec.get("cluster", {})))
        if not cluster.wait_registered(30):
            say({"event": "error", "error": "not registered within 30 s"})
            return 1
        say({"event": "ready", "address": node.address, "node_id": node.node_id,
             "member": cluster.stats().member})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "discard":
                for i in cmd["indices"]:
                    node.store.discard(keys[i])
                say({"event": "discarded", "stored": len(node.store)})
            elif cmd["op"] == "stats":
                s = cluster.stats()
                say({"event": "stats", **s.__dict__})
        cluster.close()
        cluster = None
        say({"event": "stopped"})
    finally:
        if cluster is not None:
            cluster.close(deregister=False)
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))

"""The seed bug, made impossible: V1 and V2 blocks have the same size, not the same bytes.

A V1 node (cross-layer rows, parallel-agnostic) tries to share with a V2 node
(per-layer tensors). Both are 589,824 bytes per block, so a size check would pass and the
model would decode garbage. The handshake refuses instead, on both sides, and says why.

Run: python examples/v1_vs_v2_refusal.py
"""

from __future__ import annotations


def main() -> None:
    from p2pkv import Node, PeerIncompatible, RunConfig
    from p2pkv.layout import SEED_GEOMETRY, make_layout
    from p2pkv.reports import refusal_table

    v1 = make_layout("v1", SEED_GEOMETRY)
    v2 = make_layout("v2", SEED_GEOMETRY)
    assert v1.bytes_per_block == v2.bytes_per_block == 589_824
    rc1 = RunConfig.resolve("seed-model", parallel_agnostic=True, **v1.identity_flags())
    rc2 = RunConfig.resolve("seed-model", parallel_agnostic=True, **v2.identity_flags())
    print(f"V1 fingerprint {rc1.fingerprint}, V2 fingerprint {rc2.fingerprint}")

    with Node(rc2, v2, pool_blocks=4) as server, Node(rc1, v1, pool_blocks=4) as client:
        server.put(b"k" * 20, bytes(v2.bytes_per_block))
        try:
            client.connect(server.address)
        except PeerIncompatible as exc:
            print("refused, as it must be:")
            print(refusal_table(exc.reasons))
            fields = {r.field for r in exc.reasons}
            assert "run_config.parallel_agnostic" in fields, fields
            assert "geometry.segments" in fields, fields
        else:
            raise AssertionError("V1 and V2 nodes must never share blocks")
        assert client.store.stats().used == 0
        assert server.stats().blocks_sent == 0
        refused = server.stats().handshakes_refused
        assert sum(refused.values()) >= 2, refused
        print(f"server refusals by reason: {refused}")


if __name__ == "__main__":
    main()

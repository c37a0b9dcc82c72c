"""Replicated MLA rows are shared across tensor-parallel sizes, but not with plain rows.

Compact MLA rows are identical on every TP rank, so a TP=2 node and a TP=4 node collapse
to one identity and share. A plain parallel-agnostic node with the same geometry and the
same bytes per block stays apart: its rows mean something else.

Run: python examples/replicated_vs_agnostic.py
"""

from __future__ import annotations


def main() -> None:
    from p2pkv import Node, PeerIncompatible, RunConfig
    from p2pkv.layout import Geometry, make_layout
    from p2pkv.reports import refusal_table

    mla = Geometry(num_layers=4, num_kv_heads=1, head_size=96, kv_kind="mla")
    replicated = make_layout("replicated", mla)
    plain = make_layout("v1", mla)
    assert replicated.bytes_per_block == plain.bytes_per_block

    def identity(layout: object, tp: int, rank: int) -> RunConfig:
        return RunConfig.resolve("deepseek-like", parallel_agnostic=True, tp_size=tp,
                                 rank=rank, **layout.identity_flags())  # type: ignore[attr-defined]

    tp2, tp4 = identity(replicated, 2, 1), identity(replicated, 4, 3)
    agnostic = identity(plain, 1, 0)
    assert tp2.fingerprint == tp4.fingerprint != agnostic.fingerprint
    print(f"replicated TP=2 {tp2.fingerprint} == TP=4 {tp4.fingerprint}; "
          f"plain agnostic {agnostic.fingerprint}")

    with Node(tp2, replicated, pool_blocks=8) as server, \
            Node(tp4, replicated, pool_blocks=8) as same, \
            Node(agnostic, plain, pool_blocks=8) as other:
        key, data = b"r" * 20, bytes(range(256)) * (replicated.bytes_per_block // 256)
        server.put(key, data)
        peer = same.connect(server.address)
        assert peer.fetch([key]).stored == [key]
        assert same.get(key) == data
        print("TP=4 fetched the TP=2 node's block byte-exact")
        try:
            other.connect(server.address)
        except PeerIncompatible as exc:
            print("plain agnostic node refused:")
            print(refusal_table(exc.reasons))
            assert "run_config.replicated_layout" in {r.field for r in exc.reasons}
        else:
            raise AssertionError("replicated and plain rows must never be shared")


if __name__ == "__main__":
    main()

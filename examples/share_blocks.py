"""Embedding p2pkv in a serving worker: store KV blocks on one node, fetch them on another.

Run: python examples/share_blocks.py
"""

from __future__ import annotations


def main() -> None:
    import torch

    from p2pkv import Node, RunConfig, block_keys
    from p2pkv.layout import SEED_GEOMETRY, make_layout
    from p2pkv.store.engine import EngineKVCopier

    layout = make_layout("v2", SEED_GEOMETRY)  # one tensor per layer, like vLLM's V2 runner
    rc = RunConfig.resolve("my-org/my-model", parallel_agnostic=True, **layout.identity_flags())
    with Node(rc, layout, pool_blocks=64) as producer, Node(rc, layout, pool_blocks=64) as consumer:
        # The producer's engine computed KV for a prompt: 4 full blocks in per-layer tensors.
        keys = block_keys(list(range(64)), tokens_per_block=16, seed=0)
        kv = [torch.randn(shape).half() for shape in layout.engine_shapes(len(keys))]
        EngineKVCopier(producer.store, kv).save_many(list(enumerate(keys)))

        peer = consumer.connect(producer.address)  # handshake: identities must match
        assert peer.lookup(keys) == [True] * len(keys)
        result = peer.fetch(keys)                   # bytes land in the consumer's pool
        assert result.stored == keys, result

        out = [torch.zeros_like(t) for t in kv]     # the consumer's engine tensors
        EngineKVCopier(consumer.store, out).load_many([(k, i) for i, k in enumerate(keys)])
        assert all(torch.equal(a, b) for a, b in zip(kv, out, strict=True))
        print(f"fetched {result.blocks} blocks ({result.nbytes} bytes), byte-exact")


if __name__ == "__main__":
    main()

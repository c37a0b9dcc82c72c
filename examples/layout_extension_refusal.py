"""Equal fingerprints, different bytes: NHD vs HND blocks refused by the identity extension.

Two engines serve the same model with the same run config, so their FileMapper digest,
fingerprint and storage namespace are equal, and their blocks are exactly the same size.
One attention backend keeps a block token-major (NHD), the other head-major (HND): every
lookup would hit and the model would decode garbage without an error. Each node declares
its ``kv_memory_layout`` in the identity extension, and the handshake refuses on both
sides with the reason and what to change. A third node that declares nothing is refused
by the strict policy and accepted, with a warning and a counted metric, by the lenient one.

Run: python examples/layout_extension_refusal.py
"""

from __future__ import annotations


def main() -> None:
    from p2pkv import IdentityExtension, Node, NodeConfig, PeerIncompatible, RunConfig
    from p2pkv.cli import refusal_table
    from p2pkv.identity import key_hash_identity
    from p2pkv.layout import SEED_GEOMETRY, make_layout

    layout = make_layout("v2", SEED_GEOMETRY)
    rc = RunConfig.resolve("org/llama", parallel_agnostic=True, **layout.identity_flags())
    # What a vLLM integration declares: backend layout, revision, block-key hash and seed.
    common = {"model_revision": "5f2b1c0", "key_hash": key_hash_identity("sha256",
                                                                         "vllm-none-hash")}
    nhd = IdentityExtension(kv_memory_layout="NHD", engine="vllm 0.32.0", **common)
    hnd = IdentityExtension(kv_memory_layout="HND", engine="vllm 0.32.0", **common)
    print(f"both nodes: fingerprint {rc.fingerprint}, namespace {rc.namespace('/kv')}, "
          f"{layout.bytes_per_block} bytes per block")
    print(f"extension digests: NHD node {nhd.digest}, HND node {hnd.digest}")

    with Node(rc, layout, pool_blocks=4, extension=hnd) as server, \
            Node(rc, layout, pool_blocks=4, extension=nhd) as client:
        server.put(b"k" * 20, bytes(layout.bytes_per_block))
        try:
            client.connect(server.address)
        except PeerIncompatible as exc:
            print("\nrefused, as it must be (seen from the NHD node):")
            print(refusal_table(exc.reasons))
            assert [r.field for r in exc.reasons] == ["ext.kv_memory_layout"], exc.reasons
        else:
            raise AssertionError("NHD and HND blocks must never be shared")
        try:
            server.connect(client.address)
        except PeerIncompatible as exc:
            print("\nand from the HND node:")
            print(refusal_table(exc.reasons))
            assert (exc.reasons[0].ours, exc.reasons[0].theirs) == ("HND", "NHD")
        else:
            raise AssertionError("the refusal must hold in both directions")
        assert client.store.stats().used == 0 and server.stats().blocks_sent == 0
        print(f"\nHND node refusals by reason: {server.stats().handshakes_refused}")

    # A node that declares nothing (or speaks protocol 1.0) proves nothing.
    with Node(rc, layout, pool_blocks=4, extension=hnd) as server, \
            Node(rc, layout, pool_blocks=4) as bare:
        try:
            bare.connect(server.address)
        except PeerIncompatible as exc:
            print("\nstrict policy, a node that declares nothing:")
            print(refusal_table(exc.reasons))
        else:
            raise AssertionError("the strict policy refuses undeclared fields")
    lenient = NodeConfig(identity_policy="lenient")
    with Node(rc, layout, pool_blocks=4, extension=hnd, config=lenient) as server, \
            Node(rc, layout, pool_blocks=4, config=lenient) as bare:
        peer = bare.connect(server.address)
        print(f"\nlenient policy: accepted; the peer declares {peer.remote_extension.describe()}")
        undeclared = server.stats().identity_undeclared
        assert undeclared == {"kv_memory_layout": 1, "model_revision": 1, "key_hash": 1}
        print(f"counted as undeclared: {undeclared}")


if __name__ == "__main__":
    main()

"""nixl-v1 (protocol/SPEC.md §20) in the pure protocol core: what its vectors cover, the
offer in the ``welcome`` only where nixl-v1 and shm-v1 were both negotiated, the
``attach`` that proves it (``via``), and the violations around it. No NIXL is needed
here: the offer is data."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
from test_shm_protocol import Pair, welcome_of

from p2pkv.protocol import (
    CAP_CHECKSUM_XXH3_64,
    CAP_NIXL_V1,
    CAP_SHM_V1,
    VIA_NIXL,
    VIA_SHM,
    Attach,
    AttachAnswered,
    AttachRequested,
    BlocksLocated,
    Code,
    Geometry,
    LocalProtocolError,
    NixlOffer,
    ProtocolViolated,
    ShmOffer,
    encode,
)

VECTORS = json.loads((Path(__file__).resolve().parent.parent / "protocol" / "vectors"
                      / "nixl.json").read_text())
GEO = Geometry.of([8, 4])
OFFER = NixlOffer("p2pkv-agent", b"metadata", ((0x1000, 8 * 16), (0x9000, 4 * 16)), 16,
                  0x20000)
SEGMENT = ShmOffer("p2pkv-1-2-0011223344556677", 12288)
NONCE = bytes(range(16))
NIXL = (CAP_CHECKSUM_XXH3_64, CAP_NIXL_V1, CAP_SHM_V1)


def test_nixl_vectors_cover_the_offer_and_the_attach() -> None:
    # Decoded and re-encoded with every other vector (tests/test_protocol_vectors.py).
    assert {v["message"]["type"] for v in VECTORS["messages"]} == {"welcome", "attach"}
    assert len(VECTORS["errors"]) == 12


def test_a_shared_memory_attach_keeps_its_bytes() -> None:
    # via is written only for NIXL: a shm-v1 peer that predates §20 reads the same attach.
    assert b"via" not in encode(Attach(NONCE))[0]
    assert b"via" in encode(Attach(NONCE, VIA_NIXL))[0]


def test_the_sources_of_a_slot_are_one_piece_per_region() -> None:
    assert OFFER.sources(3, GEO.seg) == [(0x1000 + 3 * 8, 8), (0x9000 + 3 * 4, 4)]


def nixl_pair(client_caps: Iterable[str] = NIXL, server_caps: Iterable[str] = NIXL,
         shm: ShmOffer | None = None) -> Pair:
    """A client and a server offering ``OFFER`` (and the segment ``shm``), every message
    through the codec."""
    return Pair(client_caps, server_caps, shm, nixl_offer=OFFER)


def test_the_pool_is_offered_only_where_nixl_and_shm_messages_were_negotiated() -> None:
    both = nixl_pair()
    assert welcome_of(both).nixl == OFFER and both.client.nixl_offer == OFFER
    for client_caps in ((CAP_CHECKSUM_XXH3_64, CAP_SHM_V1),
                        (CAP_CHECKSUM_XXH3_64, CAP_NIXL_V1)):
        # nixl-v1 not offered by the client, or without the messages of shm-v1 (§20.1)
        pair = nixl_pair(client_caps)
        assert welcome_of(pair).nixl is None and pair.client.nixl_offer is None
        with pytest.raises(LocalProtocolError):
            pair.client.attach(NONCE, VIA_NIXL)


def test_an_accepted_nixl_proof_makes_fetches_located() -> None:
    pair = nixl_pair()
    pair.deliver(pair.client, [pair.client.attach(NONCE, VIA_NIXL)])
    (req,) = pair.of("server", AttachRequested)
    assert (req.nonce, req.via) == (NONCE, VIA_NIXL)
    assert pair.server.attached_via == VIA_NIXL
    pair.deliver(pair.server, [pair.server.attach_verdict(True, "")])
    (answered,) = pair.of("client", AttachAnswered)
    assert answered.ok and pair.client.shared_memory and pair.client.attached_via == VIA_NIXL
    fetch = pair.client.fetch_shared((b"k0", b"k1"), 4, 0.0)
    pair.deliver(pair.client, [fetch])
    pair.deliver(pair.server, [pair.server.located(fetch.req, [0, 1], [5, 9], [1, 2])])
    (located,) = pair.of("client", BlocksLocated)
    assert located.slots == (5, 9)


def test_a_segment_and_a_pool_are_told_apart_by_via() -> None:
    # A server offering both: the attach says which proof it is; the other cannot follow.
    pair = nixl_pair(shm=SEGMENT)
    assert welcome_of(pair).shm == SEGMENT and welcome_of(pair).nixl == OFFER
    pair.deliver(pair.client, [pair.client.attach(NONCE)])
    (req,) = pair.of("server", AttachRequested)
    assert req.via == VIA_SHM
    with pytest.raises(LocalProtocolError):
        pair.client.attach(NONCE, VIA_NIXL)  # one attach per connection


def test_an_attach_via_nixl_without_a_pool_offered_is_a_violation() -> None:
    pair = nixl_pair(server_caps=(CAP_CHECKSUM_XXH3_64, CAP_SHM_V1), shm=SEGMENT)
    assert welcome_of(pair).nixl is None
    pair.deliver(pair.client, [Attach(NONCE, VIA_NIXL)])  # forged: the session refuses it
    (violation,) = pair.of("server", ProtocolViolated)
    assert violation.code == Code.UNEXPECTED and "NIXL pool" in violation.msg

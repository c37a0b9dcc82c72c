"""Capability ``shm-v1`` in the pure core: its vectors, and the session's rules for it.

Two :class:`Session` objects are joined by an in-memory loop through the codec,
as in ``test_session.py``; nothing here maps memory (``test_shm.py`` does).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from p2pkv.identity import RunConfig
from p2pkv.protocol import (
    CAP_CHECKSUM_XXH3_64,
    CAP_SHM_V1,
    IMPLEMENTED,
    Attach,
    AttachAnswered,
    Attached,
    AttachRequested,
    Block,
    BlockDiscarded,
    BlocksLocated,
    BlocksReleased,
    Bye,
    Code,
    Event,
    Fetch,
    FetchRequested,
    Geometry,
    HandshakeAccepted,
    Hello,
    KeyHash,
    LocalProtocolError,
    Located,
    Message,
    NixlOffer,
    ProtocolViolated,
    Release,
    Role,
    Session,
    ShmOffer,
    State,
    Welcome,
    encode,
)
from p2pkv.shm.segment import parse_header

VECTORS = json.loads((Path(__file__).resolve().parent.parent / "protocol" / "vectors"
                      / "shm.json").read_text())
GEO = Geometry.of([8, 4])
OFFER = ShmOffer("p2pkv-1-2-0011223344556677", 12288)
NONCE = bytes(range(16))
KEYS = (b"k0", b"k1", b"k2", b"k3")


# ------------------------------------------------------------------------------ vectors


def test_shm_vectors_cover_every_shm_message() -> None:
    types = {v["message"]["type"] for v in VECTORS["messages"]}
    assert types == {"welcome", "fetch", "attach", "attached", "located", "release"}


def test_header_vector_parses_to_its_fields() -> None:
    (vector,) = VECTORS["headers"]
    data = bytes.fromhex(vector["bytes"])
    header = parse_header(data, vector["total"])
    assert header.nonce.hex() == vector["nonce"]
    assert header.identity.boot_id.hex() == vector["boot_id"]
    assert header.identity.netns == vector["netns"]
    assert header.identity.pidns == vector["pidns"]
    assert header.owner_pid == vector["owner_pid"]
    assert header.num_blocks == vector["slots"]
    assert header.header_bytes == vector["header_bytes"]
    assert [list(r) for r in header.regions] == [[r["offset"], r["segment"]]
                                                 for r in vector["regions"]]


def test_a_plain_fetch_keeps_its_bytes() -> None:
    # Old peers see exactly the 1.1 fetch: the shm key is written only when set.
    assert b"shm" not in encode(Fetch(1, (b"k",), 4))[0]
    assert b"shm" in encode(Fetch(1, (b"k",), 4, shm=True))[0]


# ------------------------------------------------------------------------------ sessions


def hello(node: str, caps: Iterable[str]) -> Hello:
    return Hello.for_config(node, RunConfig("m", parallel_agnostic=True), GEO,
                            KeyHash("xxh3-128", 0), caps=tuple(caps))


BOTH = (CAP_CHECKSUM_XXH3_64, CAP_SHM_V1)


class Pair:
    """A sharing client and server, every message through the codec."""

    def __init__(self, client_caps: Iterable[str] = BOTH, server_caps: Iterable[str] = BOTH,
                 offer: ShmOffer | None = OFFER, *, plain_server: bool = False,
                 nixl_offer: NixlOffer | None = None) -> None:
        self.client = Session(Role.CLIENT, hello("c", client_caps), now=0.0)
        self.server: Session = (
            Session(Role.SERVER, hello("s", server_caps), now=0.0) if plain_server else
            Session(Role.SERVER, hello("s", server_caps), now=0.0, shm_offer=offer,
                    nixl_offer=nixl_offer))
        self.events: dict[str, list[Event]] = {"client": [], "server": []}
        self.wire: list[Message] = []
        self.deliver(self.client, self.client.start(0.0))

    def deliver(self, sender: Session, msgs: Iterable[Message]) -> None:
        queue = [(sender, m) for m in msgs]
        while queue:
            src, msg = queue.pop(0)
            self.wire.append(msg)
            dst = self.server if src is self.client else self.client
            out = dst.receive_frames(encode(msg), 0.0)
            self.events["server" if dst is self.server else "client"].extend(out.events)
            queue.extend((dst, r) for r in out.replies)

    def of(self, side: str, kind: type[Event]) -> list[Any]:
        return [e for e in self.events[side] if isinstance(e, kind)]

    def attach(self, accept: bool = True) -> None:
        self.deliver(self.client, [self.client.attach(NONCE)])
        (req,) = self.of("server", AttachRequested)
        assert req.nonce == NONCE
        server = self.server
        assert isinstance(server, Session)
        self.deliver(server, [server.attach_verdict(accept, "" if accept else "no")])


def welcome_of(pair: Pair) -> Welcome:
    (w,) = [m for m in pair.wire if isinstance(m, Welcome)]
    return w


def test_the_welcome_offers_the_segment_only_when_shm_v1_is_negotiated() -> None:
    both = Pair()
    assert welcome_of(both).shm == OFFER and both.client.shm_offer == OFFER
    assert both.client.shm_negotiated and not both.client.shared_memory
    hello_msg = next(m for m in both.wire if isinstance(m, Hello))
    assert hello_msg.shm is None  # a hello never names a segment
    for client_caps, server_caps in (((CAP_CHECKSUM_XXH3_64,), BOTH),
                                     (BOTH, (CAP_CHECKSUM_XXH3_64,))):
        pair = Pair(client_caps, server_caps)
        assert welcome_of(pair).shm is None and pair.client.shm_offer is None
        with pytest.raises(LocalProtocolError):
            pair.client.attach(NONCE)
    no_segment = Pair(offer=None)
    assert no_segment.client.shm_negotiated and no_segment.client.shm_offer is None


def test_attach_accepted_then_a_shared_fetch_is_located_and_released() -> None:
    pair = Pair()
    pair.attach()
    assert pair.of("client", AttachAnswered) == [AttachAnswered(True, "")]
    assert pair.client.shared_memory
    msg = pair.client.fetch_shared(KEYS, 2, 0.0)
    assert msg.shm
    pair.deliver(pair.client, [msg])
    server = pair.server
    assert isinstance(server, Session)
    (fr,) = pair.of("server", FetchRequested)
    assert server.shared_fetch(fr.req)
    located = server.located(fr.req, [0, 2], [5, 1], [11, 22])
    pair.deliver(server, [located])
    assert pair.of("client", BlocksLocated) == [BlocksLocated(fr.req, (0, 2), (5, 1), (11, 22))]
    # The window holds for located blocks as for blocks.
    with pytest.raises(LocalProtocolError):
        server.located(fr.req, [1], [0], [1])
    pair.deliver(pair.client, [pair.client.release(fr.req, [0, 2])])
    assert pair.of("server", BlocksReleased) == [BlocksReleased(fr.req, (0, 2))]
    pair.deliver(pair.client, [pair.client.credit(fr.req, 2, 0.0)])
    pair.deliver(server, [server.located(fr.req, [1, 3], [0, 0], [1, 2])])
    pair.deliver(server, [server.fetch_done(fr.req, [0, 0, 0, 0])])
    # A release that crosses the done is still accepted.
    pair.deliver(pair.client, [pair.client.release(fr.req, [1, 3])])
    assert pair.of("server", BlocksReleased)[-1] == BlocksReleased(fr.req, (1, 3))
    assert not server.shared_fetch(fr.req)
    assert not pair.of("client", ProtocolViolated) and not pair.of("server", ProtocolViolated)


def test_refused_attach_means_tcp() -> None:
    pair = Pair()
    pair.attach(accept=False)
    assert pair.of("client", AttachAnswered) == [AttachAnswered(False, "no")]
    assert not pair.client.shared_memory
    with pytest.raises(LocalProtocolError):
        pair.client.fetch_shared(KEYS, 2, 0.0)


def test_a_shared_fetch_before_an_accepted_attach_is_served_with_blocks() -> None:
    pair = Pair()
    pair.deliver(pair.client, [Fetch(1, KEYS, 2, shm=True)])  # what a hasty client sends
    server = pair.server
    assert isinstance(server, Session)
    assert not server.shared_fetch(1)
    with pytest.raises(LocalProtocolError):
        server.located(1, [0], [0], [1])
    assert isinstance(server.block(1, [0], [1]), Block)


@pytest.mark.parametrize("case", ["second_attach", "attach_without_offer",
                                  "attached_unasked", "located_for_plain_fetch",
                                  "release_unknown_request", "plain_server_gets_attach"])
def test_out_of_order_shm_messages_are_violations(case: str) -> None:
    pair = Pair(offer=None if case == "attach_without_offer" else OFFER,
                plain_server=case == "plain_server_gets_attach")
    if case == "second_attach":
        pair.attach()
        pair.deliver(pair.client, [Attach(NONCE)])
        side, code = "server", Code.UNEXPECTED
    elif case in ("attach_without_offer", "plain_server_gets_attach"):
        pair.deliver(pair.client, [Attach(NONCE)])
        side, code = "server", Code.UNEXPECTED
    elif case == "attached_unasked":
        out = pair.client.receive_frames(encode(Attached(True, "")), 0.0)
        pair.events["client"].extend(out.events)
        side, code = "client", Code.UNEXPECTED
    elif case == "located_for_plain_fetch":
        pair.attach()
        pair.deliver(pair.client, [pair.client.fetch(KEYS, 2, 0.0)])
        out = pair.client.receive_frames(encode(Located(1, (0,), (0,), (1,))), 0.0)
        pair.events["client"].extend(out.events)
        side, code = "client", Code.UNEXPECTED
    else:
        pair.deliver(pair.client, [Release(77, (0,))])
        side, code = "server", Code.UNKNOWN_REQUEST
    (violation,) = pair.of(side, ProtocolViolated)
    assert violation.code == code
    session = pair.server if side == "server" else pair.client
    assert session.state is State.ERROR


def test_located_after_abort_is_discarded_and_the_window_is_enforced() -> None:
    pair = Pair()
    pair.attach()
    pair.deliver(pair.client, [pair.client.fetch_shared(KEYS, 1, 0.0)])
    # More located blocks than the window granted: a violation, as for blocks.
    out = pair.client.receive_frames(encode(Located(1, (0, 1), (0, 1), (1, 2))), 0.0)
    assert any(isinstance(e, ProtocolViolated) and e.code == Code.WINDOW_EXCEEDED
               for e in out.events)
    assert any(isinstance(r, Bye) for r in out.replies)
    pair = Pair()
    pair.attach()
    pair.deliver(pair.client, [pair.client.fetch_shared(KEYS, 2, 0.0)])
    abort = pair.client.abort(1, 0.0)
    out = pair.client.receive_frames(encode(Located(1, (0,), (3,), (1,))), 0.0)
    assert out.events == (BlockDiscarded(1, (0,)),)
    assert abort.req == 1


def test_a_plain_session_refuses_shm_messages_it_does_not_speak() -> None:
    client = Session(Role.CLIENT, hello("c", BOTH), now=0.0,
                     implements=IMPLEMENTED - {CAP_SHM_V1})
    server = Session(Role.SERVER, hello("s", BOTH), now=0.0, shm_offer=OFFER)
    out = server.receive_frames(encode(client.start(0.0)[0]), 0.0)
    (welcome,) = [r for r in out.replies if isinstance(r, Welcome)]
    accepted = client.receive_frames(encode(welcome), 0.0)
    assert any(isinstance(e, HandshakeAccepted) for e in accepted.events)
    out = client.receive_frames(encode(Located(1, (0,), (0,), (1,))), 0.0)
    assert any(isinstance(e, ProtocolViolated) and e.code == Code.UNEXPECTED
               for e in out.events)

"""Hypothesis strategies and an oracle for fuzzing a live node over raw DEALER sockets.

Shared by ``tests/test_hostile.py`` (a few hundred examples in CI) and
``tools/fuzz_node.py`` (minutes, outside CI).

An example is either

* ``("raw", frames)``: one multipart message of arbitrary bytes on a fresh connection
  (no handshake), or
* ``("session", [frames, ...])``: a fresh connection that completes a valid handshake,
  then sends a sequence of messages built from random msgpack maps (known and unknown
  tags, random field values, real and random keys, stray payload frames) and valid
  messages of every type with random values.

:class:`Exerciser` runs an example, then sends a ``ping`` as a sync point and reads every
reply up to the answer to that ping (a ``pong``, or the ``refuse`` a fresh session gives
to a ping). The oracle: the node answers within a bound, every reply decodes, only a
server's message types come back, every code is a known code, and undecodable input
before the handshake is refused with MALFORMED.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
from hypothesis import strategies as st
from rawpeer import RawPeer, packed

from p2pkv import protocol as proto
from p2pkv.node import Node

Frames = list[bytes]
Example = tuple[str, Any]

# No "ping": the exerciser's own ping is the sync point.
TAGS = ("hello", "welcome", "refuse", "lookup", "hits", "fetch", "credit", "block", "done",
        "abort", "abort_ack", "pong", "bye", "error")
FIELDS = ("req", "keys", "window", "n", "idx", "sums", "hits", "outcomes", "nonce", "code",
          "msg", "node", "minor", "rc", "fp", "geo", "khash", "caps", "limits", "reasons",
          "ext")
# What a server may send (ping: its heartbeat, if an example is slow).
SERVER_TYPES = frozenset({proto.Welcome, proto.Refuse, proto.Hits, proto.Block, proto.Done,
                          proto.AbortAck, proto.Pong, proto.Ping, proto.Bye, proto.Error})
CODES = frozenset(int(c) for c in proto.Code)
U64 = 2**64 - 1


def _values(keys: Sequence[bytes]) -> st.SearchStrategy[Any]:
    key = st.one_of(st.sampled_from(list(keys)), st.binary(min_size=0, max_size=70))
    return st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), U64), st.integers(0, 20),
        st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=70),
        st.lists(key, max_size=8), st.lists(st.integers(-2, 20), max_size=8),
        st.lists(st.one_of(st.none(), st.integers(0, U64)), max_size=4),
        st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3),
    )


def random_heads(keys: Sequence[bytes]) -> st.SearchStrategy[bytes]:
    tag = st.one_of(st.sampled_from(TAGS), st.text(max_size=8).filter(lambda t: t != "ping"),
                    st.integers(-(2**63), U64), st.binary(max_size=4))
    version = st.one_of(st.just(1), st.just(1), st.integers(-3, 2**40), st.booleans())
    optional = {name: _values(keys) for name in FIELDS}
    return st.fixed_dictionaries({"t": tag}, optional={"v": version, **optional}).map(packed)


def valid_messages(keys: Sequence[bytes]) -> st.SearchStrategy[proto.Message]:
    req = st.one_of(st.integers(1, 8), st.integers(0, U64))
    some_keys = st.lists(st.sampled_from(list(keys)) | st.binary(min_size=1, max_size=64),
                         min_size=1, max_size=8).map(tuple)
    code = st.one_of(st.sampled_from(sorted(CODES)), st.integers(0, 2**32 - 1))
    text = st.text(max_size=30)
    return st.one_of(
        st.builds(proto.Lookup, req, some_keys),
        st.builds(proto.Fetch, req, some_keys, st.integers(1, 4)),
        st.builds(proto.Credit, req, st.integers(1, 4)),
        st.builds(proto.Abort, req),
        st.builds(proto.Hits, req, st.lists(st.booleans(), max_size=4).map(tuple)),
        st.builds(proto.Done, req, st.lists(st.integers(0, 2), min_size=1,
                                            max_size=4).map(tuple)),
        st.builds(proto.AbortAck, req),
        st.builds(proto.Pong, st.integers(0, U64)),
        st.builds(proto.Error, st.one_of(st.none(), req), code, text),
        st.builds(proto.Bye, code, text),
        st.builds(proto.Refuse, code, text),
    )


def session_messages(keys: Sequence[bytes]) -> st.SearchStrategy[Frames]:
    stray = st.lists(st.binary(max_size=64), max_size=2)
    random_map = st.tuples(random_heads(keys), stray).map(lambda t: [t[0], *t[1]])
    valid = valid_messages(keys).map(lambda m: [bytes(f) for f in proto.encode(m)])
    return st.one_of(random_map, valid, valid)


def examples(keys: Sequence[bytes]) -> st.SearchStrategy[Example]:
    raw = st.lists(st.binary(max_size=300), min_size=1, max_size=4)
    near_msgpack = st.tuples(random_heads(keys), st.integers(0, 8)).map(
        lambda t: [t[0][: max(1, len(t[0]) - t[1])]])  # truncated maps
    session = st.lists(session_messages(keys), min_size=1, max_size=5)
    return st.one_of(st.tuples(st.just("raw"), st.one_of(raw, near_msgpack)),
                     st.tuples(st.just("session"), session))


def _map_or_none(frame0: bytes) -> dict[Any, Any] | None:
    try:
        head = msgpack.unpackb(frame0, raw=False, strict_map_key=False)
    except Exception:
        return None
    return head if isinstance(head, dict) else None


class Exerciser:
    """Runs examples against ``server`` and checks each reply (see the module doc)."""

    def __init__(self, server: Node, reply_timeout: float = 5.0) -> None:
        self.server = server
        self.address = server.address
        self.segments = tuple(server.layout.segment_sizes)
        self.reply_timeout = reply_timeout
        self.nonces = itertools.count(1_000_000)
        self.stats: collections.Counter[str] = collections.Counter()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    def close(self) -> None:
        self.ctx.term()

    def _collect(self, peer: RawPeer, nonce: int) -> list[proto.Message]:
        """Replies up to (excluding) the answer to our sync ping."""
        replies: list[proto.Message] = []
        while True:
            frames = peer.recv(self.reply_timeout)
            assert frames is not None, (
                f"the node did not answer within {self.reply_timeout}s "
                f"(replies so far: {replies!r:.500})")
            msg = proto.decode(frames, self.segments)  # must never raise
            kind = type(msg)
            assert kind in SERVER_TYPES, f"a server sent {msg!r:.300}"
            if kind is proto.Pong and msg.nonce == nonce:  # type: ignore[union-attr]
                self.stats["sync:pong"] += 1
                return replies
            if kind in (proto.Refuse, proto.Bye, proto.Error):
                code = msg.code  # type: ignore[union-attr]
                assert code in CODES, f"unknown code in {msg!r:.300}"
                self.stats[f"{msg.TAG}:{code}"] += 1
                if kind is proto.Refuse and "'ping'" in msg.msg:  # type: ignore[union-attr]
                    assert code == proto.Code.UNEXPECTED
                    self.stats["sync:refuse"] += 1
                    return replies
            else:
                self.stats[msg.TAG] += 1
            replies.append(msg)

    def run(self, example: Example) -> list[proto.Message]:
        kind, body = example
        self.stats[f"example:{kind}"] += 1
        peer = RawPeer(self.address, ctx=self.ctx)
        try:
            if kind == "session":
                peer.handshake(self.server, "fuzz")
                for frames in body:
                    peer.send(frames)
            else:
                peer.send(body)
            nonce = next(self.nonces)
            peer.send_msg(proto.Ping(nonce))
            replies = self._collect(peer, nonce)
            if kind == "raw":
                head = _map_or_none(body[0])
                if head is None:
                    assert len(replies) == 1, f"{body!r:.200} got {replies!r:.500}"
                    assert type(replies[0]) is proto.Refuse, replies
                    assert replies[0].code == proto.Code.MALFORMED, replies
                else:
                    assert len(replies) <= 1, replies
                    for r in replies:
                        assert type(r) in (proto.Refuse, proto.Welcome), r
            peer.send_msg(proto.Bye(proto.Code.NORMAL_CLOSE, "fuzz example over"))
            return replies
        finally:
            peer.close()

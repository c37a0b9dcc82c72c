"""Capability ``tcp-data-v1``: the data stream's bytes and rules, with no IO
(``protocol/SPEC.md`` §18).

Bulk block bytes leave ZeroMQ: after a handshake that negotiated ``tcp-data-v1`` the
server's ``welcome`` names a TCP port and a random per-session token
(:class:`~p2pkv.protocol.messages.DataOffer`); the client opens one plain TCP stream to
that port and sends the token first, which binds the stream to the session (once: a
token is good for one stream, within the handshake deadline). The server then sends
the ``block`` and ``done`` messages of every fetch not served through shared memory on
that stream, each as a length-prefixed frame 0 followed, for a ``block``, by its
blocks' bytes back to back, which the client scatters straight into their
destinations. Everything else — requests, credit, aborts, heartbeats — stays on the
ZeroMQ connection, and the session's rules do not change: the client feeds every frame
0 it reads on the stream through the same door as one from ZeroMQ
(:meth:`~p2pkv.protocol.Session.receive_data`).

What is here: the stream's preface and answer, the frame prefix, how many blocks one
stream message carries, and when a client uses an offer. That a ``welcome`` carries the
offer exactly when ``tcp-data-v1`` was negotiated is a rule of the state machine's table
(:mod:`p2pkv.protocol.transitions`), like the ``shm-v1`` offer.
The sockets are :mod:`p2pkv.transport.datachannel`'s; the node's use of them is
:mod:`p2pkv.runtime.paths.data_server` (the data port), ``data_sender`` (a bound
stream's sends) and ``data_client``.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Set
from typing import Final

from p2pkv.errors import ProtocolError
from p2pkv.protocol.codes import (
    CAP_TCP_DATA_AEAD_V1,
    CAP_TCP_DATA_TLS_V1,
    CAP_TCP_DATA_V1,
    CAP_TCP_STREAMS_V1,
    DATA_TOKEN_LEN,
    MAX_BLOCKS_PER_MESSAGE,
    MAX_HEAD_BYTES,
    MAX_PAYLOAD_FRAMES,
    Code,
)
from p2pkv.protocol.messages import DataOffer

__all__ = [
    "ACCEPTED",
    "FRAME_PREFIX",
    "PREFACE_BYTES",
    "STREAM_BATCH_BYTES",
    "STREAM_MAGIC",
    "frame_length",
    "frame_prefix",
    "kept_offer",
    "preface",
    "stream_batch_limit",
    "stream_form",
    "stream_window",
    "token_of",
    "usable_offer",
]

STREAM_MAGIC: Final = b"P2PKVDC1"
"""The 8 bytes that open a data stream (client → server, before the token) and that the
server answers once it bound the stream to the token's session."""
ACCEPTED: Final = STREAM_MAGIC
"""The server's whole answer to a good preface; a refused stream is closed unanswered."""
_PREFACE: Final = struct.Struct(f"<8s{DATA_TOKEN_LEN}s")
PREFACE_BYTES: Final = _PREFACE.size
"""Bytes a client sends first on a new stream: the magic, then the session's token."""
FRAME_PREFIX: Final = struct.Struct("<I")
"""Before every frame 0 on the stream: its length in bytes, u32 little-endian."""
STREAM_BATCH_BYTES: Final = 8 << 20
"""Payload bytes the reference server puts in one stream message (several large blocks
per message, unlike ZeroMQ's 1 MiB: the per-message work is the header, not a copy)."""


STREAM_WINDOW_FACTOR: Final = 4
"""How much larger a peer's credit budget is once its blocks take a data stream: the
budget bounds how long a control reply waits behind block data on ZeroMQ, and on a
stream none does; what the stream holds in flight is bounded by TCP and by the
server's queue, so larger grants only mean fewer credit messages."""


def stream_window(window: int) -> int:
    """The per-peer credit budget, in blocks, of a connection with a bound stream."""
    return window * STREAM_WINDOW_FACTOR


def preface(token: bytes) -> bytes:
    """What a client writes first on a new stream."""
    if type(token) is not bytes or len(token) != DATA_TOKEN_LEN:
        raise ValueError(f"a data token is {DATA_TOKEN_LEN} bytes")
    return _PREFACE.pack(STREAM_MAGIC, token)


def token_of(data: bytes) -> bytes | None:
    """The token of a stream's first :data:`PREFACE_BYTES` bytes; None when they are
    not a p2pkv data stream preface."""
    if len(data) != PREFACE_BYTES:
        return None
    magic, token = _PREFACE.unpack(data)
    return bytes(token) if magic == STREAM_MAGIC else None


_FORMS: Final = frozenset({CAP_TCP_DATA_V1, CAP_TCP_DATA_TLS_V1, CAP_TCP_DATA_AEAD_V1})


def frame_prefix(head: bytes) -> bytes:
    """The length prefix of frame 0 ``head`` on the stream."""
    return FRAME_PREFIX.pack(len(head))


def frame_length(prefix: bytes | bytearray | memoryview) -> int:
    """The length a frame prefix announces; a length outside 1..MAX_HEAD_BYTES is the
    peer's protocol error (FRAME_COUNT 206 for 0, TOO_LARGE 207 above the bound)."""
    (n,) = FRAME_PREFIX.unpack(prefix)
    if n == 0:
        raise ProtocolError(Code.FRAME_COUNT, "data stream: a frame of 0 bytes")
    if n > MAX_HEAD_BYTES:
        raise ProtocolError(Code.TOO_LARGE, f"data stream: a frame 0 of {n} bytes "
                            f"(at most {MAX_HEAD_BYTES})")
    return int(n)


def stream_batch_limit(bytes_per_block: int, segments: int,
                       batch_bytes: int = STREAM_BATCH_BYTES) -> int:
    """Most blocks in one stream ``block`` message: about ``batch_bytes`` of payload,
    within the bounds of a ``block`` header (1024 indices, 16384 segments)."""
    return max(1, min(MAX_BLOCKS_PER_MESSAGE, MAX_PAYLOAD_FRAMES // max(1, segments),
                      batch_bytes // bytes_per_block))


def kept_offer(capabilities: Set[str], offer: DataOffer | None) -> DataOffer | None:
    """What a session keeps of a ``welcome``'s ``data``: nothing unless one of the
    stream's forms was negotiated, and of its parts only those of negotiated
    capabilities (``more``: tcp-streams-v1; ``cert``: tcp-data-tls-v1; ``key``:
    tcp-data-aead-v1). The rest is ignored (§18.1, §18.6–§18.8)."""
    if offer is None or not capabilities & _FORMS:
        return None
    more = offer.more if CAP_TCP_STREAMS_V1 in capabilities else ()
    cert = offer.cert if CAP_TCP_DATA_TLS_V1 in capabilities else None
    key = offer.key if CAP_TCP_DATA_AEAD_V1 in capabilities else None
    if (more, cert, key) == (offer.more, offer.cert, offer.key):
        return offer
    return dataclasses.replace(offer, more=more, cert=cert, key=key)


def stream_form(capabilities: Set[str], offer: DataOffer | None) -> str | None:
    """How a session's streams are protected: ``"sealed"`` (tcp-data-aead-v1 with a
    ``key``: preferred), ``"tls"`` (tcp-data-tls-v1 with a ``cert``), ``"plain"``
    (tcp-data-v1), or None (no usable form)."""
    if offer is None:
        return None
    if CAP_TCP_DATA_AEAD_V1 in capabilities and offer.key is not None:
        return "sealed"
    if CAP_TCP_DATA_TLS_V1 in capabilities and offer.cert is not None:
        return "tls"
    if CAP_TCP_DATA_V1 in capabilities:
        return "plain"
    return None


def usable_offer(capabilities: Set[str], offer: DataOffer | None,
                 dialed_port: int) -> tuple[DataOffer | None, str]:
    """The client's view of the server's offer: the offer to open a stream to, or None
    and why not. A client that reached the server at another port than the server's
    own endpoint (``cport``) talks to it through a relay or a port forward, which a
    stream opened to the server's data port would bypass: it stays on ZeroMQ."""
    if not capabilities & _FORMS:
        return None, (f"the peer does not offer {CAP_TCP_DATA_V1} (nor "
                      f"{CAP_TCP_DATA_AEAD_V1} or {CAP_TCP_DATA_TLS_V1} beside CurveZMQ)")
    if offer is None:
        return None, "the peer's welcome names no data stream"
    if stream_form(capabilities, offer) is None:
        return None, ("the peer's welcome carries neither the key nor the certificate "
                      "pin of its encrypted stream")
    if offer.cport != dialed_port:
        return None, (f"the peer is reached through a relay (port {dialed_port}, its own "
                      f"endpoint is port {offer.cport}): a stream would bypass it")
    return offer, ""

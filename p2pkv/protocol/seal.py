"""Capability ``tcp-data-aead-v1``: the sealed data stream's keys and records, with no IO
(``protocol/SPEC.md`` §18.8).

Under CurveZMQ a plaintext data stream would be weaker than the connection beside it.
The sealed stream is the stream of ``tcp-data-v1`` cut into records that AES-256-GCM
encrypts and authenticates, under keys that only the two ends of the authenticated
session know: the server's ``welcome`` (itself encrypted and authenticated by
CurveZMQ) carries a fresh random 32-byte ``key`` for the session, and each stream's
keys are derived from it and the stream's own token with HKDF-SHA256 (RFC 5869), one
key per direction and per epoch of :data:`RECORDS_PER_KEY` records. A record's nonce is
its number, counted from 0 in each direction of each stream, so a record that is
altered, dropped, replayed, reordered or moved to another stream fails its tag.

- The client's preface (:func:`sealed_preface`) is the magic ``P2PKVDA1``, the token,
  and a 16-byte tag: its direction's record 0 with nothing inside, authenticating the
  magic and the token. A server binds only a preface whose tag verifies.
- The server's answer is its direction's record 0, holding the 8 bytes ``P2PKVDC1``;
  the stream's messages follow in records 1, 2, …, cut anywhere the server likes.

A record on the wire is ``u32le n`` (1 ≤ n ≤ :data:`MAX_RECORD`), then the ``n``
encrypted bytes and their 16-byte tag; the 4 length bytes are the associated data.
The sockets that read and write records are :mod:`p2pkv.transport.sealed`'s.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import TYPE_CHECKING, Final

from p2pkv.errors import P2PKVError
from p2pkv.protocol.codes import DATA_KEY_LEN, DATA_TOKEN_LEN

__all__ = [
    "ANSWER_RECORD_BYTES",
    "MAX_RECORD",
    "RECORDS_PER_KEY",
    "RECORD_HEAD",
    "SEALED_MAGIC",
    "SEALED_PREFACE_BYTES",
    "TAG_LEN",
    "RecordKeys",
    "SealError",
    "check_sealed_preface",
    "open_record",
    "seal_record",
    "sealed_preface",
    "sealed_token_of",
    "traffic_key",
]

SEALED_MAGIC: Final = b"P2PKVDA1"
"""The 8 bytes that open a sealed stream (client → server, before the token)."""
TAG_LEN: Final = 16
"""Bytes of an AES-GCM tag."""
SEALED_PREFACE_BYTES: Final = len(SEALED_MAGIC) + DATA_TOKEN_LEN + TAG_LEN
"""Bytes a client sends on a new sealed stream: the magic, the token, the tag (40)."""
RECORD_HEAD: Final = struct.Struct("<I")
"""Before every record: the number of plaintext bytes in it, u32 little-endian."""
MAX_RECORD: Final = 1 << 20
"""Plaintext bytes one record holds at most (1 MiB)."""
RECORDS_PER_KEY: Final = 1 << 16
"""Records under one key: record ``i`` uses the key of epoch ``i // RECORDS_PER_KEY``
(at most 64 GiB per key, well inside AES-GCM's limits)."""
ANSWER_RECORD_BYTES: Final = RECORD_HEAD.size + len(SEALED_MAGIC) + TAG_LEN
"""Bytes of the server's answer on the wire: record 0 holding ``P2PKVDC1`` (28)."""

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_LABEL: Final = b"p2pkv tcp-data-aead-v1 "
_WRITERS: Final = ("client", "server")
_NONCE: Final = struct.Struct(">4xQ")


class SealError(P2PKVError, ConnectionError):
    """A sealed stream carried a record that is not the sender's next one: altered,
    replayed, reordered, cut, or sealed under other keys. The stream ends."""


def traffic_key(secret: bytes, token: bytes, writer: str, epoch: int) -> bytes:
    """The AES-256 key of ``writer``'s records (``"client"`` or ``"server"``) in epoch
    ``epoch`` of the stream bound by ``token``: HKDF-SHA256 with salt ``token``, input
    key ``secret`` (the ``welcome``'s ``data.key``) and info ``"p2pkv tcp-data-aead-v1 "
    ‖ writer ‖ u32be(epoch)``, 32 bytes."""
    if len(secret) != DATA_KEY_LEN or len(token) != DATA_TOKEN_LEN:
        raise ValueError(f"a stream key is derived from a {DATA_KEY_LEN}-byte secret and a "
                         f"{DATA_TOKEN_LEN}-byte token")
    if writer not in _WRITERS or not 0 <= epoch < 1 << 32:
        raise ValueError(f"no traffic key for writer {writer!r}, epoch {epoch}")
    prk = hmac.new(token, secret, hashlib.sha256).digest()  # HKDF-Extract
    info = _LABEL + writer.encode() + struct.pack(">I", epoch)
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()  # HKDF-Expand, 32 bytes


class RecordKeys:
    """One direction of one sealed stream: its record numbers and their keys.

    ``next`` is the number of the next record to seal or open; each use moves it on,
    so every record has a nonce of its own and the opener expects exactly the sender's
    order.
    """

    __slots__ = ("_aead", "_epoch", "_secret", "_token", "next", "writer")

    def __init__(self, secret: bytes, token: bytes, writer: str, first: int = 0) -> None:
        traffic_key(secret, token, writer, 0)  # checks the arguments
        self._secret = secret
        self._token = token
        self.writer = writer
        self.next = first
        self._epoch = -1
        self._aead: AESGCM | None = None

    def take(self) -> tuple[AESGCM, bytes]:
        """The cipher and nonce of the next record; the count moves on."""
        i = self.next
        epoch = i // RECORDS_PER_KEY
        if epoch != self._epoch or self._aead is None:
            # Imported here: only a node that seals streams needs ``cryptography``.
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(traffic_key(self._secret, self._token, self.writer, epoch))
            self._epoch = epoch
        self.next = i + 1
        return self._aead, _NONCE.pack(i)


def seal_record(keys: RecordKeys, plaintext: bytes) -> bytes:
    """``plaintext`` as the next record of ``keys``, on the wire (head, ciphertext, tag)."""
    if not 1 <= len(plaintext) <= MAX_RECORD:
        raise ValueError(f"a record holds 1 to {MAX_RECORD} bytes, not {len(plaintext)}")
    head = RECORD_HEAD.pack(len(plaintext))
    aead, nonce = keys.take()
    return head + aead.encrypt(nonce, plaintext, head)


def open_record(keys: RecordKeys, record: bytes) -> bytes:
    """The plaintext of the next record of ``keys`` from its wire bytes; SealError when
    it is not that record, whole."""
    if len(record) < RECORD_HEAD.size + 1 + TAG_LEN:
        raise SealError("a sealed record too short to hold anything")
    (n,) = RECORD_HEAD.unpack_from(record)
    if not 1 <= n <= MAX_RECORD or len(record) != RECORD_HEAD.size + n + TAG_LEN:
        raise SealError(f"a sealed record whose head says {n} bytes does not match "
                        f"its {len(record)} bytes")
    from cryptography.exceptions import InvalidTag

    number = keys.next
    aead, nonce = keys.take()
    try:
        return aead.decrypt(nonce, record[RECORD_HEAD.size:], record[:RECORD_HEAD.size])
    except InvalidTag:
        raise SealError(f"sealed record {number} failed authentication: altered, "
                        "replayed, reordered or not sealed by this stream's peer") from None


def sealed_preface(secret: bytes, token: bytes) -> bytes:
    """What a client writes first on a new sealed stream: magic, token, and the tag of
    its record 0 (nothing inside; the magic and the token are its associated data)."""
    aead, nonce = RecordKeys(secret, token, "client").take()
    ad = SEALED_MAGIC + token
    return ad + aead.encrypt(nonce, b"", ad)


def sealed_token_of(data: bytes) -> bytes | None:
    """The token of a sealed preface (:data:`SEALED_PREFACE_BYTES`); None when ``data``
    is not one. Its tag is checked by :func:`check_sealed_preface`, once the token named
    the session whose secret it needs."""
    if len(data) != SEALED_PREFACE_BYTES or not data.startswith(SEALED_MAGIC):
        return None
    return bytes(data[len(SEALED_MAGIC):len(SEALED_MAGIC) + DATA_TOKEN_LEN])


def check_sealed_preface(secret: bytes, data: bytes) -> bool:
    """Whether ``data`` (:data:`SEALED_PREFACE_BYTES`) is the preface of a client that
    holds ``secret``, for the token it carries."""
    from cryptography.exceptions import InvalidTag

    token = sealed_token_of(data)
    if token is None:
        return False
    aead, nonce = RecordKeys(secret, token, "client").take()
    try:
        aead.decrypt(nonce, data[-TAG_LEN:], data[:-TAG_LEN])
    except InvalidTag:
        return False
    return True

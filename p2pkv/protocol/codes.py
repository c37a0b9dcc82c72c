"""Wire codes and every protocol bound, in one place (``protocol/SPEC.md``, "Codes", "Limits").

Codes are grouped by hundreds so a reader of a log line can tell the family at a glance:

* ``1xx`` refusal reasons: why a handshake was refused (``refuse`` messages, ``Reason.code``);
* ``2xx`` protocol errors: malformed or unexpected input, per-request errors (``error``) and
  the reason of a violation ``bye``;
* ``3xx`` close reasons carried by ``bye``.

A receiver must accept codes it does not know (a newer peer may add some) and treat them
by family (:func:`code_family`).
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Final

from p2pkv.keys import MAX_KEY_LEN

__all__ = [
    "CAP_CHECKSUM_XXH3_64",
    "CAP_NIXL_V1",
    "CAP_PACKED_V1",
    "CAP_PENDING_V1",
    "CAP_SHM_V1",
    "CAP_TCP_DATA_AEAD_V1",
    "CAP_TCP_DATA_TLS_V1",
    "CAP_TCP_DATA_V1",
    "CAP_TCP_STREAMS_V1",
    "CERT_PIN_LEN",
    "DATA_KEY_LEN",
    "DATA_TOKEN_LEN",
    "MAX_BLOCKS_PER_MESSAGE",
    "MAX_BLOCK_BYTES",
    "MAX_CAPS",
    "MAX_CAP_LEN",
    "MAX_CODE",
    "MAX_DUE_MS",
    "MAX_HEAD_BYTES",
    "MAX_IN_FLIGHT",
    "MAX_KEYS",
    "MAX_KEY_HASH_ALGO_LEN",
    "MAX_KEY_LEN",
    "MAX_MAP_LEN",
    "MAX_NIXL_AGENT_LEN",
    "MAX_NIXL_META",
    "MAX_NODE_ID_LEN",
    "MAX_PACKED_BYTES",
    "MAX_PAYLOAD_FRAMES",
    "MAX_REASONS",
    "MAX_RUN_CONFIG_DEPTH",
    "MAX_RUN_CONFIG_ITEMS",
    "MAX_SEGMENTS",
    "MAX_STREAMS",
    "MAX_STR_LEN",
    "MAX_WINDOW",
    "OUTCOME_FAILED",
    "OUTCOME_MISSING",
    "OUTCOME_SENT",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "SHM_NAME_PATTERN",
    "SHM_NONCE_LEN",
    "U32_MAX",
    "U64_MAX",
    "VIA_NIXL",
    "VIA_SHM",
    "Code",
    "CodeFamily",
    "code_family",
    "code_name",
]

PROTOCOL_MAJOR: Final = 1
"""Carried as ``"v"`` in every frame 0; a different major is refused."""
PROTOCOL_MINOR: Final = 2
"""Carried as ``"minor"`` in ``hello``/``welcome``; informational. 1.1 added the identity
extension (``ext``); 1.2 added its ``model_weights`` and ``model_config`` entries; a 1.0
peer sends ``minor`` 0 and no ``ext``."""

U32_MAX: Final = 2**32 - 1
U64_MAX: Final = 2**64 - 1

MAX_HEAD_BYTES: Final = 2 * 1024 * 1024
"""Largest frame 0. Fits a lookup of MAX_KEYS keys of MAX_KEY_LEN bytes with room to spare."""
MAX_KEYS: Final = 16384
"""Most keys in one ``lookup``/``fetch`` (and entries in ``hits``/``done``)."""
MAX_STR_LEN: Final = 4096
"""Longest free-text string (``msg``, ``meaning``, ``field``)."""
MAX_NODE_ID_LEN: Final = 128
"""Longest node id, in characters."""
MAX_CAPS: Final = 64
"""Most capability names in one greeting."""
MAX_CAP_LEN: Final = 64
"""Longest capability name, in characters."""
MAX_KEY_HASH_ALGO_LEN: Final = 64
"""Longest key-hash algorithm name, in characters."""
MAX_SEGMENTS: Final = 1024
"""Most segments per block (``geo.seg`` entries)."""
MAX_BLOCK_BYTES: Final = 2**30
"""Largest block (``geo.bpb``), 1 GiB."""
MAX_BLOCKS_PER_MESSAGE: Final = 1024
"""Most blocks in one ``block`` message (``idx`` entries)."""
MAX_PAYLOAD_FRAMES: Final = 16384
"""Most payload frames after frame 0 (``len(idx) * len(geo.seg)``)."""
MAX_PACKED_BYTES: Final = MAX_HEAD_BYTES
"""Largest packed payload frame (``packed-v1``): ``len(idx) * geo.bpb`` of a packed
``block``. Equal to MAX_HEAD_BYTES, which every receiver's transport accepts."""
MAX_WINDOW: Final = 2**20
"""Largest ``window`` of a fetch and largest ``n`` of one ``credit``."""
MAX_REASONS: Final = 256
"""Most reasons in one ``refuse``."""
MAX_RUN_CONFIG_DEPTH: Final = 6
"""Deepest nesting of maps/arrays inside ``rc`` (the rc map itself is depth 1)."""
MAX_RUN_CONFIG_ITEMS: Final = 65536
"""Most values (scalars and containers) inside ``rc``."""
MAX_MAP_LEN: Final = 256
"""Most entries in any msgpack map of frame 0."""
MAX_IN_FLIGHT: Final = 64
"""Default most unfinished requests per peer connection (``Limits.max_in_flight``)."""
MAX_CODE: Final = U32_MAX
"""Codes are unsigned 32-bit on the wire."""

OUTCOME_SENT: Final = 0
"""``done`` outcome: the block was sent in a ``block`` message."""
OUTCOME_MISSING: Final = 1
"""``done`` outcome: the server does not hold the block."""
OUTCOME_FAILED: Final = 2
"""``done`` outcome: the server holds the block but could not send it."""

CAP_CHECKSUM_XXH3_64: Final = "checksum-xxh3-64"
"""Capability: every ``block`` carries the xxh3-64 (seed 0) of each block's bytes."""
CAP_SHM_V1: Final = "shm-v1"
"""Capability: same-host peers may move blocks through the server's shared-memory pool
(``welcome.shm``, ``attach``/``attached``, ``located``/``release``; SPEC §16)."""
CAP_NIXL_V1: Final = "nixl-v1"
"""Capability: a client may READ blocks one-sided out of the server's pool, registered
with a NIXL agent (``welcome.nixl``, ``attach`` with ``via``, then ``located``/``release``
as in ``shm-v1``; SPEC §20)."""
MAX_NIXL_META: Final = 1 << 16
"""Largest NIXL agent metadata a ``welcome.nixl`` may carry, in bytes."""
MAX_NIXL_AGENT_LEN: Final = 255
"""Longest NIXL agent name (``welcome.nixl.agent``)."""
VIA_SHM: Final = "shm-v1"
"""``attach.via``: the proof is the shared-memory segment's nonce (absent ``via`` too)."""
VIA_NIXL: Final = "nixl-v1"
"""``attach.via``: the proof is the nonce READ through NIXL (SPEC §20)."""
CAP_PACKED_V1: Final = "packed-v1"
"""Capability: a ``block`` may carry all its blocks in one payload frame (``pk``), the
segments of its blocks back to back, block-major (SPEC §17)."""
CAP_TCP_DATA_V1: Final = "tcp-data-v1"
"""Capability: the server's ``block`` and ``done`` messages travel on a plain TCP stream
beside the ZeroMQ connection, bound to the session by a token (``welcome.data``,
SPEC §18)."""
CAP_TCP_DATA_TLS_V1: Final = "tcp-data-tls-v1"
"""Capability: the data stream of ``tcp-data-v1`` inside TLS 1.3, its server certificate
pinned by ``welcome.data.cert`` (offered beside CurveZMQ instead of ``tcp-data-v1``,
SPEC §18.7)."""
CAP_TCP_DATA_AEAD_V1: Final = "tcp-data-aead-v1"
"""Capability: the data stream of ``tcp-data-v1`` sealed in AES-256-GCM records under
keys derived from ``welcome.data.key``, which only the two ends of the CurveZMQ session
know (offered beside CurveZMQ; preferred to ``tcp-data-tls-v1`` when both are
negotiated; SPEC §18.8)."""
DATA_KEY_LEN: Final = 32
"""Bytes of a session's stream secret (``welcome.data.key``, ``tcp-data-aead-v1``)."""
CERT_PIN_LEN: Final = 32
"""Bytes of a certificate pin (``welcome.data.cert``): the SHA-256 of the DER certificate."""
CAP_TCP_STREAMS_V1: Final = "tcp-streams-v1"
"""Capability (with ``tcp-data-v1``): several data streams per session, each bound by a
token of its own (``welcome.data.more``); a ``fetch`` names the stream it goes on
(``stream``), so one caller's fetch can be striped over them (SPEC §18.6)."""
CAP_PENDING_V1: Final = "pending-v1"
"""Capability: a ``hits`` may say, per key not held, in how many milliseconds the server
expects to hold it (``due``): the keys of a prefix it is computing now (SPEC §19)."""
MAX_DUE_MS: Final = U32_MAX
"""Largest ``due`` entry of a ``hits`` (``pending-v1``), in milliseconds."""
MAX_STREAMS: Final = 8
"""Most data streams one session may bind (``tcp-streams-v1``): the first token and at
most seven more."""
DATA_TOKEN_LEN: Final = 16
"""Bytes of the random token a ``welcome.data`` offer carries and a stream sends first."""
SHM_NONCE_LEN: Final = 16
"""Bytes of the nonce a shared-memory segment holds and an ``attach`` echoes."""
SHM_NAME_PATTERN: Final = r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}"
"""A segment name (``welcome.shm.name``): a POSIX shm name without its slash; no path."""


class Code(IntEnum):
    """Every code that p2pkv sends; see the table in ``protocol/SPEC.md``."""

    # 1xx: refusal reasons (handshake).
    FINGERPRINT_MISMATCH = 100
    """The run-config fingerprints differ (one reason per differing run-config field)."""
    FINGERPRINT_FORGED = 101
    """The peer's run config does not hash to the fingerprint it claims."""
    RUN_CONFIG_INVALID = 102
    """The peer's run config breaks the identity rules (missing/unknown field, bad type)."""
    PROTOCOL_MAJOR_MISMATCH = 103
    """The peer speaks another protocol major version."""
    BLOCK_BYTES_MISMATCH = 104
    """Bytes per block differ."""
    SEGMENTS_MISMATCH = 105
    """The per-block segment lists differ (same bytes can still be laid out differently)."""
    KEY_HASH_ALGO_MISMATCH = 106
    """The block-key hash algorithms differ: keys would never match."""
    KEY_HASH_SEED_MISMATCH = 107
    """The block-key hash seeds differ: keys would never match."""
    CAPABILITY_MISSING = 108
    """A capability this node requires was not offered by the peer."""
    KV_MEMORY_LAYOUT_MISMATCH = 109
    """Identity extension: the block byte order in the engines' memory differs."""
    MODEL_REVISION_MISMATCH = 110
    """Identity extension: the weights revisions differ (same model name)."""
    MODEL_OVERRIDES_MISMATCH = 111
    """Identity extension: the overrides that change the K/V values differ."""
    ENGINE_KEY_HASH_MISMATCH = 112
    """Identity extension: the engines' block-key hash function or seed differs."""
    EXTENSION_UNDECLARED = 113
    """Identity extension: a field only one side declares (strict identity policy)."""
    MODEL_WEIGHTS_MISMATCH = 114
    """Identity extension (1.2): the content digests of the weights differ."""
    MODEL_CONFIG_MISMATCH = 115
    """Identity extension (1.2): the digests of the models' config.json differ."""

    # 2xx: protocol errors.
    MALFORMED = 200
    """Frame 0 is not a msgpack map (not msgpack, truncated, trailing bytes, ext type)."""
    MISSING_FIELD = 201
    """A required field is absent."""
    WRONG_TYPE = 202
    """A field has the wrong msgpack type (bool is not int, bin is not str)."""
    OUT_OF_BOUNDS = 203
    """A value or a length is outside its bounds (also: too many keys for this peer)."""
    UNKNOWN_TYPE = 204
    """The message type tag is unknown (non-fatal: answered with ``error``)."""
    UNEXPECTED = 205
    """The message is not allowed in the connection's current state or role."""
    FRAME_COUNT = 206
    """Wrong number of frames, or a payload frame of the wrong size."""
    TOO_LARGE = 207
    """Frame 0 is larger than MAX_HEAD_BYTES."""
    UNKNOWN_REQUEST = 208
    """A reply or credit names a request id that was never opened."""
    DUPLICATE_REQUEST = 209
    """A request id is reused while the first request is unfinished."""
    TOO_MANY_IN_FLIGHT = 210
    """More unfinished requests than the receiver allows (non-fatal: ``error``)."""
    TIMEOUT = 211
    """A deadline expired (handshake, request, abort)."""
    WINDOW_EXCEEDED = 212
    """More blocks arrived than the receiver granted in credit."""
    CHECKSUM_MISMATCH = 213
    """A block's bytes do not match its xxh3-64 (the receiver drops the block)."""
    UNAVAILABLE = 214
    """The server cannot serve this request now (non-fatal: ``error``)."""

    # 3xx: close reasons (bye).
    NORMAL_CLOSE = 300
    """The peer closes the connection; nothing went wrong."""
    SHUTDOWN = 301
    """The node shuts down."""
    PROTOCOL_VIOLATION = 302
    """The peer broke the protocol (a 2xx code names the precise violation when known)."""
    PEER_TIMEOUT = 303
    """No traffic from the peer within the heartbeat timeout."""


def code_name(code: int) -> str:
    """``"FINGERPRINT_MISMATCH(100)"`` for a known code, ``"code 999"`` for an unknown one."""
    try:
        return f"{Code(code).name}({int(code)})"
    except ValueError:
        return f"code {code}"


class CodeFamily(Enum):
    """What a code is about, known or not: the family its hundreds name."""

    REFUSAL = "refusal"
    """``1xx``: why a handshake was refused (the connection never became ready)."""
    PROTOCOL_ERROR = "protocol_error"
    """``2xx``: malformed or unexpected input, or a request turned down."""
    CLOSE = "close"
    """``3xx``: why a connection was closed."""
    UNKNOWN = "unknown"
    """Outside the families this protocol defines."""


_FAMILIES: Final = {1: CodeFamily.REFUSAL, 2: CodeFamily.PROTOCOL_ERROR, 3: CodeFamily.CLOSE}


def code_family(code: int) -> CodeFamily:
    """The family of ``code``, from its hundreds; unknown codes are placed too."""
    if code < 0:
        return CodeFamily.UNKNOWN
    return _FAMILIES.get(int(code) // 100, CodeFamily.UNKNOWN)

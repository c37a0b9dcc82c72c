"""Typed p2pkv messages: one frozen dataclass per wire message (``protocol/SPEC.md``).

Attribute names are the wire field names, so a message reads the same in a packet dump
and in code. Messages are plain data: they do not validate themselves. Peer data is
validated once, where it enters (:func:`p2pkv.protocol.codec.decode`); messages this
node builds come from the session, which checks what it sends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, TypeVar

from p2pkv.identity import ABSENT, IdentityExtension, RunConfig
from p2pkv.protocol.codes import (
    CAP_CHECKSUM_XXH3_64,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    VIA_SHM,
    code_name,
)

__all__ = [
    "Abort",
    "AbortAck",
    "AdvertisedLimits",
    "Attach",
    "Attached",
    "Block",
    "Bye",
    "Credit",
    "DataOffer",
    "Done",
    "Error",
    "Fetch",
    "Frame",
    "Geometry",
    "Greeting",
    "Hello",
    "Hits",
    "KeyHash",
    "Located",
    "Lookup",
    "Message",
    "NixlOffer",
    "Ping",
    "Pong",
    "Reason",
    "Refuse",
    "Release",
    "ShmOffer",
    "Welcome",
    "value_from_wire",
    "value_to_wire",
]

Frame: TypeAlias = bytes | bytearray | memoryview
"""One ZeroMQ frame as the codec accepts it."""


def value_to_wire(value: Any) -> Any:
    """A reason value as sent: :data:`~p2pkv.identity.ABSENT` becomes ``{"absent": true}``."""
    return {"absent": True} if value is ABSENT else value


def value_from_wire(value: Any) -> Any:
    """Inverse of :func:`value_to_wire`."""
    if isinstance(value, Mapping) and len(value) == 1 and value.get("absent") is True:
        return ABSENT
    return value


@dataclass(frozen=True, slots=True)
class Geometry:
    """Block geometry: bytes per block and the sizes of its segments, in wire order.

    A V1 cross-layer block is one segment; a V2 per-layer block is one segment per layer.
    """

    bpb: int
    seg: tuple[int, ...]

    @classmethod
    def of(cls, segments: Sequence[int]) -> Geometry:
        """The geometry whose bytes per block is the sum of ``segments``."""
        seg = tuple(segments)
        return cls(sum(seg), seg)

    @property
    def bytes_per_block(self) -> int:
        return self.bpb

    @property
    def segments(self) -> tuple[int, ...]:
        return self.seg

    def describe(self) -> str:
        """``"one 589824-byte segment"``, ``"12 × 49152-byte segments"``, or the list."""
        if len(self.seg) == 1:
            return f"one {self.seg[0]}-byte segment"
        if len(set(self.seg)) == 1:
            return f"{len(self.seg)} × {self.seg[0]}-byte segments"
        shown = ", ".join(str(s) for s in self.seg[:8])
        more = ", ..." if len(self.seg) > 8 else ""
        return f"{len(self.seg)} segments ({shown}{more} bytes)"


@dataclass(frozen=True, slots=True)
class KeyHash:
    """How block keys are hashed: algorithm name (e.g. ``"xxh3-128"``) and u64 seed."""

    algo: str
    seed: int


@dataclass(frozen=True, slots=True)
class AdvertisedLimits:
    """Limits a node advertises in its greeting; every entry is optional.

    ``max_keys``: most keys it accepts in one lookup/fetch; ``window``: the initial
    window it grants when it fetches; ``in_flight``: most unfinished requests it accepts.
    """

    max_keys: int | None = None
    window: int | None = None
    in_flight: int | None = None


@dataclass(frozen=True, slots=True)
class ShmOffer:
    """The server's shared-memory pool (``welcome.shm``, capability ``shm-v1``, SPEC §16):
    the segment's name (a POSIX shm name without its slash) and its size in bytes."""

    name: str
    size: int


@dataclass(frozen=True, slots=True)
class NixlOffer:
    """The server's pool as a NIXL agent exposes it (``welcome.nixl``, capability
    ``nixl-v1``, SPEC §20): the agent's name and metadata (what a reader's agent loads to
    reach it), per ``geo.seg`` region its address and size in the server's memory, the
    slots of each region, and the address of the 16-byte nonce an ``attach`` echoes."""

    agent: str
    meta: bytes
    regions: tuple[tuple[int, int], ...]
    slots: int
    nonce: int

    def sources(self, slot: int, seg: Sequence[int]) -> list[tuple[int, int]]:
        """Where each segment of slot ``slot`` lies in the server's memory (address,
        length): region ``i`` holds segment ``i`` of slot ``s`` at ``s × seg[i]``."""
        return [(region[0] + slot * size, size)
                for region, size in zip(self.regions, seg, strict=True)]


@dataclass(frozen=True, slots=True)
class DataOffer:
    """The server's data stream (``welcome.data``, capability ``tcp-data-v1``, SPEC §18):
    the TCP ``port`` to open it on (at the host the client dialed), the ``token`` that
    binds it to this session (once), and ``cport``, the port of the server's own ZeroMQ
    endpoint, so that a client that reached it through a relay can tell."""

    port: int
    token: bytes = field(repr=False)
    cport: int
    #: The tokens of the session's further streams (``tcp-streams-v1``, SPEC §18.6):
    #: stream ``k`` presents ``more[k - 1]``. Empty without the capability.
    more: tuple[bytes, ...] = field(default=(), repr=False)
    #: The pin of the server's certificate (``tcp-data-tls-v1``, SPEC §18.7): the
    #: SHA-256 of its DER form; the stream is TLS 1.3 with exactly that certificate.
    cert: bytes | None = None
    #: The session's stream secret (``tcp-data-aead-v1``, SPEC §18.8): 32 random bytes
    #: from which each stream's record keys are derived. Only the two ends of the
    #: (encrypted) session know it.
    key: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Reason:
    """One reason of a refusal: code, field, both values, one-line meaning.

    ``ours``/``theirs`` are seen from whoever holds the object: in a ``refuse`` message
    they are the sender's view; :meth:`swapped` gives the receiver's view. A run-config
    key missing on one side is :data:`~p2pkv.identity.ABSENT`.
    """

    code: int
    field: str
    ours: Any
    theirs: Any
    meaning: str

    def swapped(self) -> Reason:
        """The same reason seen from the other side."""
        return Reason(self.code, self.field, self.theirs, self.ours, self.meaning)

    def to_wire(self) -> dict[str, Any]:
        return {
            "code": int(self.code),
            "field": self.field,
            "ours": value_to_wire(self.ours),
            "theirs": value_to_wire(self.theirs),
            "meaning": self.meaning,
        }

    def describe(self) -> str:
        return (
            f"{self.field}: ours {_show(self.ours)} vs theirs {_show(self.theirs)} "
            f"({self.meaning}) [{code_name(self.code)}]"
        )


def _show(value: Any) -> str:
    if value is ABSENT:
        return "absent"
    return repr(value)


@dataclass(frozen=True, slots=True)
class Greeting:
    """The identity a node presents: shared shape of ``hello`` and ``welcome``.

    ``rc`` is the full run-config dict and ``fp`` its 16-hex fingerprint; ``v`` is the
    protocol major the sender speaks (kept so a mismatch can be refused with reasons).
    ``ext`` is the identity extension (protocol 1.1); ``None`` when the sender declares
    nothing, which is also how a 1.0 peer reads. ``shm`` is the server's shared-memory
    pool, in a ``welcome`` that negotiated ``shm-v1``, ``data`` its data stream, in
    a ``welcome`` that negotiated ``tcp-data-v1``, and ``nixl`` its pool as a NIXL agent
    exposes it, in a ``welcome`` that negotiated ``nixl-v1`` (none ever in a ``hello``).
    """

    TAG: ClassVar[str] = ""

    node: str
    minor: int
    rc: dict[str, Any]
    fp: str
    geo: Geometry
    khash: KeyHash
    caps: tuple[str, ...] = (CAP_CHECKSUM_XXH3_64,)
    limits: AdvertisedLimits | None = None
    v: int = PROTOCOL_MAJOR
    ext: IdentityExtension | None = None
    shm: ShmOffer | None = None
    data: DataOffer | None = None
    nixl: NixlOffer | None = None

    @classmethod
    def for_config(
        cls: type[_G],
        node: str,
        config: RunConfig,
        geo: Geometry,
        khash: KeyHash,
        *,
        caps: Sequence[str] = (CAP_CHECKSUM_XXH3_64,),
        limits: AdvertisedLimits | None = None,
        ext: IdentityExtension | None = None,
    ) -> _G:
        """The greeting of a node running ``config`` (``rc`` and ``fp`` derived from it).

        An ``ext`` that declares nothing is sent as no extension at all.
        """
        return cls(
            node=node,
            minor=PROTOCOL_MINOR,
            rc=config.get_run_config(),
            fp=config.fingerprint,
            geo=geo,
            khash=khash,
            caps=tuple(caps),
            limits=limits,
            ext=None if ext is None or ext.is_empty else ext,
        )


_G = TypeVar("_G", bound=Greeting)


@dataclass(frozen=True, slots=True)
class Hello(Greeting):
    """Client → server, first message of a connection."""

    TAG: ClassVar[str] = "hello"


@dataclass(frozen=True, slots=True)
class Welcome(Greeting):
    """Server → client: the handshake is accepted; ``caps`` is the negotiated set."""

    TAG: ClassVar[str] = "welcome"


@dataclass(frozen=True, slots=True)
class Refuse:
    """Either side: the handshake is refused, with every reason. The sender then closes.

    The identity fields are optional; a node fills them so the refused peer can show
    who refused it and compute its own diff (``ext``: its identity extension, 1.1).
    """

    TAG: ClassVar[str] = "refuse"

    code: int
    msg: str
    reasons: tuple[Reason, ...] = ()
    node: str | None = None
    rc: dict[str, Any] | None = None
    fp: str | None = None
    geo: Geometry | None = None
    khash: KeyHash | None = None
    ext: IdentityExtension | None = None


@dataclass(frozen=True, slots=True)
class Lookup:
    """Client → server: which of ``keys`` do you hold?"""

    TAG: ClassVar[str] = "lookup"

    req: int
    keys: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Hits:
    """Server → client: one bool per key of the lookup ``req``.

    ``due`` (``pending-v1``, SPEC §19): one entry per key, the milliseconds until the
    server expects to hold a key it does not hold yet but is computing; 0 for a key
    that is held or not being computed. None (absent): nothing pending."""

    TAG: ClassVar[str] = "hits"

    req: int
    hits: tuple[bool, ...]
    due: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Fetch:
    """Client → server: send the blocks of ``keys``, at most ``window`` in flight.

    ``shm``: serve it through the shared-memory pool (``located`` instead of ``block``),
    only after an accepted ``attach`` (SPEC §16).
    """

    TAG: ClassVar[str] = "fetch"

    req: int
    keys: tuple[bytes, ...]
    window: int
    shm: bool = False
    #: The data stream to serve it on (``tcp-streams-v1``, SPEC §18.6); 0 by default.
    stream: int = 0


@dataclass(frozen=True, slots=True)
class Credit:
    """Client → server: ``n`` more blocks of window for fetch ``req``."""

    TAG: ClassVar[str] = "credit"

    req: int
    n: int


@dataclass(frozen=True, slots=True)
class Block:
    """Server → client: blocks ``idx`` (indices into the fetch's keys) of fetch ``req``.

    ``sums`` holds one xxh3-64 per block, or ``None`` entries when checksums were not
    negotiated. ``payload`` holds ``len(idx) * len(geo.seg)`` frames, block-major; it is
    empty for a header decoded alone (:func:`~p2pkv.protocol.codec.decode_head`).
    ``pk`` (capability ``packed-v1``, SPEC §17): the payload is one frame instead, the
    same bytes back to back (``len(idx) * geo.bpb`` bytes).
    """

    TAG: ClassVar[str] = "block"

    req: int
    idx: tuple[int, ...]
    sums: tuple[int | None, ...]
    payload: tuple[Frame, ...] = field(default=(), repr=False)
    pk: bool = False


@dataclass(frozen=True, slots=True)
class Located:
    """Server → client (``shm-v1``): blocks ``idx`` of fetch ``req`` are pinned in the
    server's shared pool at ``slots``; the client copies them and sends ``release``."""

    TAG: ClassVar[str] = "located"

    req: int
    idx: tuple[int, ...]
    slots: tuple[int, ...]
    sums: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class Release:
    """Client → server (``shm-v1``): the blocks ``idx`` of fetch ``req`` were copied (or
    dropped); the server may unpin them."""

    TAG: ClassVar[str] = "release"

    req: int
    idx: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Attach:
    """Client → server (``shm-v1``): the nonce read through a read-only mapping of the
    server's segment, the proof that the client is on the same host and can map it; or
    (``via`` ``nixl-v1``, SPEC §20) the nonce READ through NIXL out of the server's
    registered memory, the proof that the client's agent reaches the server's pool."""

    TAG: ClassVar[str] = "attach"

    nonce: bytes
    via: str = VIA_SHM


@dataclass(frozen=True, slots=True)
class Attached:
    """Server → client (``shm-v1``): the verdict on ``attach``; ``ok`` false means every
    fetch of this connection moves over TCP, ``msg`` says why."""

    TAG: ClassVar[str] = "attached"

    ok: bool
    msg: str


@dataclass(frozen=True, slots=True)
class Done:
    """Server → client: fetch ``req`` is over; one outcome per key (0 sent, 1 missing, 2 failed)."""

    TAG: ClassVar[str] = "done"

    req: int
    outcomes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    """Client → server: stop request ``req``."""

    TAG: ClassVar[str] = "abort"

    req: int


@dataclass(frozen=True, slots=True)
class AbortAck:
    """Server → client: request ``req`` is stopped; nothing more will be sent for it."""

    TAG: ClassVar[str] = "abort_ack"

    req: int


@dataclass(frozen=True, slots=True)
class Ping:
    """Either side: are you alive? Answered by a ``pong`` with the same nonce."""

    TAG: ClassVar[str] = "ping"

    nonce: int


@dataclass(frozen=True, slots=True)
class Pong:
    """Either side: answer to a ``ping``."""

    TAG: ClassVar[str] = "pong"

    nonce: int


@dataclass(frozen=True, slots=True)
class Bye:
    """Either side: the connection is over (code and reason); the sender closes."""

    TAG: ClassVar[str] = "bye"

    code: int
    msg: str


@dataclass(frozen=True, slots=True)
class Error:
    """Either side: a non-fatal error, for request ``req`` or (``None``) for a message."""

    TAG: ClassVar[str] = "error"

    req: int | None
    code: int
    msg: str


Message: TypeAlias = (
    Hello | Welcome | Refuse | Lookup | Hits | Fetch | Credit | Block | Done | Abort
    | AbortAck | Ping | Pong | Bye | Error | Attach | Attached | Located | Release
)
"""Any p2pkv message."""

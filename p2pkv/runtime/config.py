"""The node's configuration: :class:`NodeConfig`, everything about a node that is not
its KV identity.

It imports no torch (nor the store), so that :mod:`p2pkv.settings` can import it at
once; ``p2pkv.node`` (and ``p2pkv``) re-export it, which is where users import it from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from p2pkv.checksum import MAX_COPY_THREADS
from p2pkv.errors import ConfigError
from p2pkv.identity import IDENTITY_POLICIES
from p2pkv.keys import KEY_HASH_ALGORITHM
from p2pkv.protocol.codes import (
    CAP_CHECKSUM_XXH3_64,
    CAP_PACKED_V1,
    CAP_PENDING_V1,
    CAP_SHM_V1,
    CAP_TCP_DATA_AEAD_V1,
    CAP_TCP_DATA_TLS_V1,
    CAP_TCP_DATA_V1,
    CAP_TCP_STREAMS_V1,
    MAX_KEY_HASH_ALGO_LEN,
    MAX_STREAMS,
)
from p2pkv.transport import CurveKeys, validate_address

__all__ = ["DATA_ENCRYPTIONS", "NodeConfig"]


DATA_ENCRYPTIONS: Final = ("sealed", "tls")
"""The values of ``NodeConfig.data_encryption``."""


@dataclass(frozen=True)
class NodeConfig:
    """Everything about a node that is not its KV identity. Times are seconds."""

    listen: str = "tcp://127.0.0.1:0"
    node_id: str | None = None
    key_hash_seed: int = 0
    #: Name of the block-key hash, compared at the handshake. Keys an engine hashes
    #: itself (for example vLLM's block hashes) are carried opaquely under their own name.
    key_hash_algo: str = KEY_HASH_ALGORITHM
    checksums: bool = True
    window_bytes: int = 16 << 20
    handshake_timeout: float = 5.0
    lookup_timeout: float = 5.0
    fetch_timeout: float = 60.0
    fetch_idle_timeout: float = 10.0
    #: Serving: the send deadline. Seconds a peer may take nothing of what waits for it
    #: on its data path while blocks stay pinned for it (no byte taken off its data
    #: stream, no frame let go by libzmq, no located block released): a reader that
    #: stalled but still answers pings. Its session then ends with a ``bye`` that says
    #: why, and its blocks are released.
    send_timeout: float = 20.0
    abort_timeout: float = 2.0
    close_timeout: float = 5.0
    #: :meth:`Node.drain`: seconds in-flight sends get to finish once new fetches are
    #: declined.
    drain_timeout: float = 10.0
    #: Seconds ``close`` waits for the IO thread beyond ``close_timeout`` (the thread
    #: fails what is left at that deadline and stops; this bounds a thread that does not).
    close_grace: float = 5.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    max_peers: int = 256
    max_keys_per_request: int = 16384
    max_inflight_requests: int = 64
    curve: CurveKeys | None = None
    connect_allowlist: frozenset[str] | None = None
    #: "strict": an identity-extension field only one side declares refuses the peer;
    #: "lenient": it is accepted with a warning, counted in stats().identity_undeclared.
    identity_policy: str = "strict"
    #: Same-host shared memory (capability shm-v1): the pool lives in a /dev/shm segment
    #: that proven same-host peers copy from, and this node copies from theirs.
    shm: bool = False
    #: Threads that copy one shared-memory message's blocks (and hash them) at once.
    #: Above 1 it takes the compiled helper (``p2pkv.checksum.NATIVE``); without it the
    #: copy runs on the IO thread alone. On a host whose one core cannot use the memory
    #: bandwidth, 2 or more copy faster; on a host of few cores they cost CPU (see
    #: docs/performance.md).
    shm_copy_threads: int = 1
    #: Capability packed-v1: blocks whose segments are all small travel as one payload
    #: frame per message between peers that both offer it (False: never offer it).
    packed_blocks: bool = True
    #: The data channel: block bytes travel on a TCP stream beside the ZeroMQ
    #: connection, bound to the session by a token, between peers that both offer it:
    #: plain (capability tcp-data-v1), or under CURVE inside TLS 1.3 with a certificate
    #: pinned by the encrypted welcome (tcp-data-tls-v1), never weaker than the
    #: connection it sits beside.
    data_channel: bool = True
    #: The port this node accepts data streams on (at the host of ``listen``); 0: an
    #: ephemeral port.
    data_port: int = 0
    #: Data streams per peer (capability tcp-streams-v1, offered when above 1): this
    #: node opens up to this many to each peer that accepts them, and accepts up to
    #: this many from each peer; a fetch is striped over them. Clouds cap one TCP flow
    #: well below the NIC; several streams get past that cap.
    data_streams: int = 1
    #: How data streams are encrypted under CURVE: ``"sealed"`` offers AES-256-GCM
    #: records keyed from the CURVE session (tcp-data-aead-v1, the fast one) and TLS
    #: 1.3 for peers that only speak that (tcp-data-tls-v1); ``"tls"`` offers TLS only.
    #: Without CURVE the stream is plain and this does nothing.
    data_encryption: str = "sealed"

    def __post_init__(self) -> None:
        validate_address(self.listen, what="listen", option="listen")
        if self.identity_policy not in IDENTITY_POLICIES:
            raise ConfigError(f"identity_policy must be one of {', '.join(IDENTITY_POLICIES)}, "
                              f"got {self.identity_policy!r}")
        positive = (
            "handshake_timeout", "lookup_timeout", "fetch_timeout", "fetch_idle_timeout",
            "send_timeout", "abort_timeout", "close_timeout", "close_grace", "heartbeat_interval",
            "heartbeat_timeout", "drain_timeout",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("window_bytes", "max_peers", "max_keys_per_request",
                     "max_inflight_requests"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if type(self.key_hash_seed) is not int or not 0 <= self.key_hash_seed < 2**64:
            raise ConfigError(f"key_hash_seed must be an int in [0, 2**64), got "
                              f"{self.key_hash_seed!r}")
        if (not isinstance(self.key_hash_algo, str)
                or not 1 <= len(self.key_hash_algo) <= MAX_KEY_HASH_ALGO_LEN):
            raise ConfigError(f"key_hash_algo must be a name of 1..{MAX_KEY_HASH_ALGO_LEN} "
                              f"characters, got {self.key_hash_algo!r}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must be longer than heartbeat_interval")
        if type(self.shm) is not bool:
            raise ConfigError(f"shm must be a bool, got {self.shm!r}")
        if (type(self.shm_copy_threads) is not int
                or not 1 <= self.shm_copy_threads <= MAX_COPY_THREADS):
            raise ConfigError(f"shm_copy_threads must be an int in [1, {MAX_COPY_THREADS}], "
                              f"got {self.shm_copy_threads!r}")
        if type(self.packed_blocks) is not bool:
            raise ConfigError(f"packed_blocks must be a bool, got {self.packed_blocks!r}")
        if type(self.data_channel) is not bool:
            raise ConfigError(f"data_channel must be a bool, got {self.data_channel!r}")
        if type(self.data_port) is not int or not 0 <= self.data_port <= 65535:
            raise ConfigError(f"data_port must be an int in [0, 65535], got "
                              f"{self.data_port!r}")
        if type(self.data_streams) is not int or not 1 <= self.data_streams <= MAX_STREAMS:
            raise ConfigError(f"data_streams must be an int in [1, {MAX_STREAMS}], got "
                              f"{self.data_streams!r}")
        if self.data_encryption not in DATA_ENCRYPTIONS:
            raise ConfigError(f"data_encryption must be one of {', '.join(DATA_ENCRYPTIONS)}, "
                              f"got {self.data_encryption!r}")

    @property
    def capabilities(self) -> tuple[str, ...]:
        """The capabilities this node offers in its greeting."""
        # pending-v1 commits to nothing: a node with nothing pending answers as before.
        caps = [CAP_CHECKSUM_XXH3_64] if self.checksums else []
        caps.append(CAP_PENDING_V1)
        if self.shm:
            caps.append(CAP_SHM_V1)
        if self.packed_blocks:
            caps.append(CAP_PACKED_V1)
        if self.offers_data_channel:
            if not self.encrypts_data_stream:
                caps.append(CAP_TCP_DATA_V1)
            elif self.data_encryption == "sealed":
                caps += [CAP_TCP_DATA_AEAD_V1, CAP_TCP_DATA_TLS_V1]
            else:
                caps.append(CAP_TCP_DATA_TLS_V1)
            if self.data_streams > 1:
                caps.append(CAP_TCP_STREAMS_V1)
        return tuple(caps)

    @property
    def offers_data_channel(self) -> bool:
        """Whether this node offers a data stream (in one of its two forms)."""
        return self.data_channel

    @property
    def encrypts_data_stream(self) -> bool:
        """Whether its data streams are encrypted (``tcp-data-aead-v1`` and/or
        ``tcp-data-tls-v1``, by :attr:`data_encryption`): under CURVE, whose connections
        a plain stream would be weaker than; plain ``tcp-data-v1`` is then never
        offered."""
        return self.curve is not None

    @property
    def seals_data_stream(self) -> bool:
        """Whether it offers the sealed stream (``tcp-data-aead-v1``)."""
        return self.offers_data_channel and self.encrypts_data_stream and \
            self.data_encryption == "sealed"

"""The node's configuration: :class:`NodeConfig`, everything about a node that is not
its KV identity.

It imports no torch (nor the store), so that :mod:`p2pkv.settings` can import it at
once; ``p2pkv.node`` (and ``p2pkv``) re-export it, which is where users import it from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from p2pkv.errors import ConfigError
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
)
from p2pkv.protocol.options import NODE, defaults, option
from p2pkv.protocol.options import heartbeat_interval as ping_interval
from p2pkv.transport import CurveKeys, validate_address

__all__ = ["DATA_ENCRYPTIONS", "NodeConfig"]


DATA_ENCRYPTIONS: Final = ("sealed", "tls")
"""The values of ``NodeConfig.data_encryption``."""

#: The defaults of the options NodeConfig takes (the one table, p2pkv.protocol.options).
_DEFAULT: Final = defaults(NODE)
#: The fields checked against the table under their own names.
_CHECKED: Final = tuple(name for name in _DEFAULT if name != "key_seed")


def _field(name: str) -> str:
    return name


@dataclass(frozen=True)
class NodeConfig:
    """Everything about a node that is not its KV identity. Times are seconds."""

    listen: str = _DEFAULT["listen"]
    node_id: str | None = None
    key_hash_seed: int = _DEFAULT["key_seed"]
    #: Name of the block-key hash, compared at the handshake. Keys an engine hashes
    #: itself (for example vLLM's block hashes) are carried opaquely under their own name.
    key_hash_algo: str = KEY_HASH_ALGORITHM
    checksums: bool = _DEFAULT["checksums"]
    window_bytes: int = _DEFAULT["window_bytes"]
    handshake_timeout: float = _DEFAULT["handshake_timeout"]
    lookup_timeout: float = _DEFAULT["lookup_timeout"]
    fetch_timeout: float = _DEFAULT["fetch_timeout"]
    fetch_idle_timeout: float = _DEFAULT["fetch_idle_timeout"]
    #: Serving: the send deadline. Seconds a peer may take nothing of what waits for it
    #: on its data path while blocks stay pinned for it (no byte taken off its data
    #: stream, no frame let go by libzmq, no located block released): a reader that
    #: stalled but still answers pings. Its session then ends with a ``bye`` that says
    #: why, and its blocks are released.
    send_timeout: float = _DEFAULT["send_timeout"]
    abort_timeout: float = _DEFAULT["abort_timeout"]
    close_timeout: float = _DEFAULT["close_timeout"]
    #: :meth:`Node.drain`: seconds in-flight sends get to finish once new fetches are
    #: declined.
    drain_timeout: float = _DEFAULT["drain_timeout"]
    #: Seconds ``close`` waits for the IO thread beyond ``close_timeout`` (the thread
    #: fails what is left at that deadline and stops; this bounds a thread that does not).
    close_grace: float = _DEFAULT["close_grace"]
    heartbeat_interval: float = ping_interval(_DEFAULT["heartbeat_timeout"])
    heartbeat_timeout: float = _DEFAULT["heartbeat_timeout"]
    max_peers: int = _DEFAULT["max_peers"]
    max_keys_per_request: int = _DEFAULT["max_keys_per_request"]
    max_inflight_requests: int = _DEFAULT["max_inflight_requests"]
    curve: CurveKeys | None = None
    connect_allowlist: frozenset[str] | None = None
    #: "strict": an identity-extension field only one side declares refuses the peer;
    #: "lenient": it is accepted with a warning, counted in stats().identity_undeclared.
    identity_policy: str = _DEFAULT["identity_policy"]
    #: Same-host shared memory (capability shm-v1): the pool lives in a /dev/shm segment
    #: that proven same-host peers copy from, and this node copies from theirs.
    shm: bool = _DEFAULT["shm"]
    #: Threads that copy one shared-memory message's blocks (and hash them) at once.
    #: Above 1 it takes the compiled helper (``p2pkv.checksum.NATIVE``); without it the
    #: copy runs on the IO thread alone. On a host whose one core cannot use the memory
    #: bandwidth, 2 or more copy faster; on a host of few cores they cost CPU (see
    #: docs/performance.md).
    shm_copy_threads: int = _DEFAULT["shm_copy_threads"]
    #: One-sided reads through NIXL (capability nixl-v1, SPEC §20): ``"auto"`` where this
    #: host has an RDMA device and NIXL is installed, ``"on"`` wherever NIXL is installed
    #: (the node refuses to start where it is not), ``"off"`` never. Never under CURVE.
    nixl: str = _DEFAULT["nixl"]
    #: Seconds one NIXL read may take before it fails the blocks it carries.
    nixl_read_timeout: float = _DEFAULT["nixl_read_timeout"]
    #: Capability packed-v1: blocks whose segments are all small travel as one payload
    #: frame per message between peers that both offer it (False: never offer it).
    packed_blocks: bool = _DEFAULT["packed_blocks"]
    #: The data channel: block bytes travel on a TCP stream beside the ZeroMQ
    #: connection, bound to the session by a token, between peers that both offer it:
    #: plain (capability tcp-data-v1), or under CURVE inside TLS 1.3 with a certificate
    #: pinned by the encrypted welcome (tcp-data-tls-v1), never weaker than the
    #: connection it sits beside.
    data_channel: bool = _DEFAULT["data_channel"]
    #: The port this node accepts data streams on (at the host of ``listen``); 0: an
    #: ephemeral port.
    data_port: int = _DEFAULT["data_port"]
    #: Data streams per peer (capability tcp-streams-v1, offered when above 1): this
    #: node opens up to this many to each peer that accepts them, and accepts up to
    #: this many from each peer; a fetch is striped over them. Clouds cap one TCP flow
    #: well below the NIC; several streams get past that cap.
    data_streams: int = _DEFAULT["data_streams"]
    #: How data streams are encrypted under CURVE: ``"sealed"`` offers AES-256-GCM
    #: records keyed from the CURVE session (tcp-data-aead-v1, the fast one) and TLS
    #: 1.3 for peers that only speak that (tcp-data-tls-v1); ``"tls"`` offers TLS only.
    #: Without CURVE the stream is plain and this does nothing.
    data_encryption: str = _DEFAULT["data_encryption"]

    def __post_init__(self) -> None:
        # Every option's kind and bounds from the one table, named as this class names
        # them; then what no single option says.
        for name in _CHECKED:
            value = getattr(self, name)
            checked = option(name).check(value, spell=_field)
            if checked != value or type(checked) is not type(value):
                object.__setattr__(self, name, checked)  # a whole number of seconds
        key_seed = option("key_seed").check(self.key_hash_seed,
                                            spell=lambda _: "key_hash_seed")
        object.__setattr__(self, "key_hash_seed", key_seed)
        validate_address(self.listen, what="listen", option="listen")
        if (not isinstance(self.key_hash_algo, str)
                or not 1 <= len(self.key_hash_algo) <= MAX_KEY_HASH_ALGO_LEN):
            raise ConfigError(f"key_hash_algo must be a name of 1..{MAX_KEY_HASH_ALGO_LEN} "
                              f"characters, got {self.key_hash_algo!r}")
        ping_interval(self.heartbeat_timeout, self.heartbeat_interval, spell=_field)
        if self.nixl == "on" and self.curve is not None:
            raise ConfigError("'on' cannot be used under CURVE: UCX moves blocks in the "
                              "clear (use 'auto' or 'off')", option="nixl")

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

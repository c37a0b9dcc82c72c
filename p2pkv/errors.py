"""Every error p2pkv raises to its users derives from :class:`P2PKVError`.

This module is a leaf: the pure protocol core, the store, the transport and the node all
import it, and it imports nothing of p2pkv.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pkv.identity import FieldDiff

__all__ = [
    "ConfigError",
    "P2PKVError",
    "PeerGone",
    "PeerIncompatible",
    "PeerTimeout",
    "ProtocolError",
    "StoreFullError",
    "TransferFailed",
]


class P2PKVError(Exception):
    """Base class of every p2pkv error."""


class ConfigError(P2PKVError, ValueError):
    """A configuration value is invalid; the message names the option and the value."""


class ProtocolError(P2PKVError):
    """A peer sent something the protocol does not allow.

    ``code`` is the wire error code (see ``protocol/SPEC.md``, "Error codes").
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class PeerIncompatible(P2PKVError):
    """The handshake was refused; ``reasons`` lists every differing field.

    ``reasons`` are :class:`p2pkv.protocol.Reason` objects (code, field, both values,
    meaning) and ``diff`` the run-config :class:`~p2pkv.identity.FieldDiff` list when the
    fingerprints differ. Both are seen from this node's side (local vs remote).
    """

    def __init__(self, message: str, reasons: Sequence[Any] = (),
                 diff: Sequence[FieldDiff] = ()) -> None:
        super().__init__(message)
        self.reasons = list(reasons)
        self.diff = list(diff)
        #: What the peer said about itself (node, fp, rc), when it said anything.
        self.remote: dict[str, Any] = {}


class PeerTimeout(P2PKVError, TimeoutError):
    """A peer did not answer within the configured deadline."""


class PeerGone(P2PKVError, ConnectionError):
    """The peer closed the connection, died, or this node was closed."""


class TransferFailed(P2PKVError):
    """The peer turned a request down as a whole (too many keys, too many requests in
    flight, unavailable); the connection stays up. Per-key fetch failures are not raised:
    they are outcomes in the :class:`~p2pkv.node.FetchResult`."""


class StoreFullError(P2PKVError):
    """No slot can be allocated: every block is pinned or being written."""

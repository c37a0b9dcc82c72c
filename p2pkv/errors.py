"""Every error p2pkv raises to its users derives from :class:`P2PKVError`.

This module is a leaf: the pure protocol core, the store, the transport and the node all
import it, and it imports nothing of p2pkv.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "ConfigError",
    "LocalLimitExceeded",
    "LocalProtocolError",
    "P2PKVError",
    "P2PKVProtocolError",
    "PeerGone",
    "PeerIncompatible",
    "PeerTimeout",
    "ProtocolError",
    "StoreFullError",
    "TransferFailed",
    "TransportHandshakeFailed",
    "command_line_flag",
]


class P2PKVError(Exception):
    """Base class of every p2pkv error."""


def command_line_flag(option: str) -> str:
    """How the command line spells an option: ``pool_blocks`` -> ``--pool-blocks``."""
    return "--" + option.replace("_", "-")


class ConfigError(P2PKVError, ValueError):
    """A configuration value is invalid.

    The option at fault is data, so that each front end names it its own way (the
    command line as ``--pool-blocks``, the vLLM tier as ``pool_blocks``):

    - ``option``: the option's canonical name (``heartbeat_interval``), or None when no
      single option is at fault;
    - ``detail``: what is wrong; it may name other options as ``{name}`` when they are
      listed in ``mentions``;
    - ``origin``: where the value came from (a flag, an environment variable, a TOML
      file and key), or None;
    - ``named``: whether the text starts with the option's name (``--listen: ...``);
      a message that already says what it is about (``cannot listen on ...``) carries
      the option only as data.

    ``str()`` is :meth:`render` with the command line's spelling.
    """

    def __init__(self, detail: str, *, option: str | None = None, named: bool | None = None,
                 mentions: Sequence[str] = (), origin: str | None = None) -> None:
        self.detail = detail
        self.option = option
        self.named = option is not None if named is None else named
        self.mentions = tuple(mentions)
        self.origin = origin
        super().__init__(self.render())

    def render(self, spell: Callable[[str], str] = command_line_flag, *,
               with_origin: bool = True) -> str:
        """The message with every option name spelled by ``spell``."""
        text = self.detail
        for name in self.mentions:
            text = text.replace("{" + name + "}", spell(name))
        if self.named and self.option is not None:
            text = f"{spell(self.option)}: {text}"
        if with_origin and self.origin is not None:
            text = f"{text} (from {self.origin})"
        return text


class P2PKVProtocolError(P2PKVError):
    """A rule of the p2pkv protocol was broken, by one side or the other.

    ``code`` is the wire error code (see ``protocol/SPEC.md``, "Error codes"). Never
    raised as such: as in h11, the two sides are sibling types, so that catching one
    never catches the other. :class:`ProtocolError`: the peer broke the protocol (what
    it sent is not allowed); :class:`LocalProtocolError`: this node's own code asked its
    session for something the protocol does not allow now (a bug, or a caller's misuse).
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class ProtocolError(P2PKVProtocolError):
    """A peer sent something the protocol does not allow (h11's ``RemoteProtocolError``).

    ``code`` is the wire error code (see ``protocol/SPEC.md``, "Error codes").
    """


class LocalProtocolError(P2PKVProtocolError):
    """This node asked its session for something the protocol does not allow now (a
    call in the wrong state, or one the negotiated capabilities do not allow). Nothing
    was sent; the peer did nothing wrong. Not a :class:`ProtocolError`."""


class PeerIncompatible(P2PKVError):
    """The handshake was refused; ``reasons`` lists every differing field.

    ``reasons`` are :class:`p2pkv.protocol.Reason` objects (code, field, both values,
    meaning) and ``diff`` the run-config :class:`~p2pkv.identity.FieldDiff` list when the
    fingerprints differ. Both are seen from this node's side (local vs remote). (Typed
    ``Any`` here, like ``reasons``: this module imports nothing of p2pkv, not even for
    the type checker.)
    """

    def __init__(self, message: str, reasons: Sequence[Any],
                 diff: Sequence[Any] = ()) -> None:
        if not reasons:
            # A refusal always says what differs; anything else has its own error type
            # (ProtocolError, TransportHandshakeFailed).
            raise ValueError("PeerIncompatible needs at least one reason")
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


class TransportHandshakeFailed(P2PKVError, ConnectionError):
    """ZeroMQ's own security handshake failed, before any p2pkv message was exchanged.

    Reported from the socket monitor's handshake events. ``kind`` says what happened:

    * ``"curve-required"``: the server requires CurveZMQ, this node connected in plaintext;
    * ``"curve-not-offered"``: this node uses CurveZMQ, the server speaks plaintext;
    * ``"key-rejected"``: the server did not accept this node's CURVE public key;
    * ``"no-answer"``: the server closed the security handshake without an answer (with
      CurveZMQ: the server public key given is not this server's);
    * ``"protocol"``: another ZMTP handshake error (``detail`` names it).

    No reasons table exists for these: the peers never compared identities.
    """

    def __init__(self, message: str, kind: str, detail: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.detail = detail


class LocalLimitExceeded(P2PKVError):
    """A request goes over a limit of this node (or one the peer advertised), so it was
    not sent: more keys than ``max_keys_per_request`` (or the peer's ``max_keys``), or
    ``max_inflight_requests`` (or the peer's in-flight limit) requests already running on
    the connection. Nothing is wrong with the peer; retry later or split the request.

    ``limit`` names the limit, ``allowed`` its value, ``requested`` what was asked.
    """

    def __init__(self, message: str, *, limit: str, allowed: int, requested: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.allowed = allowed
        self.requested = requested


class StoreFullError(P2PKVError):
    """No slot can be allocated: every block is pinned or being written."""

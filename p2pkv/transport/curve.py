"""CurveZMQ for the node: key material, authorized-key files, and the authenticator.

A server with CURVE keys runs a ZAP authenticator (pyzmq's ``ThreadAuthenticator``) on
its ZeroMQ context before it binds, so that no connection slips through
unauthenticated; it admits either any client that knows the server's key or only the
public keys in an authorized-keys directory. Unknown keys and plaintext clients fail
ZeroMQ's own handshake and never reach p2pkv's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from p2pkv.errors import ConfigError

__all__ = ["CurveKeys", "load_authorized_keys", "start_authenticator"]


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ key material (Z85 text, 40 characters each).

    A server sets ``secret_key``/``public_key`` and ``authorized_clients`` (None = any
    client that knows the server key); a client sets its own pair and ``server_key``.
    """

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None
    authorized_clients: frozenset[bytes] | None = None


def load_authorized_keys(directory: str | Path) -> frozenset[bytes]:
    """Read every ``*.key`` public key file in a directory (zmq.auth format)."""
    import zmq.auth

    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"authorized keys directory {str(path)!r} does not exist")
    keys: set[bytes] = set()
    for item in sorted(path.iterdir()):
        if item.suffix not in (".key", ".key_secret"):
            continue
        try:
            public, _secret = zmq.auth.load_certificate(str(item))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read key file {str(item)!r}: {exc}") from exc
        keys.add(public)
    return frozenset(keys)


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], curve: CurveKeys) -> Any:
    """Start the ZAP authenticator for ``curve`` on ``ctx``; the caller ``stop()``s it
    after closing its sockets."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("p2pkv.auth"))
    auth.start()
    if curve.authorized_clients is None:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    else:
        auth.configure_curve_callback(domain="*", credentials_provider=_KeySet(
            curve.authorized_clients))
    return auth


class _KeySet:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        # pyzmq hands over the client's public key Z85-encoded, the form of key files.
        return key in self._keys

"""p2pkv: peer-to-peer KV-cache sharing for LLM serving clusters.

Importing ``p2pkv`` is cheap: the identity and the errors load at once; everything that
needs torch or ZeroMQ (the pool, the store, the node) loads on first use, so the pure
protocol core (``p2pkv.protocol``) can be used without either.
"""

from __future__ import annotations

import importlib
from typing import Any

from p2pkv.errors import (
    ConfigError,
    LocalLimitExceeded,
    LocalProtocolError,
    P2PKVError,
    P2PKVProtocolError,
    PeerGone,
    PeerIncompatible,
    PeerTimeout,
    ProtocolError,
    StoreFullError,
    TransferFailed,
    TransportHandshakeFailed,
)
from p2pkv.identity import FieldDiff, IdentityExtension, RunConfig, diff

__version__ = "0.1.0"

# Public name -> defining module, imported lazily (PEP 562).
_LAZY: dict[str, str] = {
    "KeyOutcome": "p2pkv.node",
    "Node": "p2pkv.node",
    "NodeConfig": "p2pkv.node",
    "PeerHandle": "p2pkv.node",
    "FetchResult": "p2pkv.node",
    "KVGeometry": "p2pkv.layout",
    "Layout": "p2pkv.layout",
    "make_layout": "p2pkv.layout",
    "BlockPool": "p2pkv.store.pool",
    "BlockStore": "p2pkv.store",
    "block_keys": "p2pkv.keys",
}

__all__ = [
    "ConfigError",
    "FieldDiff",
    "IdentityExtension",
    "LocalLimitExceeded",
    "LocalProtocolError",
    "P2PKVError",
    "P2PKVProtocolError",
    "PeerGone",
    "PeerIncompatible",
    "PeerTimeout",
    "ProtocolError",
    "RunConfig",
    "StoreFullError",
    "TransferFailed",
    "TransportHandshakeFailed",
    "__version__",
    "diff",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""Refusal reports: how a refused handshake is shown, in one place (and which typed
error a refused handshake or a failed request becomes).

Used by the node (the :class:`~p2pkv.errors.PeerIncompatible` it raises and the names
its stats count refusals under), by ``p2pkv-node probe`` (the table and the JSON) and by
the demo. Each reason is one differing field, seen from the node that reports it:
``LOCAL`` is this node's value, ``REMOTE`` the peer's, ``(absent)`` a run-config key
that one side does not write. Pure: no IO.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

from p2pkv import protocol as proto
from p2pkv.errors import (
    P2PKVError,
    PeerGone,
    PeerIncompatible,
    PeerTimeout,
    ProtocolError,
    TransferFailed,
)
from p2pkv.identity import ABSENT, FieldDiff, diff
from p2pkv.protocol.codes import CodeFamily, code_family

__all__ = [
    "ABSENT_TEXT",
    "cell",
    "incompatible",
    "own_view",
    "plain",
    "reason_dict",
    "reason_name",
    "refusal_error",
    "refusal_table",
    "remote_identity",
    "request_error",
    "show",
]

ABSENT_TEXT = "(absent)"
_CELL_WIDTH = 40


def show(value: Any) -> str:
    """One compact cell: ``(absent)``, ``12 × 49152`` for a list of equal ints,
    ``[2 × 4096, 512]`` for runs in a list of ints, JSON otherwise."""
    if value is ABSENT or (isinstance(value, dict) and value == {"absent": True}):
        return ABSENT_TEXT
    if (isinstance(value, (list, tuple)) and len(value) > 1
            and all(type(v) is int for v in value)):
        runs: list[list[int]] = []
        for v in value:
            if runs and runs[-1][1] == v:
                runs[-1][0] += 1
            else:
                runs.append([1, v])
        parts = [f"{n} × {v}" if n > 1 else str(v) for n, v in runs]
        return parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return json.dumps(value, sort_keys=True, default=str)


def plain(value: Any) -> Any:
    """A reason value for JSON: :data:`~p2pkv.identity.ABSENT` becomes ``"(absent)"``."""
    return ABSENT_TEXT if value is ABSENT else value


def cell(value: Any) -> str:
    """A :func:`plain` value (as it comes back from JSON) shown as a table cell."""
    return ABSENT_TEXT if value == ABSENT_TEXT else show(value)


def refusal_table(reasons: Sequence[Any]) -> str:
    """A fixed-width table of refusal reasons: field, ours, theirs, meaning.

    Field names are never cut; a value longer than its column is cut and ends with
    ``…``, so a cut is visible.
    """
    rows = [("FIELD", "LOCAL", "REMOTE", "MEANING")]
    for r in reasons:
        rows.append((r.field, show(r.ours), show(r.theirs), r.meaning))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    widths[1:] = [min(_CELL_WIDTH, w) for w in widths[1:]]
    lines = []
    for row in rows:
        cells = [(row[i] if len(row[i]) <= widths[i] else row[i][: widths[i] - 1] + "…")
                 .ljust(widths[i]) for i in range(3)]
        lines.append("  ".join([*cells, row[3]]).rstrip())
    return "\n".join(lines)


def reason_dict(reason: Any) -> dict[str, Any]:
    """One reason as ``p2pkv-node probe --json`` writes it."""
    return {"code": int(reason.code), "field": reason.field,
            "local": None if reason.ours is ABSENT else reason.ours,
            "local_absent": reason.ours is ABSENT,
            "remote": None if reason.theirs is ABSENT else reason.theirs,
            "remote_absent": reason.theirs is ABSENT, "meaning": reason.meaning}


def remote_identity(exc: PeerIncompatible) -> dict[str, Any]:
    """What the refused peer said about itself (node, fingerprint, run config), if anything."""
    remote = getattr(exc, "remote", None)
    return dict(remote) if isinstance(remote, dict) else {}


def reason_name(code: int) -> str:
    """The name a refusal is counted under in the node's stats (``fingerprint`` ...)."""
    try:
        return proto.Code(code).name.lower()
    except ValueError:
        return f"code_{code}"


def own_view(local: proto.Hello, refuse: proto.Refuse) -> list[proto.Reason]:
    """The reasons of a peer's refusal decided again from this side (so that "local",
    "remote" and the meanings read right), when the peer said who it is."""
    return list(proto.restate(local, refuse))


def incompatible(address: str, local: proto.Hello,
                 ev: proto.HandshakeRefused) -> PeerIncompatible:
    """The error a refused handshake with ``address`` fails its ``connect`` with."""
    who = f"{address} refused this node" if ev.by_remote else f"this node refused {address}"
    reasons = list(ev.reasons)
    remote = ev.remote
    if ev.by_remote and isinstance(remote, proto.Refuse):
        # The peer's reasons are phrased from its side; when it told us who it is,
        # decide again from ours so "local"/"remote" and the meanings read right.
        reasons = own_view(local, remote) or reasons
    lines = [f"{who}: {len(reasons)} difference(s)"]
    lines += [f"  - {r.describe()}" for r in reasons]
    remote_info: dict[str, Any] = {}
    field_diff: list[FieldDiff] = []
    if remote is not None:
        remote_info = {"node": remote.node, "fp": remote.fp, "rc": remote.rc,
                       "ext": remote.ext.to_wire() if remote.ext is not None else {}}
        if isinstance(remote.rc, dict):
            field_diff = diff(local.rc, remote.rc)
    exc = PeerIncompatible("\n".join(lines), reasons=reasons, diff=field_diff)
    exc.remote = remote_info
    return exc


_TIMEOUTS: Final = frozenset({proto.Code.PEER_TIMEOUT, proto.Code.TIMEOUT})
_DECLINED: Final = frozenset({proto.Code.OUT_OF_BOUNDS, proto.Code.TOO_MANY_IN_FLIGHT,
                              proto.Code.UNAVAILABLE})
"""Codes of a request the peer turned down; the connection stays up."""


def timeout_error(address: str, ev: proto.RequestTimedOut, blocks: int | None) -> PeerTimeout:
    """The error of a request its session timed out: its caller's deadline for the whole
    request (``ev.overall``; ``blocks``: a fetch's keys, None for a lookup) or its
    progress deadline."""
    if not ev.overall:
        return PeerTimeout(f"{address} made no progress on request {ev.req} ({ev.kind}) "
                           "within its deadline")
    if blocks is not None:
        return PeerTimeout(f"fetch of {blocks} blocks from {address} did not finish within "
                           "its deadline")
    return PeerTimeout(f"{ev.kind} on {address} not answered within its deadline")


def request_error(address: str, ev: proto.RequestFailed) -> P2PKVError:
    """The typed error for a request the session failed, chosen by its code."""
    text = f"{address}: request {ev.req} failed: {ev.msg} [{proto.code_name(ev.code)}]"
    if ev.code in _TIMEOUTS:
        return PeerTimeout(text)
    if code_family(ev.code) in (CodeFamily.REFUSAL, CodeFamily.CLOSE):
        # The connection ended: refused (PeerIncompatible is raised only by the
        # handshake itself, with its reasons) or closed.
        return PeerGone(text)
    if ev.code in _DECLINED:
        return TransferFailed(text)
    return ProtocolError(ev.code, text)


def refusal_error(address: str, hello: proto.Hello, ev: proto.HandshakeRefused) -> P2PKVError:
    """A refused handshake's error: PeerIncompatible with its reasons, or, refused for a
    protocol violation (a malformed or unexpected greeting), a ProtocolError."""
    if ev.reasons:
        return incompatible(address, hello, ev)
    who = "refused by" if ev.by_remote else "refused"
    return ProtocolError(ev.code, f"handshake {who} {address}: {ev.msg} "
                         f"[{proto.code_name(ev.code)}]")

"""The rules both directions of a connection obey, each written once, with no IO
(``protocol/SPEC.md``: §7 requests, §9 blocks and windows, §10 done, §12 checksums,
§16 ``shm-v1``, §17 ``packed-v1``).

A rule here is a check that answers with what is broken, as a :class:`Broken` (the
protocol code and the text), or None. The same check runs on what the peer sends (the
rows of :data:`~p2pkv.protocol.transitions.TRANSITIONS` turn a break into a violation:
``bye`` with the code, the state to ERROR) and on what this node is about to send (the
session's calls turn it into :class:`~p2pkv.errors.LocalProtocolError`, or
``ValueError`` for a bad argument), so the two sides cannot drift apart.

Capabilities are data: :data:`FIELD_CAPABILITIES` says which field of which message
needs which capability, and :func:`field_break` checks a message against the set the
two sides *negotiated*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from p2pkv.protocol.codes import (
    CAP_CHECKSUM_XXH3_64,
    CAP_PACKED_V1,
    CAP_PENDING_V1,
    CAP_TCP_STREAMS_V1,
    OUTCOME_SENT,
    U64_MAX,
    Code,
)
from p2pkv.protocol.messages import Message
from p2pkv.protocol.requests import Request

__all__ = [
    "FIELD_CAPABILITIES",
    "Broken",
    "FieldCapability",
    "field_break",
    "indices_break",
    "outcomes_break",
    "sums_break",
    "window_break",
]


@dataclass(frozen=True, slots=True)
class Broken:
    """What a message or a call breaks: the protocol code and why."""

    code: int
    text: str


@dataclass(frozen=True, slots=True)
class FieldCapability:
    """A field of a message that needs a capability. ``exactly``: the field must be set
    exactly when the capability was negotiated (a block's checksums); otherwise it may
    be set only then (a packed block)."""

    field: str
    capability: str
    #: What the field set means, in a violation's text.
    what: str
    exactly: bool = False


FIELD_CAPABILITIES: Final[dict[str, tuple[FieldCapability, ...]]] = {
    "block": (FieldCapability("pk", CAP_PACKED_V1, "packed block"),
              FieldCapability("sums", CAP_CHECKSUM_XXH3_64, "checksum", exactly=True)),
    "located": (FieldCapability("sums", CAP_CHECKSUM_XXH3_64, "checksum", exactly=True),),
    "fetch": (FieldCapability("stream", CAP_TCP_STREAMS_V1, "fetch naming a stream"),),
    "hits": (FieldCapability("due", CAP_PENDING_V1, "lookup answer with pending keys"),),
}
"""Which fields of which message need a capability. The offers a greeting carries
(``welcome.shm``, ``welcome.data``) and a fetch's ``shm`` are not here: they are ignored,
not refused, unless their capability was negotiated (§4.1, §16.4, §18.1)."""


def _is_set(value: object) -> bool | None:
    """Whether a field counts as set; None when it is neither wholly set nor unset (a
    checksum list with some entries missing)."""
    if isinstance(value, tuple):
        missing = value.count(None)  # one C loop: this runs for every block message
        if not missing:
            return True
        return False if missing == len(value) else None
    return bool(value)


def field_break(msg: Message, negotiated: frozenset[str]) -> Broken | None:
    """Whether ``msg`` (from the peer, or about to be sent) breaks a capability rule
    against the ``negotiated`` capabilities."""
    tag = msg.TAG
    for rule in FIELD_CAPABILITIES.get(tag, ()):
        has = rule.capability in negotiated
        value = _is_set(getattr(msg, rule.field))
        if rule.exactly:
            if has and value is not True:
                return Broken(Code.WRONG_TYPE, f"{tag} without {rule.what} "
                              f"({rule.capability} was negotiated)")
            if not has and value is not False:
                return Broken(Code.WRONG_TYPE, f"{tag} with {rule.what} "
                              f"({rule.capability} was not negotiated)")
        elif value and not has:
            return Broken(Code.UNEXPECTED, f"{rule.what} ({rule.capability} was not "
                          "negotiated)")
    return None


def indices_break(r: Request, req: int, idx: Sequence[int]) -> Broken | None:
    """A block (or located) header's indices: at least one, each a key of the request,
    each delivered once (also within the message). The indices are ints (the codec
    checked a peer's, the session a local call's); the checks run as set operations,
    since every block message passes them."""
    if not idx:
        return Broken(Code.OUT_OF_BOUNDS, f"block for request {req} names no block")
    nkeys = len(r.keys)
    fresh = set(idx)
    if min(idx) >= 0 and max(idx) < nkeys and len(fresh) == len(idx) \
            and r.delivered.isdisjoint(fresh):
        return None
    seen: set[int] = set()
    for i in idx:  # the first index at fault, for the message
        if not 0 <= i < nkeys:
            return Broken(Code.OUT_OF_BOUNDS, f"block index {i} is not a key of request "
                          f"{req}")
        if i in r.delivered or i in seen:
            return Broken(Code.OUT_OF_BOUNDS, f"block index {i} was already delivered for "
                          f"request {req}")
        seen.add(i)
    raise AssertionError("unreachable: some index is at fault")


def window_break(r: Request, req: int, n: int, verb: str = "arrived") -> Broken | None:
    """``n`` more blocks of fetch ``req`` (that ``verb``: arrived, or are sent) must
    fit the credit granted so far."""
    if r.received + n > r.granted:
        return Broken(Code.WINDOW_EXCEEDED, f"request {req}: {r.received + n} blocks "
                      f"{verb}, {r.granted} granted")
    return None


def sums_break(sums: Sequence[int | None]) -> Broken | None:
    """Every checksum a u64 (whether there must be one is a capability rule)."""
    for s in sums:
        if s is not None and (type(s) is not int or not 0 <= s <= U64_MAX):
            return Broken(Code.WRONG_TYPE, f"checksum {s!r} is not a u64")
    return None


def outcomes_break(r: Request, req: int, outcomes: Sequence[int]) -> Broken | None:
    """A ``done``: one outcome per key, each 0, 1 or 2, and OUTCOME_SENT exactly for
    the blocks that were delivered."""
    if len(outcomes) != len(r.keys):
        return Broken(Code.OUT_OF_BOUNDS, f"done: {len(outcomes)} outcomes for "
                      f"{len(r.keys)} keys (request {req})")
    if len(r.delivered) == len(outcomes) == outcomes.count(OUTCOME_SENT) and \
            set(map(type, outcomes)) == {int}:
        return None  # every block sent and delivered (a bulk fetch): no step per key
    for i, o in enumerate(outcomes):
        if type(o) is not int or not 0 <= o <= 2:
            return Broken(Code.WRONG_TYPE, f"done: outcome {i} must be 0, 1 or 2, got {o!r}")
        if (o == OUTCOME_SENT) != (i in r.delivered):
            return Broken(Code.OUT_OF_BOUNDS, f"done: outcome {i} is {o} but block {i} "
                          f"{'arrived' if i in r.delivered else 'never arrived'} "
                          f"(request {req})")
    return None

"""The handshake decision: may these two nodes exchange blocks? (``protocol/SPEC.md``).

:func:`decide` is pure and total: it compares two greetings and returns every reason to
refuse at once, each naming the field, both values and what the difference means, so
whoever debugs a refused peer sees all of it in one log line. Both sides run the same
function (the server on ``hello``, the client on ``welcome``).

The identity extension (protocol 1.1) adds one reason per differing field. A field only
one side declares refuses under the ``strict`` identity policy and becomes a warning
under ``lenient`` (a 1.0 peer declares nothing, so this is also how 1.0 peers are
treated); ``engine`` never refuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from p2pkv.identity import (
    ABSENT,
    IDENTITY_POLICIES,
    IdentityExtension,
    RunConfig,
    diff,
    extension_diff,
    fingerprint_of,
)
from p2pkv.protocol.codes import Code
from p2pkv.protocol.messages import Geometry, Greeting, Reason, Refuse, Welcome

__all__ = ["EXTENSION_CODES", "Decision", "Reason", "decide", "layout_label", "restate"]

EXTENSION_CODES: dict[str, Code] = {
    "kv_memory_layout": Code.KV_MEMORY_LAYOUT_MISMATCH,
    "model_revision": Code.MODEL_REVISION_MISMATCH,
    "model_overrides": Code.MODEL_OVERRIDES_MISMATCH,
    "key_hash": Code.ENGINE_KEY_HASH_MISMATCH,
    "model_weights": Code.MODEL_WEIGHTS_MISMATCH,
    "model_config": Code.MODEL_CONFIG_MISMATCH,
}
"""The refusal code of each extension field whose values differ; a field declared on
one side only is ``EXTENSION_UNDECLARED``."""
_NO_EXTENSION = IdentityExtension()


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of :func:`decide`, seen from the local node.

    ``accepted`` is true exactly when ``reasons`` is empty; ``capabilities`` is the
    negotiated set (the intersection of both offers). ``warnings`` are the extension
    fields only one side declares that the ``lenient`` identity policy let through
    (code ``EXTENSION_UNDECLARED``), for the node to log and count.
    """

    accepted: bool
    reasons: tuple[Reason, ...]
    capabilities: frozenset[str]
    warnings: tuple[Reason, ...] = ()

    @property
    def code(self) -> int:
        """The code of the first (most fundamental) reason; 0 when accepted."""
        return int(self.reasons[0].code) if self.reasons else 0

    def summary(self) -> str:
        """One line: ``"refused: fingerprint, run_config.parallel_agnostic, ..."``."""
        if self.accepted:
            return "accepted"
        fields = list(dict.fromkeys(r.field for r in self.reasons))
        return f"refused ({len(self.reasons)} reason(s)): {', '.join(fields)}"

    def refusal(self, local: Greeting) -> Refuse:
        """The ``refuse`` message that tells the peer every reason, with our identity."""
        return Refuse(
            code=self.code,
            msg=self.summary(),
            reasons=self.reasons,
            node=local.node,
            rc=local.rc,
            fp=local.fp,
            geo=local.geo,
            khash=local.khash,
            ext=local.ext,
        )


def layout_label(rc: object) -> str:
    """``"V1 cross-layer"`` for a parallel-agnostic run config, ``"V2 per-layer"`` otherwise."""
    if not isinstance(rc, Mapping):
        return "unknown layout"
    return "V2 per-layer" if "parallel_agnostic" in rc else "V1 cross-layer"


def _describe_geometry(rc: object, geo: Geometry) -> str:
    return f"{layout_label(rc)} ({geo.describe()})"


def _run_config_reasons(local: Greeting, remote: Greeting) -> list[Reason]:
    out: list[Reason] = []
    valid = True
    try:
        RunConfig.from_run_config(remote.rc)
    except ValueError as exc:
        valid = False
        out.append(Reason(
            Code.RUN_CONFIG_INVALID, "run_config", None, None,
            f"the peer's run config breaks the identity rules: {exc}",
        ))
    if valid:
        try:
            computed = fingerprint_of(remote.rc)
        except (TypeError, ValueError) as exc:  # not JSON-serialisable: only from local misuse
            computed = f"<unhashable: {exc}>"
        if computed != remote.fp:
            out.append(Reason(
                Code.FINGERPRINT_FORGED, "fingerprint", computed, remote.fp,
                f"the peer's run config hashes to {computed}, not to the fingerprint "
                f"{remote.fp} it claims",
            ))
    if local.fp != remote.fp:
        out.append(Reason(
            Code.FINGERPRINT_MISMATCH, "fingerprint", local.fp, remote.fp,
            "run configurations differ: the KV caches are not interchangeable",
        ))
    if isinstance(remote.rc, Mapping):
        for d in diff(local.rc, remote.rc):
            out.append(Reason(
                Code.FINGERPRINT_MISMATCH, f"run_config.{d.field}", d.local, d.remote, d.meaning
            ))
    return out


def _extension_reasons(local: Greeting, remote: Greeting) -> list[Reason]:
    """One reason per refusal-relevant extension field that differs (SPEC 5, row 11)."""
    out: list[Reason] = []
    lext = local.ext or _NO_EXTENSION
    rext = remote.ext or _NO_EXTENSION
    for d in extension_diff(lext, rext):
        meaning = d.meaning
        one_sided = d.local is ABSENT or d.remote is ABSENT
        if one_sided and ((remote.minor == 0 and d.remote is ABSENT)
                          or (local.minor == 0 and d.local is ABSENT)):
            meaning = (
                f"the node without ext.{d.field} speaks protocol 1.0, which has no identity "
                "extension, so nothing proves the KV caches interchangeable: upgrade it, or "
                "accept it with identity_policy = \"lenient\""
            )
        code = Code.EXTENSION_UNDECLARED if one_sided else EXTENSION_CODES[d.field]
        out.append(Reason(code, f"ext.{d.field}", d.local, d.remote, meaning))
    return out


def decide(
    local: Greeting,
    remote: Greeting,
    *,
    required: Iterable[str] = (),
    identity_policy: str = "strict",
) -> Decision:
    """Compare the local greeting with the peer's; every difference becomes a reason.

    Checks, in this order: protocol major; the peer's run config is valid and hashes to
    the fingerprint it claims; fingerprints (plus one reason per differing run-config
    field); bytes per block; segment list; key-hash algorithm; key-hash seed; the
    capabilities in ``required`` are offered by the peer; each identity-extension field
    (a field declared on one side only refuses under ``identity_policy="strict"`` and is
    returned in ``Decision.warnings`` under ``"lenient"``). ``ours``/``theirs`` of every
    reason are the local and the remote value.
    """
    if identity_policy not in IDENTITY_POLICIES:
        raise ValueError(f"identity_policy must be one of {', '.join(IDENTITY_POLICIES)}, "
                         f"got {identity_policy!r}")
    reasons: list[Reason] = []
    if local.v != remote.v:
        reasons.append(Reason(
            Code.PROTOCOL_MAJOR_MISMATCH, "protocol.major", local.v, remote.v,
            f"this node speaks protocol major {local.v}, the peer speaks {remote.v}",
        ))
    reasons.extend(_run_config_reasons(local, remote))
    lg, rg = local.geo, remote.geo
    if lg.bpb != rg.bpb:
        reasons.append(Reason(
            Code.BLOCK_BYTES_MISMATCH, "geometry.bytes_per_block", lg.bpb, rg.bpb,
            f"blocks are {lg.bpb} bytes here and {rg.bpb} bytes on the peer",
        ))
    if lg.seg != rg.seg:
        same_size = " (same bytes per block, different byte order)" if lg.bpb == rg.bpb else ""
        reasons.append(Reason(
            Code.SEGMENTS_MISMATCH, "geometry.segments", list(lg.seg), list(rg.seg),
            f"{_describe_geometry(local.rc, lg)} vs {_describe_geometry(remote.rc, rg)}"
            f"{same_size}",
        ))
    lk, rk = local.khash, remote.khash
    if lk.algo != rk.algo:
        reasons.append(Reason(
            Code.KEY_HASH_ALGO_MISMATCH, "key_hash.algo", lk.algo, rk.algo,
            "block keys are hashed with different algorithms: no key would ever match",
        ))
    if lk.seed != rk.seed:
        reasons.append(Reason(
            Code.KEY_HASH_SEED_MISMATCH, "key_hash.seed", lk.seed, rk.seed,
            "block keys are hashed with different seeds: no key would ever match",
        ))
    offered = frozenset(remote.caps)
    for cap in sorted(frozenset(required) - offered):
        reasons.append(Reason(
            Code.CAPABILITY_MISSING, "capabilities", cap, sorted(offered),
            f"this node requires capability {cap!r}, which the peer does not offer",
        ))
    warnings: list[Reason] = []
    for reason in _extension_reasons(local, remote):
        lenient = identity_policy == "lenient" and reason.code == Code.EXTENSION_UNDECLARED
        (warnings if lenient else reasons).append(reason)
    return Decision(
        accepted=not reasons,
        reasons=tuple(reasons),
        capabilities=frozenset(local.caps) & offered,
        warnings=tuple(warnings),
    )


def restate(local: Greeting, refuse: Refuse) -> tuple[Reason, ...]:
    """The reasons of a peer's ``refuse``, seen from the local node.

    The peer phrases its reasons from its side. When it said who it is, the decision is
    taken again from ours (every difference, strict policy) and kept for the fields the
    peer cited, so "ours"/"theirs" and the meanings read right here; a cited reason this
    node cannot reproduce (a capability the peer requires, a field only a newer peer
    knows) is kept as the peer sent it, values swapped.
    """
    theirs = [r.swapped() for r in refuse.reasons]
    if (refuse.node is None or refuse.rc is None or refuse.fp is None or refuse.geo is None
            or refuse.khash is None):
        return tuple(theirs)
    remote = Welcome(refuse.node, local.minor, refuse.rc, refuse.fp, refuse.geo,
                     refuse.khash, local.caps, ext=refuse.ext)
    if not refuse.reasons:  # a refusal without reasons (a violation): show every difference
        return decide(local, remote).reasons
    cited = {r.field for r in refuse.reasons}
    mine = [r for r in decide(local, remote).reasons if r.field in cited]
    seen = {r.field for r in mine}
    return tuple([*mine, *(r for r in theirs if r.field not in seen)])


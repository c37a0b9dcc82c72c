"""What ``p2pkv-node cluster`` shows: nodes grouped by identity, and why groups refuse.

Groups are the directory's partitions (fingerprint plus identity-extension digest).
For every pair of groups the handshake decision of their first live members is
computed offline from the registered greetings (:func:`p2pkv.protocol.decide`, the
same field-level reasons a ``probe`` prints). Inside a group, a member whose greeting
would still be refused by the group's first member (another block geometry or key-hash
seed under the same fingerprint) is listed with its reasons too.

Quarantine: each live member publishes the holders it keeps in quarantine
(:mod:`p2pkv.cluster.verdicts`); every member is shown with who quarantines it (matched
by the address it registered), and verdicts naming an address no member registered are
listed on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pkv.cluster.records import QuarantineReport
from p2pkv.cluster.redis_directory import DirectoryView, MemberView
from p2pkv.protocol import Reason, decide, layout_label
from p2pkv.protocol.codes import Code

__all__ = ["GroupDiff", "MemberDiff", "compare_groups", "extension_reason",
           "quarantined_by"]


@dataclass(frozen=True)
class GroupDiff:
    """Group ``a`` vs group ``b``: the reasons ``a``'s node would refuse ``b``'s."""

    a: str
    b: str
    reasons: tuple[Reason, ...]


@dataclass(frozen=True)
class MemberDiff:
    """A member that the first member of its own group would refuse."""

    partition: str
    member: int
    reasons: tuple[Reason, ...]


def extension_reason(ours: str, theirs: str) -> Reason:
    """The refusal reason for two different identity-extension digests."""
    return Reason(Code.FINGERPRINT_MISMATCH, "identity_extension", ours or None,
                  theirs or None, "identity extensions differ: the KV caches are not "
                  "interchangeable")


def _representative(members: list[MemberView]) -> MemberView | None:
    with_record = [m for m in members if m.record is not None]
    alive = [m for m in with_record if m.alive]
    chosen = alive or with_record
    return chosen[0] if chosen else None


def _reasons(a: MemberView, b: MemberView) -> tuple[Reason, ...]:
    assert a.record is not None and b.record is not None
    reasons = list(decide(a.record.greeting(), b.record.greeting()).reasons)
    if a.record.extension != b.record.extension:
        reasons.append(extension_reason(a.record.extension, b.record.extension))
    return tuple(reasons)


def compare_groups(view: DirectoryView) -> tuple[list[GroupDiff], list[MemberDiff]]:
    """Pairwise refusal reasons between groups, and members refused inside their group."""
    reps = {p: _representative(ms) for p, ms in view.partitions.items()}
    names = [p for p in sorted(reps) if reps[p] is not None]
    groups = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = reps[a], reps[b]
            assert ra is not None and rb is not None
            groups.append(GroupDiff(a, b, _reasons(ra, rb)))
    inside = []
    for p, members in sorted(view.partitions.items()):
        rep = reps[p]
        if rep is None:
            continue
        for m in members:
            if m is rep or m.record is None:
                continue
            reasons = _reasons(rep, m)
            if reasons:
                inside.append(MemberDiff(p, m.member, reasons))
    return groups, inside


def quarantined_by(view: DirectoryView) -> tuple[dict[str, list[dict[str, Any]]],
                                                  list[dict[str, Any]]]:
    """Who quarantines whom: registered address -> the verdicts naming it (each with
    the reporting member and its partition), and the verdicts naming an address that no
    member registered."""
    registered = {m.record.address for ms in view.partitions.values() for m in ms
                  if m.record is not None}
    by_address: dict[str, list[dict[str, Any]]] = {}
    elsewhere: list[dict[str, Any]] = []
    for p, members in sorted(view.partitions.items()):
        for m in members:
            for r in m.reports:
                entry = _verdict_dict(p, m, r)
                if r.address in registered:
                    by_address.setdefault(r.address, []).append(entry)
                else:
                    elsewhere.append({"address": r.address, "node_id": r.node_id, **entry})
    return by_address, elsewhere


def _verdict_dict(partition: str, reporter: MemberView, r: QuarantineReport) -> dict[str, Any]:
    return {"member": reporter.member, "partition": partition,
            "reporter_node_id": reporter.record.node_id if reporter.record else None,
            "reason": r.reason, "times": r.times, "expires_in": round(r.expires_in, 3)}


def report(view: DirectoryView) -> dict[str, Any]:
    """The ``cluster --json`` document."""
    groups, inside = compare_groups(view)
    verdicts, elsewhere = quarantined_by(view)
    out_groups = []
    for p, members in sorted(view.partitions.items()):
        rep = _representative(members)
        rec = rep.record if rep is not None else None
        out_groups.append({
            "partition": p,
            "fingerprint": rec.fingerprint if rec else p.partition("+")[0],
            "extension": rec.extension if rec else p.partition("+")[2],
            "model": rec.run_config.get("model_name") if rec else None,
            "layout": layout_label(rec.run_config) if rec else None,
            "alive": sum(1 for m in members if m.alive),
            "blocks": sum(m.blocks for m in members if m.alive),
            "quarantined": sum(1 for m in members if m.record is not None
                               and m.record.address in verdicts),
            "nodes": [_member_dict(m, verdicts) for m in members],
        })
    return {
        "groups": out_groups,
        "refusals": [{"a": g.a, "b": g.b, "compatible": not g.reasons,
                      "reasons": [_reason_dict(r) for r in g.reasons]} for g in groups],
        "refused_inside_group": [{"partition": d.partition, "member": d.member,
                                  "reasons": [_reason_dict(r) for r in d.reasons]}
                                 for d in inside],
        "quarantined_unregistered": elsewhere,
    }


def _member_dict(m: MemberView, verdicts: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rec = m.record
    return {
        "member": m.member, "node_id": rec.node_id if rec else None,
        "address": rec.address if rec else None, "rank": rec.rank if rec else None,
        "pool_blocks": rec.pool_blocks if rec else None, "blocks": m.blocks,
        "alive": m.alive, "expires_in": round(m.expires_in, 3),
        "capabilities": list(rec.capabilities) if rec else [], "error": m.error,
        "quarantined_by": verdicts.get(rec.address, []) if rec else [],
    }


def _reason_dict(r: Reason) -> dict[str, Any]:
    from p2pkv.identity import ABSENT

    return {"code": int(r.code), "field": r.field,
            "local": None if r.ours is ABSENT else r.ours, "local_absent": r.ours is ABSENT,
            "remote": None if r.theirs is ABSENT else r.theirs,
            "remote_absent": r.theirs is ABSENT, "meaning": r.meaning}


def render(view: DirectoryView, table: Any) -> str:
    """The text form; ``table`` renders a list of reasons (the CLI's refusal table)."""
    doc = report(view)
    groups, inside = compare_groups(view)
    lines: list[str] = []
    if not doc["groups"]:
        return "no nodes registered"
    for g in doc["groups"]:
        ext = f"  extension {g['extension']}" if g["extension"] else ""
        quarantined = f", {g['quarantined']} quarantined" if g["quarantined"] else ""
        lines.append(f"group {g['partition']}  fingerprint {g['fingerprint']}{ext}  "
                     f"model {g['model']}  {g['layout']}  {g['alive']} alive, "
                     f"{g['blocks']} blocks{quarantined}")
        rows = [("MEMBER", "NODE", "ADDRESS", "RANK", "BLOCKS", "POOL", "QUARANTINED BY",
                 "LIVENESS")]
        for n in g["nodes"]:
            live = (f"alive (expires in {n['expires_in']:.1f}s)" if n["alive"]
                    else f"expired {-n['expires_in']:.1f}s ago")
            if n["error"]:
                live += f" ({n['error']})"
            rows.append((str(n["member"]), str(n["node_id"]), str(n["address"]),
                         str(n["rank"]), str(n["blocks"]), str(n["pool_blocks"]),
                         _verdicts_text(n["quarantined_by"]) or "-", live))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            lines.append("  " + "  ".join([c.ljust(w) for c, w in zip(r, widths,
                                                                       strict=False)]
                                          + [r[-1]]).rstrip())
        lines.append("")
    for gd in groups:
        if not gd.reasons:
            lines.append(f"{gd.a} and {gd.b}: compatible")
            continue
        lines.append(f"{gd.a} would refuse {gd.b} (LOCAL = {gd.a}, REMOTE = {gd.b}):")
        lines.append(table(gd.reasons))
        lines.append("")
    for md in inside:
        lines.append(f"member {md.member} of {md.partition} would be refused inside its group:")
        lines.append(table(md.reasons))
        lines.append("")
    for v in doc["quarantined_unregistered"]:
        lines.append(f"{v['address']} (registered by no member) quarantined by "
                     + _verdicts_text([v]))
    return "\n".join(lines).rstrip()


def _verdicts_text(verdicts: list[dict[str, Any]]) -> str:
    """``member 5 (failed blocks, 2x, 3.1s left); ...``"""
    return "; ".join(f"member {v['member']} ({v['reason']}, {v['times']}x, "
                     f"{v['expires_in']:.1f}s left)" for v in verdicts)

"""A caller's fetch as protocol fetches: one per lane of the connection's data path.

A path with several lanes (several data streams, ``tcp-streams-v1``) gets each caller's
fetch striped over them: the wanted keys are cut into one contiguous part per lane, and
each part is a protocol fetch of its own that names its lane's stream, so that each
stream carries its part's blocks and its ``done`` in order. The parts share the caller's
future, outcomes and errors (:attr:`~p2pkv.runtime.state.Receiving.group`); the fetch is
over when every part is, and fails as a whole when one part fails. A path of one lane
(every other path) gets one protocol fetch, as it always did.

IO thread only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from p2pkv import protocol as proto
from p2pkv.runtime.paths.interfaces import FetchPath
from p2pkv.runtime.state import Receiving

__all__ = ["open_lanes", "parts_of", "take_others"]


def parts_of(wanted: Sequence[int], lanes: int) -> list[list[int]]:
    """``wanted`` cut into at most ``lanes`` contiguous, non-empty parts of equal size
    (to within one)."""
    n = max(1, min(lanes, len(wanted)))
    return [list(wanted[i * len(wanted) // n:(i + 1) * len(wanted) // n]) for i in range(n)]


def open_lanes(session: proto.Session, path: FetchPath, keys: Sequence[bytes],
               wanted: Sequence[int], running: list[proto.FetchCredit], now: float,
               deadline: float, opened: Callable[[Callable[[], proto.Fetch]], proto.Fetch]
               ) -> list[tuple[proto.Fetch, list[int]]]:
    """Open the protocol fetches of a caller's fetch of ``keys[i] for i in wanted``: the
    messages to send and each one's part of ``wanted``. ``opened`` runs one opening (and
    raises what the caller must see). All or none: when one cannot open, those opened
    already are withdrawn (they were never sent)."""
    parts = parts_of(wanted, path.lanes)
    if len(parts) == 1:
        # One credit budget per peer, shared by all its fetches: it bounds the data
        # queued towards this node, and so how long a lookup answer can wait behind it.
        windows = [path.budget.opening_window(running, len(wanted))]
    else:
        share = path.budget.free(running) // len(parts)  # each lane its share at once
        windows = [max(1, min(share, len(part))) for part in parts]
    out: list[tuple[proto.Fetch, list[int]]] = []
    try:
        for lane, (part, window) in enumerate(zip(parts, windows, strict=True)):
            part_keys = (tuple(keys) if len(part) == len(keys) else
                         tuple(keys[i] for i in part))
            msg = opened(functools.partial(path.open_fetch, session, part_keys, window, now,
                                           deadline, lane))
            out.append((msg, part))
    except BaseException:
        for msg, _ in out:
            session.withdraw(msg.req)
        raise
    return out


def take_others(recv: Receiving, running: dict[int, Receiving]) -> list[Receiving]:
    """The other parts of ``recv``'s caller's fetch that are still ``running``, taken
    out of it (none when it was not striped): its caller is told once, for all."""
    if recv.group is None:
        return []
    return [r for r in recv.group
            if r is not recv and running.pop(r.req, None) is not None]

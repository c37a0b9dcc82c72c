"""Flow control decisions, with no IO (``protocol/SPEC.md``, "Flow control").

A fetch carries a credit window, in blocks; the receiver grants more credit as blocks
land. What is decided here, and nowhere else:

* the receiver's **per-peer credit budget**: every fetch from one peer shares one budget
  of ``window`` blocks in flight, so the data queued towards this node (and so how long
  a lookup answer can wait behind it) is bounded by one window, whatever the number of
  fetches. :class:`CreditBudget` says how much a new fetch may open with and how much
  credit to grant to which fetch as blocks arrive.
* the sender's **batching**: how many blocks go into one message (:func:`batch_limit`)
  and which blocks of a served fetch go next (:func:`next_batch`).

The counts come from the session (:meth:`p2pkv.protocol.Session.fetch_credit` on the
receiving side, :meth:`~p2pkv.protocol.Session.window_left` on the sending side), which
also enforces the window on the wire; nothing here keeps its own copy of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from p2pkv.protocol.codes import MAX_BLOCKS_PER_MESSAGE

__all__ = [
    "BATCH_BYTES",
    "CreditBudget",
    "FetchCredit",
    "batch_limit",
    "next_batch",
    "window_blocks",
]

BATCH_BYTES: Final = 1 << 20
"""Small blocks share one message up to this many payload bytes (fewer headers, fewer
syscalls); large blocks always travel one per message."""

_MIN_WINDOW: Final = 2
"""A window of two blocks keeps one block on the wire while the other lands."""

_MIN_CREDIT_BATCH: Final = 64
"""Below half the budget, credit still goes out once this many blocks are free."""


@dataclass(frozen=True, slots=True)
class FetchCredit:
    """The credit state of one running fetch, as its session counts it."""

    req: int
    granted: int  #: blocks of credit granted so far, the opening window included
    arrived: int  #: blocks whose frames arrived (landed, failed or dropped)
    total: int  #: blocks the fetch asked for

    @property
    def outstanding(self) -> int:
        """Blocks granted that have not arrived yet."""
        return self.granted - self.arrived

    @property
    def ungranted(self) -> int:
        """Blocks that still need credit before the peer may send them."""
        return self.total - self.granted


def window_blocks(window_bytes: int, bytes_per_block: int) -> int:
    """The per-peer budget in blocks for a budget of ``window_bytes``."""
    return max(_MIN_WINDOW, window_bytes // bytes_per_block)


class CreditBudget:
    """The receiving side's credit budget for one peer, shared by all its fetches."""

    __slots__ = ("window",)

    def __init__(self, window: int) -> None:
        if type(window) is not int or window < 1:
            raise ValueError(f"window must be a positive int of blocks, got {window!r}")
        self.window = window

    def free(self, fetches: Iterable[FetchCredit]) -> int:
        """Blocks of the budget not granted to any running fetch."""
        return self.window - sum(f.outstanding for f in fetches)

    def opening_window(self, running: Iterable[FetchCredit], wanted: int) -> int:
        """The window a new fetch of ``wanted`` blocks opens with: what the running fetches
        leave free, at least one block (so a fetch always makes progress)."""
        return max(1, min(self.free(running), wanted))

    def grants(self, fetches: Sequence[FetchCredit]) -> list[tuple[int, int]]:
        """``(req, blocks)`` of credit to grant now so the peer's outstanding blocks
        return to the budget.

        Credit goes out in batches (at least half the budget, or whatever a starved
        fetch needs), which keeps the pipe full with few credit messages; it is split
        evenly over the fetches that still have blocks to be granted.
        """
        wanting = [f for f in fetches if f.ungranted > 0]
        if not wanting:
            return []
        free = self.free(fetches)
        starved = any(f.outstanding == 0 for f in wanting)
        if free <= 0 or (free * 2 < self.window and free < _MIN_CREDIT_BATCH and not starved):
            return []
        share = -(-free // len(wanting))
        out: list[tuple[int, int]] = []
        for f in wanting:
            n = min(share, f.ungranted, free)
            if n <= 0:
                continue
            out.append((f.req, n))
            free -= n
        return out


def batch_limit(bytes_per_block: int, batch_bytes: int = BATCH_BYTES) -> int:
    """How many blocks of ``bytes_per_block`` one block message carries at most."""
    return max(1, min(MAX_BLOCKS_PER_MESSAGE, batch_bytes // bytes_per_block))


def next_batch(next_index: int, total: int, credit: int, limit: int) -> int:
    """The end (exclusive) of the next batch of a served fetch whose blocks before
    ``next_index`` went out already, with ``credit`` blocks of window left."""
    return min(total, next_index + min(credit, limit))

"""The keys a node is computing now and expects to hold soon (``pending-v1``, SPEC §19).

Whoever computes blocks (an engine's tier) announces their keys with the time it
expects to store them, and withdraws them when the computation stops without storing
them. A lookup of such a key that this node does not hold yet is answered with ``due``:
the milliseconds until then. A key is never reported pending once it is held (the
lookup answers a hit), nor once its lease ended (:func:`~p2pkv.protocol.pending.lease_end`:
the computation fell behind, or it never withdrew the key; SPEC §19 rule 4). The
computation may announce a key again, with a new estimate.

Thread-safe: the announcing thread and the IO thread (answering lookups) share it under
one lock; every call is a few dictionary operations per key.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from p2pkv.protocol.codes import MAX_DUE_MS
from p2pkv.protocol.pending import estimate, lease_end

__all__ = ["MAX_PENDING_KEYS", "LookupAnswer", "PendingKeys"]

#: Most keys kept pending; past it the oldest announcement is forgotten first.
MAX_PENDING_KEYS = 1 << 18


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """A peer's whole answer to a lookup: per key, whether it holds it, and in how many
    seconds it expects to (0.0: not pending; a peer without ``pending-v1`` never says)."""

    hits: tuple[bool, ...]
    due: tuple[float, ...]

    @classmethod
    def of(cls, hits: Sequence[bool], due_ms: Sequence[int] | None) -> LookupAnswer:
        return cls(tuple(hits), tuple(d / 1000 for d in due_ms) if due_ms
                   else (0.0,) * len(hits))


class PendingKeys:
    """Keys announced as being computed: key → (when due, when forgotten)."""

    def __init__(self, *, limit: int = MAX_PENDING_KEYS) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._keys: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def announce(self, keys: Sequence[bytes], seconds: Sequence[float],
                 now: float | None = None) -> None:
        """``keys[i]`` is expected to be held in ``seconds[i]`` seconds."""
        if len(keys) != len(seconds):
            raise ValueError(f"announce: {len(keys)} keys but {len(seconds)} estimates")
        for s in seconds:
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s >= 0):
                raise ValueError(f"announce: an estimate must be a finite number of "
                                 f"seconds >= 0, got {s!r}")
        now = time.monotonic() if now is None else now
        with self._lock:
            for key, s in zip(keys, seconds, strict=True):
                kept = estimate(s)
                self._keys[key] = (now + kept, lease_end(now, kept))
                self._keys.move_to_end(key)
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def withdraw(self, keys: Sequence[bytes]) -> None:
        """The computation of ``keys`` stopped (or they were stored)."""
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)

    def due_ms(self, keys: Sequence[bytes], hits: Sequence[bool],
               now: float | None = None) -> list[int] | None:
        """For a lookup's answer: per key, the milliseconds until it is due (0 for a
        hit or a key not pending; at least 1 for a pending key), or None when none is
        pending. Keys that are held or expired are forgotten here."""
        if not self._keys:
            return None
        now = time.monotonic() if now is None else now
        out: list[int] | None = None
        with self._lock:
            for i, (key, hit) in enumerate(zip(keys, hits, strict=True)):
                entry = self._keys.get(key)
                if entry is None:
                    continue
                due, forget = entry
                if hit or now >= forget:
                    del self._keys[key]
                    continue
                if out is None:
                    out = [0] * len(keys)
                out[i] = min(MAX_DUE_MS, max(1, math.ceil((due - now) * 1000)))
        return out

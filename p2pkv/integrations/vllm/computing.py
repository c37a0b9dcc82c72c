"""The prompt chunks a :class:`~p2pkv.integrations.vllm.P2PKVTier`'s engine is computing
now, announced so that nobody computes them a second time (``pending-v1``, SPEC §19).

- When vLLM schedules a request for the first time, the tier announces the chunks it
  looked up and nobody held (the ones this engine now computes), each with the time it
  expects to store it (from the engine's measured prefill rate): through its node to
  every peer that looks them up, and to this engine's own later requests.
- A chunk leaves the announcement when its store is submitted (it is computed: a peer
  that asks again finds it held a moment later), and all of a request's chunks leave
  when the request is preempted or finishes; a node that stops takes its announcements
  with it, and one that falls behind its estimate by the estimate itself stops
  reporting them (SPEC §19 rule 4).
- Only scheduled requests announce; only requests not yet scheduled wait (their
  lookups answer RETRY, see :mod:`.lookups`). So a wait never closes a cycle.

Thread-safe: the scheduler thread announces and withdraws; the lookup threads read
:meth:`Computing.due_here`. Everything runs under the tier's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

from p2pkv.node import Node

__all__ = ["Computing"]


class Computing:
    """This engine's announced chunks: per request, its keys (vLLM's → shared), and
    per shared key the request computing it and when it is due."""

    def __init__(self, node: Callable[[], Node | None], lock: threading.Lock) -> None:
        self._node = node
        self._lock = lock
        self._requests: dict[str, dict[bytes, bytes]] = {}
        #: shared key -> (the request computing it, when due, when forgotten)
        self._due: dict[bytes, tuple[str, float, float]] = {}

    def announce(self, req_id: str, engine_keys: Sequence[bytes], shared_keys: Sequence[bytes],
                 seconds: Sequence[float]) -> None:
        """Request ``req_id`` was scheduled and computes ``engine_keys`` (shared under
        ``shared_keys``); ``seconds[i]``: when the i-th is expected to be stored."""
        node = self._node()
        if node is None or not shared_keys:
            return
        node.announce_pending(shared_keys, seconds)
        now = time.monotonic()
        with self._lock:
            mine = self._requests.setdefault(req_id, {})
            for engine_key, key, s in zip(engine_keys, shared_keys, seconds, strict=True):
                mine[bytes(engine_key)] = key
                self._due[key] = (req_id, now + s, now + 2 * s)

    def stored(self, req_id: str, engine_keys: Collection[bytes]) -> None:
        """The store of ``engine_keys`` was submitted: computed, soon held."""
        with self._lock:
            mine = self._requests.get(req_id)
            if not mine:
                return
            for engine_key in engine_keys:
                key = mine.pop(bytes(engine_key), None)
                if key is not None and self._due.get(key, ("", 0.0, 0.0))[0] == req_id:
                    del self._due[key]

    def withdraw(self, req_id: str) -> None:
        """Request ``req_id`` stopped (finished, aborted, preempted): what it did not
        store is no longer coming."""
        with self._lock:
            mine = self._requests.pop(req_id, None)
            if not mine:
                return
            keys = list(mine.values())
            for key in keys:
                if self._due.get(key, ("", 0.0, 0.0))[0] == req_id:
                    del self._due[key]
        node = self._node()
        if node is not None:
            node.withdraw_pending(keys)

    def due_here(self, req_id: str, keys: Sequence[bytes]) -> list[float]:
        """Per key: seconds until another request of this engine expects to store it
        (a little above 0 once due), else 0.0 (also once overdue by its own estimate,
        as the node answers peers)."""
        now = time.monotonic()
        with self._lock:
            if not self._due:
                return [0.0] * len(keys)
            out = []
            for key in keys:
                entry = self._due.get(key)
                out.append(0.0 if entry is None or entry[0] == req_id or now >= entry[2]
                           else max(entry[1] - now, 0.001))
            return out

    def describe(self) -> dict[str, int]:
        with self._lock:
            return {"requests": len(self._requests), "chunks": len(self._due)}

"""The prompt chunks a :class:`~p2pkv.integrations.vllm.P2PKVTier`'s engine is computing
now, announced so that nobody computes them a second time (``pending-v1``, SPEC §19).

- When vLLM schedules a request for the first time, the tier announces the chunks it
  looked up and nobody held (the ones this engine now computes), each with the time it
  expects to store it (from the engine's measured prefill rate): through its node to
  every peer that looks them up, through the tier's Redis directory when it has one
  (to every engine whose lookup goes there), and to this engine's own later requests.
- A chunk leaves the announcement when its store is submitted (it is computed: a peer
  that asks again finds it held a moment later). All of a preempted request's chunks
  leave at once. A finished request's chunks not stored yet stay announced for
  :data:`FINISH_GRACE_S` more, then leave: vLLM finishes a request before its chunks
  reach this tier (they are stored in the primary region first, then handed down), and
  a waiter that found them gone in between would compute them again. A node that stops
  takes its announcements
  with it (from the directory too: deregistering withdraws them, and a member whose
  registration lapsed is not reported). A request still running past its estimate
  renews it, a little at a time,
  up to a limit (on a thread of its own: a prefill can be one forward pass of seconds);
  past that its node stops reporting the chunks once they are overdue by their
  estimate, and at least ten seconds (SPEC §19 rule 4).
- Only scheduled requests announce; only requests not yet scheduled wait (their
  lookups answer RETRY, see :mod:`.lookups`). So a wait never closes a cycle.
- A request scheduled before the tier's node started is kept as it would have been
  announced (renewed, finished, withdrawn and stored alike), and announced when the node
  starts (:meth:`Computing.started`): what it still computes, each chunk due when it
  was, measured from then; nothing whose lease ended (SPEC §19 rule 4), nothing stored
  or withdrawn meanwhile. At most :data:`MAX_KEPT_REQUESTS` requests and
  :data:`MAX_KEPT_KEYS` chunks are kept for the start, the oldest request dropped first.

Thread-safe: the scheduler thread announces and withdraws, a thread of its own renews,
the lookup threads read :meth:`Computing.due_here`, the thread that starts the node
calls :meth:`Computing.started`; all under the tier's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from p2pkv.node import Node
from p2pkv.protocol.pending import lease_end

__all__ = ["ANNOUNCED", "DROPPED", "MAX_KEPT_KEYS", "MAX_KEPT_REQUESTS", "Computing",
           "PendingSink"]

log = logging.getLogger("vllm.p2pkv")


class PendingSink(Protocol):
    """Where announcements go besides the node: the tier's directory
    (:class:`~p2pkv.integrations.vllm.directory.DirectorySource`). Both calls must
    return at once: the scheduler thread makes them."""

    def announce_pending(self, keys: Sequence[bytes], seconds: Sequence[float]) -> None: ...

    def withdraw_pending(self, keys: Sequence[bytes]) -> None: ...


#: Seconds an overdue announcement is renewed by, twice per this period, while its request
#: still runs and has not stored the chunks.
RENEW_S = 0.5
#: Renewals stop this many seconds after the announcement: a request that never stores
#: its chunks is not reported as computing them beyond that (and every waiter has its
#: own limit, ``pending_wait``). A prefill rate measured on other prompts can be far off
#: under load, so the limit does not follow the estimate.
RENEW_LIMIT_S = 30.0
#: Seconds a finished request's chunks stay announced for their stores to arrive.
FINISH_GRACE_S = 2.0
#: Requests scheduled while the tier's node is not up, kept to be announced when it
#: starts, and their chunks, at most. The node is down only while the engine starts
#: (until the weights digest is known), and a request is kept only until it stores, is
#: preempted, or finishes and its grace ends: a live engine keeps about one running batch
#: (vLLM's ``max_num_seqs``: 256 by default, 1,024 at most among its defaults). 32,768
#: chunks are 128 prompts of 4,096 tokens in chunks of 16 tokens (512 in chunks of 64),
#: about 11 MB of keys and entries (measured with 36-byte keys). Past either bound the
#: oldest kept request is dropped (never announced), and counted: chunks a peer may then
#: compute a second time, nothing worse.
MAX_KEPT_REQUESTS = 1024
MAX_KEPT_KEYS = 1 << 15

#: What :class:`Computing` counts (``count(event, chunks)``): chunks announced (when
#: their request was scheduled, or when the node started for a request kept till then),
#: and chunks of kept requests dropped past the bounds.
ANNOUNCED, DROPPED = "announced", "dropped"


@dataclass
class _Announced:
    """One request's announced chunks not stored yet (vLLM's key → shared key)."""

    keys: dict[bytes, bytes]
    #: When announced, and when the chunks are due now.
    since: float
    due: float
    #: When the finished request's chunks not stored by then are withdrawn, or None (it
    #: runs).
    closing: float | None = None


class Computing:
    """This engine's announced chunks: per request, the ones it has not stored yet, and
    per shared key the request computing it and when it is due.

    ``node`` is the tier's node, None until it starts; ``coming()`` says whether it may
    still start (False once it failed for good, or the tier closed): until then, what is
    announced is kept for :meth:`started`. ``count(event, chunks)`` (:data:`ANNOUNCED`,
    :data:`DROPPED`) is called with ``lock`` held."""

    def __init__(self, node: Callable[[], Node | None], lock: threading.Lock, *,
                 directory: Callable[[], PendingSink | None] = lambda: None,
                 coming: Callable[[], bool] = lambda: False,
                 count: Callable[[str, int], None] = lambda event, n: None) -> None:
        self._node = node
        self._directory = directory
        self._coming = coming
        self._count = count
        self._lock = lock
        self._requests: dict[str, _Announced] = {}
        #: The requests scheduled before the node started, oldest first (announced by
        #: :meth:`started`).
        self._kept: dict[str, None] = {}
        # Renewals run on a thread of their own: a prefill of one long step gives the
        # scheduler thread no chance to renew anything until it is over.
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        #: shared key -> (the request computing it, when due, when forgotten)
        self._due: dict[bytes, tuple[str, float, float]] = {}

    def announce(self, req_id: str, engine_keys: Sequence[bytes], shared_keys: Sequence[bytes],
                 seconds: float) -> None:
        """Request ``req_id`` was scheduled and computes ``engine_keys`` (shared under
        ``shared_keys``), expected to be stored in ``seconds``. Before the node started,
        kept for :meth:`started`."""
        if not shared_keys:
            return
        now = time.monotonic()
        with self._lock:
            # Read under the lock: a node seen missing here is started after the
            # request is kept, and started() (which takes the lock) announces it.
            up = self._node() is not None
            if not up and not self._coming():
                return
            self._requests[req_id] = _Announced(
                {bytes(e): k for e, k in zip(engine_keys, shared_keys, strict=True)},
                now, now + seconds)
            self._mark(req_id, shared_keys, now, seconds)
            if up:
                self._count(ANNOUNCED, len(shared_keys))
            else:
                self._keep(req_id)
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                             name="p2pkv-pending-renew")
            self._renewer.start()
        if up:
            self._publish(shared_keys, seconds)

    def started(self) -> None:
        """The node started (and registered in the directory, when the tier has one):
        announce what the requests kept till now still compute, each chunk due when it
        was, measured from now. A chunk stored meanwhile is not (it is held, or soon
        is), nor one whose lease ended (SPEC §19 rule 4, :func:`lease_end`); a request
        withdrawn meanwhile, or finished longer than :data:`FINISH_GRACE_S` ago, is gone."""
        now = time.monotonic()
        late: list[tuple[list[bytes], float]] = []
        with self._lock:
            kept, self._kept = self._kept, {}
            for req_id in kept:
                ann = self._requests.get(req_id)
                keys = [] if ann is None else [
                    k for k in ann.keys.values()
                    if (entry := self._due.get(k)) is not None and entry[0] == req_id
                    and now < entry[2]]
                if ann is not None and keys:
                    late.append((keys, max(ann.due - now, 0.0)))
                    self._count(ANNOUNCED, len(keys))
        for keys, seconds in late:
            self._publish(keys, seconds)
        if kept:
            log.info("p2pkv tier: %d request(s) scheduled before the node started: %d "
                     "chunk(s) they still compute announced", len(kept),
                     sum(len(keys) for keys, _ in late))

    def _keep(self, req_id: str) -> None:
        """Keep request ``req_id`` for :meth:`started` (under the lock): past
        :data:`MAX_KEPT_REQUESTS` or :data:`MAX_KEPT_KEYS`, the oldest kept requests are
        dropped, and counted."""
        self._kept[req_id] = None
        while len(self._kept) > MAX_KEPT_REQUESTS or sum(
                len(self._requests[r].keys) for r in self._kept) > MAX_KEPT_KEYS:
            oldest = next(iter(self._kept))
            self._count(DROPPED, len(self._forget(oldest)))

    def _forget(self, req_id: str) -> list[bytes]:
        """Drop request ``req_id`` (under the lock); the shared keys it had not stored."""
        self._kept.pop(req_id, None)
        ann = self._requests.pop(req_id, None)
        if ann is None:
            return []
        keys = list(ann.keys.values())
        for key in keys:
            if self._due.get(key, ("", 0.0, 0.0))[0] == req_id:
                del self._due[key]
        return keys

    def close(self) -> None:
        """Stop renewing (the tier shuts down; its node takes the announcements along)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=2 * RENEW_S)

    def _renew_loop(self) -> None:
        while not self._stop.wait(RENEW_S / 2):
            self.renew()

    def renew(self) -> None:
        """The renewing thread, twice per :data:`RENEW_S`: a request still running
        whose chunks are overdue is still computing them (a prefill slower than
        measured, or queued behind others): its announcement is renewed, up to
        :data:`RENEW_LIMIT_S` after it was made."""
        now = time.monotonic()
        renewed: list[bytes] = []
        with self._lock:
            closed = [r for r, a in self._requests.items()
                      if a.closing is not None and now >= a.closing]
        for req_id in closed:
            self.withdraw(req_id)
        with self._lock:
            for req_id, ann in self._requests.items():
                if not ann.keys or ann.closing is not None or now < ann.due or \
                        now > ann.since + RENEW_LIMIT_S:
                    continue
                ann.due = now + RENEW_S
                keys = list(ann.keys.values())
                self._mark(req_id, keys, now, RENEW_S)
                renewed += keys
        if renewed:
            self._publish(renewed, RENEW_S)

    def _mark(self, req_id: str, keys: Sequence[bytes], now: float, seconds: float) -> None:
        for key in keys:
            self._due[key] = (req_id, now + seconds, lease_end(now, seconds))

    def stored(self, req_id: str, engine_keys: Collection[bytes]) -> None:
        """The store of ``engine_keys`` was submitted: computed, soon held."""
        with self._lock:
            ann = self._requests.get(req_id)
            if ann is None:
                return
            for engine_key in engine_keys:
                key = ann.keys.pop(bytes(engine_key), None)
                if key is not None and self._due.get(key, ("", 0.0, 0.0))[0] == req_id:
                    del self._due[key]
            if ann.closing is not None and not ann.keys:
                self._forget(req_id)

    def finished(self, req_id: str) -> None:
        """Request ``req_id`` finished (or was aborted): what it computed is on its way
        to this tier. Its chunks not stored yet stay announced for
        :data:`FINISH_GRACE_S`, due then; the renewing thread withdraws those still not
        stored after that."""
        with self._lock:
            ann = self._requests.get(req_id)
            if ann is None:
                return
            if not ann.keys:
                self._forget(req_id)
                return
            now = time.monotonic()
            ann.closing = ann.due = now + FINISH_GRACE_S
            keys = list(ann.keys.values())
            self._mark(req_id, keys, now, FINISH_GRACE_S)
        self._publish(keys, FINISH_GRACE_S)

    def withdraw(self, req_id: str) -> None:
        """Request ``req_id`` stopped computing and nothing more of it is coming
        (preempted, or a finished request's grace is over): what it did not store is
        no longer announced."""
        with self._lock:
            keys = self._forget(req_id)
        if keys:
            self._publish(keys, None)

    def _publish(self, keys: Sequence[bytes], seconds: float | None) -> None:
        """Tell the node's peers and the directory (when the tier has one) that ``keys``
        are due in ``seconds``, or with None that they are no longer coming. Nothing
        before the node started (:meth:`started` announces then what still comes)."""
        node = self._node()
        if node is None:
            return
        sinks: list[PendingSink] = [node]
        directory = self._directory()
        if directory is not None:
            sinks.append(directory)
        for sink in sinks:
            if seconds is None:
                sink.withdraw_pending(keys)
            else:
                sink.announce_pending(keys, [seconds] * len(keys))

    def due_here(self, req_id: str, keys: Sequence[bytes]) -> list[float]:
        """Per key: seconds until another request of this engine expects to store it
        (a little above 0 once due), else 0.0 (also once overdue by its own estimate,
        at least ten seconds: SPEC §19 rule 4, as the node answers peers)."""
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
            return {"requests": len(self._requests), "chunks": len(self._due),
                    "kept": len(self._kept)}

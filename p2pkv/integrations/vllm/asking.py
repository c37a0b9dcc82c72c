"""What the tier's lookup threads ask: one request's chunk keys, of the peers or the
directory, weighed by the load policy, and waited for where a peer computes them.

:class:`TierAsking` is the ``ask`` of :class:`~p2pkv.integrations.vllm.lookups.RequestLookups`
(``lookups.py`` decides when to ask and what the scheduler hears meanwhile; this decides
what the answer is). It runs on the lookup threads, never on the scheduler's: every part
it calls is thread-safe (the peers and the directory under one deadline, the policy and
the request's adapters under the tier's lock).
"""

from __future__ import annotations

import threading
import time

from p2pkv.integrations.vllm.adapters import RequestAdapters
from p2pkv.integrations.vllm.computing import Computing
from p2pkv.integrations.vllm.loads import DIRECTORY, TierLoads
from p2pkv.integrations.vllm.lookups import Answer, Pending, waiting_run
from p2pkv.integrations.vllm.metrics import Metrics
from p2pkv.integrations.vllm.peers import Count, Peers
from p2pkv.integrations.vllm.starter import TierNode
from p2pkv.node import Node

__all__ = ["PENDING_RECHECK_MAX", "PENDING_RECHECK_MIN", "TierAsking"]

#: Seconds between two asks about chunks a peer is computing: at least (a quick store
#: is not asked about in a busy loop), at most (a holder that dies or withdraws is
#: noticed within this, plus a lookup's deadline).
PENDING_RECHECK_MIN = 0.05
PENDING_RECHECK_MAX = 0.5


class TierAsking:
    """The answers of one tier's lookups (see the module doc)."""

    def __init__(self, run: TierNode, peers: Peers, adapters: RequestAdapters,
                 policy: TierLoads, computing: Computing, *, pending_wait: float,
                 lock: threading.Lock, count: Count) -> None:
        self._run = run
        self._peers = peers
        self._adapters = adapters
        self._policy = policy
        self._computing = computing
        self._pending_wait = pending_wait
        self._lock = lock
        self._count = count

    def ask(self, req_id: str, keys: list[bytes], first: bool) -> list[Answer]:
        """The answer for each of one request's ``keys``: asked of every connected peer
        (see :meth:`Peers.ask`) or of the directory, under the keys the request's
        adapter shares them under; the load policy then keeps only the hits worth
        loading (see :class:`TierLoads`), and keys being computed right after them are
        waited for when that pays (:meth:`wait_for`). ``first``: ``keys[0]`` is the
        request's first chunk."""
        node = self._run.node
        if node is None or not keys:
            return [False] * len(keys)
        shared = self._adapters.keys(req_id, keys)
        if shared.keys is None:  # counted once, where its chunks are kept from peers
            return [False] * len(keys)
        found, due, holders = self._holders(node, shared.keys)
        # A miss on a prompt's first chunk: does a peer hold it under another version
        # of this adapter (its name-and-path key)? Then say so; nothing is loaded.
        if shared.name_keys and not found[0] and first and \
                self._holders(node, shared.name_keys[:1])[0][0]:
            self._adapters.mismatch(str(shared.adapter), len(keys))
        answers: list[Answer] = list(self._policy.advise(req_id, keys, found, holders))
        here = self._computing.due_here(req_id, shared.keys)
        return self.wait_for(answers, found, [d or h for d, h in zip(due, here, strict=True)],
                             exact=self._run.directory is None)

    def wait_for(self, answers: list[Answer], found: list[bool], due: list[float], *,
                 exact: bool = True) -> list[Answer]:
        """The run of keys a request would wait for (:func:`waiting_run`), answered
        :class:`Pending` when waiting for the last of them and loading the run pays,
        and ``pending_wait`` allows."""
        run = waiting_run(answers, found, due, exact=exact)
        if run is None or self._pending_wait <= 0:
            return answers
        start, end, weighed = run
        coming = [d for d in due[start:end] if d > 0]
        budget = self._policy.wait_budget(weighed, max(coming))
        if budget is None:
            return answers
        now = time.monotonic()
        recheck = min(max(min(coming), PENDING_RECHECK_MIN), PENDING_RECHECK_MAX)
        answers[start:end] = [Pending(now + recheck, now + budget)] * (end - start)
        return answers

    def _holders(self, node: Node, keys: list[bytes]
                 ) -> tuple[list[bool], list[float], list[str | None]]:
        """Which of ``keys`` a peer (or the directory) holds, when a peer (or, through
        the directory, another engine) computing one expects to hold it (seconds; 0.0:
        nobody is), and who holds each."""
        if self._run.directory is not None:
            found, due = self._run.directory.ask(keys)
            with self._lock:
                self._count(Metrics.LOOKUP_KEYS, len(keys), ())
                self._count(Metrics.LOOKUP_HITS, sum(found), ())
            return found, due, [DIRECTORY] * len(keys)
        found, due = self._peers.ask(node, keys)
        return found, due, list(self._peers.route(keys)[1])


"""The lookups of a :class:`~p2pkv.integrations.vllm.P2PKVTier`: answered in the
scheduler step that asks them.

vLLM's scheduler asks a secondary tier about a request's chunk keys one at a time, and
any RETRY skips the request for the whole step (under load, a forward pass). vLLM's own
helper (``AsyncLookupManager``) answers RETRY to every new key and asks it during the
next forward pass, so every request, hit or miss, loses a step. The contract
(``SecondaryTierManager.lookup``) allows HIT or MISS on the first call, and a request's
block hashes are known when it arrives. So:

- **at arrival** (:meth:`RequestLookups.begin`, from
  :class:`~p2pkv.integrations.vllm.P2PKVConnector`'s ``on_new_request``, outside
  vLLM 0.33's manager lock) every chunk key of the prompt is asked at once, on the
  tier's lookup threads;
- the scheduler's lookups of that request **answer from that ask**: HIT or MISS when it
  has come back; when it has not, the scheduler thread waits for it, at most ``wait``
  seconds per step for all requests together (``lookup_wait``; 0: never wait), then
  answers RETRY and the answer is used at the next step;
- keys the arrival ask did not cover (a request the connector did not hand over, a
  request that grew after a preemption) are asked as vLLM's helper asks them: gathered
  during the step, asked together at its end (:meth:`RequestLookups.flush`), answered
  from the next step on;
- a key whose load failed is answered MISS for as long as the requests that know it
  live (:meth:`RequestLookups.mark_miss`): vLLM recomputes it instead of retrying a
  doomed load;
- a key an ask found **pending** (being computed by a peer or by this engine, SPEC §19)
  is answered RETRY until the time the ask named (:class:`Pending`), then asked again;
  a request waits on pending keys at most ``pending_limit`` seconds in all, and no
  later than the first ask said waiting pays (:attr:`Pending.until`), then they are
  MISS (vLLM computes them). Whether waiting pays at all is the ask's decision;
- a step that **scheduled nothing** while requests wait on an ask or on pending keys
  (:meth:`RequestLookups.pause`): vLLM's scheduler loop does not pause while a request
  waits, and its steps would re-ask the same cached RETRY hundreds of times a second,
  taking CPU from the engine that computes what they wait for; the scheduler thread
  sleeps instead until an ask comes back or a recheck is due, at most ``wait``.

Threads: every method runs on the scheduler thread (under vLLM 0.33's manager lock, but
:meth:`RequestLookups.begin`, which P2PKVConnector calls outside it);
the asks run on the tier's lookup threads and hand their answers back through futures
only. A failed ask answers MISS for its keys (logged), never an error to vLLM.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

__all__ = ["DEFERRED", "PENDING", "READY", "WAITED", "Answer", "Ask", "LookupCounts",
           "Pending", "RequestLookups", "waiting_run"]

log = logging.getLogger("vllm.p2pkv")

@dataclass(frozen=True, slots=True)
class Pending:
    """An ask's answer for a key being computed elsewhere: RETRY until ``recheck`` (a
    ``time.monotonic()`` time), then ask again; past ``until``, waiting no longer pays
    (the computation runs later than the ask expected) and the key is a MISS."""

    recheck: float
    until: float = math.inf


#: An ask's answer for one key: HIT (True), MISS (False), or wait for it (Pending).
Answer = bool | Pending

#: Runs on a lookup thread: the answer for each of ``keys`` (one request's, in prompt
#: order). ``first`` says whether ``keys[0]`` is the request's first chunk.
Ask = Callable[[str, list[bytes], bool], list[Answer]]

#: Threads that ask peers. An ask mostly waits on the node's IO thread; a few let the
#: requests that arrive together be asked together.
_ASK_THREADS = 4
#: Live requests kept (far above any engine's running and waiting requests).
_MAX_REQUESTS = 1 << 16


#: How a request's lookups went in one step, worst last: every key answered at once;
#: answered after the scheduler thread waited; some key answered RETRY because its
#: answer had not come (the request was skipped for the step); some key answered RETRY
#: because it is being computed elsewhere (skipped, on purpose).
READY, WAITED, DEFERRED, PENDING = "ready", "waited", "deferred", "pending"
_RANK = {READY: 0, WAITED: 1, DEFERRED: 2, PENDING: 3}


@dataclass
class LookupCounts:
    """What the lookups did since the last :meth:`RequestLookups.take_counts`."""

    #: Requests per outcome, one count per request per step it was looked up in.
    steps: dict[str, int] = field(default_factory=dict)
    #: Seconds the scheduler thread waited for asks.
    wait_seconds: float = 0.0
    #: Seconds the scheduler thread slept in steps that scheduled nothing
    #: (:meth:`RequestLookups.pause`).
    pause_seconds: float = 0.0


@dataclass
class _Request:
    """One live request's keys: answered, being asked, or gathered for this step's ask."""

    answers: dict[bytes, Answer] = field(default_factory=dict)
    #: The keys the scheduler asked about, in the order it asked.
    looked: dict[bytes, None] = field(default_factory=dict)
    #: The keys asked at arrival, in prompt order.
    prompt: list[bytes] = field(default_factory=list)
    #: When the request first waited on a pending key (``time.monotonic()``), or None.
    pending_since: float | None = None
    #: When its waiting stops paying: the earliest ``until`` of its pending answers.
    pending_until: float = math.inf
    #: Keys being asked, each with the future of its ask and its index in that ask.
    asking: dict[bytes, tuple[Future[list[Answer]], int]] = field(default_factory=dict)
    #: Keys met this step that nobody asked yet, in the order met; the first one's
    #: ``first`` flag.
    gathered: dict[bytes, None] = field(default_factory=dict)
    gathered_first: bool = False
    #: Keys whose load failed: MISS from now on.
    failed: set[bytes] = field(default_factory=set)
    #: How its lookups went this step (READY, WAITED, DEFERRED, PENDING), or None.
    outcome: str | None = None


class RequestLookups:
    """Each live request's lookups (see the module doc)."""

    def __init__(self, ask: Ask, *, wait: float, pending_limit: float = 0.0) -> None:
        self._ask = ask
        self._wait = wait
        self._pending_limit = pending_limit
        self._requests: dict[str, _Request] = {}
        self._asks = concurrent.futures.ThreadPoolExecutor(_ASK_THREADS, "p2pkv-lookup")
        #: When this step's waiting ends (set by its first wait), or None.
        self._step_deadline: float | None = None
        self._counts = LookupCounts()

    def begin(self, req_id: str, keys: Sequence[bytes], *, ask: bool = True) -> None:
        """Request ``req_id`` arrived: ask ``keys`` (its prompt's chunk keys of one
        group, in order, the first chunk first) now. Called once per group. ``ask``
        False (the tier's node is not up): only kept, for :meth:`computing`."""
        if not keys:
            return
        req = self._request(req_id)
        req.prompt.extend(keys)
        if ask:
            self._submit(req_id, req, list(keys), first=True)

    def missed(self, req_id: str, key: bytes) -> None:
        """The scheduler asked about ``key`` of request ``req_id`` and was answered MISS
        without an ask (the tier's node is not up): kept as such, for :meth:`computing`
        and for the request's later lookups."""
        req = self._request(req_id)
        req.looked[key] = None
        req.answers.setdefault(key, False)

    def lookup(self, req_id: str, key: bytes, first: Callable[[], bool]) -> bool | None:
        """True (HIT), False (MISS) or None (RETRY) for ``key`` of request ``req_id``.
        ``first()`` says whether ``key`` is the request's first chunk (asked only for
        a key nobody asked yet)."""
        req = self._request(req_id)
        req.looked[key] = None
        if key in req.failed:
            return False
        answer = self._answer(req, key)
        if answer is not None:
            return self._given(req_id, req, answer, READY)
        asking = req.asking.get(key)
        if asking is None:
            if not req.gathered:
                req.gathered_first = first()
            req.gathered[key] = None
            _note(req, DEFERRED)
            return None
        remaining = self._remaining()
        if remaining > 0:
            started = time.perf_counter()
            concurrent.futures.wait([asking[0]], timeout=remaining)
            self._counts.wait_seconds += time.perf_counter() - started
            answer = self._answer(req, key)
            if answer is not None:
                return self._given(req_id, req, answer, WAITED)
        _note(req, DEFERRED)
        return None

    def _given(self, req_id: str, req: _Request, answer: Answer, outcome: str
               ) -> bool | None:
        """What the scheduler is told of an answer that came (``outcome``: at once, or
        after a wait): HIT or MISS, or for a key being computed elsewhere, see
        :meth:`_pending`."""
        if isinstance(answer, Pending):
            return self._pending(req_id, req, answer)
        _note(req, outcome)
        return answer

    def computing(self, req_id: str) -> list[bytes]:
        """What the engine computes once it schedules ``req_id``: from the first key the
        scheduler asked about and was answered MISS (vLLM stops asking there, and loads
        only what comes before it) to the end of the prompt known at arrival; without
        one, the keys it asked about and was answered MISS."""
        req = self._requests.get(req_id)
        if req is None:
            return []
        missed = [k for k in req.looked if k in req.failed or req.answers.get(k) is False]
        if missed and missed[0] in req.prompt:
            return req.prompt[req.prompt.index(missed[0]):]
        return missed

    def flush(self) -> None:
        """The step's lookups are over: ask what was gathered, one ask per request."""
        for req_id, req in self._requests.items():
            if req.gathered:
                keys, req.gathered = list(req.gathered), {}
                self._submit(req_id, req, keys, first=req.gathered_first)
            if req.outcome is not None:
                steps = self._counts.steps
                steps[req.outcome] = steps.get(req.outcome, 0) + 1
                req.outcome = None
        self._step_deadline = None

    def pause(self) -> float:
        """The step scheduled nothing (called after :meth:`flush`): sleep until what a
        waiting request needs may have changed (an ask came back, a pending key's
        recheck or a request's ``pending_limit`` is due), at most ``wait`` seconds.
        No sleep when no request waits on an ask or a pending key, or an ask already
        came back. The seconds slept."""
        if self._wait <= 0:
            return 0.0
        now = time.monotonic()
        wake = now + self._wait
        asks: set[Future[list[Answer]]] = set()
        pending = False
        for req in self._requests.values():
            for fut, _ in req.asking.values():
                if fut.done():
                    return 0.0  # its answer is read at the next step
                asks.add(fut)
            rechecks = [a.recheck for a in req.answers.values() if isinstance(a, Pending)]
            if rechecks:
                pending = True
                wake = min(wake, *rechecks)
                if req.pending_since is not None:
                    wake = min(wake, req.pending_since + self._pending_limit,
                               req.pending_until)
        if not (asks or pending) or wake <= now:
            return 0.0
        started = time.perf_counter()
        if asks:
            concurrent.futures.wait(asks, timeout=wake - now,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            time.sleep(wake - now)
        slept = time.perf_counter() - started
        self._counts.pause_seconds += slept
        return slept

    def take_counts(self) -> LookupCounts:
        """What the lookups did since the last call (steps counted at their end)."""
        counts, self._counts = self._counts, LookupCounts()
        return counts

    def mark_miss(self, keys: Collection[bytes]) -> None:
        """The loads of ``keys`` failed: every live request that knows one of them is
        answered MISS for it from now on."""
        if not keys:
            return
        failed = set(keys)
        for req in self._requests.values():
            req.failed.update(failed.intersection(req.answers.keys() | req.asking.keys()))

    def finished(self, req_id: str) -> None:
        """Forget request ``req_id``; its asks still running end unread."""
        req = self._requests.pop(req_id, None)
        if req is not None:
            for fut, _ in set(req.asking.values()):
                fut.cancel()

    def shutdown(self) -> None:
        self._asks.shutdown(wait=False, cancel_futures=True)
        self._requests.clear()

    # ------------------------------------------------------------------ internals

    def _request(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            # A request vLLM never finished (one dropped before it started) must not
            # stay forever: past the bound, the oldest is forgotten.
            while len(self._requests) >= _MAX_REQUESTS:
                self.finished(next(iter(self._requests)))
            req = self._requests[req_id] = _Request()
        return req

    def _submit(self, req_id: str, req: _Request, keys: list[bytes], *, first: bool) -> None:
        keys = [k for k in keys if k not in req.answers and k not in req.asking]
        if not keys:
            return
        try:
            fut = self._asks.submit(self._ask, req_id, keys, first)
        except RuntimeError:  # shut down: nothing more is asked
            return
        for i, key in enumerate(keys):
            req.asking[key] = (fut, i)

    def _pending(self, req_id: str, req: _Request, answer: Pending) -> bool | None:
        """A key being computed elsewhere: RETRY until its recheck, then ask again; MISS
        once the request has waited ``pending_limit`` in all, or past the ``until`` of
        the first ask that told it to wait (a later ask's, made after part of the wait,
        would grant it again what the first already counted)."""
        now = time.monotonic()
        if req.pending_since is None:
            req.pending_since = now
        req.pending_until = min(req.pending_until, answer.until)
        waiting = [k for k, a in req.answers.items() if isinstance(a, Pending)]
        if now - req.pending_since >= self._pending_limit or now >= req.pending_until:
            for k in waiting:
                req.answers[k] = False
            _note(req, READY)
            return False
        if now >= answer.recheck:
            for k in waiting:
                del req.answers[k]
            self._submit(req_id, req, waiting, first=False)
        _note(req, PENDING)
        return None

    def _answer(self, req: _Request, key: bytes) -> Answer | None:
        """The key's answer, settling its ask if that came back."""
        answer = req.answers.get(key)
        if answer is not None:
            return answer
        asking = req.asking.get(key)
        if asking is None or not asking[0].done():
            return None
        self._settle(req, asking[0])
        return req.answers.get(key)

    def _settle(self, req: _Request, fut: Future[list[Answer]]) -> None:
        """Move every key of the finished ask ``fut`` to the request's answers."""
        keys = [(k, i) for k, (f, i) in req.asking.items() if f is fut]
        try:
            found = fut.result(timeout=0)
        except Exception as exc:  # an ask that failed (or was cancelled): misses
            log.warning("p2pkv tier: a lookup of %d key(s) failed, answered as misses: %s",
                        len(keys), exc)
            found = []
        for key, i in keys:
            del req.asking[key]
            answer = found[i] if i < len(found) else False
            req.answers[key] = answer if isinstance(answer, Pending) else bool(answer)

    def _remaining(self) -> float:
        """Seconds this step may still wait."""
        if self._wait <= 0:
            return 0.0
        now = time.monotonic()
        if self._step_deadline is None:
            self._step_deadline = now + self._wait
        return max(0.0, self._step_deadline - now)


def waiting_run(answers: Sequence[Answer], found: Sequence[bool], due: Sequence[float],
                *, exact: bool = True) -> tuple[int, int, int] | None:
    """Where one ask's answers would have a request wait, as ``(start, end, weighed)``:
    the keys ``start:end`` right after those to load, when the first of them nobody
    holds but somebody computes (``due[i] > 0`` seconds from now); ``weighed`` of them
    count in whether the wait pays. None: nothing to wait for.

    A holder stores the chunks of one prefill in any order, so the run goes on over the
    keys held or being computed after ``start``, those already stored included.
    ``exact``: ``found`` says of every key whether it is held; a directory says so only
    up to the first key that is not (its lookups are prefix lookups), so there the run
    is the rest of the prompt, weighed up to the last key being computed, and the keys
    after the wait are asked again."""
    start = next((i for i, a in enumerate(answers) if a is not True), len(answers))
    if start == len(answers) or found[start] or due[start] <= 0:
        return None
    if not exact:
        last = max(i for i in range(start, len(answers)) if due[i] > 0)
        return start, len(answers), last + 1 - start
    end = start
    while end < len(answers) and (found[end] or due[end] > 0):
        end += 1
    return start, end, end - start


def _note(req: _Request, outcome: str) -> None:
    """Keep the worst outcome of the request's lookups this step."""
    if req.outcome is None or _RANK[outcome] > _RANK[req.outcome]:
        req.outcome = outcome

"""The tier's lookups while a request waits (p2pkv.integrations.vllm.lookups), without
vLLM: the asks here answer when the test says so.

- A scheduler step that scheduled nothing (``RequestLookups.pause``): the scheduler
  thread sleeps while its requests wait on the tier, instead of re-asking a cached RETRY
  in a busy loop, and wakes when their answers may have changed.
- The run of chunks a request waits for (``waiting_run``), when a holder stores them out
  of order."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from p2pkv.integrations.vllm.lookups import Answer, Pending, RequestLookups, waiting_run

KEY = b"k" * 36


class Asks:
    """Asks that answer ``answers`` once their gate (if any) is open."""

    def __init__(self) -> None:
        self.gate: threading.Event | None = None
        self.answer: Answer = False

    def __call__(self, req_id: str, keys: list[bytes], first: bool) -> list[Answer]:
        if self.gate is not None:
            self.gate.wait(10)
        return [self.answer] * len(keys)


@pytest.fixture
def asks() -> Iterator[Asks]:
    made = Asks()
    yield made
    if made.gate is not None:
        made.gate.set()


def settled(lookups: RequestLookups, req_id: str) -> bool | None:
    """The scheduler's lookup of KEY: its arrival ask answers at once, and the lookup
    waits for it (within the step's ``wait``)."""
    return lookups.lookup(req_id, KEY, lambda: True)


def waiting(asks: Asks, *, wait: float, pending_limit: float, due_in: float
            ) -> RequestLookups:
    """Lookups whose one request waits, at the end of its step, on a key being computed
    elsewhere and due in ``due_in`` seconds."""
    lookups = RequestLookups(asks, wait=wait, pending_limit=pending_limit)
    asks.answer = Pending(time.monotonic() + due_in)
    lookups.begin("r", [KEY])
    assert settled(lookups, "r") is None  # RETRY: being computed elsewhere
    lookups.flush()
    return lookups


def timed_pause(lookups: RequestLookups) -> tuple[float, float]:
    started = time.monotonic()
    slept = lookups.pause()
    return slept, time.monotonic() - started


def test_nothing_waiting_never_pauses(asks: Asks) -> None:
    lookups = RequestLookups(asks, wait=1.0)
    assert timed_pause(lookups)[1] < 0.05
    lookups.begin("r", [KEY])
    assert settled(lookups, "r") is False  # answered MISS: the request will compute
    lookups.flush()
    assert timed_pause(lookups)[1] < 0.05
    assert lookups.take_counts().pause_seconds == 0.0
    lookups.shutdown()


def test_a_pending_key_pauses_until_its_recheck(asks: Asks) -> None:
    lookups = waiting(asks, wait=1.0, pending_limit=30.0, due_in=0.3)
    slept, took = timed_pause(lookups)
    assert 0.1 <= took <= 0.6, took
    assert lookups.take_counts().pause_seconds == pytest.approx(slept)
    lookups.shutdown()


def test_the_pause_is_bounded_by_the_lookup_wait(asks: Asks) -> None:
    lookups = waiting(asks, wait=0.1, pending_limit=30.0, due_in=20)
    assert 0.05 <= timed_pause(lookups)[1] <= 0.5
    # lookup_wait 0 keeps vLLM's own loop: no pause at all.
    never = RequestLookups(asks, wait=0.0, pending_limit=30.0)
    never.begin("r", [KEY])
    time.sleep(0.05)
    assert settled(never, "r") is None
    never.flush()
    assert timed_pause(never)[1] < 0.05
    for m in (lookups, never):
        m.shutdown()


def test_a_request_past_its_pending_limit_does_not_pause(asks: Asks) -> None:
    lookups = waiting(asks, wait=1.0, pending_limit=0.05, due_in=20)
    time.sleep(0.06)
    # Its limit is due: the next step answers MISS, so the step comes at once.
    assert timed_pause(lookups)[1] < 0.05
    assert lookups.lookup("r", KEY, lambda: True) is False
    lookups.shutdown()


def test_a_wait_ends_when_the_first_ask_said_it_stops_paying(asks: Asks) -> None:
    """The ask that told a request to wait said until when waiting pays; a computation
    that runs late (its asks keep naming a recheck a little ahead, each with a fresh
    budget) is given up at the first budget's end, not at ``pending_limit``."""
    lookups = RequestLookups(asks, wait=1.0, pending_limit=30.0)
    started = time.monotonic()
    asks.answer = Pending(started + 0.05, until=started + 0.3)
    lookups.begin("r", [KEY])
    assert settled(lookups, "r") is None
    lookups.flush()
    answer = None
    while answer is None and time.monotonic() - started < 5.0:
        now = time.monotonic()
        asks.answer = Pending(now + 0.05, until=now + 0.3)  # late, and asking again
        lookups.pause()  # sleeps until the recheck or the budget's end
        answer = lookups.lookup("r", KEY, lambda: True)
        lookups.flush()
    took = time.monotonic() - started
    assert answer is False  # MISS: the engine computes the chunks itself
    assert 0.25 <= took < 1.5, took
    lookups.shutdown()


def test_an_ask_that_comes_back_ends_the_pause(asks: Asks) -> None:
    asks.gate = threading.Event()
    lookups = RequestLookups(asks, wait=2.0)
    lookups.begin("r", [KEY])
    timer = threading.Timer(0.2, asks.gate.set)
    timer.start()
    try:
        lookups.flush()  # the step ends with the request's arrival ask still out
        slept, took = timed_pause(lookups)
        assert 0.1 <= took < 1.5, took
        assert slept > 0.0
        # The answer came: the next step reads it, and nothing pauses meanwhile.
        assert timed_pause(lookups)[1] < 0.05
        assert lookups.lookup("r", KEY, lambda: True) is False
    finally:
        timer.cancel()
        lookups.shutdown()


def test_a_finished_request_leaves_nothing_to_wait_for(asks: Asks) -> None:
    lookups = waiting(asks, wait=1.0, pending_limit=30.0, due_in=20)
    lookups.finished("r")
    lookups.flush()
    assert timed_pause(lookups)[1] < 0.05
    lookups.shutdown()


def test_the_wait_spans_chunks_a_holder_stored_out_of_order() -> None:
    """A holder stores one prefill's chunks in any order: the run a request waits for
    goes on over the chunks already stored, up to the first that is neither held nor
    being computed."""
    load, held, coming, gone = True, True, 0.4, 0.0
    # keys 0-1 loaded; 2 being computed; 3 stored out of order; 4 being computed; 5 gone
    answers = [load, load, False, False, False, False]
    found = [held, held, False, held, False, False]
    due = [0.0, 0.0, coming, 0.0, coming, gone]
    assert waiting_run(answers, found, due) == (2, 5, 3)
    # Through a directory the held keys after the first gap are not known: the run is
    # the rest of the prompt, weighed up to the last key being computed.
    assert waiting_run(answers, [held, held] + [False] * 4, due, exact=False) == (2, 6, 3)
    # Nothing to wait for: the first key after the loaded ones is not being computed.
    assert waiting_run(answers, found, [0.0, 0.0, 0.0, 0.0, coming, 0.0]) is None
    assert waiting_run([load] * 3, [held] * 3, [0.0] * 3) is None

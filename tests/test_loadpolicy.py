"""The load-or-recompute decision (p2pkv.integrations.vllm.loadpolicy), with the numbers
of this machine.

SmolLM2-135M in fp32 keeps 46,080 bytes of KV per token (30 layers x 3 KV heads x 64 x
K and V x 4 bytes): one 64-token chunk is 2,949,120 bytes. Its prefill here runs at
about 640 tokens/s for 256-token prompts and 300 tokens/s at 4,096 tokens; a loopback
fetch lands about 1.2 GB/s, and the throttled link of the tests moves 4 MB/s.
"""

from __future__ import annotations

import itertools
import math

import pytest

from p2pkv.integrations.vllm.loadpolicy import (
    BANDWIDTH_BOUNDS,
    LOAD_OFF,
    LOAD_PAYS,
    LOAD_PROBE,
    LOAD_UNKNOWN,
    MAX_TRACKED_REQUESTS,
    PENDING_NO_ESTIMATE,
    PENDING_PAYS,
    PENDING_POLICY_OFF,
    PENDING_SLOWER,
    PROVISIONAL_CHUNKS,
    SKIP_FLOOR,
    SKIP_SLOWER,
    STEP_SAMPLES,
    LoadPolicy,
    LoadPolicyConfig,
    PrefillMeter,
    StepMeter,
    band,
)

CHUNK_TOKENS = 64
CHUNK_BYTES = 64 * 46_080
FAST = 1.2e9  # bytes/s
SLOW = 4e6


def policy(**config: object) -> LoadPolicy:
    return LoadPolicy(LoadPolicyConfig(**config),  # type: ignore[arg-type]
                      chunk_bytes=CHUNK_BYTES, chunk_tokens=CHUNK_TOKENS)


def measured(p: LoadPolicy, peer: str, bytes_per_second: float, now: float = 0.0) -> None:
    """One completed 16-chunk fetch from ``peer`` at ``bytes_per_second``."""
    nbytes = 16 * CHUNK_BYTES
    p.fetched(peer, nbytes, nbytes / bytes_per_second, now)


def smollm2_prefill(p: LoadPolicy, now: float = 0.0) -> None:
    p.computed(256, 256 / 640, now)
    p.computed(4096, 4096 / 300, now)


def test_unknown_estimates_load_everything_until_measured() -> None:
    p = policy()
    advice = p.advise(["a"] * 64, now=0.0)
    assert (advice.load, advice.held, advice.reason) == (64, 64, LOAD_UNKNOWN)
    measured(p, "a", SLOW)
    # The link is measured, this engine's prefill is not: still optimistic.
    assert p.advise(["a"] * 64, now=1.0).reason == LOAD_UNKNOWN
    smollm2_prefill(p)
    assert p.advise(["a"] * 64, now=2.0).reason == SKIP_SLOWER
    # A new peer is loaded from until it is measured too.
    assert p.advise(["b"] * 64, now=3.0).reason == LOAD_UNKNOWN
    assert p.decisions == {LOAD_UNKNOWN: 3, SKIP_SLOWER: 1}


def test_fast_link_loads_slow_link_recomputes_with_the_estimates_of_both() -> None:
    p = policy()
    smollm2_prefill(p)
    measured(p, "fast", FAST)
    measured(p, "slow", SLOW)
    long_fast = p.advise(["fast"] * 64, now=1.0)  # 4,096 tokens, 189 MB
    assert (long_fast.load, long_fast.reason) == (64, LOAD_PAYS)
    assert long_fast.load_seconds == pytest.approx(64 * CHUNK_BYTES / FAST)  # 0.157 s
    assert long_fast.recompute_seconds == pytest.approx(4096 / 300)  # 13.65 s
    long_slow = p.advise(["slow"] * 64, now=1.0)
    assert (long_slow.load, long_slow.skipped, long_slow.reason) == (0, 64, SKIP_SLOWER)
    assert long_slow.load_seconds == pytest.approx(47.19, abs=0.01)
    short_fast = p.advise(["fast"] * 4, now=1.0)  # 256 tokens, 11.8 MB
    assert short_fast.reason == LOAD_PAYS
    assert short_fast.recompute_seconds == pytest.approx(0.4)
    short_slow = p.advise(["slow"] * 4, now=1.0)
    assert short_slow.reason == SKIP_SLOWER
    assert short_slow.load_seconds == pytest.approx(2.949, abs=0.001)
    assert p.skipped == {SKIP_SLOWER: 68}


def test_min_speedup_is_the_margin_a_load_must_win_by() -> None:
    # Recomputing 4,096 tokens takes 13.65 s: at 1.2x a load must finish in 11.38 s,
    # that is 189 MB at 16.6 MB/s or faster.
    p = policy(min_speedup=1.2)
    smollm2_prefill(p)
    need = 64 * CHUNK_BYTES / ((4096 / 300) / 1.2)
    measured(p, "a", need * 1.01)
    assert p.advise(["a"] * 64, now=1.0).reason == LOAD_PAYS
    measured(p, "a", need * 0.99)
    assert p.advise(["a"] * 64, now=2.0).reason == SKIP_SLOWER
    # With no margin the same link pays.
    q = policy(min_speedup=1.0)
    smollm2_prefill(q)
    measured(q, "a", need * 0.99)
    assert q.advise(["a"] * 64, now=1.0).reason == LOAD_PAYS


def test_floor_recomputes_short_hits_even_over_a_fast_link() -> None:
    p = policy(min_tokens=512)
    smollm2_prefill(p)
    measured(p, "a", FAST)
    short = p.advise(["a"] * 4, now=1.0)
    assert (short.load, short.reason, short.skip_reason) == (0, SKIP_FLOOR, SKIP_FLOOR)
    assert p.advise(["a"] * 8, now=1.0).reason == LOAD_PAYS
    assert p.skipped == {SKIP_FLOOR: 4}


def test_switched_off_it_loads_everything_and_still_measures() -> None:
    p = policy(enabled=False)
    smollm2_prefill(p)
    measured(p, "a", SLOW)
    advice = p.advise(["a"] * 64, now=1.0)
    assert (advice.load, advice.reason) == (64, LOAD_OFF)
    assert p.bandwidth["a"].value == pytest.approx(SLOW)
    assert p.describe(now=1.0)["enabled"] is False


def test_a_slower_fetch_is_believed_at_once_a_faster_one_halfway() -> None:
    p = policy()
    measured(p, "a", FAST)
    measured(p, "a", SLOW, now=1.0)
    assert p.bandwidth["a"].value == pytest.approx(SLOW)
    measured(p, "a", 104e6, now=2.0)
    assert p.bandwidth["a"].value == pytest.approx(54e6)
    assert p.bandwidth["a"].samples == 3
    # An estimate older than probe_interval (30 s) has decayed: the next sample, faster
    # or slower, replaces it.
    measured(p, "a", 500e6, now=40.0)
    assert p.bandwidth["a"].value == pytest.approx(500e6)


def test_a_first_sample_from_a_short_fetch_is_asked_again_before_it_refuses_a_peer(
        ) -> None:
    # The first fetch from a same-host peer was one chunk in 184 ms (16 MB/s: mapping its
    # pool, or the holder mid-step); its loads then run at 1 GB/s.
    p = policy()
    smollm2_prefill(p)
    p.fetched("a", CHUNK_BYTES, 0.184, now=0.0)
    assert p.bandwidth["a"].provisional
    assert p.describe(now=0.0)["bandwidth_bytes_per_s"]["a"]["provisional"] is True
    # 14 chunks would take 2.6 s against 1.4 s of recompute: rather than skip, it asks
    # again with one chunk (over the 5% budget: a second opinion goes whatever it costs).
    again = p.advise(["a"] * 14, now=1.0)
    assert (again.load, again.held, again.reason) == (1, 14, LOAD_PROBE)
    # Once: until that sample lands, the estimate it has decides.
    assert p.advise(["a"] * 14, now=1.1).reason == SKIP_SLOWER
    # The next sample replaces it, even a faster one (no halfway), with no backoff.
    p.fetched("a", CHUNK_BYTES, CHUNK_BYTES / 1e9, now=1.2)
    est = p.bandwidth["a"]
    assert est.value == pytest.approx(1e9) and not est.provisional and est.backoff == 0
    assert p.advise(["a"] * 14, now=1.3).reason == LOAD_PAYS
    # A second short sample as slow as the first is believed: skipped, probed after the
    # interval as any slow peer.
    q = policy()
    smollm2_prefill(q)
    q.fetched("a", CHUNK_BYTES, 0.184, now=0.0)
    assert q.advise(["a"] * 14, now=1.0).reason == LOAD_PROBE
    q.fetched("a", CHUNK_BYTES, 0.184, now=1.2)
    assert q.advise(["a"] * 14, now=2.0).reason == SKIP_SLOWER
    assert q.advise(["a"] * 14, now=20.0).reason == SKIP_SLOWER
    # A first sample from a fetch of PROVISIONAL_CHUNKS or more counts in full.
    r = policy()
    smollm2_prefill(r)
    r.fetched("a", PROVISIONAL_CHUNKS * CHUNK_BYTES, PROVISIONAL_CHUNKS * 0.184, now=0.0)
    assert not r.bandwidth["a"].provisional
    assert r.advise(["a"] * 14, now=1.0).reason == SKIP_SLOWER


def test_estimates_are_bounded() -> None:
    p = policy()
    p.fetched("a", CHUNK_BYTES, 0.0, now=0.0)  # a clock that did not move
    assert p.bandwidth["a"].value == BANDWIDTH_BOUNDS[1]
    p.fetched("b", 1, 3600.0, now=0.0)
    assert p.bandwidth["b"].value == BANDWIDTH_BOUNDS[0]
    p.fetched("c", 0, 1.0, now=0.0)  # nothing landed: no sample
    assert "c" not in p.bandwidth
    p.computed(64, 0.0, now=0.0)
    p.computed(0, 1.0, now=0.0)
    assert p.prefill == {}


def test_a_slow_peer_is_probed_again_after_the_interval_never_refused_for_good() -> None:
    # Two busy cores: 4,096 tokens recompute in 27.3 s (150 tokens/s). A probe of one
    # chunk over the 4 MB/s link adds 0.74 s, 2.7% of that: within the 5% budget.
    p = policy(probe_interval=30.0)
    p.computed(256, 256 / 640, now=0.0)
    p.computed(4096, 4096 / 150, now=0.0)
    measured(p, "a", SLOW, now=0.0)
    assert p.advise(["a"] * 64, now=10.0).reason == SKIP_SLOWER
    probe = p.advise(["a"] * 64, now=30.0)
    assert (probe.load, probe.held, probe.reason) == (1, 64, LOAD_PROBE)
    assert p.skipped[SKIP_SLOWER] == 64 + 63
    # One probe per interval, even if the probe's fetch never reports.
    assert p.advise(["a"] * 64, now=31.0).reason == SKIP_SLOWER
    # The probe found it still slow: the next one waits twice as long.
    p.fetched("a", CHUNK_BYTES, CHUNK_BYTES / SLOW, now=31.0)
    assert p.advise(["a"] * 64, now=90.0).reason == SKIP_SLOWER
    assert p.advise(["a"] * 64, now=91.0).reason == LOAD_PROBE
    # The link got fast again: the probe's sample (one chunk in 3 ms) replaces the
    # estimate, and the next hit loads the whole prefix; the backoff is forgotten.
    p.fetched("a", CHUNK_BYTES, 0.003, now=91.5)
    assert p.bandwidth["a"].value == pytest.approx(CHUNK_BYTES / 0.003)
    assert p.advise(["a"] * 64, now=92.0).reason == LOAD_PAYS
    assert p.bandwidth["a"].backoff == 0


def test_probes_back_off_and_skip_short_prompts_but_never_stop() -> None:
    p = policy(probe_interval=30.0)
    p.computed(256, 256 / 640, now=0.0)
    p.computed(4096, 4096 / 150, now=0.0)
    measured(p, "a", SLOW, now=0.0)
    # A 256-token prompt recomputes in 0.4 s; one chunk over the slow link takes 0.74 s:
    # far over the budget, so it does not probe when due ...
    for second in range(30, 60, 5):
        assert p.advise(["a"] * 4, now=float(second)).reason == SKIP_SLOWER
    # ... until the estimate is twice its wait old (60 s): then whatever it costs, so a
    # link that recovered is used again within a minute even by short prompts alone.
    assert p.advise(["a"] * 4, now=60.0).reason == LOAD_PROBE
    # It found the peer still slow: the forced probes back off (120, 240, 480 s).
    p.fetched("a", CHUNK_BYTES, CHUNK_BYTES / SLOW, now=61.0)
    forced = [60]
    for second in range(62, 2000):
        if p.advise(["a"] * 4, now=float(second)).reason == LOAD_PROBE:
            forced.append(second)
            p.fetched("a", CHUNK_BYTES, CHUNK_BYTES / SLOW, now=second + 1.0)
    assert [b - a for a, b in itertools.pairwise(forced)][:4] == [121, 241, 481, 481]
    # Over a day of long-prompt hits every 5 s from a peer that stays slow, the probes
    # come after 30, 60, 120, 240 s, then every 480 s: never stopping, rarely paying.
    q = policy(probe_interval=30.0)
    q.computed(4096, 4096 / 150, now=0.0)
    measured(q, "a", SLOW)
    times = []
    for second in range(1, 86_400, 5):
        if q.advise(["a"] * 64, now=float(second)).reason == LOAD_PROBE:
            times.append(second)
            q.fetched("a", CHUNK_BYTES, CHUNK_BYTES / SLOW, now=second + 1.0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 31 and gaps[:3] == [65, 125, 245], gaps[:4]
    assert set(gaps[3:]) == {485}
    assert times[-1] > 86_400 - 485  # still probing at the end of the day


def test_fast_and_slow_holders_in_one_prefix_load_the_part_that_pays() -> None:
    p = policy()
    smollm2_prefill(p)
    measured(p, "fast", FAST)
    measured(p, "slow", SLOW)
    advice = p.advise(["fast"] * 32 + ["slow"] * 32, now=1.0)
    assert (advice.load, advice.held, advice.reason) == (32, 64, LOAD_PAYS)
    assert advice.peers == ("fast", "slow")
    assert p.skipped == {SKIP_SLOWER: 32}
    # Once the slow holder's estimate is due, the probe reaches 2 of its chunks (1.5 s
    # on top of the fast part: within a 20% budget of the 13.7 s recompute).
    q = policy(probe_chunks=2, probe_budget=0.2)
    smollm2_prefill(q)
    measured(q, "fast", FAST)
    measured(q, "slow", SLOW)
    probe = q.advise(["fast"] * 32 + ["slow"] * 32, now=40.0)
    assert (probe.load, probe.reason) == (34, LOAD_PROBE)
    assert q.bandwidth["fast"].backoff == 0 and q.bandwidth["slow"].backoff == 1


def test_only_the_leading_held_run_counts() -> None:
    p = policy()
    assert p.advise([None, "a", "a"], now=0.0).reason is None
    assert p.advise([], now=0.0).reason is None
    assert p.decisions == {}
    advice = p.advise(["a", "a", None, "a"], now=0.0)
    assert (advice.load, advice.held) == (2, 2)


def test_prefill_rate_per_band_falls_back_to_the_nearest() -> None:
    p = policy()
    assert p.prefill_rate(256) is None
    p.computed(256, 0.4, now=0.0)
    assert p.prefill_rate(256) == pytest.approx(640)
    assert p.prefill_rate(8192) == pytest.approx(640)  # only band measured
    p.computed(4096, 4096 / 300, now=0.0)
    assert p.prefill_rate(4096 + 100) == pytest.approx(300)
    assert p.prefill_rate(300) == pytest.approx(640)
    # 1,024 is as far from 256 as from 4,096: the shorter (faster) band answers.
    assert band(1024) - band(256) == band(4096) - band(1024)
    assert p.prefill_rate(1024) == pytest.approx(640)
    p.computed(256, 256 / 440, now=1.0)  # EWMA: 0.3 of the new sample
    assert p.prefill_rate(256) == pytest.approx(640 + 0.3 * (440 - 640))


def test_prefill_meter_times_a_request_from_scheduling_to_its_last_prompt_chunk() -> None:
    meter = PrefillMeter(chunk_tokens=64)
    prompt = [bytes([i]) * 16 for i in range(6)]
    meter.asked("r1", prompt)
    meter.stored("r1", prompt[:2], now=0.5)  # before its scheduling: not timed
    meter.scheduled(["r1"], (), now=1.0)
    meter.stored("r1", prompt[:4], now=1.6)
    meter.stored("r1", prompt[4:], now=2.0)
    meter.stored("r1", [b"decode chunk...."], now=9.0)  # not one it looked up
    meter.scheduled(["r1"], (), now=3.0)  # scheduled again: the first time counts
    assert meter.finished("r1") == (6 * 64, 1.0)
    assert meter.finished("r1") is None  # forgotten
    # A preempted request gives no sample; nor does one that stored nothing.
    meter.asked("r2", prompt)
    meter.scheduled(["r2"], (), now=1.0)
    meter.stored("r2", prompt, now=2.0)
    meter.scheduled((), ["r2"], now=2.5)
    assert meter.finished("r2") is None
    meter.scheduled(["r3"], (), now=1.0)
    assert meter.finished("r3") is None
    # Requests that never finish do not pile up.
    for i in range(MAX_TRACKED_REQUESTS + 10):
        meter.asked(f"x{i}", prompt[:1])
    assert meter.tracked() == MAX_TRACKED_REQUESTS


def test_policy_takes_the_meters_samples_when_requests_finish() -> None:
    p = policy()
    keys = [bytes([i]) * 16 for i in range(4)]
    p.meter.asked("r", keys)
    p.meter.scheduled(["r"], (), now=10.0)
    p.meter.stored("r", keys, now=10.4)
    assert p.finished("r", now=10.5) == (256, pytest.approx(0.4))
    assert p.prefill_rate(256) == pytest.approx(640)


def test_describe_reports_estimates_and_decisions() -> None:
    p = policy()
    smollm2_prefill(p)
    measured(p, "tcp://h:1", SLOW, now=0.0)
    p.advise(["tcp://h:1"] * 4, now=2.0)
    report = p.describe(now=2.0)
    assert report["bandwidth_bytes_per_s"]["tcp://h:1"] == {
        "per_second": SLOW, "samples": 1, "age_s": 2.0}
    assert set(report["prefill_tokens_per_s"]) == {"256", "4096"}
    assert report["decisions"] == {SKIP_SLOWER: 1}
    assert report["skipped_chunks"] == {SKIP_SLOWER: 4}
    assert report["last"]["reason"] == SKIP_SLOWER
    assert report["last"]["load_s"] == pytest.approx(2.9491, abs=1e-4)
    assert report["chunk_bytes"] == CHUNK_BYTES


@pytest.mark.parametrize(("config", "field"), [
    ({"min_tokens": -1}, "min_tokens"), ({"min_speedup": 0.0}, "min_speedup"),
    ({"min_speedup": float("inf")}, "min_speedup"), ({"probe_interval": 0.0}, "probe_interval"),
    ({"probe_chunks": 0}, "probe_chunks"), ({"probe_budget": -0.1}, "probe_budget"),
])
def test_bad_configuration_is_refused_by_name(config: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoadPolicyConfig(**config)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes"):
        LoadPolicy(LoadPolicyConfig(), chunk_bytes=0, chunk_tokens=64)


def test_one_holder_is_all_or_nothing_whatever_the_bands_measured() -> None:
    """Seen on a loaded engine: band 128 measured at 28.8 tokens/s, band 256 at 42, the
    link at 4.55 MB/s. A 5-chunk prefix from one peer loads whole (7.6 s to recompute
    against 3.2 s to load), never just the 3 chunks whose band looks slowest."""
    p = policy()
    p.computed(192, 192 / 28.8, now=0.0)
    p.computed(256, 256 / 42.0, now=0.0)
    p.fetched("a", 5 * CHUNK_BYTES, 5 * CHUNK_BYTES / 4.55e6, now=0.0)
    advice = p.advise(["a"] * 5, now=1.0)
    assert (advice.load, advice.reason) == (5, LOAD_PAYS)
    assert advice.recompute_seconds == pytest.approx(320 / 42.0)


def test_a_wait_on_an_engine_that_computes_costs_whole_steps() -> None:
    steps = StepMeter()
    assert steps.wait_cost(0.2, now=0.0) == 0.2  # nothing measured: the wait itself
    # Busy steps of 0.5 s (forward passes), ending at 0.0, 0.5, 1.0, ...
    for i in range(STEP_SAMPLES + 1):
        steps.ended(i * 0.5)
    last = STEP_SAMPLES * 0.5
    assert steps.seconds() == pytest.approx(0.5)
    # A request that waits is looked at again a step later, at the soonest.
    assert steps.wait_cost(0.1, now=last + 0.01) == pytest.approx(0.5)
    assert steps.wait_cost(0.7, now=last + 0.01) == pytest.approx(1.0)
    assert steps.wait_cost(1.0, now=last + 0.01) == pytest.approx(1.0)
    # One long step does not move the median; the estimate follows the last steps only.
    steps.ended(last + 3.0)
    assert steps.seconds() == pytest.approx(0.5)
    for i in range(1, STEP_SAMPLES + 1):
        steps.ended(last + 3.0 + i * 0.05)  # decode steps
    assert steps.seconds() == pytest.approx(0.05)
    now = last + 3.0 + STEP_SAMPLES * 0.05
    assert steps.wait_cost(0.12, now=now) == pytest.approx(0.15)
    # A step that scheduled nothing: the engine sleeps until the recheck, the wait is
    # the wait; and its length is no busy step's.
    steps.idle()
    assert steps.wait_cost(0.12, now=now) == 0.12
    steps.ended(now + 2.0)
    assert steps.seconds() == pytest.approx(0.05)
    # An engine that stopped stepping (two step lengths without one) is not computing.
    assert steps.wait_cost(0.01, now=now + 2.0 + 0.2) == 0.01
    assert policy().describe(0.0)["steps"] == {"busy": False, "step_seconds": None,
                                                "samples": 0}


def test_a_wait_for_a_peers_prefill_pays_until_computing_here_would_have_been_done() -> None:
    p = policy()
    # Nothing measured: the wait is taken, bounded by pending_wait only.
    assert p.wait_budget(16, due=1.0, now=0.0) == (PENDING_NO_ESTIMATE, math.inf)
    p.computed(1024, 1024 / 256, now=0.0)  # 256 tokens/s: 16 chunks take 4 s here
    # No bandwidth measured yet: the load after the wait counts nothing.
    reason, budget = p.wait_budget(16, due=1.0, now=0.0)
    assert (reason, budget) == (PENDING_PAYS, pytest.approx(4.0))
    # A link of 16 MB/s moves the 16 chunks in 2.95 s: the wait pays while it stays
    # under the 1.05 s left, and its budget is that.
    measured(p, "a", 16e6)
    reason, budget = p.wait_budget(16, due=0.5, now=0.0)
    assert reason == PENDING_PAYS
    assert budget == pytest.approx(4.0 - 16 * CHUNK_BYTES / 16e6)
    assert p.wait_budget(16, due=1.2, now=0.0) == (PENDING_SLOWER, None)
    # The slowest peer decides: a second, slower link makes the same wait not pay.
    measured(p, "b", 8e6)
    assert p.wait_budget(16, due=0.5, now=0.0) == (PENDING_SLOWER, None)
    assert policy(enabled=False).wait_budget(16, due=100.0, now=0.0) == \
        (PENDING_POLICY_OFF, math.inf)


def test_a_probe_costs_its_load_less_the_computing_it_spares() -> None:
    """A link about as fast as computing (a slow link beside a busy engine) is probed
    when due, by short prompts too: loading the probe's chunk costs about what computing
    it would have, so the probe adds nearly nothing to the request. A link recovered
    after a slowdown is then used again within an interval, not after two."""
    p = policy(probe_interval=30.0)
    p.computed(512, 512 / 300, now=0.0)  # 300 tokens/s: a 64-token chunk in 0.213 s
    slow = CHUNK_BYTES / 0.25  # one chunk in 0.25 s: 12 MB/s
    measured(p, "a", slow, now=0.0)
    assert p.advise(["a"] * 8, now=10.0).reason == SKIP_SLOWER  # 2.0 s against 1.7 s
    # Its load alone (0.25 s) is 15% of the 1.7 s recompute, over the 5% budget; less
    # the chunk it spares (0.213 s), 2%: within it. Due at 30 s, not at 60 s.
    probe = p.advise(["a"] * 8, now=30.0)
    assert (probe.load, probe.reason) == (1, LOAD_PROBE)
    p.fetched("a", CHUNK_BYTES, 0.003, now=30.5)  # the link is fast again
    assert p.advise(["a"] * 8, now=31.0).reason == LOAD_PAYS

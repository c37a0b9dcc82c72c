"""When a hit is worth loading: load or recompute a KV prefix another engine holds (pure).

A prefix held by a peer saves its prefill only if moving its bytes here takes less time
than computing them again. :class:`LoadPolicy` keeps what it needs to tell:

- per peer, the **bandwidth** of this engine's own completed fetches from it (bytes/s);
- the **prefill rate** of this engine's own steps (tokens/s), per prompt-length band,
  measured from when a request is first scheduled to its last stored chunk;

and answers, for the leading run of held chunks of one lookup, how many of them to load
(:meth:`LoadPolicy.advise`): all when the load pays by ``min_speedup``, none when it does
not (the engine recomputes them), the best-paying leading part when chunks come from
peers of different speeds.

Defaults are optimistic: while either estimate is unknown, everything is loaded, so a
new peer or a new engine behaves as without the policy until it has measured. Estimates
are bounded (a zero-length or clock-glitch sample never decides for minutes) and decay:
a peer found slow is never refused for good. Once its estimate is older than
``probe_interval``, a hit from it loads ``probe_chunks`` chunks (a bounded probe), and
that fetch's bandwidth replaces the old estimate. A probe only goes with a request it
slows by at most ``probe_budget`` of its recompute (the probe's load less the computing
it spares: a short prompt waits for no slow link); each probe that finds the peer still
slow doubles the wait for the next one, up to ``2 ** MAX_PROBE_BACKOFF`` intervals. A
peer whose hits all come with prompts too short for the budget is probed by the next
hit whatever it costs once the estimate is twice its wait old (60 s after a first slow
sample by default, then 120, 240, 480 s while it stays slow): a link that was slow for
a while and recovered is used again within about a minute, and a peer that stays slow
costs one request a chunk's load at most every 8 minutes.

A peer's first sample, when its fetch was shorter than ``PROVISIONAL_CHUNKS`` chunks,
is provisional: such a fetch is mostly fixed costs that the next ones do not pay (the
first message on a connection, mapping a same-host peer's pool), or it met the holder
in the middle of a forward pass. It never refuses the peer alone: a hit it would skip
probes the peer at once instead (whatever the budget), and the next sample replaces it.

No IO, no clock: time (``now``, monotonic seconds) is an argument; the caller serialises
calls (one lock).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pkv.protocol.options import option

__all__ = [
    "LOAD_OFF",
    "LOAD_PAYS",
    "LOAD_PROBE",
    "LOAD_UNKNOWN",
    "PENDING_NO_ESTIMATE",
    "PENDING_PAYS",
    "PENDING_POLICY_OFF",
    "PENDING_SLOWER",
    "SKIP_FLOOR",
    "SKIP_SLOWER",
    "Advice",
    "LoadPolicy",
    "LoadPolicyConfig",
    "PrefillMeter",
    "Rate",
    "StepMeter",
]

#: Reasons of a decision (the ``reason`` label of the tier's metrics). Loads:
LOAD_PAYS = "pays"                 # loading is faster than recomputing by min_speedup
LOAD_UNKNOWN = "no_estimate"       # a bandwidth or the prefill rate is not measured yet
LOAD_PROBE = "probe"               # a bounded load to measure a peer found slow earlier
LOAD_OFF = "policy_off"            # the policy is switched off: every hit is loaded
#: Skips (the engine recomputes the chunks):
SKIP_FLOOR = "below_floor"         # fewer than min_tokens held
SKIP_SLOWER = "slower_than_recompute"
#: Decisions on chunks a peer is computing (pending-v1): waited for (it pays, nothing
#: is measured yet, the policy is off), or computed here (waiting and loading is slower).
PENDING_PAYS = "pending_pays"
PENDING_NO_ESTIMATE = "pending_no_estimate"
PENDING_POLICY_OFF = "pending_policy_off"
PENDING_SLOWER = "pending_slower_than_recompute"

#: A bandwidth sample is clamped into this range (bytes/s) ...
BANDWIDTH_BOUNDS = (1e3, 1e12)
#: ... and a prefill-rate sample into this one (tokens/s).
PREFILL_BOUNDS = (1e-1, 1e8)
#: Weight of a faster bandwidth sample. A slower one replaces the estimate at once
#: (trusting a link that got slower costs a slow load per request, doubting one that got
#: faster costs recomputes until the next probe), as any sample replaces a stale one.
BANDWIDTH_RISE = 0.5
#: Weight of a new prefill-rate sample (every computed request gives one).
PREFILL_WEIGHT = 0.3
#: A peer's first sample from a fetch of fewer chunks than this is provisional (see the
#: module's docstring).
PROVISIONAL_CHUNKS = 4
#: Probes that found a peer still slow double its probe interval, at most this many times.
MAX_PROBE_BACKOFF = 4
#: Requests tracked at once for prefill samples (the oldest are dropped past it).
MAX_TRACKED_REQUESTS = 4096
#: Busy scheduler steps whose lengths the step estimate is the median of.
STEP_SAMPLES = 8


@dataclass(frozen=True)
class LoadPolicyConfig:
    """What the policy decides by: the vLLM tier's ``load_*`` options (each field is
    ``load_`` + its name, ``enabled`` is ``load_policy``; their meanings, defaults and
    bounds are the one table's, p2pkv.protocol.options). With ``enabled`` False every
    hit is loaded (the estimates are still kept and reported)."""

    enabled: bool = option("load_policy").default
    min_tokens: int = option("load_min_tokens").default
    min_speedup: float = option("load_min_speedup").default
    probe_interval: float = option("load_probe_interval").default
    probe_chunks: int = option("load_probe_chunks").default
    probe_budget: float = option("load_probe_budget").default

    def __post_init__(self) -> None:
        for name in ("enabled", "min_tokens", "min_speedup", "probe_interval",
                     "probe_chunks", "probe_budget"):
            opt = option("load_policy" if name == "enabled" else "load_" + name)
            object.__setattr__(self, name, opt.check(getattr(self, name), spell=str))


@dataclass
class Rate:
    """One estimate (units per second) and when it was last fed or probed."""

    value: float
    samples: int
    updated: float
    probed: float
    #: Probes since the peer last paid (each doubles the interval to the next one).
    backoff: int = 0
    #: From one short fetch only: the next sample replaces it, and until a hit has
    #: asked for that sample (``rechecking``) it never refuses the peer.
    provisional: bool = False
    rechecking: bool = False

    def describe(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {"per_second": round(self.value, 3), "samples": self.samples,
                               "age_s": round(now - self.updated, 3)}
        if self.backoff:
            out["probe_backoff"] = self.backoff
        if self.provisional:
            out["provisional"] = True
        return out


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


@dataclass(frozen=True)
class Advice:
    """How many leading chunks of a lookup to promise (HIT), and why."""

    load: int
    held: int
    reason: str | None
    load_seconds: float | None = None
    recompute_seconds: float | None = None
    peers: tuple[str, ...] = ()

    @property
    def skipped(self) -> int:
        """Chunks held by a peer that the engine recomputes instead."""
        return self.held - self.load

    @property
    def skip_reason(self) -> str:
        """Why the skipped chunks are recomputed: every skip but the floor's is a part
        whose load was estimated slower than recomputing it."""
        return SKIP_FLOOR if self.reason == SKIP_FLOOR else SKIP_SLOWER

    def describe(self) -> dict[str, Any]:
        return {"reason": self.reason, "held": self.held, "load": self.load,
                "load_s": _round(self.load_seconds),
                "recompute_s": _round(self.recompute_seconds), "peers": list(self.peers)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


@dataclass
class _Request:
    asked: set[bytes] = field(default_factory=set)
    scheduled: float | None = None
    stored: int = 0
    last_store: float | None = None
    void: bool = False


class PrefillMeter:
    """Prefill-rate samples from a scheduler's own hooks.

    A request's sample is the chunks it computed and stored of those it looked up (its
    prompt's, not the decode's), over the time from its first scheduling to its last
    store. Preempted requests give none (their time includes the wait)."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self._requests: OrderedDict[str, _Request] = OrderedDict()

    def _get(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request()
            while len(self._requests) > MAX_TRACKED_REQUESTS:
                self._requests.popitem(last=False)
        return req

    def asked(self, req_id: str, keys: Iterable[bytes]) -> None:
        self._get(req_id).asked.update(keys)

    def scheduled(self, req_ids: Iterable[str], preempted: Iterable[str], now: float) -> None:
        for req_id in req_ids:
            req = self._get(req_id)
            if req.scheduled is None:
                req.scheduled = now
        for req_id in preempted:
            self._get(req_id).void = True

    def stored(self, req_id: str, keys: Collection[bytes], now: float) -> None:
        req = self._requests.get(req_id)
        if req is None or req.scheduled is None:
            return
        n = sum(1 for k in keys if k in req.asked)
        if n:
            req.stored += n
            req.last_store = now

    def finished(self, req_id: str) -> tuple[int, float] | None:
        """The request's sample (tokens, seconds), if it gave one; forgets it."""
        req = self._requests.pop(req_id, None)
        if req is None or req.void or req.scheduled is None or req.last_store is None:
            return None
        seconds = req.last_store - req.scheduled
        if req.stored <= 0 or seconds <= 0:
            return None
        return req.stored * self.chunk_tokens, seconds

    def tracked(self) -> int:
        return len(self._requests)


class StepMeter:
    """How long this engine's scheduler steps take while it computes, and whether it is
    computing now: a request the tier answers RETRY is looked at again only at the next
    step, so on a busy engine waiting for chunks a peer is computing costs whole steps,
    however soon they are due.

    The scheduler thread reports the end of every step (:meth:`ended`) and, under
    ``P2PKVConnector``, a step that scheduled nothing (:meth:`idle`). A busy step's
    length is the time from its end to the next one's (its forward pass and the next
    scheduling); the estimate is the median of the last :data:`STEP_SAMPLES`."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=STEP_SAMPLES)
        self._last_end: float | None = None
        self._busy = False

    def ended(self, now: float) -> None:
        """A step's scheduling ended at ``now`` (busy until :meth:`idle` says not)."""
        if self._busy and self._last_end is not None:
            self._samples.append(now - self._last_end)
        self._last_end = now
        self._busy = True

    def idle(self) -> None:
        """The step that just ended scheduled nothing."""
        self._busy = False

    def seconds(self) -> float | None:
        """The busy steps' median length, or None before the first."""
        return statistics.median(self._samples) if self._samples else None

    def wait_cost(self, due: float, now: float) -> float:
        """What waiting ``due`` seconds costs a request here: ``due`` on an idle engine
        (its scheduler sleeps until the recheck, see :mod:`.lookups`); on one that is
        computing, whole steps, at least one. An engine that has not ended a step for two
        step lengths is not computing."""
        step = self.seconds()
        if not self._busy or not step or self._last_end is None \
                or now - self._last_end > 2 * step:
            return due
        return step * max(1, math.ceil(due / step))

    def describe(self) -> dict[str, Any]:
        return {"busy": self._busy, "step_seconds": self.seconds(),
                "samples": len(self._samples)}


def _load_seconds(part: Sequence[str], rates: dict[str, float], chunk_bytes: int) -> float:
    """Estimated time to load chunks held by ``part[i]``: one fetch per peer, in
    parallel, so the slowest decides."""
    counts: dict[str, int] = {}
    for peer in part:
        counts[peer] = counts.get(peer, 0) + 1
    return max((c * chunk_bytes / rates[p] for p, c in counts.items()), default=0.0)


def band(tokens: int) -> int:
    """The prompt-length band of ``tokens``: prefill slows as prompts grow (attention),
    so rates are kept per power of two."""
    return max(0, int(tokens).bit_length() - 1)


class LoadPolicy:
    """Bandwidth and prefill-rate estimates, and the load-or-recompute decision."""

    def __init__(self, config: LoadPolicyConfig, *, chunk_bytes: int, chunk_tokens: int) -> None:
        if chunk_bytes <= 0 or chunk_tokens <= 0:
            raise ValueError(f"chunk_bytes and chunk_tokens must be positive, got "
                             f"{chunk_bytes} and {chunk_tokens}")
        self.config = config
        self.chunk_bytes = chunk_bytes
        self.chunk_tokens = chunk_tokens
        self.meter = PrefillMeter(chunk_tokens)
        self.steps = StepMeter()
        self.bandwidth: dict[str, Rate] = {}
        #: Prefill rate (tokens/s) by :func:`band` of the tokens computed.
        self.prefill: dict[int, Rate] = {}
        self.decisions: dict[str, int] = {}
        self.skipped: dict[str, int] = {}
        self.last: Advice | None = None

    # ------------------------------------------------------------------ estimates

    def fetched(self, peer: str, nbytes: int, seconds: float, now: float) -> None:
        """A completed fetch from ``peer``: ``nbytes`` landed in ``seconds``."""
        if nbytes <= 0:
            return
        sample = _clamp(nbytes / max(seconds, 1e-9), BANDWIDTH_BOUNDS)
        est = self.bandwidth.get(peer)
        if est is None:
            self.bandwidth[peer] = Rate(
                sample, 1, now, now,
                provisional=nbytes < PROVISIONAL_CHUNKS * self.chunk_bytes)
            return
        # An estimate older than probe_interval has decayed, and a provisional one is
        # only a placeholder: a new sample replaces either.
        stale = now - est.updated >= self.config.probe_interval
        est.value = sample if stale or est.provisional or sample < est.value else \
            est.value + BANDWIDTH_RISE * (sample - est.value)
        est.samples += 1
        est.updated = est.probed = now
        est.provisional = est.rechecking = False

    def computed(self, tokens: int, seconds: float, now: float) -> None:
        """This engine computed ``tokens`` prompt tokens of one request in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        sample = _clamp(tokens / seconds, PREFILL_BOUNDS)
        est = self.prefill.get(band(tokens))
        if est is None:
            self.prefill[band(tokens)] = Rate(sample, 1, now, now)
            return
        est.value += PREFILL_WEIGHT * (sample - est.value)
        est.samples += 1
        est.updated = now

    def finished(self, req_id: str, now: float) -> tuple[int, float] | None:
        """A request ended: its prefill sample (see :class:`PrefillMeter`) is taken."""
        sample = self.meter.finished(req_id)
        if sample is not None:
            self.computed(sample[0], sample[1], now)
        return sample

    def prefill_rate(self, tokens: int) -> float | None:
        """Tokens/s for a prompt part of ``tokens``: its band's estimate, else the nearest
        band's (on a tie the shorter band: it is the faster, which favours recomputing)."""
        if not self.prefill:
            return None
        b = band(tokens)
        nearest = min(self.prefill, key=lambda x: (abs(x - b), x))
        return self.prefill[nearest].value

    # ------------------------------------------------------------------ the decision

    def advise(self, holders: Sequence[str | None], now: float) -> Advice:
        """How many leading chunks to load, for one lookup whose chunk ``i`` is held by
        peer ``holders[i]`` (None: nobody; only the leading held run can be loaded)."""
        run: list[str] = []
        for holder in holders:
            if holder is None:
                break
            run.append(holder)
        n = len(run)
        if n == 0:
            return Advice(0, 0, None)
        peers = tuple(dict.fromkeys(run))
        cfg = self.config
        if not cfg.enabled:
            return self._decided(Advice(n, n, LOAD_OFF, peers=peers))
        if n * self.chunk_tokens < cfg.min_tokens:
            return self._decided(Advice(0, n, SKIP_FLOOR, peers=peers))
        if not self.prefill or any(p not in self.bandwidth for p in peers):
            return self._decided(Advice(n, n, LOAD_UNKNOWN, peers=peers))
        rates = {p: self.bandwidth[p].value for p in peers}
        best, at_best, whole = self._best_prefix(run, rates)
        for p in run[:best]:  # a peer whose load pays is not probed
            self.bandwidth[p].backoff = 0
        if best == n:
            return self._decided(Advice(n, n, LOAD_PAYS, *at_best, peers))
        probe = self._probe(run, rates, best, whole[1], now)
        if probe:
            return self._decided(Advice(probe, n, LOAD_PROBE, *whole, peers))
        if best > 0:
            return self._decided(Advice(best, n, LOAD_PAYS, *at_best, peers))
        return self._decided(Advice(0, n, SKIP_SLOWER, *whole, peers))

    def wait_budget(self, chunks: int, due: float, now: float) -> tuple[str, float | None]:
        """Whether to wait ``due`` seconds for ``chunks`` chunks a peer is computing, then
        load them, rather than compute them here: the reason, and the wait's budget
        (None: compute here; ``math.inf`` without a prefill estimate or with the policy
        off). The wait costs whole steps while this engine computes
        (:meth:`StepMeter.wait_cost`); the load goes at the slowest measured peer's
        bandwidth; no ``min_speedup`` margin (a wait that breaks even frees this engine
        for other requests). The budget is how long from ``now`` waiting still pays
        (computing here less the load): a computation that runs late costs at most that."""
        tokens = chunks * self.chunk_tokens
        rate = self.prefill_rate(tokens)
        if not self.config.enabled:
            return PENDING_POLICY_OFF, math.inf
        if rate is None:
            return PENDING_NO_ESTIMATE, math.inf
        rates = [r.value for r in self.bandwidth.values()]
        load = chunks * self.chunk_bytes / min(rates) if rates else 0.0
        recompute = tokens / rate
        if self.steps.wait_cost(due, now) + load >= recompute:
            return PENDING_SLOWER, None
        return PENDING_PAYS, recompute - load

    def _probe(self, run: list[str], rates: dict[str, float], best: int, recompute: float,
               now: float) -> int:
        """The chunks to load to probe the holders of the part not loaded whose estimate
        is due (0: no probe now), marking them probed."""
        cfg = self.config

        def waited(peer: str, backoff: int) -> bool:
            est = self.bandwidth[peer]
            if est.provisional and not est.rechecking:
                return True
            return now - est.probed >= cfg.probe_interval * (1 << backoff)

        due = {p for p in run[best:] if waited(p, self.bandwidth[p].backoff)}
        if not due:
            return 0
        length = self._probe_length(run, due, best)
        cost = _load_seconds(run[:length], rates, self.chunk_bytes) - \
            _load_seconds(run[:best], rates, self.chunk_bytes) - \
            recompute * (length - best) / len(run)
        if cost > cfg.probe_budget * recompute and not any(
                waited(p, min(self.bandwidth[p].backoff + 1, MAX_PROBE_BACKOFF))
                for p in due):
            return 0
        for p in due:
            est = self.bandwidth[p]
            if est.provisional:  # a second opinion, no probe of a peer found slow
                est.rechecking = True
            else:
                est.backoff = min(est.backoff + 1, MAX_PROBE_BACKOFF)
            est.probed = now
        return length

    def _best_prefix(self, run: list[str], rates: dict[str, float]
                     ) -> tuple[int, tuple[float, float], tuple[float, float]]:
        """The leading part that saves the most time among those that pay by
        ``min_speedup``, with its (load, recompute) seconds, and those of the whole run.

        Parts end where the holder changes (one holder: all or nothing). Fetches from
        several peers run in parallel, so the slowest one decides a part's load time; its
        recompute time is at the prefill rate of the whole run's length."""
        rate = self.prefill_rate(len(run) * self.chunk_tokens) or PREFILL_BOUNDS[0]
        counts: dict[str, int] = {}
        best, best_gain = 0, 0.0
        at_best = whole = (0.0, 0.0)
        for k, peer in enumerate(run, start=1):
            counts[peer] = counts.get(peer, 0) + 1
            if k < len(run) and run[k] == peer:
                continue
            tokens = k * self.chunk_tokens
            whole = (max(c * self.chunk_bytes / rates[p] for p, c in counts.items()),
                     tokens / rate)
            load, recompute = whole
            if (tokens >= self.config.min_tokens
                    and recompute >= self.config.min_speedup * load
                    and recompute - load >= best_gain):
                best, best_gain, at_best = k, recompute - load, whole
        return best, at_best, whole

    def _probe_length(self, run: list[str], stale: set[str], start: int) -> int:
        """Leading chunks up to the ``probe_chunks``-th one after ``start`` that a stale
        peer holds (and at least ``min_tokens`` worth)."""
        length = len(run)
        seen = 0
        for i in range(start, len(run)):
            if run[i] in stale:
                seen += 1
                if seen == self.config.probe_chunks:
                    length = i + 1
                    break
        floor_chunks = -(-self.config.min_tokens // self.chunk_tokens)
        return min(len(run), max(length, floor_chunks))

    def _decided(self, advice: Advice) -> Advice:
        assert advice.reason is not None
        self.decisions[advice.reason] = self.decisions.get(advice.reason, 0) + 1
        if advice.skipped:
            why = advice.skip_reason
            self.skipped[why] = self.skipped.get(why, 0) + advice.skipped
        self.last = advice
        return advice

    # ------------------------------------------------------------------ observability

    def describe(self, now: float) -> dict[str, Any]:
        """The configuration, the estimates, the decisions so far and the last one."""
        cfg = self.config
        return {
            "enabled": cfg.enabled, "min_tokens": cfg.min_tokens,
            "min_speedup": cfg.min_speedup, "probe_interval": cfg.probe_interval,
            "probe_chunks": cfg.probe_chunks, "probe_budget": cfg.probe_budget,
            "chunk_bytes": self.chunk_bytes,
            "chunk_tokens": self.chunk_tokens,
            "bandwidth_bytes_per_s": {p: r.describe(now) for p, r in self.bandwidth.items()},
            "prefill_tokens_per_s": {str(1 << b): r.describe(now)
                                     for b, r in sorted(self.prefill.items())},
            "steps": self.steps.describe(),
            "decisions": dict(self.decisions), "skipped_chunks": dict(self.skipped),
            "last": self.last.describe() if self.last else None,
        }

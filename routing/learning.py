"""What the router learns online: each replica's time to first token (its pending work, the
queue that TTFT is predicted behind, is `routing.pending`).

TTFT model. Per replica, TTFT = ``fixed_s`` + work / rate: a fixed part (the engine step the
prefill runs in, which also carries the decoding batch; the step in progress; the network)
plus the prefill work ahead of the first token at the replica's rate. Without the fixed part
a replica that serves mostly cache hits (little work, the same fixed time) would learn a
much lower rate than one serving misses, and look slow because it holds the cache.

Observations (work tokens, seconds) come from two places:

- a streamed first token: kvgate predicted, at routing time, the work ahead of the request
  (pending work it had sent there + the request's own uncached tokens), and now sees its TTFT;
- the replica's scraped counters (`EngineCounters`): between two scrapes, the mean prefill
  time (scheduled -> first token) and the mean prompt tokens computed per request, weighted by
  the requests in the interval -- so non-streamed traffic, and other clients' traffic on a
  shared replica, teach the model too. While the model is cold, only the intervals with no
  request waiting at either of their scrapes teach it (`observe_counters`).

The fit is a decayed weighted least-squares line through them, anchored by a prior: two
pseudo-observations (no work, and `PRIOR_ANCHOR_TOKENS` of work; together worth
``fleet_weight`` observations) on the line of the *fleet's* fit -- every replica's
observations together, itself anchored the same way (``prior_weight``) on the configured prior
(``prior_fixed_s``, ``prior_prefill_tps``). So a replica that sees too few or too similar
observations (one that serves only cache hits cannot tell its rate from its fixed part)
leans on what its peers show rather than swinging, while its own observations decide as
soon as they say something. A replica with fewer (decayed) observations than ``fleet_weight``
uses the fleet's fit as it is: two identical replicas must not differ because one of them
happened to serve a request first (every cold request would follow the first).

A replica that had none of the fleet's last `IDLE_SHARES` observations per replica (its fair
share many times over) returns to the fleet's fit. An idle replica yields no first token and
no counter that could correct its fit, so a fit learned from a cold start's queue (the wait
read as a large fixed part: prefix-tree, replica-2 at 0.59 s fixed against its peers'
0.06-0.16 s) kept it idle for the rest of the run. The replicas that serve keep their fits,
a slower one too: its share shrinks but does not vanish.

Bounds: an observation counts at most ``outlier_factor`` x (or 1/x) the current prediction,
the fixed part is in [0, ``max_fixed_s``], the rate in [``floor_tps``, `MAX_PREFILL_TPS`].
One outlier therefore moves the fit a little, a changed
replica (another model, a busy GPU) moves it within a few dozen requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from routing.pending import PendingWork, ReplicaPending

__all__ = [
    "IDLE_SHARES", "MAX_PREFILL_TPS", "PRIOR_ANCHOR_TOKENS", "EngineCounters", "PendingWork",
    "ReplicaPending", "TtftFit", "TtftModel",
]

PRIOR_ANCHOR_TOKENS = 2048.0  # the prior's second pseudo-observation (a small prompt)
MAX_PREFILL_TPS = 1e6  # no engine prefills faster: a bound for fits that see little work
_MIN_SPT = 1.0 / MAX_PREFILL_TPS
_SCRAPE_WEIGHT_CAP = 4.0  # one scrape interval counts as at most this many observations
IDLE_SHARES = 32  # fleet observations per replica without one of a replica's: it is idle
# a prefill's work past this many tokens is no observation (no context holds a millionth of
# it): an engine's absurd counters (1e300 computed tokens) overflowed the fit's sums, and the
# fleet's fit -- every replica's without one of its own -- became NaN for good
_MAX_WORK_TOKENS = 1e12


@dataclass(frozen=True, slots=True)
class TtftFit:
    """TTFT = fixed_s + work_tokens x s_per_token."""

    fixed_s: float
    s_per_token: float

    @property
    def rate(self) -> float:
        return 1.0 / self.s_per_token

    def predict(self, work_tokens: float) -> float:
        return self.fixed_s + work_tokens * self.s_per_token


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Cumulative counters of one replica's engine (a scrape of vLLM's /metrics).

    ``prefill_seconds`` / ``prefill_requests``: ``vllm:request_prefill_time_seconds`` sum and
    count; ``computed_tokens``: ``vllm:request_prefill_kv_computed_tokens`` sum (or, on an
    engine without it, prompt tokens minus prefix-cache hits); ``waiting``: the
    ``vllm:num_requests_waiting`` gauge at that scrape (None: unknown)."""

    prefill_seconds: float
    prefill_requests: float
    computed_tokens: float
    waiting: float | None = None

    @property
    def queued(self) -> bool:
        """Requests were waiting at this scrape (unknown counts as none: fail open)."""
        return self.waiting is not None and self.waiting > 0.0


@dataclass(slots=True)
class _Sums:
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def scale(self, k: float) -> None:
        self.w *= k
        self.x *= k
        self.y *= k
        self.xx *= k
        self.xy *= k

    def add(self, x: float, y: float, w: float) -> None:
        self.w += w
        self.x += w * x
        self.y += w * y
        self.xx += w * x * x
        self.xy += w * x * y


class TtftModel:
    def __init__(
        self, prior_tps: float, prior_fixed_s: float, prior_weight: float, decay: float,
        floor_tps: float, max_fixed_s: float, outlier_factor: float, fleet_weight: float,
        cold_observations: float = 0.0,
    ) -> None:
        """``cold_observations``: per replica scraped, the observations before the model is
        warm (`observe_counters`; 0: never cold)."""
        self.prior = TtftFit(prior_fixed_s, 1.0 / prior_tps)
        self._weight = prior_weight
        self._fleet_weight = fleet_weight
        self._decay = decay
        self._fleet_decay = decay**0.25  # the fleet's sums see every replica's observations
        self._max_spt = 1.0 / floor_tps
        self._max_fixed = max_fixed_s
        self._outlier = outlier_factor
        self._cold_per_replica = cold_observations
        self._fleet = _Sums()
        self.fleet = self.prior  # every replica's observations together (the replicas' prior)
        self._sums: dict[str, _Sums] = {}
        self._fits: dict[str, TtftFit] = {}
        self._counters: dict[str, EngineCounters] = {}
        self._seen = 0  # the fleet's observations so far
        self._last: dict[str, int] = {}  # per replica, `_seen` at its last observation
        self._sweep_at = 0

    @property
    def observations(self) -> int:
        """Observations learned so far, every replica's."""
        return self._seen

    def fits(self) -> Mapping[str, TtftFit]:
        """Learned fits by replica (`fleet` for replicas not in it): for the hot loop."""
        return self._fits

    def fit(self, replica: str) -> TtftFit:
        return self._fits.get(replica, self.fleet)

    def rate(self, replica: str) -> float:
        return self.fit(replica).rate

    def observe(
        self, replica: str, work_tokens: float, seconds: float, weight: float = 1.0
    ) -> None:
        """``work_tokens`` of prefill took ``seconds`` to a first token (``weight``
        observations of that mean)."""
        if not (seconds > 0.0 and 0.0 <= work_tokens <= _MAX_WORK_TOKENS and weight > 0.0):
            return  # (NaN too)
        expected = self.fit(replica).predict(work_tokens)
        seconds = min(max(seconds, expected / self._outlier), expected * self._outlier)
        self._fleet.scale(self._fleet_decay**weight)
        self._fleet.add(work_tokens, seconds, weight)
        self.fleet = self._solve(self._fleet, self.prior, self._weight)
        sums = self._sums.get(replica)
        if sums is None:
            sums = self._sums[replica] = _Sums()
        sums.scale(self._decay**weight)
        sums.add(work_tokens, seconds, weight)
        if sums.w >= self._fleet_weight:  # until then its own few observations are noise
            self._fits[replica] = self._solve(sums, self.fleet, self._fleet_weight)
        self._tick(replica)

    def _tick(self, replica: str) -> None:
        """One more sample of ``replica``'s (learned or skipped): the clock of `cold` and of
        the idle rule."""
        self._seen += 1
        self._last[replica] = self._seen
        if self._seen >= self._sweep_at:
            self._retire_idle()

    @property
    def cold(self) -> bool:
        """Fewer samples than ``cold_observations`` per replica scraped so far (the same
        clock as cache_aware's waiting floor)."""
        return self._seen < self._cold_per_replica * max(1, len(self._counters))

    def _retire_idle(self) -> None:
        """Replicas without an observation over the last `IDLE_SHARES` per replica go back
        to the fleet's fit (their counters stay: the next scrape still makes an interval)."""
        period = IDLE_SHARES * len(self._last)
        self._sweep_at = self._seen + period
        for replica in [r for r, at in self._last.items() if self._seen - at > period]:
            del self._last[replica]
            self._sums.pop(replica, None)
            self._fits.pop(replica, None)

    def observe_counters(self, replica: str, counters: EngineCounters) -> None:
        """A scrape of ``replica``'s engine counters: the interval since the last one is an
        observation (a restarted engine, whose counters went back, starts over).

        While the model is `cold`, an interval with requests waiting at either of its scrapes
        teaches nothing (it still counts as a sample, so the cold period is no longer): a
        saturated engine's prefill time carries the chunks of the prompts prefilled beside
        it, while its computed tokens count only its own, so a cold start's intervals taught a
        fixed part of about one step and a flattened slope (prefix-tree's first seconds: 0.3 s
        + 33k-47k tokens/s on 25k engines; docs/routing-and-replay.md). Once warm they teach
        again: an engine that always queues (a slow replica, other clients) must be learned."""
        last = self._counters.get(replica)
        self._counters[replica] = counters
        if last is None:
            return
        n = counters.prefill_requests - last.prefill_requests
        seconds = counters.prefill_seconds - last.prefill_seconds
        tokens = counters.computed_tokens - last.computed_tokens
        if n < 1.0 or seconds <= 0.0 or tokens < 0.0:
            return
        if (last.queued or counters.queued) and self.cold:
            self._tick(replica)
            return
        self.observe(replica, tokens / n, seconds / n, min(n, _SCRAPE_WEIGHT_CAP))

    def _solve(self, sums: _Sums, prior: TtftFit, weight: float) -> TtftFit:
        """The least-squares line through ``sums`` and ``prior``'s two pseudo-observations
        (no work, and `PRIOR_ANCHOR_TOKENS`; together worth ``weight`` observations), bounded."""
        half, x1 = weight / 2.0, PRIOR_ANCHOR_TOKENS
        y0, y1 = prior.fixed_s, prior.predict(x1)
        w, x, y = sums.w + 2.0 * half, sums.x + half * x1, sums.y + half * (y0 + y1)
        xx, xy = sums.xx + half * x1 * x1, sums.xy + half * x1 * y1
        det = w * xx - x * x
        spt = (w * xy - x * y) / det if det > 0.0 else prior.s_per_token
        spt = min(max(spt, _MIN_SPT), self._max_spt)
        fixed = (y - spt * x) / w
        if not 0.0 <= fixed <= self._max_fixed:
            # the bound binds: refit the slope through the bounded intercept
            fixed = min(max(fixed, 0.0), self._max_fixed)
            spt = min(max((xy - fixed * x) / xx, _MIN_SPT), self._max_spt)
        return TtftFit(fixed, spt)

    def forget(self, replica: str) -> None:
        self._sums.pop(replica, None)
        self._fits.pop(replica, None)
        self._counters.pop(replica, None)
        self._last.pop(replica, None)

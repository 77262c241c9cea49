"""Per-replica state the gateway owns: in-flight accounting and passive health.

`Replica.acquire` hands out a `Lease` whose `release` is idempotent and is called from a
``finally`` on every path (success, upstream error, timeout, client disconnect), so counters
cannot leak. Health is a small state machine: consecutive failures, or half of its last 20
requests failed, eject a replica for an exponentially growing back-off; when it expires the
replica is half-open and one request decides. A refused connection, a dead engine or a failed
`/health` ejects at once (`mark_down`), and such a replica is known to be down: it stays out
past its back-off until `/health` answers again (`probe_recovered`), so a pool whose replicas
are all gone answers 503 with Retry-After and is not ready, instead of a trial on a dead
replica each time a back-off expires. A slow `/health` ejects only after `slow_threshold`
consecutive slow probes (vLLM serves it on the loop that is busy with requests). Apart from
health, a replica that answers vLLM's busy 503 is *backing off* (`record_busy`): its view says
unavailable for a short, growing while, so no policy keeps sending it the traffic it rejects
at once. Time is passed in, so the machine is testable without sleeps.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.scrape import Sample
from routing.learning import TtftFit
from routing.types import ReplicaView

__all__ = ["HealthRules", "Lease", "Replica", "RetryBudget", "replica_id"]

HEALTHY, EJECTED, HALF_OPEN = "healthy", "ejected", "half_open"
# the one down reason naming a host (`transport.connect_failure`): clients are told less
_HOST = re.compile(r"cannot resolve host \S+")


def replica_id(url: str) -> str:
    """A replica's id: host:port of its URL (the default the metrics and headers use)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


@dataclass(frozen=True, slots=True)
class HealthRules:
    failure_threshold: int = 3
    eject_base_s: float = 1.0
    eject_max_s: float = 30.0
    slow_threshold: int = 3  # consecutive slow (timed-out) /health probes -> eject
    busy_backoff_s: float = 0.25  # first busy-503 back-off; doubles while it keeps answering busy
    busy_backoff_max_s: float = 2.0
    # ... or when at least half of its last `window` requests failed (`Replica.outcomes`): a
    # replica failing every other request (connections dropped on and off) had its
    # consecutive count started over by each success, failed fast, looked idle and drew up
    # to 64 % of its pool's requests; one failing one in five stays in rotation. Never with
    # fewer failures than `failure_threshold` (raised, e.g. for a pool's only replica, it
    # holds for both rules)
    window: int = 20


class Replica:
    """One upstream replica of a pool."""

    __slots__ = (
        "_heard_answers", "_policy", "answers", "attempts", "busy_streak", "busy_until",
        "down", "draining", "ejected_until", "ejections", "failed", "failures", "heard_at",
        "hit_ratio", "id", "inflight", "inflight_prefill", "inflight_prefill_tokens",
        "outcomes", "pool", "reason", "refusal_warned", "scraped", "scraped_at",
        "slow_probes", "state", "url", "waiting_since", "watch", "whole_waiting_tokens",
    )

    def __init__(self, pool: str, url: str, policy: HealthRules) -> None:
        self.pool = pool
        self.url = url.rstrip("/")
        self.id = replica_id(url)
        self._policy = policy
        self.inflight = 0
        self.inflight_prefill = 0  # requests still waiting for their first token
        self.inflight_prefill_tokens = 0
        # the part of those tokens that non-streamed requests wait with: their first token is
        # their whole answer, so nothing tells when their prefill ended (`hung` leaves them out)
        self.whole_waiting_tokens = 0
        self.answers = 0  # requests that got their first token (or whole answer) here: progress
        # when it was last heard from (`silent_for`): an answer, or its engine's counters
        # moving between two scrapes; and since when requests have waited there (None: none)
        self.heard_at = 0.0
        self._heard_answers = 0
        self.waiting_since: float | None = None
        self.scraped: Sample | None = None  # the last good scrape of its /metrics
        self.scraped_at = 0.0
        # prefix-cache hits / queries between the last two good scrapes (None: no traffic yet)
        self.hit_ratio: float | None = None
        self.state = HEALTHY
        self.failures = 0  # consecutive (health's): a success starts it over
        # cumulative, for operators (kvgate_replica_attempts_total / _failures_total, the
        # doctor): requests sent here, retries included, and those that failed here; a
        # replica failing one request in five stays in rotation (the retries hide it)
        self.attempts = 0
        self.failed = 0
        # its last `window` judged requests, one bit each (1: failed), newest lowest; kept
        # across an ejection: a replica back from one is ejected again by its next failure
        # until successes have pushed the old failures out
        self.outcomes = 0
        self.ejections = 0
        self.ejected_until = 0.0
        self.down = False  # marked down (refused, dead, /health failed): out until /health answers
        # why it was last found down ("cannot resolve host NAME", "/health answered 503"), for
        # the pools' not-ready reasons; None once it answers again
        self.reason: str | None = None
        self.slow_probes = 0  # consecutive /health probes that timed out
        self.busy_until = 0.0  # answered busy (503): no new picks before this time
        self.busy_streak = 0
        # warned about refusing kvgate's credentials and has served no request since (vLLM's
        # /health needs no key: such a replica is back every health cycle and refuses again)
        self.refusal_warned = False
        # left its pool (discovery or policy): takes no new requests, finishes its in-flight
        self.draining = False
        # called when a request on it ends (shared routing state publishes the change at
        # once: a client's next turn may reach another gateway a millisecond later)
        self.watch: Callable[[], None] | None = None

    # -- accounting ---------------------------------------------------------------------
    def acquire(self, prompt_tokens: int, stream: bool = True, now: float | None = None) -> Lease:
        """A request goes here; `stream`: it is answered as a stream (its first token shows
        when its prefill is done), else whole; `now`: when it is sent (the first to wait
        there starts `silent_for`'s count; None: from the next look)."""
        if self.inflight_prefill <= 0:
            self.waiting_since = now
        self.attempts += 1
        self.inflight += 1
        self.inflight_prefill += 1
        self.inflight_prefill_tokens += prompt_tokens
        if not stream:
            self.whole_waiting_tokens += prompt_tokens
        return Lease(self, prompt_tokens, stream)

    def record_scrape(self, sample: Sample | None, now: float) -> bool:
        """A scrape finished; a failed one (None) leaves the last good sample to age. True
        when the engine restarted since the last good one (its counters went back): its
        prefix cache is empty."""
        if sample is None:
            return False
        prev = self.scraped
        restarted = False
        if prev is not None:
            self.hit_ratio = _delta_ratio(
                prev.prefix_cache_hits, prev.prefix_cache_queries,
                sample.prefix_cache_hits, sample.prefix_cache_queries, self.hit_ratio,
            )
            restarted = _went_back(prev, sample)
            before, after = _engine_tokens(prev), _engine_tokens(sample)
            if before is not None and after is not None and after > before:
                self.heard_at = now  # its engine works (on requests of ours or not)
        self.scraped, self.scraped_at = sample, now
        return restarted

    def silent_for(self, now: float) -> float:
        """How long requests have waited here with nothing heard from it (`ReplicaView.
        silent_s`): no first token or whole answer of any request since the later of the
        first of them and the last thing heard, and its engine's scraped counters still. A
        frozen replica (stopped process, black-holed network, hung engine) answers nothing,
        so its count grows; a busy one is heard from (answers, or counters moving while it
        decodes whole answers). Non-streamed requests alone say nothing until their whole
        answer: they count only where scrapes carry the engine's counters (vLLM)."""
        if self.answers != self._heard_answers:  # answers since the last look: heard now
            self._heard_answers, self.heard_at = self.answers, now
        if self.inflight_prefill <= 0 or (
            self.inflight_prefill_tokens <= self.whole_waiting_tokens
            and self.engine_tokens() is None
        ):
            self.waiting_since = None
            return 0.0
        if self.waiting_since is None:  # noticed now (`acquire` was not told when)
            self.waiting_since = now
            return 0.0
        return now - max(self.heard_at, self.waiting_since)

    # -- health ---------------------------------------------------------------------------
    def hung(self, lease: Lease, fit: TtftFit, waited_s: float) -> bool:
        """Is a first-byte cut of `lease`'s request (it waited `waited_s`) the replica's
        failure (both edges)? Only when nothing says it is working: it streams none of its
        requests (a replica streaming others' answers is busy), none got its first token or
        whole answer while this one waited (a queue of prefills that moves is a queue), and
        the prefill work still waiting there, at its learned TTFT model `fit`, would have
        been done in that time (long prompts take long). Ejecting a busy replica under a
        load spike would turn the spike into 503s. Non-streamed requests in flight are no
        evidence either way: they are counted as waiting until their whole answer (prefill
        and all of their decode), so their prompts are not taken for prefill work still to
        do (a long one would excuse a hung engine for as long as it stays in flight); their
        answers, when they come, are progress as any other; while they decode, the engine's
        scraped token counters moving since the request was sent is (`_engine_moved`)."""
        waiting = self.inflight_prefill_tokens - self.whole_waiting_tokens
        return (self.inflight <= self.inflight_prefill and self.answers == lease.seen
                and fit.predict(waiting) < waited_s and not self._engine_moved(lease))

    def engine_tokens(self) -> float | None:
        """Tokens its engine has processed (prompt and generated, the scraped counters'
        sum), or None while no scrape said."""
        return None if self.scraped is None else _engine_tokens(self.scraped)

    def _engine_moved(self, lease: Lease) -> bool:
        """Is a queue moving there, as scraped: requests waiting in its engine (the cut one
        among them) while it processed tokens since `lease`'s request was sent? The only
        sign of a replica busy decoding non-streamed answers: a stream queued behind them
        (vLLM's `max_num_seqs` full) sees no first token, no answer and no prefill work, yet
        the engine works. A hung engine's counters stop; one that runs requests whose tokens
        never reach the gateway (nothing waiting) is hung all the same."""
        now, s = self.engine_tokens(), self.scraped
        if now is None or lease.engine_tokens is None or s is None or not s.waiting:
            return False
        return now > lease.engine_tokens

    def available(self, now: float) -> bool:
        """May a request be sent now? Moves an expired ejection to half-open."""
        if self.state == HEALTHY:
            return True
        if self.state == EJECTED and now >= self.ejected_until and not self.down:
            self.state = HALF_OPEN
        # half-open: one trial request at a time
        return self.state == HALF_OPEN and self.inflight == 0

    def condition(self, now: float) -> str:
        """Why it takes no request now (``"available"`` when it does), in words an API client
        may read: no address nor host name (those are for operators: `reason`, /readyz)."""
        if self.down:
            why = (self.reason or "down").removeprefix("/health: ")
            why = why.replace("/health answered", "its health check answered")
            return _HOST.sub("cannot resolve its host name", why)
        if self.available(now):
            return "backing off after busy 503s" if self.busy(now) else "available"
        if self.state == EJECTED:
            return "ejected after failed requests"
        return "on trial after an ejection"  # half-open, its one trial request in flight

    def back_in(self, now: float) -> float:
        """Seconds until it may be tried again, as far as kvgate knows: the end of its
        ejection (a replica marked down returns no sooner: its probes count from then on),
        0 when it may be any moment (on trial, or not out at all)."""
        return max(self.ejected_until - now, 0.0) if self.state == EJECTED else 0.0

    def busy(self, now: float) -> bool:
        """Backing off after a busy 503 (health aside)."""
        return now < self.busy_until

    def record_busy(self, now: float, asked_s: float | None = None) -> None:
        """vLLM answered 503 "engine is currently busy" (or a limiter in front of it 429):
        keep new picks away for a while -- `asked_s` when the answer's Retry-After asked for
        some (a positive number of seconds), else a back-off that doubles while the replica
        keeps rejecting and starts over once it has been quiet for the longest back-off;
        never longer than that longest one (a replica asking for an hour is asked again
        sooner). ``0`` is no ask, as `gateway.verdicts.retry_seconds` reads "Retry-After: 0":
        one rule, never a busy replica asked again at once."""
        p = self._policy
        if now - self.busy_until > p.busy_backoff_max_s:
            self.busy_streak = 0
        self.busy_streak += 1
        backoff = p.busy_backoff_s * 2 ** min(self.busy_streak - 1, 16)
        wait = asked_s if asked_s else backoff  # (None or 0: no ask)
        self.busy_until = now + min(wait, p.busy_backoff_max_s)

    def record_slow_probe(self, now: float) -> None:
        """An active probe timed out: eject only after `slow_threshold` in a row."""
        self.slow_probes += 1
        if self.slow_probes >= self._policy.slow_threshold:
            self.slow_probes = 0
            self.mark_down(now, request=False)

    def record_probe_ok(self) -> None:
        self.slow_probes = 0

    def probe_recovered(self) -> None:
        """`/health` answers again after an ejection: half-open, so the next request decides.
        (vLLM's /health stays 200 while its engine is faulted: it cannot restore a replica
        on its own, or one that fails every request would be readmitted every back-off.)"""
        self.down = False
        self.reason = None
        if self.state == EJECTED:
            self.state = HALF_OPEN

    def record_success(self) -> None:
        self._outcome(0)
        self.failures = 0
        self.down = False
        self.reason = None
        if self.state != HEALTHY:
            self.state = HEALTHY
            self.ejections = 0

    def record_failure(self, now: float) -> None:
        """A request failed here (5xx, reset, stall, cut stream)."""
        self.failures += 1
        self.failed += 1
        self._outcome(1)
        p = self._policy
        failed = self.outcomes.bit_count()
        if self.state == HALF_OPEN or (self.state == HEALTHY and (
                self.failures >= p.failure_threshold
                or (2 * failed >= p.window and failed >= p.failure_threshold))):
            self.eject(now)

    def _outcome(self, failed: int) -> None:
        self.outcomes = ((self.outcomes << 1) | failed) & ((1 << self._policy.window) - 1)

    def count_failure(self) -> None:
        """A request failed here that health does not hold against the replica: vLLM's 500
        for one request from a pool's only replica taking requests (`relay.no_other_replica`:
        no other can tell whose fault it was, and ejecting it refused every tenant). Counted
        for operators (kvgate_replica_failures_total, the doctor), so a replica failing every
        request is seen; it stays in rotation."""
        self.failed += 1

    def eject(self, now: float) -> None:
        self.ejections += 1
        backoff = self._policy.eject_base_s * 2 ** (self.ejections - 1)
        self.ejected_until = now + min(backoff, self._policy.eject_max_s)
        self.state = EJECTED

    def mark_down(self, now: float, request: bool = True) -> None:
        """Refused, explicitly unhealthy or a dead engine: stop sending here now (already
        ejected: keep the back-off). ``request``: a request failed here (not a probe)."""
        self.failures += 1
        self.failed += request
        self.down = True
        if self.state != EJECTED:
            self.eject(now)

    def probe_due(self, now: float) -> bool:
        """Should the active poller's result count now (healthy, or back-off expired)?"""
        return self.state != EJECTED or now >= self.ejected_until

    def view(self, now: float) -> ReplicaView:
        healthy = self.available(now) and now >= self.busy_until
        s = self.scraped
        if s is None:
            return ReplicaView(
                id=self.id, pool=self.pool, healthy=healthy, inflight=self.inflight,
                inflight_prefill_tokens=self.inflight_prefill_tokens,
                inflight_prefill=self.inflight_prefill, silent_s=self.silent_for(now),
            )
        return ReplicaView(
            id=self.id, pool=self.pool, healthy=healthy, waiting=s.waiting,
            running=s.running, kv_usage=s.kv_usage, cache_capacity_tokens=s.cache_capacity_tokens,
            scrape_age_s=now - self.scraped_at, inflight=self.inflight,
            inflight_prefill_tokens=self.inflight_prefill_tokens,
            inflight_prefill=self.inflight_prefill, silent_s=self.silent_for(now),
        )


def _engine_tokens(s: Sample) -> float | None:
    """Tokens an engine processed, prompt and generated (None: its /metrics do not say)."""
    if s.generation_tokens is None:
        return None
    return s.generation_tokens + (s.prompt_tokens or 0.0)


def _went_back(prev: Sample, sample: Sample) -> bool:
    """Whether the engine restarted since `prev`: a new engine starts every cumulative counter
    at 0, so each one that had counted something is lower now. One that went on, or is gone
    from the page, says the page is partial (cut short, a data-parallel engine's series
    missing from one family's sum), not a restart: forgetting the replica's prefix affinity
    on it would cost its hit rate for nothing."""
    counted = [
        (before, after)
        for before, after in (
            (prev.prefix_cache_queries, sample.prefix_cache_queries),
            (prev.prompt_tokens, sample.prompt_tokens),
            (prev.generation_tokens, sample.generation_tokens),
        )
        if before  # neither missing nor 0 (a counter still at 0 cannot go back)
    ]
    return bool(counted) and all(after is not None and after < before
                                 for before, after in counted)


def _delta_ratio(
    hits0: float | None, queries0: float | None, hits1: float | None, queries1: float | None,
    last: float | None,
) -> float | None:
    """Hit ratio over one scrape interval; the last value when nothing was queried meanwhile
    (an idle replica keeps its recent ratio) or a counter went backwards (engine restart)."""
    if None in (hits0, queries0, hits1, queries1):
        return last
    assert hits0 is not None and queries0 is not None and hits1 is not None
    assert queries1 is not None
    dq, dh = queries1 - queries0, hits1 - hits0
    if dq <= 0 or dh < 0:
        return last
    return min(1.0, dh / dq)


class Lease:
    """One request's claim on a replica's counters. `release` is safe to call twice."""

    __slots__ = ("_prefill", "_released", "_replica", "_whole", "answered", "engine_tokens",
                 "seen")

    def __init__(self, replica: Replica, prompt_tokens: int, stream: bool = True) -> None:
        self._replica = replica
        self._prefill = prompt_tokens
        self._whole = 0 if stream else prompt_tokens  # its part of `whole_waiting_tokens`
        self._released = False
        self.answered = False  # a first token (or a whole answer) arrived
        self.seen = replica.answers  # its progress when this request was sent (`hung`)
        self.engine_tokens = replica.engine_tokens()  # ... and its engine's, as last scraped

    def first_token(self) -> None:
        """The prompt is answered: it no longer waits for prefill."""
        if not self.answered and not self._released:
            self._replica.inflight_prefill -= 1
            self._replica.inflight_prefill_tokens -= self._prefill
            self._replica.whole_waiting_tokens -= self._whole
            self._replica.answers += 1
        self.answered = True

    def release(self) -> None:
        if self._released:
            return
        if not self.answered:  # ended unanswered: it no longer waits for prefill either
            self._replica.inflight_prefill -= 1
            self._replica.inflight_prefill_tokens -= self._prefill
            self._replica.whole_waiting_tokens -= self._whole
        self._released = True
        replica = self._replica
        replica.inflight -= 1
        if replica.watch is not None:
            replica.watch()


class RetryBudget:
    """Retries may not amplify an outage: each request deposits `ratio` tokens, each retry
    spends one; `reserve` tokens are there from the start (for low traffic). Clock-free."""

    __slots__ = ("_cap", "_ratio", "tokens")

    def __init__(self, ratio: float, reserve: int) -> None:
        self._ratio = ratio
        self._cap = float(max(reserve, 1) * 10)
        self.tokens = float(reserve)

    def deposit(self) -> None:
        self.tokens = min(self._cap, self.tokens + self._ratio)

    def try_spend(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

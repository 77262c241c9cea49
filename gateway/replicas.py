"""Per-replica state the gateway owns: in-flight accounting and passive health.

`Replica.acquire` hands out a `Lease` whose `release` is idempotent and is called from a
``finally`` on every path (success, upstream error, timeout, client disconnect), so counters
cannot leak. Health is a small state machine: consecutive failures, or half of its last 20
requests failed, eject a replica for an exponentially growing back-off; when it expires the
replica is half-open and one request decides: one sent since the ejection (`Lease.epoch`).
Requests still held from before do not decide it by failing late (they are counted, `failed`,
not judged), nor hold it back once its engine is seen working (`_moved_since_ejection`). A
refused connection, a dead engine or a failed `/health` ejects at once (`mark_down`), and such
a replica is known to be down: it stays out past its back-off until `/health` answers again
(`probe_recovered`), so a pool whose replicas are all gone answers 503 with Retry-After and is
not ready, instead of a trial on a dead replica each time a back-off expires. A slow `/health`
ejects only after `slow_threshold` consecutive slow probes (vLLM serves it on the loop that is
busy with requests). Apart from health, a replica that answers vLLM's busy 503 is *backing off*
(`record_busy`): its view says unavailable for a short, growing while, so no policy keeps
sending it the traffic it rejects at once. A replica whose engine stopped making progress
(`gateway.stall`: requests running, its token counters frozen for `stall_after_s`) is ejected
as *stalled* and kept out until they move again; its requests that got nothing yet are cut
(`Lease.on_stall`) and tried elsewhere, as they are at every ejection (`eject`) and when a
`/health` probe hears nothing at all from it while they wait (`frozen`: a stopped process).
Time is passed in, so the machine is testable without sleeps.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from gateway.scrape import Sample
from gateway.stall import StallWatch, progress
from routing.learning import TtftFit
from routing.load import still_running
from routing.types import ReplicaView

__all__ = ["HealthRules", "Lease", "Lost", "Replica", "RetryBudget", "replica_id"]

log = logging.getLogger(__name__)

HEALTHY, EJECTED, HALF_OPEN = "healthy", "ejected", "half_open"
# why a replica's prefix cache is empty (`Replica.record_scrape`): its engine restarted (its
# counters went back), its process was found gone (nothing listening at its address), or its
# engine was put to sleep (vLLM discards the KV cache at every sleep level)
Lost = Literal["restarted", "gone", "asleep"]
# its down reason while its engine sleeps (`Replica.record_scrape`), for /readyz
ASLEEP = "its engine is asleep (vLLM sleep mode: vllm:engine_sleep_state)"
# ... and while it answers that its model sleeps (`Replica.record_sleeping`: an older vLLM)
ASLEEP_SAID = "its engine is asleep (it answered 503: the model is sleeping)"
# ... and while its dev-mode /is_sleeping says so (`Replica.record_is_sleeping`: no gauge)
ASLEEP_ASKED = "its engine is asleep (its /is_sleeping said so)"
# asked again (one request) this long after such an answer, doubling while it sleeps on
SLEEP_RECHECK_S, SLEEP_RECHECK_MAX_S = 1.0, 30.0
# the attempt the current task made last (`Replica.acquire`): an outcome recorded from that
# task on that replica is judged by the epoch its request was sent in; one recorded anywhere
# else (a probe, another replica's attempt) counts as current
_SENT: ContextVar[Lease | None] = ContextVar("kvgate_sent_lease", default=None)
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
    # requests running there and its token counters frozen this long: stalled (`gateway.stall`;
    # None or 0: never judged). Longer than any single prefill (vLLM counts prompt tokens when
    # a prefill completes, a lone 100k-token prompt may take tens of seconds)
    stall_after_s: float | None = 60.0


class Replica:
    """One upstream replica of a pool."""

    __slots__ = (
        "_heard_answers", "_policy", "_stall", "answers", "asleep", "attempts", "busy_streak",
        "busy_until", "current", "current_waiting", "cuttable", "down", "draining",
        "ejected_until", "ejections", "ended_since_scrape",
        "epoch", "failed", "failures", "fell_asleep", "heard_at", "hit_ratio", "id", "inflight",
        "inflight_prefill", "inflight_prefill_tokens", "lost_cache", "max_model_len",
        "outcomes", "pool", "progress_at_ejection", "reason", "refusal_warned", "replies",
        "scraped", "scraped_at", "scrapes",
        "sleep_said_until", "sleep_streak", "sleep_told", "slow_probes", "stalled", "stalls",
        "state", "url",
        "waiting_since", "watch",
        "whole_waiting_tokens",
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
        # anything that came from it (a good scrape, a /health answer, a streamed chunk), one
        # count each: nothing at all over a whole /health timeout while requests wait there
        # is a frozen replica (`frozen`)
        self.replies = 0
        self.waiting_since: float | None = None
        self.scraped: Sample | None = None  # the last good scrape of its /metrics
        self.scraped_at = 0.0
        # good scrapes so far, and requests of ours that were in flight at the last one and
        # ended since: its page still counts them running (`view` takes them off)
        self.scrapes = 0
        self.ended_since_scrape = 0
        # prefix-cache hits / queries between the last two good scrapes (None: no traffic yet)
        self.hit_ratio: float | None = None
        # nothing listened at its address (`HealthMonitor`): its process was gone, and its
        # prefix cache with it; `record_scrape` says so once
        self.lost_cache = False
        # its engine's longest context (its /v1/models card, `HealthMonitor`), if known
        self.max_model_len: int | None = None
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
        # ejections so far (never reset): a request carries the one it was sent in, and only
        # those sent since the last ejection (`current` in flight) are its trial
        self.epoch = 0
        self.current = 0
        self.current_waiting = 0  # of those, the ones with no first token (or answer) yet
        self.progress_at_ejection: float | None = None  # its engine's tokens then (scraped)
        self._stall = StallWatch(policy.stall_after_s)
        self.stalled = False  # its engine makes no progress (`gateway.stall`): kept out
        # its engine sleeps (vLLM's sleep mode, scraped): kept out until it is awake again; a
        # request sent there waits unanswered (its /health says 200 all along)
        self.asleep = False
        # asleep as its own 503 said (no `vllm:engine_sleep_state` scraped): until then, then
        # one request tells whether it woke; None when its answers never said so
        self.sleep_said_until: float | None = None
        self.sleep_streak = 0
        # asleep as its /is_sleeping said (`record_is_sleeping`): a page without the sleep
        # gauge does not wake it, the next answer of that route does
        self.sleep_told = False
        # its 503 said it fell asleep (`record_sleeping`, mid-request): its KV cache is gone as
        # when a scrape says so; the next scrape reports it, for its prefixes to be forgotten
        self.fell_asleep = False
        self.stalls = 0  # times it was found stalled (kvgate_replica_stalls_total)
        # its requests that got nothing yet and can be cut when it stalls (`Lease.on_stall`)
        self.cuttable: set[Lease] = set()
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
        self.current += 1
        self.current_waiting += 1
        self.inflight_prefill += 1
        self.inflight_prefill_tokens += prompt_tokens
        if not stream:
            self.whole_waiting_tokens += prompt_tokens
        lease = Lease(self, prompt_tokens, stream)
        _SENT.set(lease)
        return lease

    def record_scrape(self, sample: Sample | None, now: float) -> Lost | None:
        """A scrape finished; a failed one (None) leaves the last good sample to age. Says
        when its prefix cache is empty: ``"restarted"`` when its engine restarted since the
        last good one (its counters went back), ``"gone"`` when its process was found gone
        meanwhile (`lost_cache`: nothing listened at its address; the only sign where vLLM
        exports no counters, ``--disable-log-stats``), ``"asleep"`` when it fell asleep (a
        scrape said so, or its 503 since the last scrape: `fell_asleep`), else None. Also
        judges whether its engine is stalled (`gateway.stall`)."""
        self._judge_progress(sample, now)
        lost: Lost | None = ("gone" if self.lost_cache
                             else "asleep" if self.fell_asleep else None)
        self.lost_cache = self.fell_asleep = False
        if sample is None:
            return lost
        self.replies += 1
        prev = self.scraped
        if prev is not None:
            self.hit_ratio = _delta_ratio(
                prev.prefix_cache_hits, prev.prefix_cache_queries,
                sample.prefix_cache_hits, sample.prefix_cache_queries, self.hit_ratio,
            )
            if _went_back(prev, sample):
                lost = "restarted"
            before, after = progress(prev), progress(sample)
            if before is not None and after is not None and after > before:
                self.heard_at = now  # its engine works (on requests of ours or not)
        self.scraped, self.scraped_at = sample, now
        self.scrapes += 1
        self.ended_since_scrape = 0
        if sample.asleep is None and (self.sleep_said_until is not None or self.sleep_told):
            return lost  # no sleep metric: its answers (`record_sleeping`) or its
            # /is_sleeping (`record_is_sleeping`) tell when it wakes
        self.sleep_said_until = None
        return self._judge_sleep(bool(sample.asleep)) or lost

    def record_sleeping(self, now: float) -> None:
        """It answered vLLM's 503 for a sleeping model (older vLLM, without the sleep metric):
        asleep, as a scrape would say -- out of rotation, no failure (three such answers
        ejected it as failing, for a back-off that grew each time). A request is let through
        again after `SLEEP_RECHECK_S`, doubling while it still sleeps; its success wakes it."""
        self.sleep_streak += 1
        wait = SLEEP_RECHECK_S * 2 ** min(self.sleep_streak - 1, 8)
        self.sleep_said_until = now + min(wait, SLEEP_RECHECK_MAX_S)
        if not self.asleep and self._judge_sleep(True):
            self.fell_asleep = True
        self.reason = ASLEEP_SAID

    def record_is_sleeping(self, asleep: bool) -> None:
        """Its dev-mode ``GET /is_sleeping`` answered (`HealthMonitor`, asked only while no
        scrape carries `vllm:engine_sleep_state`: ``--disable-log-stats``, an older vLLM):
        out while asleep, its requests that got nothing yet cut and tried elsewhere, back
        when it says it is awake. Before, such a replica put to sleep kept its requests
        waiting for their first-byte timeout (5 minutes) or their whole answer."""
        self.sleep_told = asleep
        self.sleep_said_until = None  # (its answer, not a request, tells when it wakes)
        if not asleep:
            self.sleep_streak = 0
            if self.reason in (ASLEEP_ASKED, ASLEEP_SAID):
                self.reason = None
        if self._judge_sleep(asleep) == "asleep":
            self.fell_asleep = True  # its KV cache is gone: the next scrape reports it
        if asleep:
            self.reason = ASLEEP_ASKED

    def _judge_sleep(self, asleep: bool) -> Lost | None:
        """Out while its engine sleeps, back when it wakes; "asleep" when it fell asleep (its
        KV cache is discarded). Its requests that got nothing yet are cut and tried elsewhere
        (put to sleep with ``mode=wait``, or sent just before a scrape told, they wait)."""
        if asleep == self.asleep:
            return None
        self.asleep = asleep
        if not asleep:
            log.info("replica's engine is awake again", extra={"pool": self.pool,
                                                               "replica": self.id})
            if self.reason == ASLEEP:
                self.reason = None
            return None
        log.warning("replica's engine is asleep (vLLM sleep mode): no requests sent there "
                    "until it wakes", extra={"pool": self.pool, "replica": self.id})
        self.reason = ASLEEP
        self._cut_waiting()
        return "asleep"

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

    def _judge_progress(self, sample: Sample | None, now: float) -> None:
        # (kvgate's requests there that still wait for their answer to start: one the engine
        # finished whose client reads it slowly owes it nothing -- counted, an idle engine
        # was stalled and a one-replica pool answered every other client 503)
        stalled = self._stall.observe(sample, self.inflight_prefill, now)
        if stalled == self.stalled:
            return
        self.stalled = stalled
        if not stalled:
            log.info("replica's engine makes progress again",
                     extra={"pool": self.pool, "replica": self.id})
            return
        self.stalls += 1
        log.warning("replica stalled: requests running, no tokens for %g s; ejected",
                    self._policy.stall_after_s, extra={"pool": self.pool, "replica": self.id})
        if self.state != EJECTED:
            self.eject(now)
        self._cut_waiting()

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
        return None if self.scraped is None else progress(self.scraped)

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
        if self.asleep and self.sleep_said_until is not None and now >= self.sleep_said_until:
            self.asleep = False  # its answer said so: the next request tells (`record_sleeping`)
        if self.asleep:  # (its ejection, if any, runs on: judged when it wakes)
            return False
        if self.state == HEALTHY:
            return True
        if (self.state == EJECTED and now >= self.ejected_until and not self.down
                and not self.stalled):
            self.state = HALF_OPEN
        # half-open: one trial request at a time
        return self.state == HALF_OPEN and self.current == 0 and (
            self.inflight == 0 or self._moved_since_ejection())

    def trial_answering(self, now: float) -> bool:
        """On trial, with every request sent since its ejection answering (first tokens
        streamed): it serves again, as far as can be told before its trial ends. `available`
        waits for that end -- the trial is judged as a whole, a stream that hangs mid-way
        fails it -- and a long stream keeps the replica at one request until then; a pick
        with no replica available at all takes such a one rather than answer 503."""
        return (self.state == HALF_OPEN and self.current > 0 and self.current_waiting == 0
                and not self.down and not self.stalled and not self.draining
                and not self.asleep)

    def _moved_since_ejection(self) -> bool:
        """Has its engine worked since its ejection (its scraped token counters moved, or went
        back: a new engine)? Then requests it held from before do not hold its trial back.
        While the counters stand still those requests may be hung (a replica whose streams
        stop mid-way), and a trial sent among them would hang with them: the trial waits, and
        they are cut in time -- a stream at its idle timeout, one with nothing back yet at
        `stall_after_s` -- not after the longest generation there or a client's timeout."""
        now, then = self.engine_tokens(), self.progress_at_ejection
        return now is not None and then is not None and now != then

    def condition(self, now: float) -> str:
        """Why it takes no request now (``"available"`` when it does), in words an API client
        may read: no address nor host name (those are for operators: `reason`, /readyz)."""
        if self.asleep:
            return "its engine is asleep"
        if self.stalled:
            return "its engine stopped making progress"
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
        on its own, or one that fails every request would be readmitted every back-off; nor
        does it while its engine is stalled: a hung engine answers /health too.)"""
        self.down = False
        self.reason = None
        if self.state == EJECTED and not self.stalled:
            self.state = HALF_OPEN

    def record_success(self) -> None:
        self._outcome(0)
        self.failures = 0
        self.sleep_said_until, self.sleep_streak = None, 0
        self.down = False
        self.reason = None
        if self.state != HEALTHY:
            self.state = HEALTHY
            self.ejections = 0

    def record_failure(self, now: float) -> None:
        """A request failed here (5xx, reset, stall, cut stream). One sent before its last
        ejection is counted (`failed`) but not judged: its replica has been judged since, and
        a late failure of a request it held then would decide (or start) its next ejection."""
        sent = _SENT.get()
        if sent is not None and sent.replica is self and sent.epoch != self.epoch:
            self.failed += 1
            return
        self.failures += 1
        self.failed += 1
        self._outcome(1)
        p = self._policy
        failed = self.outcomes.bit_count()
        trial = self.state == HALF_OPEN
        if trial or (self.state == HEALTHY and (
                self.failures >= p.failure_threshold
                or (2 * failed >= p.window and failed >= p.failure_threshold))):
            self.eject(now)
            why = ("its trial request failed" if trial
                   else f"{self.failures} requests failed in a row"
                   if self.failures >= p.failure_threshold
                   else f"{failed} of its last {p.window} requests failed")
            self.reason = why  # for operators (/readyz, GET /admin/replicas, the doctor)
            log.warning("replica ejected: %s; back in %g s at the earliest", why,
                        self.ejected_until - now, extra={"pool": self.pool, "replica": self.id})

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
        """Out for a back-off. Its requests that got nothing yet are cut and tried elsewhere
        at once (`_cut_waiting`): before, those of a replica ejected for failing requests
        waited on it for their own first-byte timeout (5 minutes) or their whole answer. Only
        those another replica can take (`Lease.on_stall`'s ``retried``): the Envoy edge's
        could only end with an error, and a replica failing some requests may still answer
        them (one stopped, down, asleep or stalled is cut whatever the edge)."""
        self._cut_waiting(retried_only=True)
        self.epoch += 1
        self.current = 0  # what is in flight now was sent before: not its trial
        self.current_waiting = 0
        self.progress_at_ejection = self.engine_tokens()
        self.ejections += 1
        backoff = self._policy.eject_base_s * 2 ** (self.ejections - 1)
        self.ejected_until = now + min(backoff, self._policy.eject_max_s)
        self.state = EJECTED

    def rejoin(self) -> None:
        """Back in its pool while it still drained (discovery listed it again: a pod ready
        again, a flapping readiness probe): it starts as a replica new to the pool does,
        healthy and with no back-off, failures or busy streak of its past membership (it was
        kept out for the rest of an ejection's back-off, doubled by every ejection before,
        up to `eject_max_s`); its health checks and requests judge it from here. Requests
        it still holds from before count as sent before an ejection (`Lease.epoch`): a late
        failure of one does not eject it again."""
        self.draining = False
        self.epoch += 1
        self.current = 0
        self.state = HEALTHY
        self.failures = self.outcomes = self.ejections = self.slow_probes = 0
        self.busy_streak = 0
        self.ejected_until = self.busy_until = 0.0
        self.down = self.stalled = False
        self.reason = None

    def mark_down(self, now: float, request: bool = True, reason: str | None = None) -> None:
        """Refused, explicitly unhealthy or a dead engine: stop sending here now (already
        ejected: keep the back-off). ``request``: a request failed here (not a probe); why
        (`reason`, else it could not connect) is logged when that takes it out (the health
        checks log their own findings, and a refusal of kvgate's credentials is warned about
        once, `refusal_warned`: its /health is back every cycle). Found
        down by its health checks, its requests that got nothing yet are cut to be tried
        elsewhere, as a stalled engine's: a stopped process or a black-holed network keeps
        their connections open with no answer to come (they waited for their first-byte or
        total timeout, 5 or 30 minutes)."""
        if reason is not None:
            self.reason = reason
        if request and not self.down and not self.refusal_warned:
            log.warning("replica down: %s", reason or "a request could not connect to it",
                        extra={"pool": self.pool, "replica": self.id})
        self.failures += 1
        self.failed += request
        self.down = True
        if self.state != EJECTED:
            self.eject(now)
        if not request:
            self._cut_waiting()

    def _cut_waiting(self, retried_only: bool = False) -> None:
        """Cut its requests that got nothing yet (`Lease.on_stall`): tried elsewhere. Not the
        one whose failure is being recorded (`_SENT`): its own handler is ending it."""
        judged = _SENT.get()
        for lease in list(self.cuttable):  # (each cut removes itself)
            if lease is not judged and (lease.retried or not retried_only):
                lease.cut()

    def reply_mark(self) -> int:
        """A count that moves whenever anything comes from it (`replies`, `answers`)."""
        return self.replies + self.answers

    def frozen(self, mark: int, now: float, waited_s: float) -> bool:
        """A /health probe sent at `reply_mark` `mark` got no answer in `waited_s`: if
        nothing else came from it meanwhile either (no scrape, no first token, no streamed
        chunk) while requests of ours wait there, its process is stopped, its host frozen
        or its network black-holed: down now, those requests cut and tried elsewhere
        (`mark_down`). Before, they waited for `health.slow_threshold` slow probes (some 21 s
        with the defaults). A replica that answers anything, or has nothing waiting, is
        left to the slow-probe rule (a saturated vLLM answers /health late)."""
        if self.inflight_prefill <= 0 or self.reply_mark() != mark:
            return False
        self.reason = (f"no answer from it for {waited_s:g} s (not /health, /metrics nor its "
                       "requests): a stopped process, a frozen host or a cut network")
        log.warning("replica down: %s", self.reason,
                    extra={"pool": self.pool, "replica": self.id})
        self.mark_down(now, request=False)
        return True

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
                max_model_len=self.max_model_len,
            )
        return ReplicaView(
            id=self.id, pool=self.pool, healthy=healthy, waiting=s.waiting,
            running=still_running(s.running, self.ended_since_scrape), kv_usage=s.kv_usage,
            cache_capacity_tokens=s.cache_capacity_tokens,
            scrape_age_s=now - self.scraped_at, inflight=self.inflight,
            inflight_prefill_tokens=self.inflight_prefill_tokens,
            inflight_prefill=self.inflight_prefill, silent_s=self.silent_for(now),
            max_model_len=self.max_model_len,
        )


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

    __slots__ = ("_cut", "_prefill", "_released", "_whole", "answered", "engine_tokens", "epoch",
                 "replica", "retried", "scrapes", "seen")

    def __init__(self, replica: Replica, prompt_tokens: int, stream: bool = True) -> None:
        self.replica = replica
        self.epoch = replica.epoch  # the ejections it was sent after (`Replica.record_failure`)
        self._cut: Callable[[], None] | None = None
        self.retried = True  # a cut is tried elsewhere (`on_stall`)
        self._prefill = prompt_tokens
        self._whole = 0 if stream else prompt_tokens  # its part of `whole_waiting_tokens`
        self._released = False
        self.answered = False  # a first token (or a whole answer) arrived
        self.seen = replica.answers  # its progress when this request was sent (`hung`)
        self.engine_tokens = replica.engine_tokens()  # ... and its engine's, as last scraped
        self.scrapes = replica.scrapes  # the scrapes before it was sent

    def on_stall(self, cut: Callable[[], None], retried: bool = True) -> None:
        """Call `cut` if its replica is found stalled before this request got anything (a
        first token, a whole answer) or ended: it can be tried elsewhere. ``retried``: a cut
        request is tried on another replica (the HTTP edge); not (the Envoy edge, where a
        cut ends it with an error), it is cut only when its replica cannot answer it."""
        if not self.answered and not self._released:
            self._cut = cut
            self.retried = retried
            self.replica.cuttable.add(self)

    def cut(self) -> None:
        """Its replica stalled: the request is cut (once)."""
        cut = self._cut
        self._uncuttable()
        if cut is not None:
            cut()

    def _uncuttable(self) -> None:
        if self._cut is not None:
            self._cut = None
            self.replica.cuttable.discard(self)

    def first_token(self) -> None:
        """The prompt is answered: it no longer waits for prefill."""
        if not self.answered and not self._released:
            self.replica.inflight_prefill -= 1
            self.replica.inflight_prefill_tokens -= self._prefill
            self.replica.whole_waiting_tokens -= self._whole
            self.replica.answers += 1
            if self.epoch == self.replica.epoch:
                self.replica.current_waiting -= 1
        self.answered = True
        self._uncuttable()

    def release(self) -> None:
        if self._released:
            return
        replica = self.replica
        if not self.answered:  # ended unanswered: it no longer waits for prefill either
            replica.inflight_prefill -= 1
            replica.inflight_prefill_tokens -= self._prefill
            replica.whole_waiting_tokens -= self._whole
        self._released = True
        self._uncuttable()
        replica.inflight -= 1
        if self.scrapes < replica.scrapes:  # in flight at its last scrape, which counts it
            replica.ended_since_scrape += 1
        if self.epoch == replica.epoch:  # sent since its last ejection
            replica.current -= 1
            if not self.answered:
                replica.current_waiting -= 1
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

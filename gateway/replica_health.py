"""A replica's passive health: the rules that eject it (consecutive failures, or half of its
last `HealthRules.window` requests failed), its back-off, its trial once that expires (a request
sent since the ejection, `Lease.epoch`), down (refused, dead, failed or slow `/health`, frozen)
until `/health` answers again, and the busy back-off after vLLM's 503. An ejection cuts the
requests that got nothing yet there (`Lease.on_stall`) to be tried elsewhere."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from gateway.lease import _SENT, Lease
from gateway.replica_state import EJECTED, HALF_OPEN, HEALTHY, ReplicaState
from routing.learning import TtftFit

__all__ = ["HealthRules", "ReplicaHealth"]

# (the replica's logger, as before these rules had a module of their own: operators filter on it)
log = logging.getLogger("gateway.replicas")

# the one down reason naming a host (`transport.connect_failure`): clients are told less
_HOST = re.compile(r"cannot resolve host \S+")


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


class ReplicaHealth(ReplicaState):
    """A replica's health rules (`Replica` is one)."""

    __slots__ = ()

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
            self.mark_down(now, request=False, started=True)

    def record_probe_ok(self) -> None:
        self.slow_probes = 0

    def probe_recovered(self) -> None:
        """`/health` answers again after an ejection. Ejected because nothing answered there
        (`gone`: a refused connection, a failing or silent `/health`, a frozen process): back
        in rotation now, as a replica new to its pool -- a restarted one answers /health once
        it serves (before, it came back half-open, one trial request at a time: a pool
        restarted whole, e.g. by a rollout, answered its first burst 503 "on trial" while
        /readyz said ready). Ejected for what its requests got (failures, a dead engine's or
        a credentials refusal's answer): half-open, so the next request decides (vLLM's
        /health stays 200 while its engine is faulted: it cannot restore such a replica on
        its own, or one that fails every request would be readmitted every back-off). A
        stalled one stays out: a hung engine answers /health too."""
        self.down = False
        self.reason = None
        if self.state == EJECTED and not self.stalled:
            self.state = HEALTHY if self.gone else HALF_OPEN
            if self.gone:
                self.failures = 0  # (what found it gone was no failure of a request's)
                self.gone = False

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
        """Out for a back-off. Its requests waiting there stay: a replica failing some
        requests may still answer the others, and cutting them all at once (28 in a storm of
        120 clients) spent the pool's retry budget on one ejection, the rest ending in 504s
        their replica would have answered. One found stalled, down by its health checks,
        frozen or asleep has them cut (`_cut_waiting`): nothing will come from it."""
        self.epoch += 1
        self.gone = False  # (`mark_down` says when it is)
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

    def mark_down(
        self, now: float, request: bool = True, reason: str | None = None, started: bool = False,
        gone: bool = False,
    ) -> None:
        """Refused, explicitly unhealthy or a dead engine: stop sending here now (already
        ejected: keep the back-off). ``request``: a request failed here (not a probe); why
        (`reason`, else it could not connect) is logged when that takes it out (the health
        checks log their own findings, and a refusal of kvgate's credentials is warned about
        once, `refusal_warned`: its /health is back every cycle). Found
        down by its health checks, its requests that got nothing yet are cut to be tried
        elsewhere, as a stalled engine's: a stopped process or a black-holed network keeps
        their connections open with no answer to come (they waited for their first-byte or
        total timeout, 5 or 30 minutes). With ``started`` (found by silence: frozen, slow
        probes with nothing heard meanwhile) its streams that sent the client something and
        went quiet are ended too (`Lease.on_lost`: they waited for their idle timeout, 2
        minutes). A refusal or a non-200 `/health` does not end them: a killed process resets
        their connections (they end at once), a dead vLLM engine ends them with its error
        event, a server shutting down gracefully finishes them. ``gone``: a request found
        nothing listening there (health's own findings are that too): its /health answering
        again brings it back without a trial (`probe_recovered`)."""
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
            self.gone = gone or not request
        if not request:
            self._cut_waiting(started)

    def _cut_waiting(self, started: bool = False) -> None:
        """Cut its requests that got nothing yet (`Lease.on_stall`): tried elsewhere; with
        ``started`` (found down, frozen or stalled: not asleep, which a running stream
        finishes first) its answering streams are asked too (`Lease.on_lost`: ended, if
        quiet). Not the one whose failure is being recorded (`_SENT`): its own handler is
        ending it."""
        judged = _SENT.get()
        for lease in list(self.cuttable):  # (each cut of a waiting one removes itself)
            if lease is not judged and (started or not lease.answered):
                lease.cut()

    def reply_mark(self) -> int:
        """A count that moves whenever anything comes from it (`replies`, `answers`)."""
        return self.replies + self.answers

    def frozen(self, mark: int, now: float, waited_s: float) -> bool:
        """A /health probe sent at `reply_mark` `mark` got no answer in `waited_s`: if
        nothing else came from it meanwhile either (no scrape, no first token, no streamed
        chunk) while requests of ours are there, its process is stopped, its host frozen
        or its network black-holed: down now, those that got nothing yet cut and tried
        elsewhere, its streams that did ended (`mark_down`). Before, they waited for
        `health.slow_threshold` slow probes (some 21 s with the defaults), and a replica
        whose requests all streamed was never found frozen: its streams waited for their
        idle timeout. A replica that answers anything (a stream's chunk too), or holds
        nothing of ours, is left to the slow-probe rule (a saturated vLLM answers /health
        late)."""
        if self.inflight <= 0 or self.reply_mark() != mark:
            return False
        self.reason = (f"no answer from it for {waited_s:g} s (not /health, /metrics nor its "
                       "requests): a stopped process, a frozen host or a cut network")
        log.warning("replica down: %s", self.reason,
                    extra={"pool": self.pool, "replica": self.id})
        self.mark_down(now, request=False, started=True)
        return True

    def probe_due(self, now: float) -> bool:
        """Should the active poller's result count now (healthy, or back-off expired)?"""
        return self.state != EJECTED or now >= self.ejected_until

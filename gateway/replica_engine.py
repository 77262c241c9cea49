"""What a replica's engine is seen doing, from its scrapes (a restart, its prefix-cache hit
ratio, progress: stalled when its token counters freeze with requests running) and its sleep
mode (scraped, its 503s, its dev-mode ``/is_sleeping``): out of rotation while asleep or
stalled, its requests that got nothing yet cut and tried elsewhere."""

from __future__ import annotations

import logging
from typing import Literal

from gateway.replica_health import ReplicaHealth
from gateway.replica_state import EJECTED
from gateway.scrape import Sample
from gateway.stall import progress

__all__ = ["ASLEEP", "ASLEEP_ASKED", "ASLEEP_SAID", "Lost", "ReplicaEngine"]

# (the replica's logger, as before this had a module of its own: operators filter on it)
log = logging.getLogger("gateway.replicas")

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


class ReplicaEngine(ReplicaHealth):
    """A replica's view of its engine (`Replica` is one)."""

    __slots__ = ()

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

    def _judge_progress(self, sample: Sample | None, now: float) -> None:
        # (kvgate's requests there that still wait for their answer to start: one the engine
        # finished whose client reads it slowly owes it nothing -- counted, an idle engine
        # was stalled and a one-replica pool answered every other client 503)
        stalled = self._stall.observe(sample, self.inflight_prefill, now)
        # never a page with its engine's counters (`--disable-log-stats`): kvgate's own
        # streams waiting there with nothing from its engine (`BlindWatch`); before, a hung
        # engine there kept them until their first-byte timeout (5 minutes)
        stalled = self._blind.observe(
            self.answers + self.streamed,
            self.inflight_prefill > 0 and self.whole_waiting_tokens <= 0,
            now, self.longest_first_s) if sample is None and self.scraped is None else stalled
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
        self._cut_waiting(started=True)


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

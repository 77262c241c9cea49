"""What kvgate knows of one replica (`ReplicaState`): its attributes, read by health, the
proxy, the admin API and metrics, and set by the rules that judge it (`replica_health`,
`replica_engine`) and by its requests (`Replica.acquire`, `Lease`). Its id and the three
states of its passive health live here too, shared by those rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gateway.scrape import Sample
from gateway.stall import BlindWatch, StallWatch, progress

if TYPE_CHECKING:
    from gateway.lease import Lease
    from gateway.replica_health import HealthRules

__all__ = ["EJECTED", "HALF_OPEN", "HEALTHY", "STORED_REASONS", "ReplicaState", "replica_id"]

HEALTHY, EJECTED, HALF_OPEN = "healthy", "ejected", "half_open"
# why a response stored on it was answered 503 (kvgate_stored_response_unavailable_total)
STORED_REASONS = ("down", "stalled", "asleep")


def replica_id(url: str) -> str:
    """A replica's id: host:port of its URL (the default the metrics and headers use)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


class ReplicaState:
    """One replica's state; its behaviour is in the classes built on it (`Replica`)."""

    __slots__ = (
        "_blind", "_heard_answers", "_policy", "_stall", "answers", "asleep", "attempts",
        "busy_streak", "busy_until", "current", "current_waiting", "cuttable", "down", "draining",
        "ejected_until", "ejections", "ended_since_scrape",
        "epoch", "failed", "failures", "fell_asleep", "gone", "heard_at", "hit_ratio", "id",
        "inflight", "inflight_prefill", "inflight_prefill_tokens", "longest_first_s", "lost_cache",
        "max_model_len",
        "outcomes", "pool", "progress_at_ejection", "reason", "refusal_warned", "replies",
        "scraped", "scraped_at", "scrapes",
        "sleep_said_until", "sleep_streak", "sleep_told", "slow_probes", "stalled", "stalls",
        "state", "stored_503s", "streamed", "url",
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
        # ... and where no counters are scraped (`--disable-log-stats`): its output, streamed
        # events of any request of ours (`streamed`) and first events or answers (`answers`)
        self._blind = BlindWatch(policy.stall_after_s)
        self.streamed = 0
        # the longest a stream of ours waited there for its first event lately (decaying,
        # `Lease.first_token`): a long prefill or queue it served is no stall when seen again
        # (`BlindWatch`)
        self.longest_first_s = 0.0
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
        # requests for a response stored here answered 503 while it could not serve them,
        # per reason of `STORED_REASONS` (`stored_unavailable`)
        self.stored_503s: dict[str, int] = {}
        # its requests that got nothing yet and can be cut when it stalls (`Lease.on_stall`)
        self.cuttable: set[Lease] = set()
        self.down = False  # marked down (refused, dead, /health failed): out until /health answers
        # its ejection was for nothing answering there (refused, /health failing, frozen): the
        # /health that answers again is the evidence it is back (`probe_recovered`)
        self.gone = False
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

    def oldest_wait_s(self, now: float) -> float:
        """Age (on the monotonic clock `now`) of the oldest request of kvgate's here still
        waiting for its first event (a non-streamed one: its whole answer), 0 with none: read
        from its leases that can still be cut (`cuttable`) when /metrics is served or the
        doctor samples, nothing per request (kvgate_replica_oldest_wait_seconds). An answering
        stream is there too (`Lease.on_lost`), and left out: it waits for nothing."""
        oldest = min((lease.since for lease in self.cuttable if not lease.answered),
                     default=now)
        return max(0.0, now - oldest)

    def stored_unavailable(self) -> None:
        """A request for a response stored here is answered 503: it is down, or (a follow-up,
        which runs its engine) stalled or asleep (`responses.home_out`)."""
        reason = "down" if self.down else "stalled" if self.stalled else "asleep"
        self.stored_503s[reason] = self.stored_503s.get(reason, 0) + 1

    def returned(self) -> float:
        """A count that moves whenever its engine gives anything back: a first event or whole
        answer, a streamed event, its scraped token counters (the doctor's "nothing
        returned")."""
        return float(self.answers + self.streamed) + (self.engine_tokens() or 0.0)

    def engine_tokens(self) -> float | None:
        """Tokens its engine has processed (prompt and generated, the scraped counters'
        sum), or None while no scrape said."""
        return None if self.scraped is None else progress(self.scraped)

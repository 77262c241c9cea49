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

The parts live where their names say: `replica_state` (the attributes), `replica_health` (the
ejection, back-off and trial rules), `replica_engine` (scrapes, sleep, stall), `lease` (a
request's claim and its cut) and `retry_budget`; `Replica` puts them together with its
accounting. Importers take `Replica` and the names of `__all__` from here.
"""

from __future__ import annotations

from gateway.lease import _SENT, Lease
from gateway.replica_engine import Lost, ReplicaEngine
from gateway.replica_health import HealthRules
from gateway.replica_state import replica_id
from gateway.retry_budget import RetryBudget
from routing.load import still_running
from routing.types import ReplicaView

__all__ = ["HealthRules", "Lease", "Lost", "Replica", "RetryBudget", "replica_id"]


class Replica(ReplicaEngine):
    """One upstream replica of a pool."""

    __slots__ = ()

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

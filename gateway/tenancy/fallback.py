"""Admission that survives a Redis outage: per-process limits while the shared ones are gone.

While the primary (Redis) limiter is unreachable, each gateway enforces its tenants' limits
divided by the number of gateway processes, so the fleet as a whole stays near the budget: the
configured count (`gateway_replicas` x `server.workers`) or, with shared routing state on, the
most processes it heard from in the last minute before the outage (`processes`), whichever is
larger (an autoscaler changes the count; a fixed setting cannot follow it); a worker started
again during the outage, which heard from nobody, takes the fleet its siblings saw
(`fleet_seen.py`). The
primary is retried at most every `recheck_s`, and used again as soon as it answers (a
tenant whose keys Redis refuses as of the wrong type is admitted here alone, each time: Redis
answers the others). `degraded`
says what the next admission would use: once `recheck_s` has passed it goes to the primary
again, so an idle gateway does not report a recovered Redis as down (the tenancy store's own
health says whether Redis answers meanwhile) -- unless Redis refused the limits' own commands
(out of memory, an ACL, a read-only replica), which the store's reads do not meet: that is
reported until an admission goes through.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from gateway.errors import BackendUnavailable, StoreUnreachable
from gateway.policy_doc import Limits
from gateway.tenancy.fleet_seen import FleetSeen
from gateway.tenancy.key_types import WRONG_TYPE
from gateway.tenancy.limits import Admission, MemoryRateLimiter, RateLimiter
from gateway.tenancy.reachability import Reachability, ends_with_a_connection
from gateway.tenancy.redis_conn import cause_label

__all__ = ["FallbackRateLimiter", "scale_limits"]

log = logging.getLogger(__name__)

FLEET_MEMORY_S = 60  # samples (one a second) of the fleet's size kept for an outage


def scale_limits(limits: Limits, replicas: int) -> Limits:
    """Each replica's share of a fleet-wide limit (at least 1 where a limit is set)."""

    def share(value: int | None) -> int | None:
        return None if value is None else max(1, value // max(1, replicas))

    return Limits(
        rpm=share(limits.rpm), tpm=share(limits.tpm), max_concurrency=share(limits.max_concurrency)
    )


class FallbackRateLimiter(RateLimiter):
    def __init__(
        self,
        primary: RateLimiter,
        *,
        address: str,
        replicas: int,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._primary = primary
        self._local = MemoryRateLimiter(clock=clock)
        self._replicas = max(1, replicas)
        # the gateway processes sharing these limits (this one included), as the shared
        # routing state sees them; sampled once a second while Redis answers
        self.processes: Callable[[], int] | None = None
        self._seen: deque[int] = deque(maxlen=FLEET_MEMORY_S)
        # a worker of several: where the workers keep the fleet they saw, for one started
        # again while Redis is down (`fleet_seen.py`)
        self.kept: FleetSeen | None = None
        self._recalled: int | None = None  # read once, when first needed
        self._sampled_at = float("-inf")
        self._recheck_s = recheck_s
        self._clock = clock
        self._down_until: float | None = None
        # the log while the shared limits are away: a line, then one a minute, one at the end
        self.reach = Reachability(address, retry_every_s=recheck_s, clock=clock,
                                  subject="rate limits", logger=log)

    @property
    def degraded(self) -> bool:
        if self._down_until is not None and self._clock() < self._down_until:
            return True
        # past the recheck: a Redis away (or refusing kvgate's credentials) is the store's
        # to report too, and an idle gateway must not report it down once it is back; a
        # refusal of the limits' own commands (out of memory, NOPERM, a read-only replica)
        # the store's reads do not meet: reported until an admission goes through (it read
        # "up" one second after each refused admission)
        cause = self.reach.cause
        return cause is not None and not ends_with_a_connection(cause)

    @property
    def down_cause(self) -> str | None:
        cause = self.reach.cause
        return cause_label(cause) if self.degraded and cause is not None else None

    async def start(self) -> None:
        await self._primary.start()

    async def close(self) -> None:
        await self._primary.close()

    async def admit(self, tenant_id: str, limits: Limits, *, tokens: int) -> Admission:
        return await self._decide(tenant_id, limits, tokens, peek=False)

    async def peek(self, tenant_id: str, limits: Limits) -> Admission:
        return await self._decide(tenant_id, limits, 0, peek=True)

    async def _decide(self, tenant_id: str, limits: Limits, tokens: int, *,
                      peek: bool) -> Admission:
        if self._down_until is None or self._clock() >= self._down_until:
            try:
                admission = await (self._primary.peek(tenant_id, limits) if peek else
                                   self._primary.admit(tenant_id, limits, tokens=tokens))
            except BackendUnavailable as exc:
                cause = exc.cause if isinstance(exc, StoreUnreachable) else exc.message
                if cause != WRONG_TYPE:  # else this tenant's keys only (logged by the primary)
                    self.reach.failed(cause)
                    self._down_until = self._clock() + self._recheck_s
            else:
                self.reach.answered()
                self._down_until = None
                self._sample()
                return admission
        scaled = scale_limits(limits, self.divisor)
        local = self._local
        admission = await (local.peek(tenant_id, scaled) if peek else
                           local.admit(tenant_id, scaled, tokens=tokens))
        admission.degraded = True
        return admission

    @property
    def divisor(self) -> int:
        """How many processes share a limit while Redis is down."""
        if self._seen:
            return max(self._replicas, max(self._seen))
        if self.kept is not None and self._recalled is None:  # (heard nobody itself)
            self._recalled = self.kept.recall() or 1
        return max(self._replicas, self._recalled or 1)

    def _sample(self) -> None:
        if self.processes is None:
            return
        now = self._clock()
        if now - self._sampled_at >= 1.0:
            self._sampled_at = now
            self._seen.append(self.processes())
            if self.kept is not None:
                self.kept.keep(max(self._seen))

    async def settle(self, admission: Admission, used_tokens: int, *,
                     served: bool = True) -> None:
        try:
            await (admission.owner or self._primary).settle(admission, used_tokens,
                                                            served=served)
        except BackendUnavailable:
            log.debug("usage not settled: Redis unreachable")

    async def release(self, admission: Admission) -> None:
        try:
            await (admission.owner or self._primary).release(admission)
        except BackendUnavailable:  # the lease expires on its own
            log.debug("lease not released: Redis unreachable")

"""Failed admin authentications: throttled per client address, logged, counted and audited.

Each client address has a bucket of `burst` failures refilled at `per_minute` (on a gateway of
several ``server.workers``, each process holds its share: `AuthGuard.share_of`). With Redis the
budget is also counted once for every gateway sharing it (`TenantStore.auth_failures`, charged
with each failure; a failure that leaves the address throttled is told to every gateway, whose
bucket `adopt`s the shared level and refills it at the shared budget's rate, not its share's),
so N gateways do not give an address N times the guesses; while Redis does not answer, each
process counts alone. An address whose bucket is empty gets 429 with ``Retry-After`` on every
admin request (before its token is even looked at, and before its body is read) until one
failure's worth has refilled, so guessing tokens costs minutes per dozen tries. Successful
requests cost nothing. The address is the TCP peer (behind a reverse proxy every client shares
the proxy's address: serve the admin API on its own port, reached directly). Every failure is
counted (`kvgate_admin_auth_failures_total{reason}`) and, while the address is not throttled,
logged at WARNING and written to the audit log (``admin.auth_failed``); the moment an address
becomes throttled is logged and audited once (``admin.auth_throttled``).
The token presented is never logged or stored.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.asgi import Scope
from gateway.errors import RateLimited

__all__ = ["BURST", "PER_MINUTE", "REASONS", "AuthGuard", "AuthGuardCollector"]

log = logging.getLogger(__name__)

# why an admin request was refused: no bearer token, a wrong one, a tenant key, no admin token
# configured at all, or the address is throttled (the token was not checked)
REASONS = ("missing", "invalid", "tenant_key", "disabled", "throttled")


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float
    rate: float  # refill per second: this process's share's, or the shared budget's (`adopt`)


BURST = 10  # failures an address may make at once, on one gateway (all its workers)
PER_MINUTE = 10.0  # and then per minute


class AuthGuard:
    def __init__(
        self,
        *,
        burst: float = BURST,
        per_minute: float = PER_MINUTE,
        max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        shared_per_minute: float = PER_MINUTE,
    ) -> None:
        self._burst = float(burst)
        self._rate = per_minute / 60.0
        # the refill of the budget every gateway shares in Redis (`TenantStore.auth_failures`)
        self._shared_rate = shared_per_minute / 60.0
        self._max = max_addresses
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.failures: dict[str, int] = dict.fromkeys(REASONS, 0)

    @classmethod
    def share_of(cls, processes: int) -> AuthGuard:
        """One process's share of a gateway's budget, for each of its ``server.workers``
        processes: each counts alone, and the kernel spreads an address's connections over
        them (a whole budget each gave an address twice the guesses with two workers: 20,
        then 2 every 6 s). At least one failure each."""
        return cls(burst=max(1.0, BURST / processes), per_minute=PER_MINUTE / processes)

    def _level(self, address: str, now: float) -> _Bucket | None:
        bucket = self._buckets.get(address)
        if bucket is not None:
            bucket.level = min(self._burst, bucket.level + (now - bucket.at) * bucket.rate)
            bucket.at = now
        return bucket

    def check(self, address: str) -> None:
        """Raise 429 (`RateLimited`) while `address` has used up its failures."""
        bucket = self._level(address, self._clock())
        if bucket is not None and bucket.level < 1.0:
            self.failures["throttled"] += 1
            wait = (1.0 - bucket.level) / bucket.rate
            raise RateLimited(
                "too many failed admin authentications from this address: all admin requests "
                f"from this address are refused for {max(1, math.ceil(wait))} s, valid tokens "
                "included", retry_after_s=wait,
            )

    def check_scope(self, scope: Scope) -> None:
        """`check` for an ASGI request's client address (before its body is read)."""
        client = scope.get("client")
        self.check(client[0] if client else "unknown")

    def failed(self, address: str, reason: str) -> bool:
        """Record one failure; True when it has just made `address` throttled."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
        bucket = self._bucket(address, self._clock())
        bucket.level -= 1.0
        bucket.rate = self._rate  # counted here: this process's share refills it
        return bucket.level < 1.0

    def adopt(self, address: str, level: float) -> None:
        """The failures `address` has left at every gateway (the tenancy store's shared
        count, `TenantStore.auth_failures`): this process's bucket follows it down, never
        up, so `check` throttles here too, before a body is read; and refills as the shared
        budget does. At this process's share's rate, a worker of a gateway of two answered
        the address ``Retry-After: 12`` and refused it for 12 s where the shared budget,
        and a gateway of one worker, let it try again after 6."""
        now = self._clock()
        bucket = self._level(address, now)
        if bucket is None:
            if level >= self._burst:
                return
            bucket = self._bucket(address, now)
        if level < bucket.level:
            bucket.level, bucket.rate = level, self._shared_rate

    def _bucket(self, address: str, now: float) -> _Bucket:
        bucket = self._level(address, now)
        if bucket is None:
            bucket = self._buckets[address] = _Bucket(self._burst, now, self._rate)
            while len(self._buckets) > self._max:  # bounded memory: forget the oldest
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(address)
        return bucket


class AuthGuardCollector(Collector):
    """`kvgate_admin_auth_failures_total{reason}` (every reason present from the start)."""

    def __init__(self, guard: AuthGuard) -> None:
        self._guard = guard

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvgate_admin_auth_failures", "admin API requests refused for authentication",
            labels=["reason"],
        )
        for reason, count in self._guard.failures.items():
            family.add_metric([reason], count)
        yield family

"""Per-tenant admission: requests/minute, tokens/minute and concurrent requests.

Both minute limits are token buckets holding at most one minute of budget and refilling
continuously (limit/60 per second). TPM admission needs only a positive balance; what the
request may consume (its prompt estimate plus ``n`` times its output: `gateway.flow.asked_tokens`,
as flow control charges it) is reserved at once and the real usage is settled afterwards, so
the bucket overshoots by at most the reservations of the requests already admitted.
Concurrency is a set of leases released when the request ends. `RedisRateLimiter` runs the same
rules in one Lua script; `MemoryRateLimiter` is the single-process (and fallback) version.

A refusal's wait is what the bucket says: an RPM bucket admits again at one whole request, a
TPM bucket as soon as its balance is above zero (`POSITIVE_S` past the moment it reaches it),
and both go out to the millisecond in ``retry-after-ms`` (the openai SDKs read it before
``Retry-After``, whose whole seconds round it up). A TPM refusal said the time to a balance of
one token: 60/TPM s late (6 s on a 10 TPM budget). A concurrency refusal waits for the first
of the tenant's requests to be likely over (`HoldTimes`; with Redis, over the whole fleet).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gateway.errors import RateLimited, RateLimitedBeyondWindow
from gateway.policy_doc import Limits

__all__ = [
    "CONCURRENCY_WAIT_S",
    "POSITIVE_S",
    "Admission",
    "HoldTimes",
    "MemoryRateLimiter",
    "RateLimiter",
    "refill",
    "tpm_wait",
]

WINDOW_S = 60.0
# past the moment a TPM balance owed reaches zero, when it is above it (a balance of exactly
# zero is refused): one millisecond, the resolution of ``retry-after-ms``
POSITIVE_S = 0.001
# a concurrency refusal's wait when nothing tells when a lease frees (`HoldTimes`)
CONCURRENCY_WAIT_S = 1.0


def refill(level: float, last: float, now: float, capacity: int) -> float:
    """A bucket's level after refilling at `capacity` per minute since `last`."""
    return min(float(capacity), level + max(0.0, now - last) * capacity / WINDOW_S)


def _seconds_to(level: float, target: float, capacity: int) -> float:
    return max(0.0, (target - level) * WINDOW_S / capacity)


def tpm_wait(level: float, tpm: int) -> float:
    """How long a TPM bucket at `level` (zero or below: refused) takes to admit again: until
    its balance is above zero (`redis_limit_scripts.ADMIT` computes the same)."""
    return _seconds_to(level, 0.0, tpm) + POSITIVE_S


def _fmt_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


@dataclass(slots=True)
class Admission:
    """The answer to one admission request, and the handle to settle and release it."""

    allowed: bool
    tenant_id: str
    reason: str | None = None  # when denied: "concurrency" | "rpm" | "tpm"
    retry_after_s: float = 0.0
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0
    reserved_tokens: int = 0
    tokens_level: float = 0.0  # the token bucket right after admission (below 0: owed)
    requests_level: float = 0.0  # the request bucket right after admission
    lease_id: str | None = None
    # a reservation without a lease: its mark in the shared store, taken away by `settle`
    reservation_id: str | None = None
    degraded: bool = False  # admitted by per-process fallback limits
    owner: RateLimiter | None = field(default=None, repr=False, compare=False)
    settled: bool = False
    released: bool = False

    def headers(self) -> dict[str, str]:
        """``x-ratelimit-*`` (OpenAI's names) and, when denied, ``retry-after`` (whole seconds,
        rounded up) and ``retry-after-ms`` (milliseconds, as the openai SDKs read it first)."""
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests or 0)
            out["x-ratelimit-reset-requests"] = _fmt_duration(self.reset_requests_s)
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens or 0)
            out["x-ratelimit-reset-tokens"] = _fmt_duration(self.reset_tokens_s)
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            out["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return out

    def settled_to(self, used_tokens: int, *, served: bool = True) -> Admission:
        """This admission as it reads once `used_tokens` replaced its reservation: the
        remaining tokens (and their reset) after the request, as OpenAI's headers give them
        (others' use since the admission is not seen, as it was not before). A request never
        `served` (`RateLimiter.settle`: its request given back too) reads one more request
        remaining: a 429 or 503 of flow control's queue said one fewer than was left."""
        if not self.allowed:
            return self
        out = self
        if (rpm := self.limit_requests) and not served:
            left = min(float(rpm), self.requests_level + 1)
            out = replace(out, remaining_requests=max(0, math.floor(left)),
                          reset_requests_s=_seconds_to(left, rpm, rpm), requests_level=left)
        if limit := self.limit_tokens:
            level = min(float(limit), self.tokens_level + self.reserved_tokens - used_tokens)
            out = replace(out, remaining_tokens=max(0, math.floor(level)),
                          reset_tokens_s=_seconds_to(level, limit, limit), tokens_level=level)
        return out

    def error(self) -> RateLimited:
        what = {"rpm": "requests per minute", "tpm": "tokens per minute"}.get(
            self.reason or "", "concurrent requests"
        )
        # a wait past the window: not retried by the SDKs (`RateLimitedBeyondWindow`)
        cls = RateLimitedBeyondWindow if self.retry_after_s > WINDOW_S else RateLimited
        return cls(
            f"rate limit exceeded: {what}; retry after {max(1, math.ceil(self.retry_after_s))}s",
            retry_after_s=self.retry_after_s,
        )


class RateLimiter(ABC):
    """`admit` before forwarding; `settle` with real usage; `release` when the request ends
    (always, in a ``finally``). `settle` and `release` are idempotent."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Start background work (lease renewal)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work."""

    @property
    def degraded(self) -> bool:
        return False

    @property
    def down_cause(self) -> str | None:
        """While `degraded`: why the shared limits fail (one of `redis_conn.CAUSE_LABELS`)."""
        return None

    @abstractmethod
    async def admit(self, tenant_id: str, limits: Limits, *, tokens: int) -> Admission: ...

    @abstractmethod
    async def peek(self, tenant_id: str, limits: Limits) -> Admission:
        """The decision `admit` would make now, with nothing charged or leased (a request
        refused before its body is read; an allowed peek is followed by the real `admit`)."""

    @abstractmethod
    async def settle(self, admission: Admission, used_tokens: int, *,
                     served: bool = True) -> None:
        """Charge real usage: the difference to the estimate reserved at admission. A
        request not `served` (no replica took it, or its replicas failed before any output:
        a 502/503) gives its request back to the RPM bucket as well."""

    @abstractmethod
    async def release(self, admission: Admission) -> None:
        """Give back the concurrency lease."""

    async def finish(self, admission: Admission, used_tokens: int | None, *,
                     served: bool = True) -> None:
        """`settle` (when usage is known) and `release` together, at once: a stream's last
        bytes have gone out, and its client's next request may already be here. One after
        the other (two Redis round trips) a tenant with a TPM limit running as many streams
        at once as its `max_concurrency` got a third of them refused for concurrency. The
        release runs however the settle ends, in a task of its own: one cancelled while it
        waited on Redis (an edge's cleanup cancelled again) left the lease live, renewed for
        as long as the process ran."""
        release = asyncio.ensure_future(self.release(admission))
        try:
            if used_tokens is not None:
                await self.settle(admission, used_tokens, served=served)
        finally:
            await asyncio.shield(release)


HOLD_WEIGHT = 0.3  # the weight of a lease's hold time in its tenant's running mean
HOLD_TENANTS = 4096  # tenants whose mean hold time is remembered (the least recent go)


class HoldTimes:
    """How long a tenant's requests hold their concurrency lease in this process: the leases
    held here (since when) and a running mean of the hold times of those released. A
    concurrency refusal's wait (`wait`) is when the first of them is likely to end: the mean
    less its age, at least 1 s (due or past it: any moment). It said 1 s whatever the
    requests: an SDK with its two retries a second apart got the 429 two seconds later, while
    the tenant's streams ran for tens of seconds. The leases held by other processes are
    not seen here; the shared limiter asks Redis for the fleet's (`redis_limit_scripts`),
    and with no hold time known, 1 s as before."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, dict[str, float]] = {}  # tenant -> lease id -> taken at
        self._mean: OrderedDict[str, float] = OrderedDict()  # tenant -> mean hold (s)

    def taken(self, tenant_id: str, lease_id: str) -> None:
        self._held.setdefault(tenant_id, {})[lease_id] = self._clock()

    def freed(self, tenant_id: str, lease_id: str) -> float | None:
        """How long the lease was held (s); None for one not taken here."""
        held = self._held.get(tenant_id)
        since = held.pop(lease_id, None) if held is not None else None
        if since is None:
            return None
        if not held:
            del self._held[tenant_id]
        took = max(0.0, self._clock() - since)
        mean = self._mean.pop(tenant_id, None)
        self._mean[tenant_id] = took if mean is None else mean + HOLD_WEIGHT * (took - mean)
        if len(self._mean) > HOLD_TENANTS:
            self._mean.popitem(last=False)
        return took

    def wait(self, tenant_id: str) -> float:
        """Seconds until a lease of the tenant's held here is likely free (1 to `WINDOW_S`)."""
        mean, held = self._mean.get(tenant_id), self._held.get(tenant_id)
        if mean is None or not held:
            return CONCURRENCY_WAIT_S
        now = self._clock()
        soonest = min(mean - (now - since) for since in held.values())
        return min(WINDOW_S, max(CONCURRENCY_WAIT_S, soonest))


@dataclass(slots=True)
class _Bucket:
    requests: float
    tokens: float
    at: float
    rpm: int  # the capacities it was last charged under (0: no such limit)
    tpm: int

    def idle(self, now: float) -> bool:
        """Charged last `KEEP_S` ago and refilled to capacity by `now`: the same as no
        bucket (a new one starts full), and its admissions' settlements are most likely
        made (one that comes later is not charged)."""
        return (now - self.at >= KEEP_S
                and (not self.rpm or refill(self.requests, self.at, now, self.rpm) >= self.rpm)
                and (not self.tpm or refill(self.tokens, self.at, now, self.tpm) >= self.tpm))


MIN_SWEEP = 1024  # buckets kept before the first sweep for idle ones
# how long a bucket outlives its last charge, as the Redis limiter's bucket (61 s): refilled
# sooner (a small reservation), it still takes the excess a long stream settles later
KEEP_S = WINDOW_S + 1.0


class MemoryRateLimiter(RateLimiter):
    """The same rules for one process (exact within it; no sharing across processes).

    Memory is bounded by the tenants active within about a minute, not by every tenant ever
    seen (removed ones, or keys used once): a bucket refilled to capacity and charged last
    `KEEP_S` ago is dropped (a tenant without one starts full), in a sweep each time the
    buckets double past `MIN_SWEEP`; a tenant's lease set goes with its last lease. A
    settlement that finds its bucket dropped (a request longer than `KEEP_S`) is not
    charged, as the Redis limiter's for an expired bucket."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._leases: dict[str, set[str]] = {}
        self._sweep_at = MIN_SWEEP
        self.holds = HoldTimes(clock)

    @property
    def tenants_tracked(self) -> int:
        """Tenants with a bucket or a lease held here."""
        return len(self._buckets.keys() | self._leases.keys())

    async def admit(self, tenant_id: str, limits: Limits, *, tokens: int) -> Admission:
        return self._decide(tenant_id, limits, tokens, charge=True)

    async def peek(self, tenant_id: str, limits: Limits) -> Admission:
        return self._decide(tenant_id, limits, 0, charge=False)

    def _decide(self, tenant_id: str, limits: Limits, tokens: int, *, charge: bool) -> Admission:
        now = self._clock()
        rpm, tpm, conc = limits.rpm or 0, limits.tpm or 0, limits.max_concurrency or 0
        b = self._buckets.get(tenant_id) or _Bucket(float(rpm), float(tpm), now, rpm, tpm)
        r = refill(b.requests, b.at, now, rpm) if rpm else 0.0
        t = refill(b.tokens, b.at, now, tpm) if tpm else 0.0
        leases = self._leases.get(tenant_id, ())
        # refused by the first limit that refuses, until the last one allows (a tenant at its
        # concurrency limit with its RPM spent was told 1 s, then 60 s more)
        waits: dict[str, float] = {}  # each limit that refuses: how long it will
        if conc and len(leases) >= conc:
            waits["concurrency"] = self.holds.wait(tenant_id)
        if rpm and r < 1:
            waits["rpm"] = _seconds_to(r, 1.0, rpm)
        if tpm and t <= 0:
            waits["tpm"] = tpm_wait(t, tpm)
        reason = next(iter(waits), None)
        retry = max(waits.values(), default=0.0)
        lease_id = None
        if not charge:
            return build_admission(tenant_id, limits, reason, retry, r, t, 0, None, self)
        if reason is None:
            r, t = (r - 1 if rpm else r), (t - tokens if tpm else t)
            if conc:
                lease_id = secrets.token_hex(8)
                self._leases.setdefault(tenant_id, set()).add(lease_id)
                self.holds.taken(tenant_id, lease_id)
        if rpm or tpm:  # (concurrency alone needs no bucket)
            self._keep(tenant_id, _Bucket(r, t, now, rpm, tpm), now)
        return build_admission(tenant_id, limits, reason, retry, r, t, tokens, lease_id, self)

    def _keep(self, tenant_id: str, bucket: _Bucket, now: float) -> None:
        self._buckets[tenant_id] = bucket
        if len(self._buckets) >= self._sweep_at:
            self._buckets = {k: b for k, b in self._buckets.items() if not b.idle(now)}
            self._sweep_at = max(MIN_SWEEP, 2 * len(self._buckets))

    async def settle(self, admission: Admission, used_tokens: int, *,
                     served: bool = True) -> None:
        if admission.settled or not admission.allowed:
            return
        admission.settled = True
        b = self._buckets.get(admission.tenant_id)
        if b is not None and admission.limit_tokens:
            extra = used_tokens - admission.reserved_tokens
            b.tokens = min(float(admission.limit_tokens), b.tokens - extra)
        if b is not None and admission.limit_requests and not served:
            b.requests = min(float(admission.limit_requests), b.requests + 1)

    async def release(self, admission: Admission) -> None:
        if admission.released or admission.lease_id is None:
            return
        admission.released = True
        self.holds.freed(admission.tenant_id, admission.lease_id)
        leases = self._leases.get(admission.tenant_id)
        if leases is not None:
            leases.discard(admission.lease_id)
            if not leases:
                del self._leases[admission.tenant_id]

    def inflight(self, tenant_id: str) -> int:
        return len(self._leases.get(tenant_id, ()))


def build_admission(
    tenant_id: str,
    limits: Limits,
    reason: str | None,
    retry: float,
    r: float,
    t: float,
    tokens: int,
    lease_id: str | None,
    owner: RateLimiter,
) -> Admission:
    """An `Admission` from bucket levels after the decision (shared with the Redis limiter)."""
    rpm, tpm = limits.rpm, limits.tpm
    return Admission(
        allowed=reason is None,
        tenant_id=tenant_id,
        reason=reason,
        retry_after_s=retry,
        limit_requests=rpm,
        remaining_requests=max(0, math.floor(r)) if rpm else None,
        reset_requests_s=_seconds_to(r, rpm, rpm) if rpm else 0.0,
        limit_tokens=tpm,
        remaining_tokens=max(0, math.floor(t)) if tpm else None,
        reset_tokens_s=_seconds_to(t, tpm, tpm) if tpm else 0.0,
        reserved_tokens=tokens if reason is None else 0,
        tokens_level=t,
        requests_level=r,
        lease_id=lease_id,
        owner=owner,
    )

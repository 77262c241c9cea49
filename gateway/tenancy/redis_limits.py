"""Admission shared by every gateway replica: one Lua script, one round trip per request.

Per tenant (named by `Tenant.limits_key`: its id, and for one the admin API created, the
incarnation it drew, so one created again under a deleted tenant's id starts afresh): a hash
``<ns>:rl:{<tenant>}`` with both bucket levels and their time (kept until
both are full again, tokens owed included: a missing bucket starts full), a sorted set
``<ns>:rl:{<tenant>}:leases`` of concurrency leases scored by expiry, and one,
``...:reserved``, of the TPM reservations made without a lease (no concurrency limit), each
marked for a lease TTL or until its settle takes the mark away in its own call, and a set
``...:holders`` of the processes holding its leases, ``...:held`` (when each lease was
taken) and ``...:hold`` (the tenant's mean hold time): a concurrency refusal's
``Retry-After`` is when the tenant's oldest lease, whichever gateway holds it, is likely
over. Time is Redis's
own clock (``TIME``), so gateways with skewed clocks still share one budget. Leases expire
after `lease_ttl_s` unless renewed: a gateway renews its live leases in the background. A
process that dies frees its tenants' concurrency sooner: each lease names its holder (this
process), whose heartbeat key lives `holder_ttl_s` (5 s) unless written again, and a tenant
found full drops the leases of holders without one (`holders.py`); the supervisor of
``server.workers`` deletes a dead worker's at once. A release that fails (Redis
stalled or unreachable) is kept and retried as soon as Redis answers again -- by the tenant's
next admission, in its own script call, and by a background retry -- so a tenant is not locked
out for a lease TTL after a stall. So is the lease of an admission that failed: a stalled Redis
(paused, a long fork) still runs the script it had read when it wakes, after this process gave
up on it and admitted the request on its per-process fallback, and nobody would hold or release
that lease. Such an admission (failed, or cancelled while Redis ran it: a client leaving the
picker while its admission waited on a slow Redis) also gives its TPM reservation back when its
lease is found in Redis, which tells that the script ran (without a concurrency limit, its
reservation's mark tells): the request never reached a replica, and kept its whole reservation
charged (``max_tokens`` 900 of a 1,000 TPM budget: 900 tokens for ~54 s). A mark lives about a
lease TTL (pruned by the tenant's next marking admission, its key expiring a second after the
last); found later, nothing is given back (the bucket has refilled much of it by then). A
settle runs in a task of its own, so one whose caller is cancelled before it was sent is still
made.
While Redis does not answer, failed renewals are logged like the tenancy store's
(`gateway.tenancy.reachability`): the first at once, then a line a minute, one on recovery.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import BackendUnavailable, StoreUnreachable
from gateway.policy_doc import Limits
from gateway.tenancy import redis_limit_scripts as scripts
from gateway.tenancy.holders import HOLDER_TTL_S, holder_key
from gateway.tenancy.key_types import WRONG_TYPE, wrong_types
from gateway.tenancy.limits import Admission, HoldTimes, RateLimiter, build_admission
from gateway.tenancy.reachability import Reachability
from gateway.tenancy.redis_conn import failure_cause, redis_address, redis_unavailable

__all__ = ["RELEASE_RETRY_S", "RedisRateLimiter"]

RELEASE_RETRY_S = 0.25  # how often failed lease releases are retried while Redis is away
# the types of a tenant's keys, in `RedisRateLimiter._keys`'s order (the admission script's)
_LIMIT_TYPES = ("hash", "zset", "zset", "set", "zset", "string")
SETTLE_WAIT_S = 2.0  # how long `close` waits for settles still on their way to Redis

log = logging.getLogger(__name__)


class RedisRateLimiter(RateLimiter):
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "kvgate",
        lease_ttl_s: float = 30.0,
        holder_ttl_s: float = HOLDER_TTL_S,
        clock: Callable[[], float] | None = None,  # None: Redis's clock (production)
    ) -> None:
        self._r = client
        self._ns = namespace
        self._ttl = lease_ttl_s
        self._holder_ttl = holder_ttl_s
        self.holder = secrets.token_hex(6)  # this process, in its lease ids (`holders.py`)
        self._clock = clock
        self._admit = client.register_script(scripts.ADMIT)
        self._settle = client.register_script(scripts.SETTLE)
        self._renew = client.register_script(scripts.RENEW)
        self._release = client.register_script(scripts.RELEASE)
        self._live: dict[str, str] = {}  # lease id -> tenant id, renewed while live
        self.holds = HoldTimes()  # (this process's leases: a concurrency refusal's wait)
        # lease id -> (tenant id, tokens to give back with it, tpm): release failed, or its
        # admission's outcome is unknown
        self._unreleased: dict[str, tuple[str, int, int]] = {}
        self._wrong_type: dict[str, str] = {}  # tenant id -> its bucket, said in the log
        self._settling: set[asyncio.Task[object]] = set()  # settles on their way to Redis
        self._retry_wake = asyncio.Event()
        self._renewer: asyncio.Task[None] | None = None
        self._retrier: asyncio.Task[None] | None = None
        self.renewal = Reachability(redis_address(client), retry_every_s=self._tick,
                                    subject="concurrency lease renewal", logger=log)

    def _bucket(self, tenant_id: str) -> str:
        return f"{self._ns}:rl:{{{tenant_id}}}"  # {hash tag}: both keys in one cluster slot

    @property
    def _tick(self) -> float:
        """How often the heartbeat is written (and the leases renewed, when due)."""
        return min(self._ttl, self._holder_ttl) / 3

    def _now(self) -> str:
        return "" if self._clock is None else repr(self._clock())

    async def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_loop(), name="lease-renewal")
        if self._retrier is None:
            self._retrier = asyncio.create_task(self._retry_loop(), name="lease-release-retry")

    async def close(self) -> None:
        for task in (self._renewer, self._retrier):
            while task is not None and not task.done():  # redis-py can swallow a cancel
                task.cancel()
                await asyncio.wait({task}, timeout=0.5)
        self._renewer = self._retrier = None
        if self._settling:  # the last requests' usage (each call bounded by its socket timeout)
            await asyncio.wait(set(self._settling), timeout=SETTLE_WAIT_S)

    @property
    def unreleased(self) -> int:
        """Leases whose release failed and is waiting for Redis to answer again."""
        return len(self._unreleased)

    async def admit(self, tenant_id: str, limits: Limits, *, tokens: int) -> Admission:
        return await self._decide(tenant_id, limits, tokens, peek=False)

    async def peek(self, tenant_id: str, limits: Limits) -> Admission:
        return await self._decide(tenant_id, limits, 0, peek=True)

    async def _decide(self, tenant_id: str, limits: Limits, tokens: int, *,
                      peek: bool) -> Admission:
        # Redis may be back: the tenant's stalled leases are freed before its own are counted,
        # by the same call (a round trip more before was 2 x redis_timeout_s on a slow Redis);
        # not the others': a release stuck on another tenant's broken key must not fail this
        stalled = [(lid, held) for lid, held in self._unreleased.items() if held[0] == tenant_id]
        for lid, _ in stalled:  # taken: admissions arriving together each sent them all (and
            del self._unreleased[lid]  # logged them), until one call answered
        lease_id = f"{self.holder}.{secrets.token_hex(8)}"
        bucket = self._bucket(tenant_id)
        tpm = limits.tpm or 0
        args: list[str | int | float] = [
            self._now(),
            limits.rpm or 0,
            tpm,
            limits.max_concurrency or 0,
            tokens,
            lease_id,
            self._ttl,
            "1" if peek else "0",
            holder_key(self._ns, ""),
            self.holder,
            self._holder_ttl,
        ]
        for lid, (_, reserved, its_tpm) in stalled:  # (each its own: a lease's is 0)
            args += [lid, reserved, its_tpm]
        try:
            with redis_unavailable():
                reason, retry, r, t = await self._admit(keys=self._keys(tenant_id), args=args)
        except BaseException as exc:
            if stalled:  # not known to be released: still pending
                self._unreleased.update(stalled)
                self._retry_wake.set()
            if not isinstance(exc, (StoreUnreachable, asyncio.CancelledError)):
                raise
            if isinstance(exc, StoreUnreachable) and exc.cause == WRONG_TYPE:  # not an outage
                await self._say_wrong_type(tenant_id, bucket)
                raise  # refused before the script wrote this admission's lease or mark
            # Redis may still take the lease (a client that left cancels the request while
            # its script runs): free it, or it holds the tenant's slot until its TTL; and
            # give back its reservation (found by its lease, or by its mark without one)
            if not peek and (limits.max_concurrency or (tpm and tokens > 0)):
                self._unreleased[lease_id] = (tenant_id, tokens, tpm)
                self._retry_wake.set()
            raise
        if self._wrong_type.pop(tenant_id, None) is not None:
            log.info("rate limits of tenant %s: its keys in Redis work again",
                     _tenant_of(tenant_id), extra={"tenant": _tenant_of(tenant_id)})
        if stalled:
            log.info("concurrency leases released after Redis answered again",
                     extra={"leases": len(stalled)})
        lease = lease_id if not reason and limits.max_concurrency and not peek else None
        if lease is not None:
            self._live[lease] = tenant_id
            self.holds.taken(tenant_id, lease)
        if reason == "concurrency":  # the fleet's wait (1 s when unknown) or this process's
            retry = max(float(retry), self.holds.wait(tenant_id))
        admission = build_admission(
            tenant_id,
            limits,
            reason or None,
            float(retry),
            float(r),
            float(t),
            tokens,
            lease,
            self,
        )
        if not reason and not peek and lease is None and tpm and tokens > 0:
            admission.reservation_id = lease_id  # marked by the script
        return admission

    def _keys(self, tenant_id: str) -> list[str]:
        """A tenant's bucket, lease, reservation and lease holder keys, and its leases' take
        times and mean hold time (one cluster slot)."""
        bucket = self._bucket(tenant_id)
        return [bucket, bucket + ":leases", bucket + ":reserved", bucket + ":holders",
                bucket + ":held", bucket + ":hold"]

    async def settle(self, admission: Admission, used_tokens: int, *,
                     served: bool = True) -> None:
        """In a task of its own, which a cancelled caller does not stop: marked settled here,
        a settle cancelled before it was sent (waiting for a connection) was never made, and
        the reservation stayed charged until the bucket refilled."""
        refund = 0 if served else admission.limit_requests or 0  # (the RPM to refill up to)
        if (admission.settled or not admission.allowed
                or not (admission.limit_tokens or refund)):
            return
        admission.settled = True
        extra = used_tokens - admission.reserved_tokens
        bucket = self._bucket(admission.tenant_id)
        task: asyncio.Task[object] = asyncio.ensure_future(self._settle(
            keys=[bucket, bucket + ":reserved"],
            args=[extra, admission.limit_tokens or 0, admission.reservation_id or "", refund]))
        self._settling.add(task)
        task.add_done_callback(self._settled)
        with redis_unavailable():
            await asyncio.shield(task)

    def _settled(self, task: asyncio.Task[object]) -> None:
        self._settling.discard(task)
        if not task.cancelled():
            task.exception()  # seen: its caller may have gone (a failure is its caller's)

    async def release(self, admission: Admission) -> None:
        if admission.released or admission.lease_id is None:
            return
        admission.released = True
        self._live.pop(admission.lease_id, None)
        took = self.holds.freed(admission.tenant_id, admission.lease_id)
        args: list[str | float] = [admission.lease_id, 0, 0]
        if took is not None:  # the tenant's mean hold time, fleet-wide (a concurrency wait)
            args.append(took)
        try:
            with redis_unavailable():
                await self._release(keys=self._keys(admission.tenant_id), args=args)
        except (BackendUnavailable, asyncio.CancelledError):  # cancelled: as in `_decide`
            self._unreleased[admission.lease_id] = (admission.tenant_id, 0, 0)
            self._retry_wake.set()
            raise

    async def release_pending(self) -> int:
        """Retry the releases that failed; the number still pending (0: all done).

        `BackendUnavailable` while Redis still does not answer, or refuses one of them (a
        key of the wrong type): the others are done."""
        pending = list(self._unreleased.items())
        if not pending:
            return 0
        with redis_unavailable():
            async with self._r.pipeline(transaction=False) as pipe:
                for lease_id, (tenant, tokens, tpm) in pending:
                    await self._release(keys=self._keys(tenant), args=[lease_id, tokens, tpm],
                                        client=pipe)
                results = await pipe.execute(raise_on_error=False)
        refused = [res for res in results if isinstance(res, Exception)]
        for (lease_id, _), res in zip(pending, results, strict=True):
            if not isinstance(res, Exception):
                self._unreleased.pop(lease_id, None)
        if len(refused) < len(pending):
            log.info("concurrency leases released after Redis answered again",
                     extra={"leases": len(pending) - len(refused)})
        if refused:
            raise StoreUnreachable(failure_cause(refused[0]))
        return len(self._unreleased)

    async def _say_wrong_type(self, tenant_id: str, bucket: str) -> None:
        """Once per tenant (until its keys work): this is no outage, but a key to delete,
        named by its type (it named four of the six keys the script checks, whichever was
        wrong; all six when their types cannot be read)."""
        if tenant_id in self._wrong_type:
            return
        self._wrong_type[tenant_id] = bucket
        keys = self._keys(tenant_id)
        try:
            wrong = await wrong_types(self._r, dict(zip(keys, _LIMIT_TYPES, strict=True)))
        except (RedisError, OSError):
            wrong = []
        said = ("; ".join(wrong) if wrong else
                "one of " + ", ".join(keys) + " (their types could not be read)")
        log.error("rate limits of tenant %s: Redis refused its keys: %s (WRONGTYPE: written by "
                  "hand or another application?); it is admitted on per-process limits until "
                  "it is deleted", _tenant_of(tenant_id), said,
                  extra={"tenant": _tenant_of(tenant_id)})

    async def _retry_loop(self) -> None:
        while True:
            await self._retry_wake.wait()
            self._retry_wake.clear()
            while self._unreleased:
                await asyncio.sleep(RELEASE_RETRY_S)
                try:
                    await self.release_pending()
                except BackendUnavailable:
                    continue

    async def _renew_loop(self) -> None:
        loop = asyncio.get_running_loop()
        renew_at = loop.time() + self._ttl / 3
        while True:
            await asyncio.sleep(self._tick)
            try:
                answered = await self.beat()
                if loop.time() >= renew_at:
                    answered = await self.renew() > 0 or answered
                    renew_at = loop.time() + self._ttl / 3
            except StoreUnreachable as exc:
                self.renewal.failed(exc.cause)
                continue
            if answered:  # Redis answered (nothing to renew asks it nothing)
                self.renewal.answered()

    async def beat(self) -> bool:
        """Keep this process's heartbeat alive while it holds leases (one ``SET``, however
        many): False when it holds none (nothing written)."""
        if not self._live:
            return False
        with redis_unavailable():
            await self._r.set(holder_key(self._ns, self.holder), "1",
                              px=math.ceil(self._holder_ttl * 1000))
        return True

    async def renew(self) -> int:
        """Push the expiry of every live lease of this process one TTL ahead."""
        by_tenant: dict[str, list[str]] = {}
        for lease_id, tenant in self._live.items():
            by_tenant.setdefault(tenant, []).append(lease_id)
        if not by_tenant:
            return 0
        keys: list[str] = []
        args: list[str | float] = [self._now(), self._ttl, self.holder]
        for tenant, ids in by_tenant.items():
            keys += [self._bucket(tenant) + ":leases", self._bucket(tenant) + ":holders"]
            args += [len(ids), *ids]
        with redis_unavailable():
            await self._renew(keys=keys, args=args)
        return sum(len(ids) for ids in by_tenant.values())


def _tenant_of(limits_key: str) -> str:
    """The tenant's id in a `Tenant.limits_key` (``acme#<incarnation>``): what a log line
    names it by, as the other lines do (its keys are named whole)."""
    return limits_key.partition("#")[0]

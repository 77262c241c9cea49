"""Everything tenancy needs, built from settings and owned by the app's lifespan.

``tenancy = build_tenancy(settings, secret)``; ``await tenancy.start(tenants=..., policy=...)``
at start-up (bootstrap from config, first load, background sync and lease renewal);
``await tenancy.close()`` at shutdown. No Redis URL means the in-memory store and limiter.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from gateway.body import ClientSaltMode
from gateway.errors import BackendUnavailable, StoreUnreachable, UnreadableRecord
from gateway.policy_doc import PolicyDoc
from gateway.tenancy.fallback import FallbackRateLimiter
from gateway.tenancy.holders import HOLDER_TTL_S
from gateway.tenancy.limits import MemoryRateLimiter, RateLimiter
from gateway.tenancy.memory import InMemoryStore
from gateway.tenancy.models import PolicySnapshot, Tenant
from gateway.tenancy.redis_conn import MAX_CONNECTIONS, connect_redis, redis_address
from gateway.tenancy.redis_limits import RedisRateLimiter
from gateway.tenancy.redis_store import RedisStore
from gateway.tenancy.resolver import TenantResolver
from gateway.tenancy.salts import SaltDeriver, SaltEncoding
from gateway.tenancy.secret_check import SaltSecretCheck
from gateway.tenancy.store import BootstrapResult, TenantStore, bootstrap

__all__ = ["Tenancy", "TenancyCollector", "TenancySettings", "build_tenancy"]

log = logging.getLogger(__name__)
SKIPPED_KINDS = ("key", "policy", "salt_group", "tenant")  # of kvgate_tenancy_records_skipped_total


class TenancySettings(BaseModel):
    """Tenancy's settings (the `tenancy` section of the gateway's config extends these)."""

    model_config = ConfigDict(extra="forbid")
    namespace: str = "kvgate"
    redis_timeout_s: Annotated[float, Field(gt=0)] = 0.5
    # connections to Redis of the store and the rate limits (one client); more calls at once
    # wait for one, up to redis_timeout_s
    redis_max_connections: Annotated[int, Field(ge=2)] = MAX_CONNECTIONS
    poll_interval_s: Annotated[float, Field(gt=0, le=1.0)] = 0.5  # safety net for pub/sub
    max_staleness_s: Annotated[float, Field(gt=0)] | None = 300.0  # None: serve stale forever
    client_salt: ClientSaltMode = "strip"
    salt_encoding: SaltEncoding = "base64url"
    gateway_replicas: Annotated[int, Field(ge=1)] = 1  # divides limits while Redis is down
    lease_ttl_s: Annotated[float, Field(gt=0)] = 30.0
    # how long the leases of a process that died without a word still count (`holders.py`)
    lease_holder_ttl_s: Annotated[float, Field(gt=0)] = HOLDER_TTL_S
    audit_cap: Annotated[int, Field(ge=1)] = 10_000


@dataclass
class Tenancy:
    settings: TenancySettings
    salts: SaltDeriver
    store: TenantStore
    limiter: RateLimiter
    resolver: TenantResolver
    redis_url: str | None = None  # KVGATE_REDIS_URL; None: in-memory, single process
    lease_holder: str | None = None  # this process in its Redis leases (`holders.py`)
    # whether the other gateways on its Redis derive salts from the same secret
    secret_check: SaltSecretCheck | None = None

    async def start(
        self, *, tenants: Iterable[Tenant] = (), policy: PolicyDoc | None = None
    ) -> None:
        """Seed the store from configuration, load it and keep it in sync. A store that is
        unreachable now, or wiped later (its bootstrap marker gone), is seeded by the
        resolver as soon as it answers."""
        await self.store.start()
        seed = list(tenants)
        if policy is not None:  # in force if the stored one is unreadable from the start
            self.resolver.configured_policy = PolicySnapshot(0, policy)

        async def reseed() -> BootstrapResult:
            return await bootstrap(self.store, tenants=seed, policy=policy)

        async def seed_and_say() -> None:
            seeded = await reseed()
            # only a warning to give, or not (an unreadable one: the resolver says so)
            with contextlib.suppress(BackendUnavailable, UnreadableRecord):
                await _say_if_the_stored_policy_wins(self.store, policy)
                await _say_if_stored_tenants_win(self.store, seed, seeded)

        try:
            await seed_and_say()
        except BackendUnavailable as exc:  # seeded by the resolver once the store answers
            if self.store.reach is not None and isinstance(exc, StoreUnreachable):
                # where and why, once (as the resolver says it: `TenantStore.explain`)
                self.store.reach.failed(await self.store.explain(exc.cause))
            else:
                log.warning("tenancy bootstrap postponed: %s", exc)
            self.resolver.seed_later(seed_and_say)  # (a wiped store is seeded anyway)
        self.resolver.reseed_with(reseed)
        await self.resolver.start()
        await self.limiter.start()
        if self.secret_check is not None:
            self.resolver.also_degraded = self.secret_check.reason
            await self.secret_check.start()

    async def close(self) -> None:
        if self.secret_check is not None:
            await self.secret_check.close()
        await self.limiter.close()
        await self.resolver.close()
        await self.store.close()


async def _say_if_the_stored_policy_wins(store: TenantStore, policy: PolicyDoc | None) -> None:
    """The store owns the policy once seeded (operators change it through the admin API), so a
    restart with other pools or models in its configuration (e.g. a new ``--upstream`` on a
    reused Redis) keeps the stored one: say so at start, with how to apply the new one."""
    if policy is None:
        return
    stored = await store.get_policy()
    if stored is not None and stored.doc != policy:
        log.warning(
            "the policy in the tenancy store differs from this configuration's; the stored "
            "one is used (it holds what operators changed through the admin API). To use "
            "the configuration's: kvgate admin policy put FILE (or flush the store)",
            extra={"stored_version": stored.version,
                   "differs_in": _differences(stored.doc, policy)})


async def _say_if_stored_tenants_win(
    store: TenantStore, configured: list[Tenant], seeded: BootstrapResult
) -> None:
    """The store owns the tenants once seeded, as the policy: say so at start for a configured
    tenant whose stored tier or salt group differs (the stored one is used; a changed file
    was silently ignored), and for one the store had lost since an earlier start (deleted
    through the admin API: created again, without keys, at each start while it is
    configured)."""
    differ: dict[str, list[str]] = {}
    for tenant in configured:
        if tenant.id in seeded.created_tenants:
            continue
        stored = await store.get_tenant(tenant.id)
        if stored is None:
            continue
        fields = [name for name in ("tier", "salt_group")
                  if getattr(stored, name) != getattr(tenant, name)]
        if fields:
            differ[tenant.id] = fields
    if differ:
        log.warning(
            "configured tenants differ from the tenancy store's, whose records are used (they "
            "hold what operators changed through the admin API): %s. To use the "
            "configuration's: kvgate admin tenants update ID --tier ... (PATCH /admin/tenants/ID)",
            ", ".join(f"{tid!r} ({', '.join(fields)})" for tid, fields in differ.items()),
            extra={"tenants": differ})
    if seeded.seeded_before and seeded.created_tenants:
        log.warning(
            "configured tenants missing from the tenancy store were created again from the "
            "configuration, without API keys: %s (a tenant deleted through the admin API comes "
            "back at each start while the configuration lists it; remove it there too)",
            ", ".join(repr(t) for t in seeded.created_tenants),
            extra={"tenants": list(seeded.created_tenants)})


def _differences(stored: PolicyDoc, configured: PolicyDoc) -> list[str]:
    """The top-level sections that differ (pools, models, tiers, ...)."""
    a, b = stored.model_dump(), configured.model_dump()
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


class TenancyCollector(Collector):
    """`kvgate_tenancy_store_resets_total`: wiped stores noticed (0 from start);
    `kvgate_tenancy_store_wiped`: 1 while the wipe notice lasts; and
    `kvgate_tenancy_records_skipped_total{kind}`: unreadable records left out of loads."""

    def __init__(self, resolver: TenantResolver) -> None:
        self._resolver = resolver

    def collect(self) -> Iterator[Metric]:
        resets = CounterMetricFamily(
            "kvgate_tenancy_store_resets",
            "times the tenancy store was found wiped (bootstrap marker gone), then restored "
            "from a gateway's last state or re-seeded from configuration",
        )
        health = self._resolver.health()
        resets.add_metric([], health.store_resets)
        wiped = GaugeMetricFamily(
            "kvgate_tenancy_store_wiped",
            "1 for 10 minutes after the tenancy store was found wiped (restored or not: "
            "/readyz is degraded only if not), else 0",
        )
        wiped.add_metric([], 1.0 if health.store_wiped else 0.0)
        skipped = CounterMetricFamily(
            "kvgate_tenancy_records_skipped",
            "unreadable tenancy records left out of loads, each counted once",
            labels=["kind"],
        )
        # every kind from 0: an alert on increase() sees the first skipped record
        for kind in SKIPPED_KINDS:
            skipped.add_metric([kind], health.records_skipped.get(kind, 0))
        yield from (resets, wiped, skipped)


def build_tenancy(
    settings: TenancySettings, salt_secret: str | bytes, redis_url: str | None = None,
    *, workers: int = 1, salted: bool = True,
) -> Tenancy:
    """`workers`: this gateway's processes (`server.workers`). Each keeps its own limits while
    Redis is down, so each enforces limit / (gateway_replicas x workers): the fleet stays
    near the budget instead of `workers` times it. `salted`: its requests carry a
    `cache_salt` (False: ``--no-auth`` without a secret, a random one per process, whose
    salts are never sent and so never compared with the other gateways')."""
    salts = SaltDeriver(salt_secret, encoding=settings.salt_encoding)
    store: TenantStore
    limiter: RateLimiter
    holder: str | None = None
    check: SaltSecretCheck | None = None
    if redis_url is None:
        store = InMemoryStore(audit_cap=settings.audit_cap)
        limiter = MemoryRateLimiter()
    else:
        client = connect_redis(redis_url, timeout_s=settings.redis_timeout_s,
                               max_connections=settings.redis_max_connections)
        store = RedisStore(client, namespace=settings.namespace, audit_cap=settings.audit_cap)
        shared = RedisRateLimiter(
            client, namespace=settings.namespace, lease_ttl_s=settings.lease_ttl_s,
            holder_ttl_s=settings.lease_holder_ttl_s,
        )
        holder = shared.holder
        if salted:
            check = SaltSecretCheck(client, settings.namespace, salts.fingerprint())
        limiter = FallbackRateLimiter(shared, address=redis_address(client),
                                      replicas=settings.gateway_replicas * max(1, workers))
    resolver = TenantResolver(
        store,
        salts,
        poll_interval_s=settings.poll_interval_s,
        max_staleness_s=settings.max_staleness_s,
    )
    return Tenancy(settings, salts, store, limiter, resolver, redis_url, holder, check)

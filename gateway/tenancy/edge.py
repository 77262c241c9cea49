"""Tenancy on the proxy's hot path: who is calling, may they, and what the metrics call them.

`TenantGate.principal` authenticates from the in-memory cache (no I/O); `admit` is the one
store round trip per request (skipped entirely for a tenant without limits); `settle` (before
a whole answer goes out) or `finish` (when the request is over, whichever comes first) settles
real usage and releases the concurrency lease. `TenantLabels` keeps the `tenant` metric label
bounded: an operator's allow-list, or the first N tenants seen, and "_other" for the rest
(no tenant id starts with "_").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gateway.body import ClientPriorityMode, ClientSaltMode
from gateway.errors import BackendUnavailable, KvgateError
from gateway.tenancy.keys import hash_key
from gateway.tenancy.limits import Admission
from gateway.tenancy.models import PolicySnapshot
from gateway.tenancy.resolver import Principal
from gateway.tenancy.service import Tenancy

__all__ = ["NO_AUTH_TENANT", "TenantGate", "TenantLabels"]

log = logging.getLogger(__name__)
NO_AUTH_TENANT = "default"
# why a `--no-auth` gateway serves nobody while the store's tenant `default` has API keys
ANONYMOUS_KEYED = (
    "this gateway runs without authentication (--no-auth) on a tenancy store whose tenant "
    f"{NO_AUTH_TENANT!r} has API keys: authenticated gateways share the store, and serving "
    "every caller here as that tenant would give them its cache salt and its limits. Give "
    "this gateway its own tenancy.namespace (or Redis), or run it with authentication")
# past the bound: a value no tenant id can be (an id starts with a letter or a digit:
# `policy_doc.NAME_PATTERN`), so a tenant named `other` is not counted with the rest
OTHER = "_other"


class TenantLabels:
    """tenant id -> metric label, from a fixed allow-list or the first `cap` tenants seen."""

    __slots__ = ("_allowed", "_cap", "_seen")

    def __init__(self, allow: Iterable[str] = (), cap: int = 20) -> None:
        self._allowed = frozenset(allow)
        self._cap = cap
        self._seen: set[str] = set()

    def __call__(self, tenant_id: str) -> str:
        if self._allowed:
            return tenant_id if tenant_id in self._allowed else OTHER
        if tenant_id in self._seen:
            return tenant_id
        if len(self._seen) < self._cap:
            self._seen.add(tenant_id)
            return tenant_id
        return OTHER


class TenantGate:
    """Authentication and admission for proxied requests, over one `Tenancy`."""

    def __init__(
        self,
        tenancy: Tenancy,
        *,
        auth: bool,
        salted: bool,
        client_salt: ClientSaltMode,
        labels: TenantLabels,
    ) -> None:
        self.tenancy = tenancy
        self.auth = auth
        self.salted = salted  # False: --no-auth without a secret (nothing to isolate)
        self.client_salt: ClientSaltMode = client_salt
        # with keys, tiers decide vLLM priority; the single --no-auth user may set their own
        self.client_priority: ClientPriorityMode = "drop" if auth else "keep"
        self.labels = labels
        self._resolver = tenancy.resolver
        self._limiter = tenancy.limiter
        self._said_keyed = False  # ANONYMOUS_KEYED logged

    def principal(self, token: str | None) -> Principal:
        """The caller (401 `AuthError` for a missing/unknown/revoked key; 503 when stale)."""
        if self.auth:
            return self._resolver.authenticate(token)
        principal = self._resolver.principal_for(NO_AUTH_TENANT)
        if self._resolver.has_keys(NO_AUTH_TENANT):
            # a store shared with authenticated gateways: its tenant `default` is a customer,
            # and every caller of this gateway would share its cache salt and its limits
            if not self._said_keyed:
                self._said_keyed = True
                log.error(ANONYMOUS_KEYED)
            raise BackendUnavailable(ANONYMOUS_KEYED)
        return principal

    @property
    def policy(self) -> PolicySnapshot | None:
        """The policy in force now (a request keeps the one its principal was resolved
        under, unless that one's pool is gone: `Planner.plan`)."""
        return self._resolver.policy

    def key_hash(self, token: str | None) -> str | None:
        """What `current` finds a caller's key by (None without authentication)."""
        return hash_key(token) if self.auth and token else None

    def current(self, principal: Principal, key_hash: str | None) -> Principal:
        """`principal` as the state in force now has it: a request released from flow
        control's queue is sent on it, not on what it arrived with. Its key revoked or its
        tenant deleted while it waited is a 401, a salt rotated meanwhile the one it carries,
        and it is planned on the policy in force (a change that moved its model to another
        pool does not make it a 503 for the pool removed)."""
        return self._resolver.current(principal.tenant_id, key_hash)

    def owner(self, tenant_id: str) -> str:
        """Whose a tenant's stored responses are: its incarnation (`TenantResolver.owner`);
        the id alone without authentication (one tenant, nothing to tell apart)."""
        return self._resolver.owner(tenant_id) if self.auth else tenant_id

    def salt(self, principal: Principal) -> str | None:
        return principal.cache_salt if self.salted else None

    async def admit(self, principal: Principal, tokens: int) -> Admission | None:
        """Admit against the tenant's limits; None when it has none (no round trip)."""
        limits = principal.limits
        if limits.rpm is None and limits.tpm is None and limits.max_concurrency is None:
            return None
        return await self._limiter.admit(principal.limits_key, limits, tokens=tokens)

    async def peek(self, principal: Principal) -> Admission | None:
        """What `admit` would answer now, nothing charged; None for a tenant without limits."""
        limits = principal.limits
        if limits.rpm is None and limits.tpm is None and limits.max_concurrency is None:
            return None
        return await self._limiter.peek(principal.limits_key, limits)

    async def settle(self, adm: Admission, used_tokens: int, *, served: bool = True) -> None:
        """Charge real usage and release the concurrency lease now, before the answer goes
        out (`finish` then does nothing more); never raises. Released after it, the lease
        was still held when the client's next request came: through a gateway nearer Redis
        than this one, a 429 for concurrency each time."""
        await self.finish(adm, used_tokens, served=served)

    async def finish(self, adm: Admission, used_tokens: int | None, *,
                     served: bool = True) -> None:
        """Settle and release; never raises (a request's answer must not depend on it). A
        request not `served` gives its request back to the tenant's RPM (`unserved`)."""
        try:
            await self._limiter.finish(adm, used_tokens, served=served)
        except KvgateError:
            log.debug("admission not settled: store unavailable")

    def redis_up(self) -> bool | None:
        """None without Redis; else whether both the store and the shared limits answer.
        Reachability only: a wiped store or an unreadable record answers (their degraded
        notices have their own signals)."""
        if self.tenancy.redis_url is None:
            return None
        return self._resolver.health().store_answers and not self._limiter.degraded

    def redis_down_cause(self) -> str | None:
        """Why `redis_up` is False (one of `redis_conn.CAUSE_LABELS`), the store's load first;
        None while it is True or without Redis."""
        if self.tenancy.redis_url is None:
            return None
        return self._resolver.health().store_cause or self._limiter.down_cause

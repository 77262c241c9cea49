"""What the admin routes share: the dependencies the gateway supplies (`AdminDeps`) and the
context every route group holds (`AdminContext`: audit writes, tenant views, tier checks, the
policy this gateway runs on). Nothing global: one context per router.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.admin.auth import AdminToken
from gateway.admin.errors import REQUEST_ID
from gateway.admin.guard import AuthGuard
from gateway.admin.schemas import tenant_view
from gateway.errors import BackendUnavailable, BadRequest, Conflict, StaleCheck, shown_name
from gateway.policy_doc import DEFAULT_TIER
from gateway.tenancy.audited import AUDITING, AuditIntent
from gateway.tenancy.models import AuditEntry, PolicySnapshot, Tenant
from gateway.tenancy.store import TenantStore, tenant_missing

__all__ = ["AdminContext", "AdminDeps", "maybe_await"]

Supplier = Callable[[], Any]  # may return an awaitable
Explainer = Callable[[dict[str, Any]], Any]  # may return an awaitable
# the policy this gateway runs on and where it came from (`TenantResolver.policy_source`)
InForce = Callable[[], tuple[PolicySnapshot | None, str | None]]
T = TypeVar("T")
CHECK_TRIES = 8  # a write checked against another object that keeps changing: then a 409


@dataclass
class AdminDeps:
    store: TenantStore
    tokens: Sequence[AdminToken]
    replicas: Supplier | None = None  # live view of pools/replicas (the gateway supplies it)
    explain: Explainer | None = None  # dry-run routing of a request body
    doctor: Callable[[float], Any] | None = None  # `kvgate doctor`: window seconds -> report
    clock: Callable[[], float] = time.time  # wall clock for audit timestamps
    guard: AuthGuard = field(default_factory=AuthGuard)  # failed-auth throttle and counters
    policy_in_force: InForce | None = None
    # where this gateway listens (`server.host`) and its ports by setting: a policy write
    # naming a replica there is refused, as at start (`gateway.config.selfloop`); no ports:
    # nothing checked
    listen_host: str = "127.0.0.1"
    own_ports: Mapping[int, str] = field(default_factory=dict)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class AdminContext:
    """Shared helpers for the route groups (holds the dependencies, nothing global)."""

    def __init__(self, deps: AdminDeps) -> None:
        self.deps = deps
        self.store = deps.store
        self.patching = asyncio.Lock()  # policy PATCHes (read, merge, write) one at a time

    def _entry(self, who: str, action: str, target: str, detail: dict[str, Any]) -> AuditEntry:
        return AuditEntry(at=self.deps.clock(), who=who, action=action, target=target,
                          detail=detail, request_id=REQUEST_ID.get())

    async def audit(self, who: str, action: str, target: str, **detail: Any) -> None:
        """An entry of its own (a refused authentication): nothing else is written with it."""
        await self.store.append_audit(self._entry(who, action, target, detail))

    @asynccontextmanager
    async def audited(
        self, who: str, action: str, target: str, **detail: Any
    ) -> AsyncIterator[AuditIntent]:
        """The store writes made inside carry this entry: the Redis store writes it in the
        script of the change itself (`gateway.tenancy.audited`); else it is appended once the
        block is done (`AuditIntent.add`: the detail only the write's result tells). A
        write that failed is audited only if the store wrote it with the change."""
        intent = AuditIntent(self._entry(who, action, target, detail))
        token = AUDITING.set(intent)
        try:
            yield intent
        finally:
            intent.open = False
            AUDITING.reset(token)
        if not intent.written:
            await self.store.append_audit(intent.entry)

    async def view(self, tenant: Tenant) -> dict[str, Any]:
        """The tenant as every route answers it, with its keys and its salt's epoch."""
        keys = await self.store.list_keys(tenant.id)
        epochs = await self.store.salt_group_epochs() if tenant.salt_group else {}
        return tenant_view(tenant, keys, epochs)

    async def tenant(self, tenant_id: str) -> Tenant:
        tenant = await self.store.get_tenant(tenant_id)
        if tenant is None:
            raise tenant_missing(tenant_id)
        return tenant

    async def in_tier(self, tier: str | None, write: Callable[[int | None], Awaitable[T]]) -> T:
        """`write(policy_version)` of a tenant put in `tier` (None: its tier is not changed),
        checked against the policy at that version: the store writes only while that version
        is in force, so a concurrent PUT cannot remove the tier from under it; a policy stored
        in between is checked again."""
        for _ in range(CHECK_TRIES):
            version = None if tier is None else await self.check_tier(tier)
            try:
                return await write(version)
            except StaleCheck:
                continue
        raise Conflict("the policy kept changing while the tenant's tier was checked against "
                       "it; retry", param="tier")

    async def check_tier(self, tier: str) -> int:
        """A tenant's tier must exist in the policy in force (its version is returned); with
        no policy stored (a wiped store not yet re-seeded, a lost policy not yet written back)
        no tier is known, so nothing is accepted: a 503 to retry, not a 400 that blames the
        request (it stayed one while the policy could not be written back: Redis a read-only
        replica)."""
        policy = await self.store.get_policy()
        if policy is None:
            raise BackendUnavailable(
                f"no policy is stored in the tenancy store yet, so tier {shown_name(tier)!r} "
                "cannot be checked (a wiped store is written back by the gateways; the log "
                "says why if it is not); retry shortly")
        if not policy.doc.knows_tier(tier):
            known = ", ".join(sorted({*policy.doc.tiers, DEFAULT_TIER}))
            raise BadRequest(f"tier: unknown tier {shown_name(tier)!r} (known: {known})",
                             param="tier")
        return policy.version

    def running_on(self) -> str:
        """What this gateway runs on while the stored policy is unreadable, in words."""
        if self.deps.policy_in_force is None:
            return "this process has no policy in force of its own"
        snap, source = self.deps.policy_in_force()
        if snap is None:
            return "this gateway runs on no policy (every tenant is refused with 403)"
        if source == "configuration":
            return "this gateway runs on its configuration's policy (none was read from the store)"
        return f"this gateway runs on the last readable version, {snap.version}"

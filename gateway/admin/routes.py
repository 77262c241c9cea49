"""The admin API as a router factory: ``make_admin_router(AdminDeps(...))``.

Routes: tenants CRUD, key creation/revocation, salt
rotation, the versioned policy document (ETag / If-Match; PUT replaces it, PATCH merges a JSON
merge patch into it), replicas, route explain, doctor
(`GET /admin/doctor?window=5m`, gateway/doctor/), audit.
A record the store holds but cannot read, asked for by name (a tenant, the policy), is a 409
``record_unreadable`` saying how to write a new one over it (POST the tenant again, PUT the
policy) and, for the policy, what this gateway runs on meanwhile; never a 500. A PATCH or a
salt rotation keeps the fields of the stored record this kvgate does not know (a newer one
wrote them: `gateway.tenancy.unknown`).
Every change is audited with the admin token's id; failed authentications are throttled per
client address, logged, counted and audited (`AuthGuard`). Keys appear only in the 201 of key
creation. Times are ISO 8601 (UTC).
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real
# annotations, including the `Who` dependency alias that exists only inside the factory.

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from gateway.admin.auth import AdminToken, check_admin
from gateway.admin.errors import AdminRoute
from gateway.admin.guard import AuthGuard
from gateway.admin.schemas import (
    NoFields,
    TenantCreate,
    TenantPatch,
    audit_view,
    key_view,
    tenant_view,
)
from gateway.doctor.render import parse_duration
from gateway.errors import (
    AuthError,
    BackendUnavailable,
    BadRequest,
    Conflict,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    UnreadableRecord,
)
from gateway.policy_doc import DEFAULT_TIER, PolicyValidationError, parse_policy
from gateway.tenancy.keys import generate_key, hash_key, new_key_id
from gateway.tenancy.models import NAME_PATTERN, AuditEntry, KeyRecord, PolicySnapshot, Tenant
from gateway.tenancy.store import TenantStore, apply_tenant_changes, check_policy_version
from gateway.urls import restore_hidden, shown_policy

__all__ = ["AdminDeps", "make_admin_router", "merge_patch"]

log = logging.getLogger(__name__)

Supplier = Callable[[], Any]  # may return an awaitable
Explainer = Callable[[dict[str, Any]], Any]  # may return an awaitable
# the policy this gateway runs on and where it came from (`TenantResolver.policy_source`)
InForce = Callable[[], tuple[PolicySnapshot | None, str | None]]
# the body of a route that takes none: absent, or an object without fields
Empty = Annotated[NoFields | None, Body()]


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


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _Ctx:
    """Shared helpers for the route groups (holds the dependencies, nothing global)."""

    def __init__(self, deps: AdminDeps) -> None:
        self.deps = deps
        self.store = deps.store
        self.patching = asyncio.Lock()  # policy PATCHes (read, merge, write) one at a time

    async def audit(self, who: str, action: str, target: str, **detail: Any) -> None:
        entry = AuditEntry(
            at=self.deps.clock(), who=who, action=action, target=target, detail=detail
        )
        await self.store.append_audit(entry)

    async def view(self, tenant: Tenant) -> dict[str, Any]:
        """The tenant as every route answers it, with its keys and its salt's epoch."""
        keys = await self.store.list_keys(tenant.id)
        epochs = await self.store.salt_group_epochs() if tenant.salt_group else {}
        return tenant_view(tenant, keys, epochs)

    async def tenant(self, tenant_id: str) -> Tenant:
        tenant = await self.store.get_tenant(tenant_id)
        if tenant is None:
            raise NotFound(f"tenant {tenant_id!r} not found", param="id")
        return tenant

    async def check_tier(self, tier: str) -> None:
        """A tenant's tier must exist in the policy in force; with no policy stored (a wiped
        store not yet re-seeded) no tier is known, so nothing is accepted."""
        policy = await self.store.get_policy()
        if policy is None:
            raise BadRequest(
                f"tier: unknown tier {tier!r} (no policy is stored yet; retry shortly)",
                param="tier",
            )
        if tier not in policy.doc.tiers and tier != DEFAULT_TIER:
            known = ", ".join(sorted({*policy.doc.tiers, DEFAULT_TIER}))
            raise BadRequest(f"tier: unknown tier {tier!r} (known: {known})", param="tier")

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

    async def auth_failed(
        self, address: str, reason: str, path: str
    ) -> None:
        """Count, and (until the address is throttled) log and audit a refused request."""
        throttled = self.deps.guard.failed(address, reason)
        extra = {"client": address, "reason": reason, "path": path}
        log.warning("admin authentication failed", extra=extra)
        action = "admin.auth_throttled" if throttled else "admin.auth_failed"
        if throttled:
            log.warning("admin authentication throttled for this address", extra=extra)
        with contextlib.suppress(BackendUnavailable):  # an audit write never decides the answer
            await self.audit("-", action, address, reason=reason, path=path)


def make_admin_router(deps: AdminDeps) -> APIRouter:
    """An APIRouter with every admin route under ``/admin``; mount it with include_router."""

    ctx = _Ctx(deps)

    async def admin(
        request: Request, authorization: Annotated[str | None, Header()] = None
    ) -> str:
        address = request.client.host if request.client is not None else "unknown"
        deps.guard.check(address)  # 429 while this address is throttled
        try:
            return check_admin(deps.tokens, authorization)
        except (AuthError, PermissionDenied) as exc:
            await ctx.auth_failed(address, exc.reason, request.url.path)
            raise

    router = APIRouter(prefix="/admin", route_class=AdminRoute, tags=["admin"])
    who_dep = Annotated[str, Depends(admin)]
    _tenant_routes(router, ctx, who_dep)
    _key_routes(router, ctx, who_dep)
    _policy_routes(router, ctx, who_dep)
    _ops_routes(router, ctx, who_dep)
    return router


def _tenant_routes(router: APIRouter, ctx: _Ctx, Who: Any) -> None:
    @router.post("/tenants", status_code=201)
    async def create_tenant(body: TenantCreate, who: Who) -> dict[str, Any]:
        await ctx.check_tier(body.tier)
        # the fields sent, plus the tier: its default ("default") is not "sent" but is needed
        data = {"tier": body.tier, **body.model_dump(exclude_unset=True)}
        if "limits" in data:  # null = the tier's limit, as in a PATCH (never "unlimited")
            data["limits"] = {k: v for k, v in data["limits"].items() if v is not None}
        tenant = Tenant.model_validate(data)
        # over a stored record that cannot be read: the operator's way out (keys are kept)
        await ctx.store.create_tenant(tenant, over_unreadable=True)
        await ctx.audit(who, "tenant.create", tenant.id, tier=tenant.tier)
        return await ctx.view(tenant)  # keys: none, or those of the unreadable record replaced

    @router.get("/tenants")
    async def list_tenants(
        who: Who, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        after: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    ) -> dict[str, Any]:
        """A page of tenants in id order, OpenAI's list shape: ``after`` the last id of the
        previous page."""
        tenants, more = await ctx.store.tenant_page(after, limit)
        keys = await ctx.store.keys_by_tenant([t.id for t in tenants])
        epochs = await ctx.store.salt_group_epochs()
        return {"object": "list",
                "data": [tenant_view(t, keys.get(t.id, []), epochs) for t in tenants],
                "first_id": tenants[0].id if tenants else None,
                "last_id": tenants[-1].id if tenants else None, "has_more": more}

    @router.get("/tenants/{tenant_id}")
    async def get_tenant(tenant_id: str, who: Who) -> dict[str, Any]:
        return await ctx.view(await ctx.tenant(tenant_id))

    @router.patch("/tenants/{tenant_id}")
    async def patch_tenant(tenant_id: str, body: TenantPatch, who: Who) -> dict[str, Any]:
        changes = body.changes()
        if not changes:  # nothing to change: no write, nothing to audit
            return await ctx.view(await ctx.tenant(tenant_id))
        if "tier" in changes:
            if body.tier is None:
                raise BadRequest("tier: must not be null", param="tier")
            await ctx.check_tier(body.tier)
        current = await ctx.tenant(tenant_id)
        changed = _changed(current, apply_tenant_changes(current, changes))
        if not changed:
            # values it already has: no write (every gateway would reload), no audit entry
            return await ctx.view(current)
        tenant = await ctx.store.update_tenant(tenant_id, changes)
        await ctx.audit(who, "tenant.update", tenant_id, fields=changed)
        return await ctx.view(tenant)

    @router.delete("/tenants/{tenant_id}", status_code=204)
    async def delete_tenant(tenant_id: str, who: Who) -> Response:
        if not await ctx.store.delete_tenant(tenant_id):
            raise NotFound(f"tenant {tenant_id!r} not found", param="id")
        await ctx.audit(who, "tenant.delete", tenant_id)
        return Response(status_code=204)

    @router.post("/tenants/{tenant_id}/rotate-salt")
    async def rotate_salt(tenant_id: str, who: Who, empty: Empty = None) -> dict[str, Any]:
        rotation = await ctx.store.rotate_salt(tenant_id)
        await ctx.audit(
            who,
            "tenant.rotate_salt",
            tenant_id,
            scope=rotation.scope,
            salt_group=rotation.salt_group,
            epoch=rotation.epoch,
        )
        # the tenant as the other routes show it, with the epoch this rotation gave and what
        # it rotated ("tenant": its own salt; "group": every tenant of its salt group)
        tenant = await ctx.tenant(tenant_id)
        view = tenant_view(tenant, await ctx.store.list_keys(tenant_id), {})
        return {**view, "salt_epoch": rotation.epoch, "scope": rotation.scope}


def _changed(old: Tenant, new: Tenant) -> list[str]:
    """The fields whose values differ, sorted: a value sent that the tenant already has, or
    a limit override dropped that was never set, is no change."""
    before, after = old.model_dump(), new.model_dump()
    return sorted(name for name, value in after.items() if before.get(name) != value)


def _key_routes(router: APIRouter, ctx: _Ctx, Who: Any) -> None:
    @router.post("/tenants/{tenant_id}/keys", status_code=201)
    async def create_key(tenant_id: str, who: Who, empty: Empty = None) -> JSONResponse:
        key, key_id = generate_key(), new_key_id()
        record = KeyRecord(
            key_id=key_id, tenant_id=tenant_id, key_hash=hash_key(key), created_at=ctx.deps.clock()
        )
        await ctx.store.add_key(record)
        await ctx.audit(who, "key.create", tenant_id, key_id=key_id)
        body = {**key_view(record), "key": key}
        return JSONResponse(body, status_code=201, headers={"cache-control": "no-store"})

    @router.delete("/tenants/{tenant_id}/keys/{key_id}", status_code=204)
    async def revoke_key(tenant_id: str, key_id: str, who: Who) -> Response:
        if not await ctx.store.revoke_key(tenant_id, key_id):
            raise NotFound(f"key {key_id!r} of tenant {tenant_id!r} not found", param="key_id")
        await ctx.audit(who, "key.revoke", tenant_id, key_id=key_id)
        return Response(status_code=204)


PATCH_TRIES = 8  # a policy PATCH without If-Match: merges onto a newer version this often


def _parse_if_match(value: str | None) -> int | None:
    if value is None or value.strip() == "*":
        return None
    text = value.strip().removeprefix("W/").strip('"')
    if not text.isdigit():
        raise BadRequest('If-Match: expected a policy version such as "3"', param="If-Match")
    return int(text)


def _policy_routes(router: APIRouter, ctx: _Ctx, Who: Any) -> None:
    @router.get("/policy")
    async def get_policy(who: Who) -> JSONResponse:
        try:
            snap = await ctx.store.get_policy()
        except UnreadableRecord as exc:
            raise UnreadableRecord(f"{exc.message}; {ctx.running_on()}") from None
        if snap is None:
            raise NotFound("no policy document has been stored yet")
        doc = snap.doc.model_dump(mode="json", exclude_unset=True)
        return JSONResponse(shown_policy(doc), headers={"etag": f'"{snap.version}"'})

    async def store(
        who: str, document: Any, if_match: str | None, action: str, keep_unknown: bool = False
    ) -> JSONResponse:
        """Validate a whole policy document and store it as the next version."""
        expected = _parse_if_match(if_match)
        try:
            doc = parse_policy(document)
        except PolicyValidationError as exc:
            raise BadRequest(str(exc), param=exc.field or None) from None
        if not doc.pools:  # as at start: a policy without pools would serve no model at all
            raise BadRequest("pools: at least one pool is required", param="pools")
        for tenant in await ctx.store.list_tenants():
            if tenant.tier not in doc.tiers and tenant.tier != DEFAULT_TIER:
                raise BadRequest(
                    f"tiers: tier {tenant.tier!r} is used by tenant {tenant.id!r}", param="tiers"
                )
        snap = await ctx.store.put_policy(doc, if_version=expected, keep_unknown=keep_unknown)
        await ctx.audit(who, action, "policy", version=snap.version)
        body = snap.doc.model_dump(mode="json", exclude_unset=True)
        return JSONResponse(shown_policy(body), headers={"etag": f'"{snap.version}"'})

    @router.put("/policy")
    async def put_policy(
        who: Who,
        document: Annotated[dict[str, Any], Body()],
        if_match: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        """Replace the whole document: a section or field left out takes its default. A
        replica URL shown with hidden credentials (as GET answers it) gets the stored ones."""
        if restore_hidden(document, None) is not None:  # (None: it has such a URL)
            try:
                stored = await ctx.store.get_policy()
            except UnreadableRecord:
                stored = None
            _restore(document, stored.doc.model_dump(mode="json") if stored else None)
        return await store(who, document, if_match, "policy.put")

    @router.patch("/policy")
    async def patch_policy(
        who: Who,
        patch: Annotated[dict[str, Any], Body()],
        if_match: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        """A JSON merge patch (RFC 7396) on the policy in force: objects merge key by key,
        `null` removes a key (its default applies), anything else replaces; the result is
        validated and stored as a PUT of it would be. With If-Match, against that version."""
        expected = _parse_if_match(if_match)
        async with ctx.patching:  # this process's patches in turn: only other gateways race
            return await patch_in_turn(who, patch, expected)

    async def patch_in_turn(
        who: str, patch: dict[str, Any], expected: int | None
    ) -> JSONResponse:
        for _ in range(PATCH_TRIES):
            snap = await ctx.store.get_policy()
            if snap is None:
                raise NotFound("no policy document has been stored yet")
            check_policy_version(snap.version, expected)
            current = snap.doc.model_dump(mode="json", exclude_unset=True)
            merged = merge_patch(current, patch)
            _restore(merged, current)
            if merged == current:  # e.g. `{}`: nothing changes, no new version, no audit
                return JSONResponse(shown_policy(current),
                                    headers={"etag": f'"{snap.version}"'})
            # stored only over the version it was merged onto, with the fields of that
            # version this kvgate does not know
            try:
                return await store(who, merged, f'"{snap.version}"', "policy.patch",
                                   keep_unknown=True)
            except PreconditionFailed:
                if expected is not None:  # the client's version is not the latest any more
                    raise
                # another write landed after the read: merge onto it (a client that named
                # no version got a 412 for a version it never sent)
        raise Conflict("the policy document kept changing while this patch was merged into "
                       "it; retry")


def _restore(document: Any, stored: dict[str, Any] | None) -> None:
    """Credentials back into replica URLs sent hidden (`restore_hidden`), or a 400."""
    if (hidden := restore_hidden(document, stored)) is not None:
        raise BadRequest(f"{hidden}: a hidden replica URL no stored replica matches; send it "
                         "with its credentials", param="pools")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: ``patch`` applied to ``target`` (neither is changed)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _ops_routes(router: APIRouter, ctx: _Ctx, Who: Any) -> None:
    @router.get("/replicas")
    async def replicas(who: Who) -> Any:
        if ctx.deps.replicas is None:
            return {"object": "list", "data": []}
        return await _maybe_await(ctx.deps.replicas())

    @router.post("/route/explain")
    async def explain(who: Who, body: Annotated[dict[str, Any], Body()]) -> Any:
        if ctx.deps.explain is None:
            raise NotFound("route explain is not available in this process")
        return await _maybe_await(ctx.deps.explain(body))

    @router.get("/doctor")
    async def doctor(who: Who, window: Annotated[str, Query(max_length=16)] = "5m") -> Any:
        if ctx.deps.doctor is None:
            raise NotFound("the doctor is not available in this process")
        try:
            seconds = parse_duration(window)
        except ValueError as exc:
            raise BadRequest(str(exc), param="window") from None
        return await _maybe_await(ctx.deps.doctor(seconds))

    @router.get("/audit")
    async def audit(who: Who, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
        entries = await ctx.store.list_audit(limit)
        return {"object": "list", "data": [audit_view(e) for e in entries]}

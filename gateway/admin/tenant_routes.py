"""The admin API's tenant and key routes: tenants CRUD, salt rotation, key creation and
revocation. Keys appear only in the 201 of key creation.
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real
# annotations, including the `Who` dependency alias the router factory passes in.

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Response
from fastapi.responses import JSONResponse

from gateway.admin.deps import AdminContext
from gateway.admin.schemas import NoFields, TenantCreate, TenantPatch, key_view, tenant_view
from gateway.errors import BadRequest, Conflict, NotFound, shown_name
from gateway.tenancy.keys import generate_key, hash_key, new_key_id
from gateway.tenancy.models import NAME_PATTERN, KeyRecord, Tenant, fresh_incarnation
from gateway.tenancy.salts import fresh_epoch
from gateway.tenancy.store import apply_tenant_changes, tenant_missing

# A tenant named in a path: no record's id can be anything else (and the Redis store's hashes
# hold a "." field, `redis_store.PRESENT`, that no route may touch).
TenantId = Annotated[str, Path(pattern=NAME_PATTERN)]
# a key's id as `new_key_id` makes it: anything else is no key's (a 60,000-character one was
# echoed whole in the 404)
KeyId = Annotated[str, Path(pattern=NAME_PATTERN)]

__all__ = ["key_routes", "tenant_routes"]

KEY_TRIES = 3  # a new key's id taken (`TenantStore.add_key`): drawn again this often

# the body of a route that takes none: absent, or an object without fields
Empty = Annotated[NoFields | None, Body()]


def tenant_routes(router: APIRouter, ctx: AdminContext, Who: Any) -> None:
    """Tenants created, listed and read; then the routes that change one."""

    @router.post("/tenants", status_code=201)
    async def create_tenant(body: TenantCreate, who: Who) -> dict[str, Any]:
        # the fields sent, plus the tier: its default ("default") is not "sent" but is needed;
        # a fresh salt epoch: a tenant deleted under this id had epoch 0 (or counted on from
        # it), and the same salt would hit its prefix cache in vLLM
        # and a fresh incarnation: its rate limits start full, the deleted one's leases
        # (streams still in flight) are not counted against it
        data = {"tier": body.tier, **body.model_dump(exclude_unset=True),
                "salt_epoch": fresh_epoch(), "incarnation": fresh_incarnation()}
        if "limits" in data:  # null = the tier's limit, as in a PATCH (never "unlimited")
            data["limits"] = {k: v for k, v in data["limits"].items() if v is not None}
        tenant = Tenant.model_validate(data)
        # over a stored record that cannot be read: the operator's way out (keys are kept)
        async with ctx.audited(who, "tenant.create", tenant.id, tier=tenant.tier):
            await ctx.in_tier(tenant.tier, lambda version: ctx.store.create_tenant(
                tenant, over_unreadable=True, policy_version=version))
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
    async def get_tenant(tenant_id: TenantId, who: Who) -> dict[str, Any]:
        return await ctx.view(await ctx.tenant(tenant_id))

    _tenant_update_routes(router, ctx, Who)


def _tenant_update_routes(router: APIRouter, ctx: AdminContext, Who: Any) -> None:
    """A tenant changed, deleted or its salt rotated."""

    @router.patch("/tenants/{tenant_id}")
    async def patch_tenant(tenant_id: TenantId, body: TenantPatch, who: Who) -> dict[str, Any]:
        changes = body.changes()
        if not changes:  # nothing to change: no write, nothing to audit
            return await ctx.view(await ctx.tenant(tenant_id))
        if "tier" in changes:
            if body.tier is None:
                raise BadRequest("tier: must not be null", param="tier")
            await ctx.check_tier(body.tier)  # a 400 first, even for the tier it already has
        current = await ctx.tenant(tenant_id)
        changed = _changed(current, apply_tenant_changes(current, changes))
        if not changed:
            # values it already has: no write (every gateway would reload), no audit entry
            return await ctx.view(current)
        async with ctx.audited(who, "tenant.update", tenant_id, fields=changed):
            tenant = await ctx.in_tier(body.tier if "tier" in changes else None,
                                       lambda version: ctx.store.update_tenant(
                                           tenant_id, changes, policy_version=version))
        return await ctx.view(tenant)

    @router.delete("/tenants/{tenant_id}", status_code=204)
    async def delete_tenant(tenant_id: TenantId, who: Who) -> Response:
        async with ctx.audited(who, "tenant.delete", tenant_id):
            if not await ctx.store.delete_tenant(tenant_id):
                raise tenant_missing(tenant_id)
        return Response(status_code=204)

    @router.post("/tenants/{tenant_id}/rotate-salt")
    async def rotate_salt(tenant_id: TenantId, who: Who, empty: Empty = None) -> dict[str, Any]:
        async with ctx.audited(who, "tenant.rotate_salt", tenant_id) as audit:
            rotation = await ctx.store.rotate_salt(tenant_id)
            audit.add(scope=rotation.scope, salt_group=rotation.salt_group,
                      epoch=rotation.epoch)
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


def key_routes(router: APIRouter, ctx: AdminContext, Who: Any) -> None:
    @router.post("/tenants/{tenant_id}/keys", status_code=201)
    async def create_key(tenant_id: TenantId, who: Who, empty: Empty = None) -> JSONResponse:
        for attempt in range(KEY_TRIES):
            key, key_id = generate_key(), new_key_id()
            record = KeyRecord(key_id=key_id, tenant_id=tenant_id, key_hash=hash_key(key),
                               created_at=ctx.deps.clock())
            try:
                async with ctx.audited(who, "key.create", tenant_id, key_id=key_id):
                    await ctx.store.add_key(record)
                break
            except Conflict:  # an id of 48 random bits the tenant already has: another one
                if attempt == KEY_TRIES - 1:
                    raise
        body = {**key_view(record), "key": key}
        return JSONResponse(body, status_code=201, headers={"cache-control": "no-store"})

    @router.delete("/tenants/{tenant_id}/keys/{key_id}", status_code=204)
    async def revoke_key(tenant_id: TenantId, key_id: KeyId, who: Who) -> Response:
        async with ctx.audited(who, "key.revoke", tenant_id, key_id=key_id):
            if not await ctx.store.revoke_key(tenant_id, key_id):
                raise NotFound(f"key {shown_name(key_id)!r} of tenant "
                               f"{shown_name(tenant_id)!r} not found",
                               param="key_id")
        return Response(status_code=204)

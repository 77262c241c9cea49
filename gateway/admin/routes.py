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
client address (with Redis, one budget for every gateway on it), logged, counted and audited
(`AuthGuard`). Keys appear only in the 201 of key
creation. Times are ISO 8601 (UTC).
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real
# annotations, including the `Who` dependency alias that exists only inside the factory.

import contextlib
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request

from gateway.admin.auth import check_admin, one_authorization
from gateway.admin.deps import AdminContext, AdminDeps
from gateway.admin.errors import READS, AdminRoute
from gateway.admin.guard import BURST, PER_MINUTE
from gateway.admin.ops_routes import ops_routes
from gateway.admin.policy_routes import policy_routes
from gateway.admin.tenant_routes import key_routes, tenant_routes
from gateway.errors import AuthError, BackendUnavailable, PermissionDenied, PreconditionFailed

__all__ = ["make_admin_router"]

PREFIX = "/admin"

log = logging.getLogger(__name__)
# of a refused request's path, what the audit log and the log line keep: the path is the
# client's (a tenant id in it is not checked before the token), up to `server.max_header_bytes`
# long, and 10,000 audit entries of 64 KiB paths held 640 MB in the store
SHOWN_PATH_CHARS = 256


def make_admin_router(deps: AdminDeps) -> APIRouter:
    """An APIRouter with every admin route under ``/admin``; mount it with include_router."""

    ctx = AdminContext(deps)
    deps.store.tell_throttles_to(deps.guard.adopt)

    async def admin(
        request: Request, authorization: Annotated[str | None, Header()] = None
    ) -> str:
        address = request.client.host if request.client is not None else "unknown"
        # the addresses throttled before this gateway listened: known before any is checked
        # (a gateway just started let a throttled address's valid token in)
        await deps.store.throttles_read()
        deps.guard.check(address)  # 429 while this address is throttled (with Redis: at any
        # gateway, `AuthGuard.adopt` told by the store)
        try:  # (`authorization` names the header in the schema; every value is read here)
            who = check_admin(deps.tokens, one_authorization(
                request.headers.getlist("authorization")))
        except (AuthError, PermissionDenied) as exc:
            await _auth_failed(ctx, address, exc.reason, request.url.path)
            raise
        _untagged(request)
        return who

    router = APIRouter(prefix=PREFIX, route_class=AdminRoute, tags=["admin"])
    who_dep = Annotated[str, Depends(admin)]
    tenant_routes(router, ctx, who_dep)
    key_routes(router, ctx, who_dep)
    policy_routes(router, ctx, who_dep)
    ops_routes(router, ctx, who_dep)
    return router


def _untagged(request: Request) -> None:
    """A 412 for a write with an ``If-Match`` naming a tag, to anything but the policy (the
    one object with an ETag, checked by its routes): no tag matches an object that has none
    (RFC 9110 13.1.1), and the write must not be made; ``*`` matches any that exists. It
    was ignored: a tenant changed on a condition that did not hold."""
    value = request.headers.get("if-match")
    route = getattr(request.scope.get("route"), "path", "")
    if value is None or value.strip() == "*" or request.method in READS or \
            route == f"{PREFIX}/policy":
        return
    raise PreconditionFailed("If-Match: only the policy document (GET /admin/policy) has an "
                             "entity tag; this object has none, so no tag matches it (send "
                             "no If-Match, or *)", param="If-Match")


async def _auth_failed(ctx: AdminContext, address: str, reason: str, path: str) -> None:
    """Count, and (until the address is throttled) log and audit a refused request."""
    throttled = ctx.deps.guard.failed(address, reason)
    shared = await _shared_failures(ctx, address)
    if shared is not None:
        ctx.deps.guard.adopt(address, shared)
        throttled = throttled or shared < 1.0
    if len(path) > SHOWN_PATH_CHARS:
        path = path[:SHOWN_PATH_CHARS] + "..."
    extra = {"client": address, "reason": reason, "path": path}
    log.warning("admin authentication failed", extra=extra)
    action = "admin.auth_throttled" if throttled else "admin.auth_failed"
    if throttled:
        log.warning("admin authentication throttled for this address", extra=extra)
    with contextlib.suppress(BackendUnavailable):  # an audit write never decides the answer
        await ctx.audit("-", action, address, reason=reason, path=path)


async def _shared_failures(ctx: AdminContext, address: str) -> float | None:
    """One failure of `address` taken from its budget at every gateway on this store: what
    is left; None without a shared count (in memory) or while the store does not answer
    (this process's own count decides alone)."""
    try:
        return await ctx.deps.store.auth_failures(address, burst=BURST, per_minute=PER_MINUTE)
    except BackendUnavailable:
        return None

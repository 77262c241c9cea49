"""The admin API's operational routes: the live replica view, route explain (a dry run of
the routing of a request body), the doctor (`GET /admin/doctor?window=5m`, gateway/doctor/)
and the audit log.
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real
# annotations, including the `Who` dependency alias the router factory passes in.

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query

from gateway.admin.deps import AdminContext, maybe_await
from gateway.admin.schemas import audit_view
from gateway.doctor.render import parse_duration
from gateway.errors import BadRequest, NotFound

__all__ = ["ops_routes"]


def ops_routes(router: APIRouter, ctx: AdminContext, Who: Any) -> None:
    @router.get("/replicas")
    async def replicas(who: Who) -> Any:
        if ctx.deps.replicas is None:
            return {"object": "list", "data": []}
        return await maybe_await(ctx.deps.replicas())

    @router.post("/route/explain")
    async def explain(who: Who, body: Annotated[dict[str, Any], Body()]) -> Any:
        if ctx.deps.explain is None:
            raise NotFound("route explain is not available in this process")
        return await maybe_await(ctx.deps.explain(body))

    @router.get("/doctor")
    async def doctor(who: Who, window: Annotated[str, Query(max_length=16)] = "5m") -> Any:
        if ctx.deps.doctor is None:
            raise NotFound("the doctor is not available in this process")
        try:
            seconds = parse_duration(window)
        except ValueError as exc:
            raise BadRequest(str(exc), param="window") from None
        return await maybe_await(ctx.deps.doctor(seconds))

    @router.get("/audit")
    async def audit(who: Who, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
        entries = await ctx.store.list_audit(limit)
        return {"object": "list", "data": [audit_view(e) for e in entries]}

"""The admin API as an app: the router, OpenAI-shaped errors everywhere, schema and docs.

`create_admin_app(deps)` is what the gateway mounts at ``/admin`` (on its port, or on
`server.admin_port`) and what tests serve standalone. Paths the router does not know, and
methods a route does not allow, answer in OpenAI's error shape too (404/405), never FastAPI's
``{"detail": ...}``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException

from gateway.admin.errors import error_response
from gateway.admin.routes import AdminDeps, make_admin_router
from gateway.errors import KvgateError, MethodNotAllowed, NotFound, for_status

__all__ = ["create_admin_app"]


def _http_error(request: Request, exc: HTTPException) -> KvgateError:
    path = request.url.path
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow")
        return MethodNotAllowed(f"{request.method} is not allowed on {path}", allow=allow)
    if exc.status_code == 404:
        return NotFound(f"unknown admin path {path}")
    return for_status(exc.status_code, str(exc.detail))


def create_admin_app(
    deps: AdminDeps, *, openapi_url: str | None = "/openapi.json", docs_url: str | None = None
) -> FastAPI:
    app = FastAPI(title="kvgate admin API", version="1", openapi_url=openapi_url,
                  docs_url=docs_url, redoc_url=None)
    app.include_router(make_admin_router(deps))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(_http_error(request, exc))

    app.add_exception_handler(HTTPException, on_http_error)
    return app

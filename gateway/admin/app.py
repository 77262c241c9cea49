"""The admin API as an app: the router, OpenAI-shaped errors everywhere, schema and docs.

`create_admin_app(deps)` is what the gateway mounts at ``/admin`` (on its port, or on
`server.admin_port`) and what tests serve standalone. Paths the router does not know, and
methods a route does not allow, answer in OpenAI's error shape too (404/405, with every method
the path takes in Allow), never FastAPI's ``{"detail": ...}``; a trailing slash is such a
path (a 404 naming the path without it), never a redirect. HEAD is answered as GET
without the body.
"""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import Match

from gateway.admin.deps import AdminDeps
from gateway.admin.errors import error_response
from gateway.admin.routes import make_admin_router
from gateway.asgi import ASGIApp, Receive, Scope, Send
from gateway.errors import KvgateError, MethodNotAllowed, NotFound, for_status, shown_name

__all__ = ["create_admin_app"]


def _allowed(routes: list[APIRoute], request: Request) -> str:
    """Every method the routes of this path take (Starlette names only the last route's)."""
    methods: set[str] = set()
    for route in routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods or set()
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


def _http_error(routes: list[APIRoute], request: Request, exc: HTTPException) -> KvgateError:
    path = request.url.path
    if exc.status_code == 405:
        allow = _allowed(routes, request)
        return MethodNotAllowed(f"Use {allow} for {shown_name(path)}.", allow=allow)
    if exc.status_code == 404:
        bare = request.scope["path"].rstrip("/")
        known = bare != request.scope["path"] and any(
            r.matches({**request.scope, "path": bare})[0] != Match.NONE for r in routes)
        hint = f" (without the trailing slash: {shown_name(bare)})" if known else ""
        return NotFound(f"unknown admin path {shown_name(path)}{hint}")
    return for_status(exc.status_code, str(exc.detail))


def create_admin_app(
    deps: AdminDeps, *, openapi_url: str | None = "/openapi.json", docs_url: str | None = None
) -> FastAPI:
    # a path with a trailing slash is one the router does not know (a 404 naming the path
    # without it), not Starlette's 307 to an absolute URL built from the Host header: empty,
    # and http:// behind a proxy that ends TLS (a client following it sent its admin token
    # over plain HTTP)
    app = FastAPI(title="kvgate admin API", version="1", openapi_url=openapi_url,
                  docs_url=docs_url, redoc_url=None, redirect_slashes=False)
    router = make_admin_router(deps)
    app.include_router(router)
    routes = [r for r in router.routes if isinstance(r, APIRoute)]

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(_http_error(routes, request, exc))

    app.add_exception_handler(HTTPException, on_http_error)
    app.add_middleware(HeadAsGet)
    return app


class HeadAsGet:
    """HEAD is GET without the body (RFC 9110 9.3.2): the app answers it as GET; the server,
    which still sees HEAD in its own scope, leaves the body out and keeps Content-Length."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self._app(scope, receive, send)

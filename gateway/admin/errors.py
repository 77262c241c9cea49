"""OpenAI-shaped errors for the admin routes, handled inside the router itself.

A custom route class catches kvgate's errors (one hierarchy: `gateway.errors.KvgateError`)
and request-validation errors, so the router answers
``{"error": {...}}`` wherever it is mounted, without app-level exception handlers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from gateway.errors import BadRequest, KvgateError

__all__ = ["AdminRoute", "error_response"]

log = logging.getLogger(__name__)


def error_response(error: KvgateError) -> Response:
    headers = {k.decode(): v.decode() for k, v in error.headers()}
    if error.status == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(error.body(), status_code=error.status, headers=headers)


def _from_validation(exc: RequestValidationError) -> BadRequest:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return BadRequest("invalid request")
    loc = [str(p) for p in errors[0].get("loc", ()) if p not in ("body", "query", "path")]
    field = ".".join(loc)
    msg = str(errors[0].get("msg", "invalid value"))
    return BadRequest(f"{field}: {msg}" if field else msg, param=field or None)


class AdminRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await inner(request)
            except KvgateError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                return error_response(_from_validation(exc))

        return handler

"""OpenAI-shaped errors for the admin routes, handled inside the router itself.

A custom route class catches tenancy errors and request-validation errors, so the router
answers ``{"error": {...}}`` wherever it is mounted, without app-level exception handlers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from gateway.tenancy.errors import InvalidRequest, TenancyError

__all__ = ["AdminRoute", "error_response"]

log = logging.getLogger(__name__)


def error_response(error: TenancyError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.to_dict(), status_code=error.status, headers=headers)


def _from_validation(exc: RequestValidationError) -> InvalidRequest:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return InvalidRequest("invalid request")
    loc = [str(p) for p in errors[0].get("loc", ()) if p not in ("body", "query", "path")]
    field = ".".join(loc)
    msg = str(errors[0].get("msg", "invalid value"))
    return InvalidRequest(f"{field}: {msg}" if field else msg, param=field or None)


class AdminRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await inner(request)
            except TenancyError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                return error_response(_from_validation(exc))

        return handler

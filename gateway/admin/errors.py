"""OpenAI-shaped errors for the admin routes, handled inside the router itself.

A custom route class catches kvgate's errors (one hierarchy: `gateway.errors.KvgateError`)
and request-validation errors, so the router answers
``{"error": {...}}`` wherever it is mounted, without app-level exception handlers. It also
reads every body as JSON, whatever its Content-Type, and refuses one whose object names a
key twice (`_duplicate_key`).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from gateway.errors import (
    BadRequest,
    KvgateError,
    StoreUnreachable,
    WriteOutcomeUnknown,
    WriteRefused,
    for_status,
    shown_name,
)
from gateway.tenancy.models import NAME_PATTERN, NAME_RULE

__all__ = ["READS", "REQUEST_ID", "AdminRoute", "error_response"]

log = logging.getLogger(__name__)

# The admin request's id: the client's `X-Request-Id` when it is a plain token, else a new
# one; answered in `X-Request-Id` and carried by the audit entry of the write it makes, so a
# write whose outcome is unknown (a 503) can be looked up (`AdminContext.audited`).
REQUEST_ID: ContextVar[str | None] = ContextVar("kvgate_admin_request_id", default=None)
_SENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
READS = ("GET", "HEAD")


def _request_id(request: Request) -> str:
    # from the scope, not `request.headers`: those are cached, and `_read_body_as_json`
    # changes the scope's Content-Type afterwards for FastAPI to read
    sent = next((v for k, v in request.scope["headers"] if k == b"x-request-id"), b"")
    text = sent.decode("latin-1")
    return text if _SENT_ID.fullmatch(text) else secrets.token_hex(12)


def error_response(error: KvgateError) -> Response:
    headers = {k.decode(): v.decode() for k, v in error.headers()}
    if error.status == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(error.body(), status_code=error.status, headers=headers)


def _whole_body(error: dict[str, Any]) -> BadRequest | None:
    """The body itself is wrong (not JSON, missing, not an object): the proxy's wording, no
    param (FastAPI would name the parse position, e.g. ``"6: JSON decode error"``)."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == "json_invalid":
        return BadRequest("The request body is not valid JSON.")
    if loc != ("body",):
        return None
    if error.get("type") == "missing":
        return BadRequest("The request body is missing: send a JSON object.")
    return BadRequest("The request body must be a JSON object.")


def _from_validation(exc: RequestValidationError) -> BadRequest:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return BadRequest("invalid request")
    whole = _whole_body(errors[0])
    if whole is not None:
        return whole
    loc = [str(p) for p in errors[0].get("loc", ()) if p not in ("body", "query", "path")]
    field = ".".join(loc)
    msg = str(errors[0].get("msg", "invalid value"))
    if errors[0].get("type") == "string_pattern_mismatch" and \
            (errors[0].get("ctx") or {}).get("pattern") == NAME_PATTERN:  # not the regex itself
        msg = f"{shown_name(str(errors[0].get('input')))!r} is not a name: {NAME_RULE}"
    return BadRequest(f"{field}: {msg}" if field else msg, param=field or None)


def _read_body_as_json(request: Request) -> None:
    """Every admin body is JSON, whatever its Content-Type says (as on the proxied routes):
    ``curl -d`` sends a form type, and FastAPI would not even parse the body then."""
    headers = request.scope["headers"]
    if not any(k == b"content-type" and b"json" in v for k, v in headers):
        request.scope["headers"] = [
            *(h for h in headers if h[0] != b"content-type"),
            (b"content-type", b"application/json"),
        ]


class _Duplicate(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


async def _duplicate_key(request: Request) -> BadRequest | None:
    """A JSON object naming a key twice (``{"tier": "free", "tier": "premium"}``): the JSON
    parser keeps the last value silently, where another reader (a proxy, a log, an operator
    reviewing the call) may take the first: a 400 naming the key instead of a guess. A body
    that is not JSON is left to the route (its own 400)."""
    body = await request.body()  # kept by the request: the route reads it again
    if not body:
        return None
    try:
        json.loads(body, object_pairs_hook=_unique)
    except _Duplicate as dup:
        named = len(dup.key) <= 64
        return BadRequest(f"{dup.key if named else 'a key'}: sent twice in one JSON object",
                          param=dup.key if named else None)
    except (ValueError, RecursionError):
        pass
    return None


class AdminRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        inner = super().get_route_handler()
        # route explain's body is an OpenAI request: read as the proxy reads one (the last
        # value of a key sent twice), or the dry run would refuse what the proxy serves
        unique_keys = not self.path.endswith("/route/explain")

        async def handler(request: Request) -> Response:
            request_id = _request_id(request)
            token = REQUEST_ID.set(request_id)
            try:
                response = await answer(request, request_id)
            finally:
                REQUEST_ID.reset(token)
            response.headers["x-request-id"] = request_id
            return response

        async def answer(request: Request, request_id: str) -> Response:
            _read_body_as_json(request)
            try:
                if unique_keys and (duplicate := await _duplicate_key(request)) is not None:
                    return error_response(duplicate)
                return await inner(request)
            except StoreUnreachable as exc:  # the cause is for the log, not the answer
                refused = WriteRefused.covers(exc.cause)
                log.warning("admin request failed: the tenancy store (Redis) %s (%s)",
                            "refused it" if refused else "did not answer", exc.cause,
                            extra={"path": request.url.path, "request_id": request_id})
                if unique_keys and request.method not in READS:  # a write's: not known
                    return error_response(WriteRefused(exc.cause, request_id) if refused
                                          else WriteOutcomeUnknown(exc.cause, request_id))
                return error_response(exc)
            except KvgateError as exc:
                return error_response(exc)
            except RequestValidationError as exc:
                return error_response(_from_validation(exc))
            except HTTPException as exc:  # FastAPI's own refusal: a body that is not UTF-8
                # text is its 400 "error parsing the body", the client's fault, not a 500
                return error_response(for_status(exc.status_code, _detail(exc)))
            except Exception:
                # a fault of kvgate's: the log gets the traceback, the client an OpenAI-shaped
                # 500 (Starlette's was plain text, and the connection was dropped after it)
                log.exception("admin request failed", extra={"path": request.url.path})
                return error_response(KvgateError("internal error in the admin API; the "
                                                  "gateway's log has the details"))

        return handler


def _detail(exc: HTTPException) -> str:
    if exc.status_code != 400:
        return str(exc.detail)
    cause = exc.__cause__  # FastAPI's parse error: its JSON decode errors are validation's
    if isinstance(cause, ValueError) and not isinstance(cause, UnicodeError):
        # Python's limit on an integer's digits (CVE-2020-10735), hit while parsing JSON
        return (f"the body holds a number of more than {sys.get_int_max_str_digits()} "
                "digits: no field takes one")
    return "the body could not be read: send JSON text (UTF-8)"

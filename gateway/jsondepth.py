"""A bound on JSON nesting, checked before any work is done on a request body.

orjson parses up to 1024 levels but serialises only 254, so a proxied body nested deeper than
that used to pass the parser and fail in the body rewrite (a 500 with a traceback); the admin
API's JSON parser has its own recursion limits. `MAX_JSON_DEPTH` is far above what any
OpenAI request needs (deep JSON schemas included) and far below both limits.

A proxied body is checked once parsed (`check_parsed_depth`): one pass per level over the
containers, ~30-60 µs for a 100-message conversation (the text scan below took ~950 µs there:
blanking every string costs ~1 µs each). `too_deep` checks text not parsed yet: bodies with
fewer brackets than the limit are accepted after two `bytes.count` calls, otherwise strings are
blanked out (brackets inside them do not nest) and innermost ``[]``/``{}`` pairs are removed
level by level, each level one C-speed pass, stopping after `limit` levels. `guard_json_depth`
applies it to an ASGI app whose request bodies are JSON (the admin API): 400 in OpenAI's shape,
before the app sees the body; it also bounds the body's size (413), as it reads the body before
the app authenticates the caller, and runs an `admit` check before reading it (the admin
API's throttle of failed authentications: 429 without buffering the upload). A caller that
`authorized` refuses (no valid admin token) has its body left unread: the app sees an empty one
and answers 401/403 at once, so an anonymous upload is never buffered, nor waited for.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gateway.asgi import Receive, Scope, Send, send_whole
from gateway.errors import BadRequest, BodyTooLarge, KvgateError

__all__ = ["MAX_JSON_DEPTH", "check_parsed_depth", "guard_json_depth", "too_deep",
           "too_deep_error"]

MAX_JSON_DEPTH = 128
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: fast on long strings
_PAIR = re.compile(rb"\[\]|\{\}")  # one scan removes only the pairs innermost before it
_SCALARS = bytes(b for b in range(256) if b not in b"[]{}")


def too_deep_error(limit: int = MAX_JSON_DEPTH) -> BadRequest:
    return BadRequest(f"The request body nests JSON deeper than {limit} levels.")


def too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text `raw` nests arrays/objects more than `limit` levels deep
    (meaningful for well-formed JSON; anything else is left to the parser)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b'""', raw).translate(None, _SCALARS)
    if len(brackets) <= 2 * limit:
        return False
    for _ in range(limit):
        shorter = _PAIR.sub(b"", brackets)
        if not shorter:
            return False
        brackets = shorter
    return True


def check_parsed_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise a 400 (`BadRequest`) when the parsed JSON `value` nests deeper than `limit`."""
    if _value_too_deep(value, limit):
        raise too_deep_error(limit)


def _value_too_deep(value: Any, limit: int) -> bool:
    level = [value] if isinstance(value, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [c for v in level for c in (v.values() if type(v) is dict else v)
                 if type(c) is dict or type(c) is list]
    return False


def guard_json_depth(
    app: Any, max_bytes: int | Callable[[Scope], int], limit: int = MAX_JSON_DEPTH,
    admit: Callable[[Scope], None] | None = None,
    authorized: Callable[[Scope], bool] | None = None,
) -> Any:
    """Wrap an ASGI app: request bodies nested deeper than `limit` get a 400 before the app
    runs, bodies over `max_bytes` (a number, or one per request: `max_bytes(scope)`) a 413 as
    soon as they pass it (they are read before the app checks who sent them: unbounded, one
    anonymous upload could fill the memory). The body is read whole first, then replayed to
    the app (admin bodies are small). `admit(scope)` runs before a byte is read: a
    `KvgateError` it raises is the answer."""
    bound = max_bytes if callable(max_bytes) else lambda _: max_bytes

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "DELETE"):
            await app(scope, receive, send)
            return
        if admit is not None:
            try:
                admit(scope)
            except KvgateError as exc:
                await _refuse(send, exc)
                return
        if authorized is not None and not authorized(scope):
            await app(scope, _unread(receive), send)
            return
        cap = bound(scope)
        messages: list[dict[str, Any]] = []
        size = _declared_length(scope)  # refused before a byte is read when above the limit
        if size <= cap:
            size = 0
            while size <= cap:
                msg = await receive()
                messages.append(msg)
                if msg["type"] != "http.request":
                    break
                size += len(msg.get("body", b""))
                if not msg.get("more_body", False):
                    break
        if size > cap:
            await _refuse(send, BodyTooLarge(
                f"The request body exceeds the limit of {cap} bytes."))
            return
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if too_deep(body, limit):
            await _refuse(send, too_deep_error(limit))
            return
        pending = iter(messages)

        async def replay() -> Any:
            nxt = next(pending, None)
            return nxt if nxt is not None else await receive()

        await app(scope, replay, send)

    return guarded


def _unread(receive: Receive) -> Receive:
    """An empty body for the app; the client's is dropped as it arrives, never held."""
    given = False

    async def empty() -> Any:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        while (msg := await receive())["type"] == "http.request":
            pass  # (the app asked again: it waits for the client to leave)
        return msg

    return empty


def _declared_length(scope: Scope) -> int:
    """The declared Content-Length (0 when absent: a chunked upload is counted as it
    arrives)."""
    for key, value in scope["headers"]:
        if key == b"content-length" and value.isdigit():
            return int(value)
    return 0


async def _refuse(send: Send, exc: KvgateError) -> None:
    await send_whole(send, exc.status, exc.headers(), exc.body())

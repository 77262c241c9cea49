"""An error that Envoy or a filter answered itself (a local reply: an authorization filter's
401/403, a rate limit's 429, Envoy's 408 for a body that stopped arriving, its 503 "no healthy
upstream"), shown to the picker as the stream's first message, while the request's body is
still arriving, or after the picker's answer with Envoy's details saying so
(`AnswerSide._local`): its body in OpenAI's shape, its status kept.

Such bodies are a filter's fixed text ("RBAC: access denied", "local_rate_limited"): kept as
the message when short and printable, else the status is said. An OpenAI-shaped body (a
filter configured to answer one) passes as it is."""

from __future__ import annotations

from gateway import anthropic_errors
from gateway.errors import error_body, for_status, type_for
from gateway.upstream_errors import openai_shaped

__all__ = ["local_error"]

MAX_TEXT = 200  # bytes of a plain-text body kept as the message


def local_error(status: int, body: bytes, path: str = "") -> bytes | None:
    """The body in OpenAI's shape (Anthropic's on its routes, `path`), or None when it
    already is one."""
    if openai_shaped(status, body) is None:
        return None
    text = body.strip()
    if 0 < len(text) <= MAX_TEXT and text.isascii() and text.decode().isprintable():
        message = text.decode()
    else:
        message = f"The gateway answered {status} itself; no replica was asked."
    if path in anthropic_errors.ANTHROPIC_PATHS:
        return anthropic_errors.error_body(path, for_status(status, message))
    return error_body(message, type_for(status), status)

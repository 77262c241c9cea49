"""`openai_shaped` re-words a replica's error in Anthropic's shape on Anthropic's routes.

Both edges (the HTTP proxy and the Envoy picker) replace a replica's error body that is no
JSON error object with kvgate's own; on ``/v1/messages`` and count_tokens that was OpenAI's
``{"error": {...}}``, which the Anthropic SDK does not read as an error of its own.
"""

from __future__ import annotations

import orjson
import pytest

from gateway.upstream_errors import openai_shaped


@pytest.mark.parametrize(("status", "body", "kind", "message"), [
    (500, b"<html>Internal Server Error</html>", "api_error", "The upstream replica answered 500."),
    (429, b"", "rate_limit_error", "The upstream replica answered 429."),
    (503, b"", "overloaded_error", "The upstream replica answered 503."),
    (400, b'{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}',
     "invalid_request_error", "bad"),
    (422, b'{"detail":[{"loc":["body","max_tokens"],"msg":"Field required","type":"missing"}]}',
     "invalid_request_error", "1 validation error: max_tokens: Field required"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_routes_get_anthropics_shape(
    path: str, status: int, body: bytes, kind: str, message: str,
) -> None:
    shaped = openai_shaped(status, body, path)
    assert shaped is not None
    assert orjson.loads(shaped) == {"type": "error", "error": {"type": kind, "message": message}}


def test_a_replicas_own_error_object_is_kept_on_anthropic_routes() -> None:
    own = b'{"type":"error","error":{"type":"invalid_request_error","message":"no"}}'
    assert openai_shaped(400, own, "/v1/messages") is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", None])
def test_other_routes_keep_openais_shape(path: str | None) -> None:
    shaped = openai_shaped(500, b"oops", path)
    assert shaped is not None
    assert orjson.loads(shaped)["error"]["type"] == "InternalServerError"

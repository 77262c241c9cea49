"""`without_salt`: every form in which an upstream error can echo the `cache_salt` kvgate sent."""

from __future__ import annotations

import orjson
import pytest

from gateway.upstream_errors import openai_shaped, without_salt

SALT = "cgkXvthVaJ5Zw1vH64A5HjvSbVSJy7z-qIl_7QGYHo4"
BODY = {"model": "m", "cache_salt": SALT, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("message", [
    f"1 validation error:\n  {{'input': {BODY}}}",  # FastAPI's str(exc): a Python repr
    f"echo {orjson.dumps(BODY).decode()}",  # JSON inside the message
    f"bad salt (parameter=cache_salt, value={SALT})",  # VLLMValidationError's str
])
@pytest.mark.parametrize("nested", [True, False])  # vLLM >= 0.10.1's shape, and the flat one
def test_an_echoed_salt_is_hidden(message: str, nested: bool) -> None:
    error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    body = orjson.dumps({"error": error} if nested else {"object": "error", **error})
    shaped = openai_shaped(400, body)
    assert shaped is not None and SALT.encode() not in shaped
    assert b"***" in shaped


def test_an_error_naming_the_field_alone_is_kept() -> None:
    body = orjson.dumps({"error": {
        "message": "Parameter 'cache_salt' must be a non-empty string if provided.",
        "type": "BadRequestError", "param": "cache_salt", "code": 400}})
    assert openai_shaped(400, body) is None  # relayed as it came
    assert without_salt(body) is body

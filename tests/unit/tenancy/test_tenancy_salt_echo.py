"""`without_salt`: every form in which an upstream error can echo the `cache_salt` kvgate sent."""

from __future__ import annotations

import orjson
import pytest

from gateway.upstream_errors import error_in_success, openai_shaped, without_salt

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


HEX_SALT = "9f" * 32


@pytest.mark.parametrize(("message", "salt"), [
    # a body JSON-encoded inside a message, then the message JSON-encoded again
    (orjson.dumps(orjson.dumps(BODY).decode()).decode(), SALT),
    (f"cache_salt = '{SALT}' is not allowed here", SALT),
    (f"cache_salt={SALT}", SALT),
    (f"cache_salt={HEX_SALT}", HEX_SALT),  # `tenancy.salt_encoding: hex`
    (orjson.dumps({"param": "cache_salt", "input": SALT}).decode(), SALT),  # a neighbour
])
def test_an_echoed_salt_is_hidden_in_any_shape(message: str, salt: str) -> None:
    """Shapes of an echo that the key's pattern missed (the review's probes): each showed the
    salt to the client before."""
    body = orjson.dumps({"error": {"message": message, "type": "BadRequestError",
                                   "param": None, "code": 400}})
    shaped = openai_shaped(400, body)
    assert shaped is not None and salt.encode() not in shaped


def test_an_error_answered_with_a_200_hides_the_salt() -> None:
    """A replica (or a proxy before it) answering 200 with an error object that echoes the
    body: its message is relayed in a 502, masked as any error is."""
    body = orjson.dumps({"error": {"message": f"echo {BODY}"}})
    message = error_in_success(body)
    assert message is not None and SALT not in message and "***" in message


def test_other_tokens_of_an_error_without_cache_salt_are_kept() -> None:
    body = orjson.dumps({"error": {"message": f"request {SALT} failed", "code": 400}})
    assert without_salt(body) is body  # it names no cache_salt: nothing is hidden

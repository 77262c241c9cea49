"""The stream scanner hides a `cache_salt` an error event echoes, and only there: a model's
text that writes the words (code about vLLM, say) is relayed as it came."""

from __future__ import annotations

import orjson

from gateway.sse import StreamScanner

SALT = "cgkXvthVaJ5Zw1vH64A5HjvSbVSJy7z-qIl_7QGYHo4"


def event(data: object) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def test_an_error_event_loses_the_salt_and_keeps_the_rest() -> None:
    scanner = StreamScanner(strip_usage=False)
    error = {"error": {"message": f"bad request {{'cache_salt': '{SALT}'}}", "code": 400}}
    out = scanner.feed(event(error))
    assert SALT.encode() not in out
    assert b"'cache_salt': '***'" in out and not scanner.malformed
    assert scanner.error_code == 400 and SALT not in (scanner.error_message or "")


def test_a_models_text_naming_cache_salt_is_relayed_unchanged() -> None:
    text = f'{{"cache_salt": "{SALT}"}} is how the field is sent; an error" word too'
    chunk = event({"choices": [{"index": 0, "delta": {"content": text}}]})
    assert StreamScanner(strip_usage=False).feed(chunk) == chunk


def test_a_responses_api_error_event_loses_the_salt() -> None:
    """The Responses API's error events (``event: error``, ``response.failed``) echo alike."""
    message = f"bad request {{'cache_salt': '{SALT}'}}"
    error = b"event: error\n" + event({"type": "error", "code": "400", "message": message,
                                       "param": None, "sequence_number": 2})
    failed = b"event: response.failed\n" + event(
        {"type": "response.failed", "sequence_number": 3,
         "response": {"id": "r", "status": "failed", "error": {"code": "server_error",
                                                                "message": message}}})
    for block in (error, failed):
        out = StreamScanner(strip_usage=False).feed(block)
        assert SALT.encode() not in out and b"'cache_salt': '***'" in out

"""An error event's data may span several ``data:`` lines (SSE joins them with LF): the
stream scanner hid an echoed `cache_salt` per line, so a value on the line after the one
naming cache_salt reached the client. It is hidden on the event's joined data now."""

from __future__ import annotations

import orjson

from gateway.sse import StreamScanner

SALT = "cgkXvthVaJ5Zw1vH64A5HjvSbVSJy7z-qIl_7QGYHo4"
SHORT = "tenant-own-salt"  # not shaped as kvgate derives one: only the key before it tells


def _joined(out: bytes) -> bytes:
    """The event's data as an SSE client reads it."""
    lines = [line.removeprefix(b"data:") for line in out.split(b"\n") if line.startswith(b"data")]
    return b"\n".join(line.removeprefix(b" ") for line in lines)


def test_a_salt_on_the_line_after_its_key_is_hidden() -> None:
    for salt in (SALT, SHORT):
        block = (b'data: {"error": {"message": "bad request", "code": 400,\n'
                 b'data: "input": {"cache_salt":\n'
                 b'data: "' + salt.encode() + b'", "model": "m"}}}\n\n')
        scanner = StreamScanner(strip_usage=False)
        out = scanner.feed(block)
        assert salt.encode() not in out, out
        data = orjson.loads(_joined(out))  # still one JSON object, the rest as it came
        assert data["error"]["input"] == {"cache_salt": "***", "model": "m"}
        assert data["error"]["code"] == 400 and not scanner.malformed


def test_a_salt_split_from_the_error_line_in_a_responses_event_is_hidden() -> None:
    block = (b"event: error\n"
             b'data: {"type": "error", "code": "400",\n'
             b"data: \"message\": \"bad request {'cache_salt': '" + SALT.encode()
             + b"'}\", \"param\": null, \"sequence_number\": 2}\n\n")
    out = StreamScanner(strip_usage=False).feed(block)
    assert SALT.encode() not in out and b"'cache_salt': '***'" in out


def test_a_models_multi_line_text_naming_cache_salt_is_relayed_unchanged() -> None:
    block = (b'data: {"choices": [{"index": 0, "delta": {"content": "an error\\" word"}}],\n'
             b'data: "x": "cache_salt", "y": "' + SALT.encode() + b'"}\n\n')
    assert StreamScanner(strip_usage=False).feed(block) == block

"""`gateway.whole.json_object`: whether a 200's head and body may be the JSON object a proxied
route answers (a cheap look at its ends, not a parse)."""

from __future__ import annotations

import pytest

from gateway.whole import json_object

JSON = "application/json"


@pytest.mark.parametrize(("content_type", "body", "expected"), [
    (JSON, b'{"id": "x"}', True),
    ("application/json; charset=utf-8", b'{"id": "x"}', True),
    (JSON, b'\r\n\t {"id": "x"} \n', True),
    (JSON, b"{}", True),
    ("text/html", b'{"id": "x"}', False),
    ("", b'{"id": "x"}', False),
    (JSON, b"", False),
    (JSON, b"   ", False),
    (JSON, b"<html>bad gateway</html>", False),
    (JSON, b'{"id": "x", "choices": [', False),
    (JSON, b"{", False),
    (JSON, b"null", False),
    (JSON, b'"a string"', False),
    (JSON, b"[1, 2]", False),
])
def test_json_object(content_type: str, body: bytes, expected: bool) -> None:
    assert json_object(content_type, body) is expected

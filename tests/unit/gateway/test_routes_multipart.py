"""An audio route's multipart form (`gateway.multipart`): read for its model and stream,
rewritten part by part for the pool, its file's bytes untouched."""

from __future__ import annotations

import pytest

from gateway.errors import BadRequest
from gateway.multipart import declared_form, parse_form

FILE = b"RIFF\x00\x01\r\n--not-the-boundary\r\n\xff" * 3


def _body(boundary: bytes, *extra: tuple[bytes, bytes]) -> bytes:
    parts = [(b'name="model"', b"open"), (b'name="file"; filename="a.wav"', FILE), *extra]
    out = b"".join(b"--" + boundary + b"\r\nContent-Disposition: form-data; " + d
                   + b"\r\nContent-Type: application/octet-stream\r\n\r\n" + v + b"\r\n"
                   for d, v in parts)
    return out + b"--" + boundary + b"--\r\n"


def test_the_model_is_read_and_replaced_and_the_file_kept() -> None:
    body = _body(b"Bound-4", (b'name="stream"', b"true"))
    form, parsed = parse_form(body, 'multipart/form-data; boundary="Bound-4"')
    assert (parsed.model, parsed.stream, parsed.generates) == ("open", True, True)
    sent = form.rewrite("served-model", "strip", "drop")
    again, reread = parse_form(sent, form.content_type)
    assert reread.model == "served-model"
    files = [content for name, _, content in again.parts if name == "file"]
    assert files == [FILE]
    assert sent == body.replace(b"\r\n\r\nopen\r\n", b"\r\n\r\nserved-model\r\n")


def test_a_clients_salt_is_dropped_or_refused_and_priority_dropped() -> None:
    body = _body(b"b", (b'name="cache_salt"', b"theirs"), (b'name="priority"', b"-5"))
    form, _ = parse_form(body, "multipart/form-data; boundary=b")
    sent = form.rewrite("m", "strip", "drop")
    assert b"theirs" not in sent and b'name="priority"' not in sent
    assert b'name="priority"' in form.rewrite("m", "strip", "keep")
    with pytest.raises(BadRequest) as err:
        form.rewrite("m", "reject", "drop")
    assert err.value.param == "cache_salt"


@pytest.mark.parametrize(("declared", "body", "param"), [
    ("application/json", b'{"model": "m"}', None),
    ("multipart/form-data", _body(b"b"), None),
    ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data", None),
    ("multipart/form-data; boundary=b", b"--b\r\nX: y\r\n\r\nv\r\n--b--\r\n", None),
    ("multipart/form-data; boundary=b", _body(b"b").replace(b'name="model"', b'name="m2"'),
     "model"),
    ("multipart/form-data; boundary=b", _body(b"b", (b'name="stream"', b"maybe")), "stream"),
    ("multipart/form-data; boundary=b", _body(b"b", (b'name="response_format"', b"vtt")),
     "response_format"),
])
def test_what_is_not_a_readable_form_is_a_400(
    declared: str, body: bytes, param: str | None,
) -> None:
    with pytest.raises(BadRequest) as err:
        parse_form(body, declared)
    assert err.value.param == param


def test_the_declared_content_type_is_kept_as_sent() -> None:
    form = declared_form([(b"content-type", b"multipart/form-data; boundary=AbC")])
    assert form.content_type == "multipart/form-data; boundary=AbC"
    assert declared_form([]).content_type == ""

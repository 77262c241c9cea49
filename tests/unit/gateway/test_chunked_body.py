"""`ChunkedBody`: the chunked framing of an upgrade request's body (`curl --http2` with a
chunked POST), read by hand so the bytes after the body are the next request's."""

from __future__ import annotations

import httptools
import pytest

from gateway.upgrade_body import MAX_LINE, ChunkedBody

BODY = b'{"model": "m", "prompt": "hi"}'
FRAMED = (b"7;name=value\r\n" + BODY[:7] + b"\r\n" + b"%X\r\n" % (len(BODY) - 7) + BODY[7:]
          + b"\r\n0\r\nX-Trailer: yes\r\n\r\n")
NEXT = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


def _feed(parts: list[bytes]) -> tuple[bytes, bytes | None]:
    """(the body read, the bytes after it, or None while it goes on)"""
    got: list[bytes] = []
    chunks = ChunkedBody(got.append)
    rest = None
    for part in parts:
        assert rest is None, "fed after the body ended"
        rest = chunks.feed(part)
    return b"".join(got), rest


def test_the_bytes_after_the_body_are_the_next_requests_wherever_the_reads_split() -> None:
    data = FRAMED + NEXT
    for cut in range(1, len(FRAMED) + 1):
        body, rest = _feed([data[:cut], data[cut:]] if cut < len(FRAMED) else [data])
        assert (body, rest) == (BODY, NEXT), cut
    body, rest = _feed([bytes([b]) for b in FRAMED])  # one byte a read
    assert (body, rest) == (BODY, b"")


def test_a_body_not_finished_is_not_over() -> None:
    assert _feed([FRAMED[:-1]]) == (BODY, None)


@pytest.mark.parametrize("framed", [
    b"7\n" + BODY[:7] + b"\r\n0\r\n\r\n",  # a bare LF
    b"0x7\r\n" + BODY[:7] + b"\r\n0\r\n\r\n",  # int(..., 16) would take these
    b"+7\r\n" + BODY[:7] + b"\r\n0\r\n\r\n",
    b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
    b" 7\r\n" + BODY[:7] + b"\r\n0\r\n\r\n",
    b"\r\n",  # no size
    b"zz\r\n",
    b"7\r\n" + BODY[:7] + b"XX0\r\n\r\n",  # no CRLF after the data
    b"1" * 17 + b"\r\n",  # more than 64 bits
    b"7;" + b"x" * MAX_LINE + b"\r\n",  # extensions without end
    b"0\r\n" + b"X-T: a\r\n" * (MAX_LINE // 8 + 1) + b"\r\n",  # trailers without end
], ids=["bare-lf", "0x", "plus", "underscore", "space", "empty", "not-hex", "no-crlf",
        "too-wide", "long-line", "long-trailers"])
def test_what_is_not_chunked_framing_is_refused(framed: bytes) -> None:
    with pytest.raises(httptools.HttpParserError):
        _feed([framed])

"""An event whose data opens and closes as a JSON object but does not parse is malformed too:
relayed, the official SDK raised a JSONDecodeError (or a UnicodeDecodeError) mid-stream -- no
APIError, nothing saying which side failed. What Python's `json` reads is kept (the SDK reads
it with that parser), however orjson judges it."""

from __future__ import annotations

import pytest

from gateway.event_json import PARSED_BYTES
from gateway.sse import StreamScanner

GOOD = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DELTA = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'


@pytest.mark.parametrize("bad", [
    b"data: {not json}\n\n",
    b'data: {"a": }\n\n',
    b'data: {"a":1}}\n\n',
    b'data: {"choices":[{"index":0]}\n\n',  # brackets that do not match
    b'data: {"a":1}\ndata: {"b":2}\n\n',  # two objects: the client joins the lines
    b'data: {"a":"\xff\xfe"}\n\n',  # not UTF-8 (the SDK decodes each line strictly)
    b"event: response.output_text.delta\ndata: {type: x}\n\n",
    b"data: {not json}\r\n\r\n",  # CRLF framing: the general path
    b'data: {"a":' + b"[" * 5000 + b"]" * 5000 + b"}\n\n",  # deeper than either parser goes
], ids=["bare-words", "no-value", "extra-brace", "brackets", "two-objects", "not-utf8",
        "responses", "crlf", "too-deep"])
def test_an_event_that_does_not_parse_is_malformed_and_not_forwarded(bad: bytes) -> None:
    first = DELTA if b"response." in bad else GOOD
    scanner = StreamScanner(strip_usage=False)
    out = scanner.feed(first + bad + GOOD)
    assert scanner.malformed
    assert out == first  # the events before it only


@pytest.mark.parametrize("fine", [
    b'data:{"a":1}\n\n',
    b'data: {"a":\ndata: 1}\n\n',  # one object over two data lines
    b'data: {"a":NaN,"b":1e999}\n\n',  # Python's json reads both (orjson does not)
    b'data: {"a":"\\ud800"}\n\n',  # a lone surrogate escape: Python's json reads it
    DELTA,
    b"data: [DONE]\n\n",
    b": keep-alive\n\n",
], ids=["no-space", "split-object", "nan", "surrogate", "responses", "done", "comment"])
def test_what_the_sdk_parses_is_relayed_as_sent(fine: bytes) -> None:
    scanner = StreamScanner(strip_usage=False)
    assert scanner.feed(GOOD + fine) == GOOD + fine
    assert not scanner.malformed


def test_an_unparsable_event_split_across_reads_is_caught_when_whole() -> None:
    scanner = StreamScanner(strip_usage=False)
    assert scanner.feed(GOOD + b"data: {not") == GOOD
    assert scanner.feed(b" json}\n\n" + GOOD) == b""
    assert scanner.malformed


def test_a_huge_event_is_judged_by_its_ends_only() -> None:
    """Past `PARSED_BYTES` an event is not parsed on the event loop (a completions echo with
    prompt logprobs is tens of MB): one that opens and closes as an object is relayed."""
    huge = b'data: {"a":"' + b"x" * PARSED_BYTES + b'" oops}\n\n'
    scanner = StreamScanner(strip_usage=False)
    assert scanner.feed(GOOD + huge) == GOOD + huge
    assert not scanner.malformed

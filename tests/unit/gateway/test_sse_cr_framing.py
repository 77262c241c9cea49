"""The stream scanner with every line end SSE allows (LF, CRLF, bare CR) and every mix of
them ending events, split anywhere: the bytes pass as sent, the usage-only chunk is stripped
with its own end, [DONE] ends the stream, error events and events that are not JSON are
still seen."""

from __future__ import annotations

import random

import pytest

from gateway.sse import StreamScanner
from tests.unit.gateway.test_sse import CHUNK, COMMENT, DONE, EXPECTED_USAGE, USAGE, run

# an event's end: a line's end (LF, CRLF, CR) then an empty line's
ENDS = [b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r", b"\r\n\r", b"\r\r\n", b"\n\r\n", b"\r\n\n"]
EVENTS = (CHUNK, COMMENT, CHUNK, USAGE, DONE)


def _framed(ends: tuple[bytes, ...], events: tuple[bytes, ...] = EVENTS) -> bytes:
    return b"".join(e.removesuffix(b"\n\n") + end for e, end in zip(events, ends, strict=True))


def _kept(ends: tuple[bytes, ...]) -> bytes:
    pairs = [(e, end) for e, end in zip(EVENTS, ends, strict=True) if e is not USAGE]
    return _framed(tuple(end for _, end in pairs), tuple(e for e, _ in pairs))


FRAMINGS = [tuple([end] * len(EVENTS)) for end in ENDS] + [
    tuple(random.Random(seed).choice(ENDS) for _ in EVENTS) for seed in range(24)]


@pytest.mark.parametrize("ends", FRAMINGS)
def test_split_anywhere_loses_and_merges_nothing(ends: tuple[bytes, ...]) -> None:
    stream = _framed(ends)
    for at in range(len(stream) + 1):
        out, scanner = run([stream[:at], stream[at:]], True)
        assert out == _kept(ends), at
        assert scanner.usage == EXPECTED_USAGE and not scanner.malformed
        assert scanner.complete() and scanner.done(), at


@pytest.mark.parametrize("ends", FRAMINGS)
@pytest.mark.parametrize("size", [1, 2, 5, 4096])
def test_small_reads(ends: tuple[bytes, ...], size: int) -> None:
    stream = _framed(ends)
    out, scanner = run([stream[i:i + size] for i in range(0, len(stream), size)], True)
    assert out == _kept(ends) and scanner.complete() and scanner.usage == EXPECTED_USAGE


def test_each_cr_framed_event_goes_out_as_it_comes() -> None:
    scanner = StreamScanner(True)
    first = CHUNK.replace(b"\n\n", b"\r\r")
    assert scanner.feed(first) == first
    assert scanner.feed(b"data: {\"id\":") == b""  # half an event: held
    assert scanner.feed(b"1}\r\r") == b"data: {\"id\":1}\r\r"


def test_a_cr_framed_stream_cut_short_is_not_complete() -> None:
    out, scanner = run([CHUNK.replace(b"\n\n", b"\r\r") * 2], True)
    assert out and not scanner.complete()


def test_cr_framed_error_events_and_bad_events_are_seen() -> None:
    error = b'data: {"error": {"message": "engine died", "code": 500}}\r\r'
    _, scanner = run([CHUNK.replace(b"\n\n", b"\r\r") + error], True)
    assert scanner.error_code == 500 and scanner.error_message == "engine died"
    bad = b"data: <html>\r\r"
    out, scanner = run([CHUNK.replace(b"\n\n", b"\r") + b"\r" + bad + DONE], True)
    assert scanner.malformed and out == CHUNK.replace(b"\n\n", b"\r\r")


@pytest.mark.parametrize("blank", [b"\r\n", b"\r", b"\n"])
@pytest.mark.parametrize("end", [b"\r\n\r\n", b"\r\r"])
def test_blank_lines_after_the_last_event_of_a_read_pass_as_sent(
    end: bytes, blank: bytes,
) -> None:
    """A read holding the usage chunk (stripped) whose last event is followed by a blank
    line's end: those bytes were dropped with the split into events."""
    stream = _framed((end,) * len(EVENTS)) + blank
    out, scanner = run([stream], strip=True)
    assert out == _kept((end,) * len(EVENTS)) + blank
    assert scanner.usage == EXPECTED_USAGE and scanner.complete()

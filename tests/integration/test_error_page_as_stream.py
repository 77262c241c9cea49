"""A 200 labelled ``text/event-stream`` whose body is a JSON error object, no event: a proxy's
error page in front of a replica, or an error answered with the stream's media type. The
client is told what the error said -- in its 502 before the stream started, in the stream's
error event after -- not that the replica "ended its answer before it started" (or "ended the
stream before it was complete"), which lost the message. The official client raises with it.
So for an HTML page labelled as the stream (an ingress's 502 page): the client is told it was
one -- its lines were relayed in a 200 as fields the client ignores when the page had blank
lines, and "ended its answer before it started" when it had none."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from gateway.stream_end import HTML_PAGE, NOT_SSE
from tests.support.bad_replica import BadReplica, End, behind_a_gateway, chunked, sse_head
from tests.support.gateway import inflight, request_statuses, wait_for

MODEL = "m"
SAID = "upstream connect error or disconnect/reset before headers"
NESTED = orjson.dumps({"error": {"message": SAID, "type": "ServiceUnavailable", "code": 503}})
FLAT = orjson.dumps({"object": "error", "message": SAID, "code": 503})
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
PAGE = (b"<!DOCTYPE html>\n<html>\n<head><title>502 Bad Gateway</title></head>\n\n<body>\n"
        b"<center><h1>502 Bad Gateway</h1></center>\n\n<hr><center>nginx</center>\n</body>\n"
        b"</html>\n")


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL) as (replica, base):
        yield replica, base


def _stream(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]})


@pytest.mark.parametrize("body", [
    NESTED, FLAT, NESTED + b"\n", NESTED + b"\n\n", orjson.dumps(
        orjson.loads(NESTED), option=orjson.OPT_INDENT_2) + b"\n\n\n"],
    ids=["nested", "flat", "line-ended", "blank-line-ended", "indented"])
def test_an_error_object_for_a_stream_is_a_502_with_its_message(
    gw: tuple[BadReplica, str], body: bytes,
) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(body)
    resp = _stream(base)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["type"] == "BadGatewayError" and SAID in error["message"], error
    assert inflight(base) == 0
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError, match="upstream connect error"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)


def test_an_error_object_after_the_first_event_ends_the_stream_with_its_message(
    gw: tuple[BadReplica, str],
) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(CHUNK, last=False)
    replica.rest, replica.gate = chunked(NESTED), threading.Event()
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=10, json={
                "model": MODEL, "stream": True,
                "messages": [{"role": "user", "content": "x"}]}) as resp:
            chunks = resp.iter_bytes()
            got = next(chunks)  # the stream started before the error came
            replica.gate.set()
            got += b"".join(chunks)
    finally:
        replica.gate.set()
        replica.rest = b""
    events = [e for e in got.split(b"\n\n") if e]
    assert events[0] == CHUNK.strip() and events[-1] == DONE.strip()
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and SAID in error["message"], error
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_stream_cut_short_still_says_so(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(CHUNK, b'data: {"choices":[{"ind')
    resp = _stream(base)
    events = [e for e in resp.content.split(b"\n\n") if e]
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["message"] == "The upstream replica ended the stream before it was complete."


@pytest.mark.parametrize(("page", "framing"), [
    (PAGE, "chunked"), (PAGE, "close"), (PAGE.replace(b"\n\n", b"\n"), "chunked"),
    (b"\r\n" + PAGE.replace(b"\n", b"\r\n"), "close"),
], ids=["blank-lines", "blank-lines-close", "no-blank-line", "crlf-close"])
def test_an_html_page_for_a_stream_is_a_502_that_says_so(
    gw: tuple[BadReplica, str], page: bytes, framing: str,
) -> None:
    replica, base = gw
    end: End = "close" if framing == "close" else "keep"
    replica.answer = (sse_head(chunked_body=False) + page if framing == "close"
                      else sse_head() + chunked(page))
    replica.end = end
    try:
        before = request_statuses(base).get("502", 0.0)
        resp = _stream(base)
        assert resp.status_code == 502, resp.text
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["error"]["message"] == HTML_PAGE
        assert request_statuses(base).get("502", 0.0) == before + 1
        assert inflight(base) == 0
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.APIStatusError, match="HTML page"):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    finally:
        replica.end = "keep"


def test_an_html_page_after_the_first_event_ends_the_stream_saying_so(
    gw: tuple[BadReplica, str],
) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(CHUNK, last=False)
    replica.rest, replica.gate = chunked(PAGE), threading.Event()
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=10, json={
                "model": MODEL, "stream": True,
                "messages": [{"role": "user", "content": "x"}]}) as resp:
            chunks = resp.iter_bytes()
            got = next(chunks)  # the stream started before the page came
            replica.gate.set()
            got += b"".join(chunks)
    finally:
        replica.gate.set()
        replica.rest = b""
    assert resp.status_code == 200
    events = [e for e in got.split(b"\n\n") if e]
    assert b"<" not in got  # none of the page's lines reached the client
    assert events[0] == CHUNK.strip() and events[-1] == DONE.strip()
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error == {"message": HTML_PAGE, "type": "BadGatewayError", "param": None,
                     "code": 502}
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


@pytest.mark.parametrize("body", [b"Service Unavailable", b'{"id": "x", "choices": []}\n\n'],
                         ids=["text", "json-answer"])
def test_text_that_is_no_event_stream_is_a_502_that_says_so(
    gw: tuple[BadReplica, str], body: bytes,
) -> None:
    """A line of such a body followed by a blank line was an event of fields the client
    ignores: relayed in a 200 (the JSON error object's message lost)."""
    replica, base = gw
    replica.answer = sse_head() + chunked(body)
    resp = _stream(base)
    assert resp.status_code == 502
    assert resp.json()["error"]["message"] == NOT_SSE

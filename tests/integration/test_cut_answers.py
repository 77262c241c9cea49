"""Answers a replica cuts short. A stream must end the way OpenAI streams end -- ``data:
[DONE]``, a Responses API terminal event, or an error event -- or the client is told it was
cut: a replica (or a proxy in front of it) that ends the body cleanly but early would otherwise
hand the official client a stream it cannot tell from a complete one. A whole answer cut after
its headers, a 200 that is not JSON and a stream that fails before its first event reached the
client are retried elsewhere. The replica here is a real loopback server that answers
exactly those bytes (`tests/support/bad_replica.py`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests.support.bad_replica import BadReplica, End, behind_a_gateway, chunked, sse_head
from tests.support.gateway import (
    gateway_proc,
    inflight,
    metric_values,
    request_statuses,
    wait_for,
)
from tests.support.procs import sim_proc

MODEL = "bad-model"
CHUNK = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}) + b"\n\n"
DONE = b"data: [DONE]\n\n"
EMOJI = CHUNK.replace(b'"hi"', '"\U0001f600 \u00e9"'.encode()).replace(b"\n\n", b"\r\n\r\n")
CUT = EMOJI.index("\U0001f600".encode()) + 2  # inside the character's 4 bytes
CREATED = (b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
           b'"response":{"id":"resp_1","object":"response","status":"in_progress"}}\n\n')
# a Responses stream's first output (its opening events are held until one: another replica
# may still answer in their place)
DELTA = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
         b'"sequence_number":1,"delta":"hi"}\n\n')
COMPLETED = (b'event: response.completed\ndata: {"type":"response.completed","sequence_number":1,'
             b'"response":{"id":"resp_1","object":"response","status":"completed"}}\n\n')


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL) as (replica, base):
        yield replica, base


def events(base: str, path: str = "/v1/chat/completions") -> list[bytes]:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}],
            "input": "x"}
    resp = httpx.post(f"{base}{path}", json=body, timeout=10)
    assert resp.status_code == 200
    return [e for e in resp.content.split(b"\n\n") if e]


@pytest.mark.parametrize(
    ("answer", "end"),
    [
        (sse_head() + chunked(CHUNK, CHUNK), "keep"),  # the chunked body ends, no [DONE]
        (sse_head(chunked_body=False) + CHUNK + CHUNK, "close"),  # the connection ends it
        (sse_head() + chunked(CHUNK, CHUNK, b'data: {"id":"c1","obj'), "keep"),  # half
    ],
    ids=["chunked", "connection-close", "half-event"],
)
def test_a_stream_ended_early_gets_an_error_event(
    gw: tuple[BadReplica, str], answer: bytes, end: End,
) -> None:
    replica, base = gw
    replica.answer, replica.end = answer, end
    before = request_statuses(base).get("502", 0.0)
    got = events(base)
    assert got[:-2] == [CHUNK.strip()] * 2  # what came whole is relayed, no half event
    error = orjson.loads(got[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "before it was complete" in error["message"]
    assert got[-1] == DONE.strip()
    wait_for(lambda: request_statuses(base).get("502", 0.0) == before + 1, what="counted as a 502")
    assert inflight(base) == 0

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                    "content": "x"}], stream=True)
    with pytest.raises(openai.APIError, match="before it was complete"):
        list(stream)


def test_a_responses_stream_without_its_terminal_event_gets_an_error_event(
    gw: tuple[BadReplica, str],
) -> None:
    replica, base = gw
    replica.answer, replica.end = sse_head() + chunked(CREATED + DELTA), "keep"
    got = events(base, "/v1/responses")
    assert got[:2] == [CREATED.strip(), DELTA.strip()]
    assert b"before it was complete" in got[-2] and got[-1] == DONE.strip()


def test_a_responses_stream_cut_after_its_opening_events_is_a_502(
    gw: tuple[BadReplica, str],
) -> None:
    """`response.created` alone is no answer yet (vLLM sends it before the prefill): it is
    held, so the cut comes before anything reached the client -- a 502 JSON (after a retry
    elsewhere, had there been another replica), as for a chat stream cut before its first
    event."""
    replica, base = gw
    replica.answer, replica.end = sse_head() + chunked(CREATED), "keep"
    resp = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "stream": True,
                                                    "input": "x"}, timeout=10)
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["message"] == "The replica ended its answer before it started."


@pytest.mark.parametrize(
    ("bad", "path"),
    [
        (b"data: <html><body>Bad Gateway</body></html>\n\n", "/v1/chat/completions"),
        (b"data:\n\n", "/v1/chat/completions"),  # empty data
        (b"event: response.output_text.delta\ndata: oops\n\n", "/v1/responses"),
        (b'data: {"id":"c1","object":"chat.compl\n\n', "/v1/chat/completions"),  # cut JSON
    ],
    ids=["html", "empty", "responses", "truncated-json"],
)
def test_a_malformed_event_mid_stream_ends_it_with_an_error_event(
    gw: tuple[BadReplica, str], bad: bytes, path: str,
) -> None:
    """An event whose data is neither JSON nor [DONE] (a replica or a proxy gone wrong) is not
    relayed: the official client would raise a JSON decode error halfway through, blaming
    nobody. Once the stream has reached the client it ends as a cut one does: a 502 error
    event and [DONE] (before that, it is retried: see the "malformed" case below)."""
    replica, base = gw
    first = CREATED + DELTA if path == "/v1/responses" else CHUNK
    replica.answer = sse_head() + chunked(first, last=False)
    replica.rest, replica.end = chunked(first + bad, CHUNK, DONE), "keep"
    before = request_statuses(base).get("502", 0.0)
    try:
        replica.gate = threading.Event()
        body = {"model": MODEL, "stream": True, "input": "x",
                "messages": [{"role": "user", "content": "x"}]}
        with httpx.stream("POST", f"{base}{path}", json=body, timeout=30) as resp:
            chunks = resp.iter_bytes()
            received = next(chunks)  # the first event went out before the rest was sent
            replica.gate.set()
            received += b"".join(chunks)
        got = [e for e in received.split(b"\n\n") if e]
        # what came before it is relayed, not after
        assert got[:-2] == [e for e in (first * 2).split(b"\n\n") if e]
        error = orjson.loads(got[-2].removeprefix(b"data: "))["error"]
        assert error == {"message": "The upstream replica sent a stream event that is not a "
                         "JSON object.", "type": "BadGatewayError", "param": None, "code": 502}
        assert got[-1] == DONE.strip()
        wait_for(lambda: request_statuses(base).get("502", 0.0) == before + 1, what="a 502")
        assert inflight(base) == 0
        if path != "/v1/chat/completions":
            return
        replica.gate = threading.Event()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
        assert next(iter(stream)).choices[0].delta.content == "hi"
        replica.gate.set()
        with pytest.raises(openai.APIError, match="not a JSON object"):  # not a JSONDecodeError
            list(stream)
    finally:
        replica.rest = b""
        replica.gate.set()


@pytest.mark.parametrize(
    ("parts", "path"),
    [
        ((CHUNK, b"data: [DONE]\n"), "/v1/chat/completions"),  # one newline short
        ((CHUNK, DONE, b": keep-alive\n\n"), "/v1/chat/completions"),
        ((CREATED, COMPLETED), "/v1/responses"),
        # an event split inside a 4-byte UTF-8 character and across CRLF line ends
        ((EMOJI[:7], EMOJI[7:CUT], EMOJI[CUT:] + b"data: [DONE]\r", b"\n\r\n"),
         "/v1/chat/completions"),
    ],
    ids=["done-one-newline", "comment-after-done", "responses", "split-emoji-crlf"],
)
def test_a_complete_stream_is_relayed_as_sent(
    gw: tuple[BadReplica, str], parts: tuple[bytes, ...], path: str,
) -> None:
    replica, base = gw
    replica.answer, replica.end = sse_head() + chunked(*parts), "keep"
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}],
            "input": "x"}
    assert httpx.post(f"{base}{path}", json=body, timeout=10).content == b"".join(parts)


@pytest.mark.parametrize("blank", [b"\n\n", b"\r\n\r\n"], ids=["lf", "crlf"])
def test_blank_lines_after_the_done_in_a_read_of_their_own_are_no_cut(
    gw: tuple[BadReplica, str], blank: bytes,
) -> None:
    """Blank lines are nothing in SSE (an empty event is not dispatched), but a read holding
    only them, after the [DONE], was taken for the stream's last event: the whole stream got a
    502 error event "ended the stream before it was complete" after its [DONE], was counted a
    502 and its replica charged a failure. Now it is relayed as sent, a 200."""
    replica, base = gw
    replica.answer, replica.end = sse_head() + chunked(CHUNK + DONE, last=False), "keep"
    replica.drip, replica.drip_s = [chunked(blank)], 0.2  # (a read of their own)
    try:
        before = request_statuses(base)
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10).content == (
            CHUNK + DONE + blank)
        wait_for(lambda: request_statuses(base).get("200", 0.0) == before.get("200", 0.0) + 1,
                 what="counted as a 200")
        assert request_statuses(base).get("502", 0.0) == before.get("502", 0.0)
    finally:
        replica.drip = []


USAGE = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"bad-model",'
         b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n')


@pytest.mark.parametrize("end", ["close", "reset"])
@pytest.mark.parametrize(
    ("events", "path"),
    [(CHUNK + USAGE + DONE, "/v1/chat/completions"),
     (CREATED + DELTA + COMPLETED, "/v1/responses")],
    ids=["chat", "responses"],
)
def test_a_whole_stream_whose_connection_breaks_after_its_end_is_whole(
    gw: tuple[BadReplica, str], events: bytes, path: str, end: End,
) -> None:
    """The replica (or a proxy in front) sends the whole stream -- its usage and [DONE], or
    ``response.completed`` -- then closes or resets the connection without the body's last
    chunk. The client had its whole answer, but got a 502 error event "failed mid-stream"
    after the [DONE]; the request was counted a 502, its usage lost, and the replica charged
    a failure for every such answer (ejected after three of them). Now the stream ends as it
    came, a 200 with its usage, and no failure."""
    replica, base = gw
    replica.answer, replica.end = sse_head() + chunked(events, last=False), end
    before = request_statuses(base)
    failures = sum(metric_values(base, "kvgate_replica_failures_total").values())
    tokens = metric_values(base, "kvgate_tokens_total").get(
        '{kind="completion",pool="default",tier="default"}', 0.0)
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}],
            "input": "x"}
    assert httpx.post(f"{base}{path}", json=body, timeout=10).content == (
        events.replace(USAGE, b""))  # (not asked for: kvgate asked for it, and drops it)
    wait_for(lambda: request_statuses(base).get("200", 0.0) == before.get("200", 0.0) + 1,
             what="counted as a 200")
    assert request_statuses(base).get("502", 0.0) == before.get("502", 0.0)
    assert sum(metric_values(base, "kvgate_replica_failures_total").values()) == failures
    if path == "/v1/chat/completions":
        assert metric_values(base, "kvgate_tokens_total")[
            '{kind="completion",pool="default",tier="default"}'] == tokens + 1
    assert inflight(base) == 0


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[BadReplica, str, str]]:
    """The faulty replica and a simulated one, taken in turns (round robin)."""
    sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim, BadReplica(MODEL) as replica:
        proc, base = gateway_proc(upstreams=[replica.url, sim_url],
                                  args=["--policy", "round_robin"],
                                  env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with proc:
            yield replica, sim_url, base


def answered_by_the_sim(pair: tuple[BadReplica, str, str], answer: bytes, end: End,
                        *, stream: bool) -> None:
    """Four requests, half of them sent to the faulty replica first: each is answered whole
    by the simulated one, and the faulty one's answers were retried."""
    replica, sim, base = pair
    replica.answer, replica.end = answer, end
    posts, before = replica.posts, retried(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    for _ in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
            stream=stream)
        assert raw.headers["x-kvgate-replica"].endswith(sim[7:])
        parsed = raw.parse()
        if isinstance(parsed, openai.Stream):
            assert "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
        else:
            assert parsed.choices[0].message.content
    assert replica.posts - posts >= 2 and retried(base) - before >= 2
    assert inflight(base) == 0


def retried(base: str) -> float:
    return sum(metric_values(base, "kvgate_upstream_retries_total").values())


def test_a_whole_answer_cut_after_its_headers_is_retried_elsewhere(
    pair: tuple[BadReplica, str, str],
) -> None:
    """Nothing reached the client yet, so another replica can answer instead (as for a reset
    before the headers)."""
    cut = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 99\r\n\r\n{"
    answered_by_the_sim(pair, cut, "reset", stream=False)


@pytest.mark.parametrize(
    ("answer", "end"),
    [
        (sse_head(), "reset"),  # the head, then a reset
        (sse_head() + chunked(b'data: {"error":{"message":"dead","type":"x","code":500}}\n\n',
                              DONE), "keep"),  # vLLM's engine died before the first token
        (sse_head() + chunked(), "keep"),  # an empty stream
        (sse_head() + chunked(b"data: Internal Server Error\n\n", CHUNK, DONE), "keep"),
    ],
    ids=["reset", "error-event", "empty", "malformed"],
)
def test_a_stream_that_fails_before_its_first_event_is_retried_elsewhere(
    pair: tuple[BadReplica, str, str], answer: bytes, end: End,
) -> None:
    """vLLM sends a stream's headers at once, before the prompt is even scheduled: the
    client's own headers wait for the first event, so a replica that fails before it (dies
    in prefill, resets) is hidden like a failure before the headers."""
    answered_by_the_sim(pair, answer, end, stream=True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_200_that_is_not_json_is_a_502_not_a_string_or_an_empty_stream(
    gw: tuple[BadReplica, str], stream: bool,
) -> None:
    """An HTML page with 200 (a URL that reaches some web server, a captive proxy) is no
    answer: the SDK would hand back a `str`, or an empty stream that looks complete."""
    replica, base = gw
    page = b"<html>hello</html>"
    replica.answer, replica.end = (b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\n"
                                   b"content-length: %d\r\n\r\n" % len(page) + page), "keep"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=stream)
    assert caught.value.status_code == 502
    what = "the stream asked for" if stream else "JSON"
    assert caught.value.body == {
        "message": f"The replica's answer is not {what} (text/html).",
        "type": "BadGatewayError", "param": None, "code": 502}
    assert inflight(base) == 0


def test_a_whole_json_answer_to_a_stream_is_a_502_not_an_empty_stream(
    gw: tuple[BadReplica, str],
) -> None:
    """The SDK reads a JSON body given to `stream=True` as a stream without events: it would
    end at once, looking complete."""
    replica, base = gw
    whole = orjson.dumps({"object": "list", "model": MODEL, "data": [
        {"object": "embedding", "index": 0, "embedding": [1.0]}]})  # whole, as any 200 here
    replica.answer, replica.end = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                   b"content-length: %d\r\n\r\n" % len(whole) + whole), "keep"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError, match="not the stream asked for"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    # embeddings never stream: a `stream` field there is not a stream asked for
    embedded = client.embeddings.create(model=MODEL, input="x", encoding_format="float",
                                        extra_body={"stream": True})
    assert embedded.data[0].embedding == [1.0]


BACK_OFF = "the replica's busy back-off, whole seconds (`health.busy_backoff_max_s` 2 s at most)"


@pytest.mark.parametrize(
    ("sent", "relayed"),
    [("7", "7"), ("86400", "3600"), ("Wed, 21 Oct 2015 07:28:00 GMT", BACK_OFF),
     (None, BACK_OFF)],
    ids=["seconds", "capped", "http-date", "none"],
)
def test_a_replicas_429_keeps_its_retry_after(
    gw: tuple[BadReplica, str], sent: str | None, relayed: str | None,
) -> None:
    """Whatever rate-limits in front of a replica says how long to wait; the SDK honours it.
    When it says no number of seconds, the replica's busy back-off (at least 1 s)."""
    replica, base = gw
    body = b'{"error": {"message": "slow down", "type": "RateLimitError", "code": 429}}'
    head = b"retry-after: %s\r\n" % sent.encode() if sent is not None else b""
    replica.answer = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                      + head + b"content-length: %d\r\n\r\n" % len(body) + body)
    replica.end = "keep"
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 429 and resp.json()["error"]["message"] == "slow down"
    if relayed == BACK_OFF:  # (it doubles while the replica keeps answering 429: 1 or 2 s)
        assert resp.headers.get("retry-after") in ("1", "2"), resp.headers
    else:
        assert resp.headers.get("retry-after") == relayed


def test_a_stream_opened_by_keep_alives_and_answered_202_elsewhere_is_a_failure() -> None:
    """A replica sends `: keep-alive` (the client's stream is open: 200) then hangs; after the
    first-byte cut another replica answers 202 with a JSON body, no stream. The client gets a
    502 error event ending its stream: the request and that replica are recorded as such, a
    failure, not a success that would keep it in rotation (and clear its failure count)."""
    with BadReplica(MODEL) as hung, BadReplica(MODEL) as odd:
        hung.answer = sse_head() + chunked(b": keep-alive\n\n", last=False)
        hung.rest, hung.gate = b"x", threading.Event()  # never sent: the try is cut first
        body = b'{"id": "queued-1", "status": "queued"}'
        odd.answer = (b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n" % len(body) + body)
        gw, base = gateway_proc(upstreams=[hung.url, odd.url], args=["--policy", "round_robin"],
                                env={"KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "0.5",
                                     "KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with gw, httpx.Client(timeout=10) as http:
            opened = None
            for _ in range(4):  # round robin (id order): one of the first two starts on `hung`
                try:
                    with http.stream("POST", f"{base}/v1/chat/completions", json={
                            "model": MODEL, "stream": True,
                            "messages": [{"role": "user", "content": "x"}]},
                            timeout=httpx.Timeout(10, read=3)) as resp:
                        text = resp.read()
                except httpx.ReadTimeout:
                    # it started on `odd`: its 202 (nothing sent yet) is retried on `hung`,
                    # the last try, which waits for the replica (no first-byte cut left)
                    continue
                if text.startswith(b": keep-alive") and b'"code":504' in text:
                    # it started on `odd`: its 202 (nothing sent yet) was retried on `hung`,
                    # the last try, cut at its own first-byte timeout: not the case here
                    continue
                if text.startswith(b": keep-alive"):
                    opened = text
                    break
            hung.gate.set()
            assert opened is not None, "no request started on the hung replica"
            assert b'"code":502' in opened and b"answered 202" in opened, opened
            assert opened.endswith(DONE)
            failures = metric_values(base, "kvgate_replica_failures_total")
            assert failures[f'{{pool="default",replica="{odd.url[7:]}"}}'] >= 1, failures
            requests = metric_values(base, "kvgate_requests_total")
            assert any('status="502"' in k for k in requests), requests
            wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")

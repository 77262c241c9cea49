"""Legal but unusual answers from a replica (or a proxy, a sidecar in front of it), at both
edges -- the HTTP proxy (`kvgate serve`) and the Envoy endpoint picker behind a real Envoy --
against what the official `openai` client makes of them: a stream event whose data is JSON but
no object (``[1, 2]``, ``42``: the SDK raised a TypeError, no APIError), a whole answer that
opens with a UTF-8 byte order mark (the client's decoder reads it; kvgate answered 502), and a
multipart upload (the picker answered 400 where the HTTP edge answers 415).

The replica is `tests/support/bad_replica.py`, scripted per test.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.stream_end import MALFORMED
from tests.integration.test_stored_stream import COMPLETED, CREATED, DELTA, RID, WHOLE
from tests.support.bad_replica import CHAT_ANSWER, BadReplica, chunked, sse_head, whole
from tests.support.epp import both_edges, store_through
from tests.support.gateway import inflight, wait_for

MODEL = "odd-model"
EDGES = ["http", "envoy"]
BOM = b"\xef\xbb\xbf"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

# one event of output per kind of stream, as vLLM sends it
CHAT_EVENT = b"data: " + orjson.dumps({
    "id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}) + b"\n\n"
TEXT_EVENT = b"data: " + orjson.dumps({
    "id": "c", "object": "text_completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}) + b"\n\n"
FIRST = {"chat": CHAT_EVENT, "completions": TEXT_EVENT, "responses": CREATED + DELTA}


@pytest.fixture(scope="module")
def bad() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    with BadReplica(MODEL) as replica, both_edges(replica.url, MODEL, {}) as every:
        yield replica, every


@pytest.fixture
def replica(bad: tuple[BadReplica, dict[str, str]]) -> Iterator[BadReplica]:
    replica = bad[0]
    replica.gate, replica.end = threading.Event(), "keep"
    yield replica
    replica.rest, replica.answer = b"", b""
    replica.gate.set()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


def _stream(client: openai.OpenAI, kind: str) -> list[object]:
    """A stream of `kind`, read to its end."""
    if kind == "chat":
        return list(client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                   stream=True))
    if kind == "completions":
        return list(client.completions.create(model=MODEL, prompt="hi", stream=True))
    return list(client.responses.create(model=MODEL, input="hi", stream=True))


def _event(kind: str, data: bytes) -> bytes:
    """An event of `kind`'s stream whose data is `data` (a Responses API one named)."""
    name = b"event: response.output_text.delta\n" if kind == "responses" else b""
    return name + b"data: " + data + b"\n\n"


# -- a stream event that is JSON but no object ---------------------------------------------
@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("kind", ["chat", "completions", "responses"])
@pytest.mark.parametrize("data", [b"[1, 2]", b"42", b"null"])
def test_a_first_event_that_is_no_object_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, kind: str,
    data: bytes,
) -> None:
    """An event's data is a JSON object or ``[DONE]``: JSON of another kind (an array: the
    SDK raised ``TypeError``, a number or null: an error in its parser) is the replica's
    fault, before anything reached the client a 502 saying so -- not a 200 whose stream the
    SDK cannot read."""
    replica.answer = sse_head() + chunked(_event(kind, data), b"data: [DONE]\n\n")
    with pytest.raises(openai.InternalServerError) as err:
        _stream(_client(bad[1][edge]), kind)
    assert err.value.status_code == 502
    assert err.value.body == {"message": MALFORMED, "type": "BadGatewayError", "param": None,
                              "code": 502}
    if edge == "http":
        wait_for(lambda: inflight(bad[1]["http"]) == 0, what="in-flight back to 0")


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("kind", ["chat", "completions", "responses"])
def test_an_event_that_is_no_object_after_output_is_an_error_event(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, kind: str,
) -> None:
    """After output reached the client, the array event ends the stream with kvgate's error
    event: the SDK raises an APIError naming the replica's fault (it raised a TypeError)."""
    replica.answer = sse_head() + chunked(FIRST[kind], last=False)
    replica.rest = chunked(_event(kind, b'[{"choices": []}]'), b"data: [DONE]\n\n")
    client = _client(bad[1][edge])
    events: Iterator[object]
    if kind == "chat":
        events = iter(client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                     stream=True))
    elif kind == "completions":
        events = iter(client.completions.create(model=MODEL, prompt="hi", stream=True))
    else:
        events = iter(client.responses.create(model=MODEL, input="hi", stream=True))
    next(events)  # the first output reached the client before the replica went on
    replica.gate.set()
    with pytest.raises(openai.APIError) as err:
        list(events)
    assert err.value.body == {"message": MALFORMED, "type": "BadGatewayError", "param": None,
                              "code": 502}
    if edge == "http":
        wait_for(lambda: inflight(bad[1]["http"]) == 0, what="in-flight back to 0")


# -- a whole answer opening with a byte order mark -----------------------------------------
@pytest.mark.parametrize("edge", EDGES)
def test_a_whole_answer_opening_with_a_bom_is_relayed_without_it(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """The client's decoder reads a JSON body opening with a UTF-8 byte order mark (the SDK
    calling the replica directly gets its completion): kvgate answered 502 "not JSON". Now
    relayed without the mark (RFC 8259 8.1: a JSON text has none), its usage counted."""
    replica.answer = whole(BOM + CHAT_ANSWER)
    direct = _client(replica.url).chat.completions.create(model=MODEL, messages=MESSAGES)
    done = _client(bad[1][edge]).chat.completions.create(model=MODEL, messages=MESSAGES)
    assert done.choices[0].message.content == direct.choices[0].message.content == "hello"
    raw = httpx.post(f"{bad[1][edge]}/v1/chat/completions", timeout=30,
                     json={"model": MODEL, "messages": MESSAGES})
    assert raw.status_code == 200 and raw.content == CHAT_ANSWER


@pytest.mark.parametrize("edge", EDGES)
def test_an_error_opening_with_a_bom_keeps_its_message(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """A replica's 400 whose JSON opens with a byte order mark: its message reaches the
    client (it was replaced by "The upstream replica answered 400.")."""
    error = {"message": "max_tokens is too large", "type": "BadRequestError", "param": None,
             "code": 400}
    replica.answer = whole(BOM + orjson.dumps({"error": error}), status=400)
    with pytest.raises(openai.BadRequestError) as err:
        _client(bad[1][edge]).chat.completions.create(model=MODEL, messages=MESSAGES)
    assert err.value.body == error


# -- a multipart upload --------------------------------------------------------------------
def test_a_multipart_body_is_a_415_at_both_edges(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica,
) -> None:
    """A file upload to a JSON route: the HTTP edge's 415 at the picker too (it answered 400
    "not valid JSON" at the form's boundary line); the replica gets nothing."""
    answers = {}
    for edge in EDGES:
        posts = replica.posts
        resp = httpx.post(f"{bad[1][edge]}/v1/chat/completions", timeout=30,
                          data={"model": MODEL}, files={"file": ("a.wav", b"RIFF....")})
        assert replica.posts == posts
        answers[edge] = resp.status_code, resp.json()
    assert answers["envoy"] == answers["http"]
    assert answers["http"][0] == 415
    # an audio upload behind Envoy (the picker routes no form): the 415 says where it goes
    resp = httpx.post(f"{bad[1]['envoy']}/v1/audio/transcriptions", timeout=30,
                      data={"model": MODEL}, files={"file": ("a.wav", b"RIFF....")})
    assert resp.status_code == 415, resp.text
    assert "send audio to kvgate's HTTP edge" in resp.json()["error"]["message"]
    assert replica.posts == posts


# -- the replica's response headers --------------------------------------------------------
def _head(content_type: bytes, framing: bytes) -> bytes:
    """A 200 head carrying end-to-end headers, hop-by-hop ones and ones kvgate sets itself."""
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\n" + framing + b"\r\n"
            b"cache-control: no-store\r\nvary: Accept\r\nx-sidecar: 7\r\n"
            b"connection: keep-alive, x-hop\r\nkeep-alive: timeout=5\r\nx-hop: 1\r\n"
            b"x-request-id: the-replicas\r\nx-ratelimit-remaining-requests: 3\r\n"
            b"set-cookie: lb=replica-2\r\nalt-svc: h3=\":443\"\r\n"
            b"content-location: http://10.0.0.7:8000/v1/x\r\netag: \"v1\"\r\n"
            b"via: 1.1 vllm-3.llm.svc.cluster.local\r\nx-forwarded-for: 10.0.0.7\r\n"
            b"x-forwarded-host: vllm-3.llm.svc\r\nforwarded: for=10.0.0.7\r\n\r\n")


PASSED = {"cache-control": "no-store", "vary": "Accept", "x-sidecar": "7"}
NOT_PASSED = ["keep-alive", "x-ratelimit-remaining-requests", "set-cookie", "alt-svc",
              "content-location", "etag", "via", "x-forwarded-for", "x-forwarded-host",
              "forwarded"]


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_replicas_end_to_end_headers_reach_the_client(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, stream: bool,
) -> None:
    """What a client calling the replica directly gets of its head, it gets through kvgate:
    ``cache-control``, ``vary``, a sidecar's ``x-*`` (the HTTP edge dropped them all, Envoy
    passed them: the edges disagreed). Not the hop-by-hop ones (RFC 9110 7.6.1), nor what
    kvgate sets itself (its ``x-request-id``, the tenant's ``x-ratelimit-*``: a replica's
    read as kvgate's limits through Envoy) or what is the replica origin's (an internal load
    balancer's cookie, ``alt-svc``: passed through Envoy), nor the internal host names and
    addresses a proxy in front of the replica wrote (``via``, ``x-forwarded-*``,
    ``forwarded``: passed at both edges)."""
    if stream:
        replica.answer = _head(b"text/event-stream", b"transfer-encoding: chunked") + chunked(
            CHAT_EVENT, b"data: [DONE]\n\n")
    else:
        replica.answer = _head(b"application/json", b"content-length: %d" % len(CHAT_ANSWER)
                               ) + CHAT_ANSWER
    resp = httpx.post(f"{bad[1][edge]}/v1/chat/completions", timeout=30,
                      headers={"x-request-id": "mine"},
                      json={"model": MODEL, "messages": MESSAGES, "stream": stream})
    assert resp.status_code == 200, resp.text
    got = dict(resp.headers.multi_items())
    assert {k: got.get(k) for k in PASSED} == PASSED
    assert resp.headers.get_list("vary") == ["Accept"] and got["x-request-id"] == "mine"
    assert [k for k in NOT_PASSED if k in got] == []
    if edge == "http":  # (Envoy leaves what the replica's Connection header names)
        assert "x-hop" not in got
    assert b"hello" in resp.content if not stream else resp.content.endswith(b"[DONE]\n\n")


# -- a compressed answer -------------------------------------------------------------------
@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_compressed_answer_is_the_same_502_at_both_edges(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, stream: bool,
) -> None:
    """Both edges ask the replica for identity; a proxy in front of it that compresses
    anyway is the 502 naming the encoding at both (the HTTP edge showed Python's ``b'gzip'``;
    the picker said "not JSON" or "ended its answer before it started")."""
    if stream:
        body = gzip.compress(CHAT_EVENT + b"data: [DONE]\n\n")
        head = b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        replica.answer = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\n" + head + b"\r\n" + \
            chunked(body)
    else:
        body = gzip.compress(CHAT_ANSWER)
        replica.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                          b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(body)
                          + body)
    with pytest.raises(openai.InternalServerError) as err:
        if stream:
            _stream(_client(bad[1][edge]), "chat")
        else:
            _client(bad[1][edge]).chat.completions.create(model=MODEL, messages=MESSAGES)
    assert err.value.status_code == 502
    assert err.value.body == {
        "message": "The replica's answer was not readable (an answer in gzip encoding).",
        "type": "BadGatewayError", "param": None, "code": 502}


@pytest.mark.parametrize("edge", EDGES)
def test_a_stream_opening_with_a_bom_loses_no_event(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """A stream opening with a UTF-8 byte order mark: SSE decoders leave it out, the official
    SDK does not -- calling the replica directly it loses the first event, silently (its
    line reads as a field named ``\\ufeffdata``). Through kvgate it gets every event."""
    second = CHAT_EVENT.replace(b'"hi"', b'"there"')
    replica.answer = sse_head() + chunked(BOM + CHAT_EVENT, second, b"data: [DONE]\n\n")

    def contents(base: str) -> list[str | None]:
        chunks = _client(base).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                       stream=True)
        return [c.choices[0].delta.content for c in chunks]

    assert contents(replica.url) == ["there"]  # the SDK's own loss
    assert contents(bad[1][edge]) == ["hi", "there"]


@pytest.mark.parametrize("edge", EDGES)
def test_sse_fields_the_sdk_misreads_are_not_relayed(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """Legal SSE the official SDK cannot read: it dispatches an event for fields without
    data (``event: ping``, ``retry: 3000``) and, once it read an ``id:``, for every comment
    block (a keep-alive) -- each with data "", which it fails to parse (a JSONDecodeError,
    calling the replica directly too). Through kvgate those fields are comment lines and the
    ids left out: the client reads every event."""
    second = CHAT_EVENT.replace(b'"hi"', b'"there"')
    replica.answer = sse_head() + chunked(
        b"id: 1\n" + CHAT_EVENT, b": keep-alive\n\n", b"event: ping\n\nretry: 3000\n\n",
        b"id: 2\n" + second, b"data: [DONE]\n\n")

    def contents(base: str) -> list[str | None]:
        chunks = _client(base).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                       stream=True)
        return [c.choices[0].delta.content for c in chunks]

    with pytest.raises(ValueError, match="Expecting value"):  # (a JSONDecodeError)
        contents(replica.url)
    assert contents(bad[1][edge]) == ["hi", "there"]
    if edge == "http":
        wait_for(lambda: inflight(bad[1]["http"]) == 0, what="in-flight back to 0")


@pytest.mark.parametrize("edge", EDGES)
def test_fields_without_data_among_comment_lines_are_not_relayed(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """An event of fields without data with comment lines among them (a proxy's note, then
    ``event: ping``): SSE leaves the comments out and dispatches nothing, the SDK dispatched
    an event of data "" and failed to parse it, directly and through kvgate (only an event
    opening with its field was made comment lines)."""
    second = CHAT_EVENT.replace(b'"hi"', b'"there"')
    replica.answer = sse_head() + chunked(
        CHAT_EVENT, b": a proxy's note\nevent: ping\n\n", second,
        b"retry: 3000\n: note\n\n", b"data: [DONE]\n\n")

    def contents(base: str) -> list[str | None]:
        chunks = _client(base).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                       stream=True)
        return [c.choices[0].delta.content for c in chunks]

    with pytest.raises(ValueError, match="Expecting value"):  # (a JSONDecodeError)
        contents(replica.url)
    assert contents(bad[1][edge]) == ["hi", "there"]


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stored_answers_end_to_end_headers_reach_the_client(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, stream: bool,
) -> None:
    """A stored response's answer (``GET /v1/responses/{id}``) carries the replica's
    end-to-end headers as a proxied one does: Envoy passed them, the HTTP edge dropped them."""
    store_through(replica, {edge: bad[1][edge]}, MODEL, WHOLE)
    if stream:
        replica.get_answer = _head(b"text/event-stream", b"transfer-encoding: chunked") + \
            chunked(CREATED, DELTA, COMPLETED)
    else:
        replica.get_answer = _head(b"application/json", b"content-length: %d" % len(WHOLE)) + \
            WHOLE
    try:
        resp = httpx.get(f"{bad[1][edge]}/v1/responses/{RID}", timeout=30,
                         params={"stream": "true"} if stream else None)
    finally:
        replica.get_answer = None
    assert resp.status_code == 200, resp.text
    got = dict(resp.headers.multi_items())
    assert {k: got.get(k) for k in PASSED} == PASSED
    assert [k for k in NOT_PASSED if k in got] == []

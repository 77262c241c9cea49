"""The two edges answer the same request alike: the HTTP proxy (`kvgate serve`) and the Envoy
endpoint picker (a real Envoy in front of `kvgate epp`), over one simulated replica, for the
requests where they used to differ -- a JSON body sent under another content type, a
`previous_response_id` that is not a string, a stored response's cancel with a body over
`server.max_body_bytes` (and its order against the key check), a stored response's event
stream that breaks (`tests/support/bad_replica.py` as its replica) and its HEAD, answers past
`upstream.max_answer_bytes` (proxied and stored), a stream that fails before its first event
or in its first read (vLLM's error event of code >= 500, a good event then one that is not
JSON), a replica that refuses kvgate's credentials or serves another model, the
`x-request-id` of a stored response's answers, and the upstream timeouts (a stream that sends
only keep-alive comments or a Responses API stream's opening events has not answered; a whole
answer's body is bounded by the idle timeout once its head came, between its chunks: a slow
but moving body is answered whole).

What reaches the replica is read from its own request log (`/sim/requests`), matched by the
X-Request-Id the test sends.
"""

from __future__ import annotations

import gzip
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.config import UpstreamConfig
from gateway.errors import AnswerTooLarge, KvgateError, ReplicaRefused, ReplicaWrongModel
from gateway.stored import NO_EVENTS, NOT_IN_TIME
from gateway.stream_end import CUT_SHORT, HTML_PAGE, MALFORMED, NOT_STARTED, stream_error
from gateway.upstream_errors import ANSWERED_AN_ERROR
from gateway.whole import CUT_ANSWER
from tests.integration.test_stored_stream import COMPLETED, CREATED, DELTA, RID, WHOLE
from tests.support.bad_replica import BadReplica, End, chunked, sse_head, whole
from tests.support.epp import both_edges, envoy_proc, epp_proc, store_through
from tests.support.gateway import (
    AUTH_SECRET,
    gateway_proc,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
LIMIT = 4096  # server.max_body_bytes of both edges
ANSWER_LIMIT = 64 * 1024  # upstream.max_answer_bytes of both edges over the bad replica


@dataclass
class Edges:
    http: str
    envoy: str
    sim: str

    def seen(self, request_id: str) -> dict[str, Any] | None:
        """The replica's record of the request with this id (a client's, with kvgate's
        appended: `gateway.request.replica_id`), if it got there."""
        for item in httpx.get(f"{self.sim}/sim/requests", timeout=5).json()["requests"]:
            sent = item["headers"].get("x-request-id", "")
            if sent == request_id or sent.startswith(f"{request_id}-"):
                return dict(item)
        return None


@pytest.fixture(scope="module")
def edges() -> Iterator[Edges]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "20", "--enable-store", model=MODEL)
        procs.append(sim.start())
        # the replica/route headers off (`test_stored_answers_follow_the_header_settings`)
        gw, http = gateway_proc(upstreams=[url],
                                env={"KVGATE_SERVER__MAX_BODY_BYTES": str(LIMIT),
                                     "KVGATE_SERVER__REPLICA_HEADER": "false",
                                     "KVGATE_SERVER__ROUTE_HEADER": "false"})
        procs.append(gw.start())
        epp = epp_proc(config={"pools": {"default": {"served_model": MODEL, "replicas": [url]}},
                               "server": {"max_body_bytes": LIMIT, "replica_header": False,
                                          "route_header": False}})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        yield Edges(http, base, url)
    finally:
        for proc in reversed(procs):
            proc.stop()


EDGES = ["http", "envoy"]


def _base(edges: Edges, edge: str) -> str:
    return edges.http if edge == "http" else edges.envoy


@pytest.mark.parametrize("edge", EDGES)
def test_a_json_body_under_another_content_type_reaches_the_replica_as_json(
    edges: Edges, edge: str,
) -> None:
    """kvgate parses the body as JSON whatever its declared type (curl's `-d` sends a form
    type) and sends it on as `application/json`, which is all vLLM takes (it refuses another
    type); the picker used to pass the client's type on, so vLLM refused it there only."""
    rid = f"ct-{uuid.uuid4().hex}"
    body = b'{"model": "sim-model", "prompt": "hi", "max_tokens": 2}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        resp = httpx.post(f"{_base(edges, edge)}/v1/completions", content=body, timeout=10,
                          headers={"content-type": content_type, "x-request-id": rid})
        assert resp.status_code == 200, resp.text
        seen = edges.seen(rid)
        assert seen is not None and seen["headers"]["content-type"] == "application/json"


@pytest.mark.parametrize("edge", EDGES)
def test_a_compressed_body_is_a_415_at_both_edges(edges: Edges, edge: str) -> None:
    """kvgate reads bodies as sent: a gzip body is refused saying so, at both edges (the
    picker passed it on, to be judged "not JSON" by the replica)."""
    rid = f"gz-{uuid.uuid4().hex}"
    body = gzip.compress(b'{"model": "sim-model", "prompt": "hi", "max_tokens": 2}')
    resp = httpx.post(f"{_base(edges, edge)}/v1/completions", content=body, timeout=10,
                      headers={"content-type": "application/json", "content-encoding": "gzip",
                               "x-request-id": rid})
    assert resp.status_code == 415, resp.text
    assert resp.headers["accept-encoding"] == "identity"
    assert "send the body uncompressed" in resp.json()["error"]["message"]
    assert edges.seen(rid) is None


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("prev", [123, ["resp_a"], {"id": "resp_a"}, True])
def test_a_previous_response_id_that_is_not_a_string_is_a_400(
    edges: Edges, edge: str, prev: object,
) -> None:
    """vLLM answers 400 for it; it used to reach the replica, to be routed as an unknown id."""
    rid = f"prev-{uuid.uuid4().hex}"
    resp = httpx.post(f"{_base(edges, edge)}/v1/responses", timeout=10,
                      headers={"x-request-id": rid},
                      json={"model": MODEL, "input": "hi", "previous_response_id": prev})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"]) == ("BadRequestError", "previous_response_id")
    assert edges.seen(rid) is None


@pytest.mark.parametrize("edge", EDGES)
def test_a_cancel_body_over_the_limit_is_a_413(edges: Edges, edge: str) -> None:
    """`POST /v1/responses/{id}/cancel` takes no body; one over `server.max_body_bytes` is
    refused as any other body is, declared or streamed (the picker used to pass it on
    unbounded). A small one does not stand in the way."""
    base = _base(edges, edge)
    created = httpx.post(f"{base}/v1/responses", timeout=10,
                         json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert created.status_code == 200, created.text
    url = f"{base}/v1/responses/{created.json()['id']}/cancel"
    declared = httpx.post(url, content=b"x" * (LIMIT + 1), timeout=10)
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"]["type"] == "RequestEntityTooLargeError"

    def chunks() -> Iterator[bytes]:
        for _ in range(4):
            yield b"y" * (LIMIT // 2)

    streamed = httpx.post(url, content=chunks(), timeout=10)
    assert streamed.status_code == 413, streamed.text
    small = httpx.post(url, content=b"{}", timeout=10)
    # the replica's own answer: the response has finished, there is nothing to cancel
    assert small.status_code == 400, small.text


@pytest.mark.parametrize("edge", EDGES)
def test_a_body_over_the_limit_without_a_valid_key_is_a_401(edges: Edges, edge: str) -> None:
    """The key is checked before the body's size, on a stored response's cancel as on the
    proxied routes (it used to be a 413 there: the size was judged first)."""
    procs: list[Proc] = []
    try:  # the same two edges with API keys on (no tenant: no key is valid)
        env = {"KVGATE_SALT_SECRET": AUTH_SECRET}
        gw, http = gateway_proc(upstreams=[edges.sim], auth=True,
                                env={**env, "KVGATE_SERVER__MAX_BODY_BYTES": str(LIMIT)})
        if edge == "http":
            procs.append(gw.start())
            base = http
        else:
            epp = epp_proc(auth=True, env=env, config={
                "pools": {"default": {"served_model": MODEL, "replicas": [edges.sim]}},
                "server": {"max_body_bytes": LIMIT}})
            procs.append(epp.start())
            envoy, base = envoy_proc(epp.picker)
            procs.append(envoy.start())
        for path in ("/v1/chat/completions", "/v1/responses/resp_abc/cancel"):
            for key in ({}, {"authorization": "Bearer sk-not-a-key"}):
                resp = httpx.post(f"{base}{path}", content=b"x" * (LIMIT + 1), headers=key,
                                  timeout=10)
                assert resp.status_code == 401, (path, resp.text)
                assert resp.json()["error"]["type"] == "AuthenticationError"
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.mark.parametrize("edge", EDGES)
def test_stored_answers_follow_the_header_settings(edges: Edges, edge: str) -> None:
    """With `server.replica_header` and `server.route_header` off, a stored response's GET,
    HEAD and cancel carry neither header, as the proxied answers do (the HTTP edge used to
    send both there whatever the settings; the picker followed them)."""
    base = _base(edges, edge)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    created = client.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=2)
    rid = created.parse().id
    sdk = (created.http_response, client.responses.with_raw_response.retrieve(rid).http_response)
    plain = (httpx.head(f"{base}/v1/responses/{rid}", timeout=10),
             httpx.post(f"{base}/v1/responses/{rid}/cancel", timeout=10))
    answers = [(r.status_code, set(r.headers)) for r in sdk]
    answers += [(r.status_code, set(r.headers)) for r in plain]
    assert [status for status, _ in answers] == [200, 200, 200, 400]  # (cancel: finished)
    for _, names in answers:
        assert not names & {"x-kvgate-replica", "x-kvgate-route"}, names


# -- a stored response's event stream (`GET /v1/responses/{id}?stream=true`) ----------------
BAD_MODEL = "bad-model"


@pytest.fixture(scope="module")
def bad() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    """Both edges over one scriptable replica, each knowing where RID is stored."""
    with BadReplica(BAD_MODEL) as replica, both_edges(
            replica.url, BAD_MODEL, {"max_answer_bytes": ANSWER_LIMIT}) as every:
        replica.answer = whole(WHOLE)
        for edge in EDGES:
            assert httpx.post(f"{every[edge]}/v1/responses", timeout=10,
                              json={"model": BAD_MODEL, "input": "x"}).status_code == 200
        yield replica, every


@pytest.fixture
def replica(bad: tuple[BadReplica, dict[str, str]]) -> Iterator[BadReplica]:
    replica = bad[0]
    replica.gate, replica.end = threading.Event(), "keep"
    answer = replica.answer
    yield replica
    replica.rest, replica.get_answer, replica.answer = b"", None, answer
    replica.gate.set()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize(
    ("head", "rest", "end", "message"),
    [
        (sse_head(chunked_body=False) + CREATED, DELTA, "close", CUT_SHORT),
        (sse_head() + chunked(CREATED, last=False), chunked(DELTA, last=False), "reset",
         "The upstream replica failed mid-stream."),
        (sse_head() + chunked(CREATED, last=False),
         chunked(DELTA + b"data: Internal Server Error\n\n", COMPLETED), "keep", MALFORMED),
    ],
    ids=["ended-early", "reset", "malformed"],
)
def test_a_broken_stored_stream_fails_for_the_client(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, head: bytes,
    rest: bytes, end: End, message: str,
) -> None:
    """A stream that breaks after its first event is not taken for a whole one: it ends with
    the HTTP edge's error event (the SDK raises it), where the picker used to pass a clean
    early end and a malformed event through. A reset is the exception (gateway/epp/README.md):
    Envoy resets the client's stream too, with no message to the picker first, so the client
    sees a broken connection instead of the error event -- failed either way."""
    replica.get_answer, replica.rest, replica.end = head, rest, end
    events = iter(_client(bad[1][edge]).responses.retrieve(RID, stream=True))
    assert next(events).type == "response.created"  # the stream has started
    replica.gate.set()
    if end == "reset" and edge == "envoy":
        with pytest.raises(openai.APIConnectionError):
            list(events)
        return
    with pytest.raises(openai.APIError) as err:
        list(events)
    assert err.value.body == {"message": message, "type": "BadGatewayError", "param": None,
                              "code": 502}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("how", ["empty", "malformed", "reset"])
def test_a_stored_stream_without_a_first_event_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, how: str,
) -> None:
    """The stream's head goes out with its first event: a stream that ends cleanly without one
    (or whose first event is not JSON) is a 502 JSON saying so, not an empty 200 stream. A
    reset (vLLM's answer for a response whose events it did not keep) is that 502 on the HTTP
    edge; through Envoy, which tells the picker nothing, it is Envoy's own 502, which the
    bootstrap's local reply mapper words as the HTTP edge's for a cut answer (it was plain
    text), where the client used to get a 200 and a broken stream."""
    if how == "reset":
        replica.get_answer, replica.end = sse_head(), "reset"
    else:
        replica.get_answer = sse_head() + (
            chunked(b"data: <html>Bad Gateway</html>\n\n") if how == "malformed" else chunked())
    client = _client(bad[1][edge])
    with pytest.raises(openai.InternalServerError) as err:
        client.responses.retrieve(RID, stream=True)
    assert err.value.status_code == 502
    if how == "reset" and edge == "envoy":  # Envoy's own reply, not shown to the picker
        assert err.value.body == {"message": CUT_ANSWER, "type": "BadGatewayError",
                                  "param": None, "code": 502}
        return
    assert err.value.body == {"message": MALFORMED if how == "malformed" else NO_EVENTS,
                              "type": "BadGatewayError", "param": None, "code": 502}


@pytest.mark.parametrize("edge", EDGES)
def test_head_of_a_stored_stream_is_the_streams_head(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """`HEAD ...?stream=true` is the stream's head (the picker used to answer a whole GET's):
    the replica is asked for the stream, the head goes out at its first event, no body."""
    replica.get_answer = sse_head() + chunked(CREATED, last=False)
    replica.rest = chunked(DELTA)  # never asked for: the head went out at the first event
    resp = httpx.head(f"{bad[1][edge]}/v1/responses/{RID}?stream=true", timeout=10)
    assert (resp.status_code, resp.content) == (200, b"")
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.headers["x-kvgate-route"] == "response-affinity"
    assert b"stream=true" in replica.gets[-1]
    replica.get_answer, replica.rest, replica.end = sse_head(), b"", "reset"  # not kept
    resp = httpx.head(f"{bad[1][edge]}/v1/responses/{RID}?stream=true", timeout=10)
    assert (resp.status_code, resp.content) == (502, b"")


# -- an answer over `upstream.max_answer_bytes` ----------------------------------------------
TOO_LARGE = {"message": AnswerTooLarge(ANSWER_LIMIT).message, "type": "BadGatewayError",
             "param": None, "code": 502}


def _padded(start: bytes) -> list[bytes]:
    """The parts of a JSON object opened by `start`, larger than the bound."""
    pad = b"a" * (ANSWER_LIMIT // 4)
    return [start + b', "pad": "', pad, pad, pad, pad, b'", "choices": []}']


def _huge_event(kind: bytes) -> bytes:
    """One event of type `kind` growing past the bound, sent in chunks, never ended."""
    start = b"event: " + kind + b'\ndata: {"type": "' + kind + b'", "pad": "'
    return chunked(start, *[b"a" * 16384] * (ANSWER_LIMIT // 8192), last=False)


def _error(exc: KvgateError) -> dict[str, Any]:
    """The OpenAI error object a client reads for `exc`."""
    return {"message": exc.message, "type": exc.type_, "param": None, "code": exc.status}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_whole_answer_over_the_bound_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, declared: bool,
) -> None:
    """A whole answer larger than `upstream.max_answer_bytes` is a 502 the SDK does not retry
    (`x-should-retry: false`), declared so or not; the picker used to pass it on unbounded
    (keeping a copy of it all)."""
    replica.answer = whole(*_padded(b'{"id": "chatcmpl-1", "object": "chat.completion"'),
                           declared=declared)
    with pytest.raises(openai.InternalServerError) as err:
        _client(bad[1][edge]).chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 502
    assert err.value.response.headers["x-should-retry"] == "false"
    assert err.value.body == TOO_LARGE


@pytest.mark.parametrize("edge", EDGES)
def test_a_stream_event_over_the_bound_ends_the_stream(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """One stream event growing past `upstream.max_answer_bytes` is not relayed: the started
    stream ends with the error event saying so (the picker's scanner used to take the
    default bound, 256 MiB, whatever the setting)."""
    first = b'data: {"id": "c", "object": "chat.completion.chunk", "choices": []}\n\n'
    replica.answer = sse_head() + chunked(first, last=False)
    huge = b'data: {"id": "c", "object": "chat.completion.chunk", "pad": "'
    replica.rest = chunked(huge, *[b"a" * 16384] * (ANSWER_LIMIT // 8192), last=False)
    events = iter(_client(bad[1][edge]).chat.completions.create(
        model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=True))
    assert next(events).id == "c"  # the stream has started
    replica.gate.set()
    with pytest.raises(openai.APIError) as err:
        list(events)
    assert err.value.body == TOO_LARGE


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_stored_answer_over_the_bound_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, declared: bool,
) -> None:
    """A stored response's GET, its HEAD and its cancel read the replica's answer as a proxied
    whole answer is read: past `upstream.max_answer_bytes` it is the 502 the SDK does not
    retry (both edges used to relay it whole, whatever its size)."""
    replica.get_answer = replica.answer = whole(*_padded(b'{"id": "resp_stored1"'),
                                                declared=declared)  # (the cancel is a POST)
    base = bad[1][edge]
    with pytest.raises(openai.InternalServerError) as err:
        _client(base).responses.retrieve(RID)
    assert err.value.status_code == 502
    assert err.value.response.headers["x-should-retry"] == "false"
    assert err.value.body == TOO_LARGE
    head = httpx.head(f"{base}/v1/responses/{RID}", timeout=10)
    assert (head.status_code, head.headers["x-should-retry"]) == (502, "false")
    cancel = httpx.post(f"{base}/v1/responses/{RID}/cancel", timeout=10)
    assert (cancel.status_code, cancel.json()["error"]) == (502, TOO_LARGE)


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("first", [True, False], ids=["first-event", "later-event"])
def test_a_stored_stream_event_over_the_bound_is_not_relayed(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, first: bool,
) -> None:
    """A stored response's event stream takes the bound per event, as a proxied one: a first
    event past it is the 502 JSON, a later one ends the started stream with the error event
    (both edges used to relay it, held whole until it ended)."""
    huge = _huge_event(b"response.output_text.delta")
    client = _client(bad[1][edge])
    if first:
        replica.get_answer = sse_head() + huge
        with pytest.raises(openai.InternalServerError) as err:
            client.responses.retrieve(RID, stream=True)
        assert err.value.response.headers["x-should-retry"] == "false"
        assert err.value.body == TOO_LARGE
        return
    replica.get_answer, replica.rest = sse_head() + chunked(CREATED, last=False), huge
    events = iter(client.responses.retrieve(RID, stream=True))
    assert next(events).type == "response.created"  # the stream has started
    replica.gate.set()
    with pytest.raises(openai.APIError) as error:
        list(events)
    assert error.value.body == TOO_LARGE


# -- a whole answer that is not one, whatever its framing says ----------------------------
CHAT = orjson.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": BAD_MODEL,
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "hi"}}]})
CLOSE_DELIMITED = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
PAGE = b"<!DOCTYPE html>\n<html>\n<head><title>502</title></head>\n\n<body>x</body>\n</html>\n"


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize(("answer", "end", "stream", "message"), [
    (CLOSE_DELIMITED + CHAT[:CHAT.index(b"}]") + 1], "close", False, CUT_ANSWER),
    (whole(b'{"error": {"message": "no healthy upstream", "code": 503}}'), "keep", False,
     ANSWERED_AN_ERROR + "no healthy upstream"),
    (sse_head() + chunked(PAGE), "keep", True, HTML_PAGE),
], ids=["cut-by-a-close", "error-with-a-200", "html-page-as-a-stream"])
def test_an_answer_that_is_not_one_is_the_same_502_at_both_edges(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, answer: bytes,
    end: End, stream: bool, message: str,
) -> None:
    """A whole JSON answer a clean close cut at a nested object's ``}`` and a JSON error object
    answered with a 200 were 200s at both edges (the client could not decode the first, and
    got a completion of nothing for the second); an HTML page labelled as the stream was "the
    replica ended its answer before it started"."""
    replica.answer, replica.end = answer, end
    with pytest.raises(openai.InternalServerError) as err:
        created = _client(bad[1][edge]).chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream)
        if stream:
            list(created)
    assert err.value.status_code == 502
    assert err.value.body == {"message": message, "type": "BadGatewayError", "param": None,
                              "code": 502}


# -- a proxied stream that fails before its first event -----------------------------------
@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("how", ["oversized", "malformed", "empty"])
def test_a_stream_that_fails_before_its_first_event_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, how: str,
) -> None:
    """A stream's head goes out with its first event, at both edges: a first event past
    `upstream.max_answer_bytes` or not JSON, or a stream ending without one, is the HTTP
    edge's 502 JSON, not a 200 (the picker used to pass the replica's head at once, so its
    client got a 200 and then an error event)."""
    if how == "oversized":
        replica.answer = sse_head() + _huge_event(b"chat.completion.chunk")
    else:
        replica.answer = sse_head() + chunked(b"data: <html>Bad Gateway</html>\n\n"
                                              if how == "malformed" else b"")
    with pytest.raises(openai.InternalServerError) as err:
        _client(bad[1][edge]).chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert err.value.status_code == 502
    if how == "oversized":
        assert err.value.response.headers["x-should-retry"] == "false"
        assert err.value.body == TOO_LARGE
        return
    message = MALFORMED if how == "malformed" else NOT_STARTED
    assert err.value.body == {"message": message, "type": "BadGatewayError", "param": None,
                              "code": 502}


# -- a client that leaves mid-stream -------------------------------------------------------
@pytest.mark.parametrize("edge", EDGES)
def test_a_client_leaving_mid_stream_counts_as_499_and_frees_its_replica(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """A client that reads the first event and leaves: a 499 in `kvgate_requests_total` at
    both edges (the picker counted it 200: the stream had started) and nothing left in
    flight."""
    replica.answer = sse_head() + chunked(GOOD, last=False)
    replica.rest = chunked(GOOD + b"data: [DONE]\n\n")  # never asked for
    metrics = bad[1][f"{edge}-metrics"]

    def left() -> float:
        counts = metric_values(metrics, "kvgate_requests_total")
        return sum(v for k, v in counts.items() if 'status="499"' in k)

    before = left()
    with httpx.stream("POST", f"{bad[1][edge]}/v1/chat/completions", timeout=10, json={
            "model": BAD_MODEL, "messages": [{"role": "user", "content": "hi"}],
            "stream": True}) as resp:
        assert resp.status_code == 200
        assert next(resp.iter_raw()) == GOOD
    wait_for(lambda: left() == before + 1, what="the request counted as 499")
    wait_for(lambda: sum(metric_values(metrics, "kvgate_inflight_requests").values()) == 0,
             what="no request in flight")


# -- a replica that refuses kvgate's credentials, or serves another model -------------------
# vLLM's answers: its --api-key middleware's 401, its 404 for a model it does not serve
UNAUTHORIZED = whole(b'{"error": "Unauthorized"}', status=401)
NO_MODEL = whole(b'{"error": {"message": "The model `bad-model` does not exist.", "type": '
                 b'"NotFoundError", "param": "model", "code": 404}}', status=404)


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("answer", "error"),
    [(UNAUTHORIZED, ReplicaRefused(401)), (NO_MODEL, ReplicaWrongModel())],
    ids=["refused", "wrong-model"])
def test_a_replica_refusing_kvgate_or_serving_another_model_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, stream: bool,
    answer: bytes, error: KvgateError,
) -> None:
    """The replica's 401 (kvgate's own credentials refused) or vLLM's 404 for a model it does
    not serve is not the client's to see: the HTTP edge's 502 (`ReplicaRefused`, not retried
    by the SDK; `ReplicaWrongModel`) at both edges, and the replica is taken out of service
    until its health checks bring it back. The picker used to relay the 401 / 404 as sent."""
    replica.answer, ok = answer, replica.answer
    client = _client(bad[1][edge])
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream)
    assert err.value.status_code == 502
    assert err.value.body == _error(error)
    if isinstance(error, ReplicaRefused):
        assert err.value.response.headers["x-should-retry"] == "false"
    replica.answer = ok

    def back() -> bool:
        try:
            client.chat.completions.create(
                model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc  # down: no replica left to pick
            return False
        return True

    wait_for(back, what="the replica back in service")


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_answer_refused_by_the_replica_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """A replica refusing kvgate's credentials on a stored response's GET is the HTTP edge's
    502 `ReplicaRefused` through the picker too (it relayed the 401)."""
    replica.get_answer = UNAUTHORIZED
    with pytest.raises(openai.InternalServerError) as err:
        _client(bad[1][edge]).responses.retrieve(RID)
    assert err.value.body == _error(ReplicaRefused(401))
    assert err.value.response.headers["x-should-retry"] == "false"


# -- a proxied stream whose first read fails -------------------------------------------------
GOOD = b'data: {"id": "c", "object": "chat.completion.chunk", "choices": []}\n\n'
# vLLM's first event when its engine fails before answering
ENGINE_ERROR = (b'data: {"error": {"message": "The engine failed.", "type": '
                b'"InternalServerError", "param": null, "code": 500}}\n\n')
# the 502 both edges answer for it keeps the replica's message (both used to drop it)
ENGINE_FAILED = "The replica's answer was an error (500): The engine failed."


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize(
    ("first", "message"),
    [(ENGINE_ERROR + b"data: [DONE]\n\n", ENGINE_FAILED),
     (GOOD + b"data: <html>Bad Gateway</html>\n\n", MALFORMED),
     (GOOD + ENGINE_ERROR + b"data: [DONE]\n\n", ENGINE_FAILED)],
    ids=["error-event", "good-then-malformed", "good-then-error-event"])
def test_a_stream_failing_in_its_first_read_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, first: bytes,
    message: str,
) -> None:
    """Nothing reaches the client before the stream's head goes out with its first events: a
    first read holding vLLM's error event of code >= 500 (its engine failed), or an event that
    is not JSON (after good ones too: none was sent yet), is the HTTP edge's 502 JSON (after
    trying another replica), not a 200 and those events. The picker used to send a 200 and
    the error event, or the good event and then the error event. The 502 says what vLLM's
    error event said (both edges used to drop its message)."""
    replica.answer = sse_head() + chunked(first)
    with pytest.raises(openai.InternalServerError) as err:
        _client(bad[1][edge]).chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert err.value.status_code == 502
    assert err.value.body == {"message": message, "type": "BadGatewayError", "param": None,
                              "code": 502}
    assert err.value.response.headers["x-request-id"]


NOT_ANSWERS = {
    "204": b"HTTP/1.1 204 No Content\r\n\r\n",
    "202-page": (b"HTTP/1.1 202 Accepted\r\ncontent-type: text/html\r\ncontent-length: 5\r\n"
                 b"\r\nhello"),
    "302": (b"HTTP/1.1 302 Found\r\nlocation: http://10.0.0.9/login\r\ncontent-length: 0\r\n"
            b"\r\n"),
}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("answer", list(NOT_ANSWERS))
def test_a_success_or_redirect_that_is_not_an_answer_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, stream: bool,
    answer: str,
) -> None:
    """vLLM answers its routes 200 or an error: a 204, a 202 page or a redirect comes from
    something else at the replica's address (a proxy, an ingress redirecting to https). Both
    edges relayed it: the SDK raised a JSON decode error, returned a str for a completion, or
    an APIStatusError 302 with an internal address in `Location`. It is the 502 JSON now,
    naming the status."""
    replica.answer = NOT_ANSWERS[answer]
    with pytest.raises(openai.InternalServerError) as err:
        _client(bad[1][edge]).chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream)
    assert err.value.status_code == 502
    assert err.value.body == {"message": f"The replica answered {answer[:3]}, not an answer.",
                              "type": "BadGatewayError", "param": None, "code": 502}
    assert "location" not in err.value.response.headers


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_200_that_is_not_the_answer_asked_for_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, stream: bool,
) -> None:
    """A 200 page (an HTML error page at the replica's address), or a whole JSON answer to a
    stream: the SDK would get a str, or an empty stream that looks complete."""
    replica.answer = whole(b'{"id": "x"}') if stream else (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 5\r\n\r\nhello")
    with pytest.raises(openai.InternalServerError) as err:
        _client(bad[1][edge]).chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream)
    assert err.value.status_code == 502
    what = "the stream asked for (application/json)" if stream else "JSON (text/html)"
    assert err.value.body == {"message": f"The replica's answer is not {what}.",
                              "type": "BadGatewayError", "param": None, "code": 502}


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_stream_failing_in_its_first_read_is_a_502(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """The same rule for a stored response's stream: a good first event and one that is not
    JSON in the same read are the 502 JSON (the HTTP edge used to send the good one, then the
    error event: its head went out before the read was checked)."""
    replica.get_answer = sse_head() + chunked(CREATED + b"data: <html>Bad Gateway</html>\n\n")
    with pytest.raises(openai.InternalServerError) as err:
        _client(bad[1][edge]).responses.retrieve(RID, stream=True)
    assert err.value.status_code == 502
    assert err.value.body == {"message": MALFORMED, "type": "BadGatewayError", "param": None,
                              "code": 502}


# -- x-request-id on every answer ------------------------------------------------------------
@pytest.mark.parametrize("edge", EDGES)
def test_stored_answers_carry_the_request_id(edges: Edges, edge: str) -> None:
    """A stored response's GET, HEAD, cancel and refusal carry `x-request-id` (the client's
    when it sent a sane one), as proxied answers do (the picker left it out of them)."""
    base = _base(edges, edge)
    created = httpx.post(f"{base}/v1/responses", timeout=10,
                         json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert created.status_code == 200, created.text
    assert created.headers["x-request-id"]
    url = f"{base}/v1/responses/{created.json()['id']}"
    asks = [("GET", url, 200), ("HEAD", url, 200), ("POST", f"{url}/cancel", 400),
            ("GET", f"{base}/v1/responses/resp_unknown", 404), ("PUT", url, 405)]
    for method, target, status in asks:
        rid = f"stored-{uuid.uuid4().hex}"
        resp = httpx.request(method, target, headers={"x-request-id": rid}, timeout=10)
        assert resp.status_code == status, (method, target, resp.text)
        assert resp.headers.get("x-request-id") == rid, (method, target, resp.headers)
        resp = httpx.request(method, target, timeout=10)  # none sent: one is made
        assert resp.headers.get("x-request-id"), (method, target, resp.headers)


@pytest.mark.parametrize("edge", EDGES)
def test_a_request_id_is_echoed_else_made_in_one_format(edges: Edges, edge: str) -> None:
    """A client's sane x-request-id is echoed and sent to the replica with a kvgate id
    appended (two requests may share a client's id: `gateway.request.replica_id`); otherwise
    (none, or one over 128 bytes) kvgate makes one -- 32 hex digits at both edges (Envoy used
    to make its own, a UUID, which the picker took for the client's) -- and sends it as it
    is."""
    base = _base(edges, edge)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    sent = f"mine-{uuid.uuid4().hex}"
    for header, echoed in ((sent, True), (None, False), ("x" * 129, False)):
        headers = {"x-request-id": header} if header is not None else {}
        resp = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=10)
        assert resp.status_code == 200, resp.text
        rid = resp.headers["x-request-id"]
        seen = edges.seen(rid)
        assert seen is not None
        if echoed:
            assert rid == sent
            assert re.fullmatch(f"{sent}-[0-9a-f]{{32}}", seen["headers"]["x-request-id"])
            assert resp.json()["id"] == f"cmpl-{seen['headers']['x-request-id']}"
        else:
            assert len(rid) == 32 and int(rid, 16) >= 0, rid
            assert seen["headers"]["x-request-id"] == rid


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_request_sends_the_replica_the_answers_request_id(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """A stored response's GET reaches its replica with the x-request-id its answer carries,
    as a proxied request does (the HTTP edge sent none; the picker Envoy's or the client's
    as it came, even one it replaced in the answer)."""
    replica.get_answer = whole(WHOLE)
    for header in ("mine-1", None, "x" * 129):
        headers = {"x-request-id": header} if header is not None else {}
        resp = httpx.get(f"{bad[1][edge]}/v1/responses/{RID}", headers=headers, timeout=10)
        assert resp.status_code == 200, resp.text
        assert replica.get_ids[-1] == resp.headers["x-request-id"].encode()
        assert header != "mine-1" or replica.get_ids[-1] == b"mine-1"


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_stream_carries_the_request_id(
    bad: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """A stored response's event stream carries `x-request-id` too."""
    replica.get_answer = sse_head() + chunked(CREATED, COMPLETED)
    rid = f"stored-{uuid.uuid4().hex}"
    with httpx.stream("GET", f"{bad[1][edge]}/v1/responses/{RID}?stream=true", timeout=10,
                      headers={"x-request-id": rid}) as resp:
        assert resp.status_code == 200
        assert resp.headers.get("x-request-id") == rid, resp.headers
        assert b"response.completed" in resp.read()


# -- a replica that goes silent: the upstream timeouts (`upstream.*_timeout_s`) ---------------
QUICK = {"first_byte_timeout_s": 1.0, "idle_timeout_s": 1.0, "max_attempts": 1}


@pytest.fixture(scope="module")
def silent() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    """Both edges over one scriptable replica with 1 s first-byte and idle timeouts (and no
    retry at the HTTP edge: the picker cannot retry), Envoy's router bounds alike."""
    # Envoy's router: a replica's silence past 3 s (above the picker's idle timeout, which
    # must cut a stalled stream first, as kvgate's defaults are: 300 s, 120 s)
    with BadReplica(BAD_MODEL) as replica, both_edges(
            replica.url, BAD_MODEL, QUICK,
            upstream=UpstreamConfig(first_byte_timeout_s=3.0)) as every:
        try:
            bases = {edge: every[edge] for edge in EDGES}
            store_through(replica, bases, BAD_MODEL, WHOLE)  # RID stored, through each edge
            yield replica, bases
        finally:
            replica.gate.set()


@pytest.fixture
def quiet(silent: tuple[BadReplica, dict[str, str]]) -> Iterator[BadReplica]:
    replica = silent[0]
    replica.gate, replica.end = threading.Event(), "close"
    yield replica
    replica.gate.set()
    replica.rest, replica.answer, replica.get_answer, replica.end = b"", b"", None, "keep"
    replica.drip = []


def _chat(base: str, stream: bool) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=20, json={
        "model": BAD_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream})


FIRST_BYTE = {"error": {"message": "The replica did not answer in time (first byte timeout).",
                        "type": "GatewayTimeoutError", "param": None, "code": 504}}


@pytest.mark.parametrize("edge", EDGES)
def test_a_stream_without_a_first_event_in_time_is_a_504(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stream's head, then nothing: cut after `first_byte_timeout_s` with the HTTP edge's
    504 JSON at both edges (the picker used to hold the head until Envoy's stream idle
    timeout, 5 min, or its message timeout, 1000 s: a 503)."""
    quiet.answer, quiet.rest = sse_head(), chunked(b'data: {"x": 1}\n\n')  # rest: never sent
    start = time.monotonic()
    resp = _chat(silent[1][edge], stream=True)
    assert time.monotonic() - start < 10
    assert resp.status_code == 504, resp.text
    assert resp.json() == FIRST_BYTE


@pytest.mark.parametrize("edge", EDGES)
def test_a_stream_that_stalls_ends_with_the_idle_timeouts_error_event(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stream's first event, then nothing: after `idle_timeout_s` the client's stream ends
    with the HTTP edge's error event and [DONE] (the picker used to wait for Envoy's idle
    timeout)."""
    first = b'data: {"id": "c", "object": "chat.completion.chunk", "choices": []}\n\n'
    quiet.answer, quiet.rest = sse_head() + chunked(first, last=False), chunked(first)
    start = time.monotonic()
    resp = _chat(silent[1][edge], stream=True)
    assert time.monotonic() - start < 10
    assert resp.status_code == 200
    assert resp.content == first + stream_error(
        "The replica did not answer in time (idle timeout).", "GatewayTimeoutError", 504)


@pytest.mark.parametrize("edge", EDGES)
def test_a_replica_that_sends_no_head_is_cut_after_the_first_byte_timeout(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """Nothing at all, not even the head: the picker is never called (Envoy's response path
    starts with the head); Envoy's router cuts it after the first-byte timeout it was
    configured with (`envoy_config`'s `per_try_idle_timeout`), a 504 in OpenAI's shape at
    both edges (the shipped config's route had no timeout, the stream idle one was 5 min)."""
    quiet.answer, quiet.rest = b"", sse_head()  # rest: never sent
    start = time.monotonic()
    resp = _chat(silent[1][edge], stream=True)
    assert time.monotonic() - start < 10
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == 504


# -- ... and a stored response's answers: the same timeouts at both edges -------------------
@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_answer_without_its_body_in_time_is_a_504(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stored response's GET whose head comes but not its body: the HTTP edge's 504 after
    `first_byte_timeout_s` at both edges (the picker held it until Envoy's per-try idle
    timeout)."""
    head, _, body = whole(WHOLE).partition(b"\r\n\r\n")
    quiet.get_answer, quiet.rest = head + b"\r\n\r\n", body  # rest: never sent
    start = time.monotonic()
    resp = httpx.get(f"{silent[1][edge]}/v1/responses/{RID}", timeout=20,
                     headers={"x-request-id": "late-whole"})
    assert time.monotonic() - start < 2.5
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"] == {"message": NOT_IN_TIME, "type": "GatewayTimeoutError",
                                    "param": None, "code": 504}
    assert resp.headers["x-request-id"] == "late-whole"


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_stream_without_a_first_event_in_time_is_a_504(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stored response's stream: its head, then nothing -- the HTTP edge's 504 JSON after
    `first_byte_timeout_s` at both edges (the picker held the head for Envoy to cut)."""
    quiet.get_answer, quiet.rest = sse_head(), chunked(CREATED)  # rest: never sent
    start = time.monotonic()
    resp = httpx.get(f"{silent[1][edge]}/v1/responses/{RID}?stream=true", timeout=20)
    assert time.monotonic() - start < 2.5
    assert resp.status_code == 504, resp.text
    assert resp.json() == FIRST_BYTE


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_stream_that_stalls_ends_with_the_idle_timeouts_error_event(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stored response's stream: its first event, then nothing -- the idle timeout's error
    event and [DONE] at both edges."""
    quiet.get_answer, quiet.rest = sse_head() + chunked(CREATED, last=False), chunked(DELTA)
    start = time.monotonic()
    resp = httpx.get(f"{silent[1][edge]}/v1/responses/{RID}?stream=true", timeout=20)
    assert time.monotonic() - start < 2.5
    assert resp.status_code == 200
    assert resp.content == CREATED + stream_error(
        "The replica did not answer in time (idle timeout).", "GatewayTimeoutError", 504)


# -- a Responses API stream's opening events are no first token ------------------------------
def _respond(base: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{base}/v1/responses", timeout=20, json={
        "model": BAD_MODEL, "input": "hi", "stream": True, **extra})


@pytest.mark.parametrize("edge", EDGES)
def test_a_responses_stream_silent_after_its_opening_events_is_a_504(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """vLLM sends `response.created` before the prefill: a replica that hangs after it has not
    answered. Both edges hold it (it goes out with the first output) and answer the
    first-byte timeout's 504 JSON (the picker took it for the first token: a 200, that event,
    and the idle timeout's error event)."""
    quiet.answer, quiet.rest = sse_head() + chunked(CREATED, last=False), chunked(DELTA)
    start = time.monotonic()
    resp = _respond(silent[1][edge])
    assert time.monotonic() - start < 2.5
    assert resp.status_code == 504, resp.text
    assert resp.json() == FIRST_BYTE


@pytest.mark.parametrize("edge", EDGES)
def test_a_background_responses_stream_silent_after_its_opening_events_is_cut_at_first_byte(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A background response's opening events go out as they come (the replica runs it on
    anyway), but they are no answer: the first-byte timeout's error event ends the stream
    (the picker waited for the idle timeout's)."""
    quiet.answer, quiet.rest = sse_head() + chunked(CREATED, last=False), chunked(DELTA)
    resp = _respond(silent[1][edge], background=True)
    assert resp.status_code == 200
    assert resp.content == CREATED + stream_error(
        str(FIRST_BYTE["error"]["message"]), "GatewayTimeoutError", 504)


# -- a whole answer's body: the idle timeout once its head came --------------------------------
IDLE = {"message": "The replica did not answer in time (idle timeout).",
        "type": "GatewayTimeoutError", "param": None, "code": 504}


@pytest.mark.parametrize("edge", EDGES)
def test_a_whole_answer_whose_body_stalls_is_cut_by_the_idle_timeout(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A proxied whole answer's head, then not its body: the idle timeout's 504 at both edges
    (the picker bounded it by the total timeout only: Envoy's router cut it later)."""
    head, _, body = whole(b'{"id": "chatcmpl-1", "object": "chat.completion"}').partition(
        b"\r\n\r\n")
    quiet.answer, quiet.rest = head + b"\r\n\r\n", body  # rest: never sent
    start = time.monotonic()
    resp = _chat(silent[1][edge], stream=False)
    assert time.monotonic() - start < 2.5
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"] == IDLE


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_stream_answered_whole_whose_body_stalls_is_cut_by_the_idle_timeout(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stored response's `?stream=true` answered with a non-200 head, then not its body: the
    idle timeout's 504 at both edges (the picker bounded it by the first-byte timeout, as a
    stored response's whole GET, with that one's message)."""
    error = b'{"error": {"message": "x", "type": "BadRequestError", "param": null, "code": 400}}'
    head, _, body = whole(error, status=400).partition(b"\r\n\r\n")
    quiet.get_answer, quiet.rest = head + b"\r\n\r\n", body  # rest: never sent
    start = time.monotonic()
    resp = httpx.get(f"{silent[1][edge]}/v1/responses/{RID}?stream=true", timeout=20)
    assert time.monotonic() - start < 2.5
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"] == IDLE


def _dripped(answer: bytes) -> tuple[bytes, list[bytes]]:
    """`answer`'s head and the first of five parts of its body; the other four parts."""
    head, _, body = answer.partition(b"\r\n\r\n")
    n = -(-len(body) // 5)
    parts = [body[i:i + n] for i in range(0, len(body), n)]
    return head + b"\r\n\r\n" + parts[0], parts[1:]


DRIP_S = 0.4  # between the parts of a body: under the 1 s idle timeout, 1.6 s in all


@pytest.mark.parametrize("edge", EDGES)
def test_a_whole_answer_whose_body_arrives_slowly_is_answered_whole(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A proxied whole answer's body in parts, each gap under `idle_timeout_s`, all of them
    over it: the idle timeout bounds the gaps, so the answer arrives whole (the HTTP edge
    timed the body from its head, and cut it with a 504)."""
    answer = b'{"id": "chatcmpl-1", "object": "chat.completion", "choices": []}'
    quiet.answer, quiet.drip = _dripped(whole(answer))
    quiet.drip_s = DRIP_S
    resp = _chat(silent[1][edge], stream=False)
    assert resp.status_code == 200, resp.text
    assert resp.content == answer


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_stream_answered_whole_whose_body_arrives_slowly_is_relayed_whole(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stored response's `?stream=true` answered with a non-200 whose body comes in parts,
    each gap under `idle_timeout_s`, all of them over it: relayed whole, not cut."""
    error = b'{"error": {"message": "x", "type": "BadRequestError", "param": null, "code": 400}}'
    quiet.get_answer, quiet.drip = _dripped(whole(error, status=400))
    quiet.drip_s = DRIP_S
    resp = httpx.get(f"{silent[1][edge]}/v1/responses/{RID}?stream=true", timeout=20)
    assert resp.status_code == 400, resp.text
    assert resp.content == error


@pytest.mark.parametrize("edge", EDGES)
def test_a_stream_of_keep_alive_comments_only_is_cut_at_first_byte(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """`: keep-alive` comments open the client's stream but are no answer: the first-byte
    timeout's error event ends it at both edges (the picker took them for its start: the
    idle timeout's event, and comments every few seconds were never cut)."""
    quiet.answer = sse_head() + chunked(b": keep-alive\n\n", last=False)
    quiet.rest = chunked(GOOD)  # never sent
    resp = _chat(silent[1][edge], stream=True)
    assert resp.status_code == 200
    assert resp.content == b": keep-alive\n\n" + stream_error(
        str(FIRST_BYTE["error"]["message"]), "GatewayTimeoutError", 504)


_SAYS = {503: b'"maintenance", "type": "ServiceUnavailableError"',
         429: b'"slow down", "type": "RateLimitError"'}


@pytest.mark.parametrize(("status", "sent", "relayed"), [
    (503, "30", ["30"]), (503, "86400", ["3600"]), (503, None, ["1"]), (503, "0030", ["30"]),
    (503, "9" * 5000, ["3600"]), (503, "-5", ["1"]), (503, "2.5", ["1"]), (503, "\xb2", ["1"]),
    (503, "Wed, 21 Oct 2015 07:28:00 GMT", ["1"]),
    (429, "30", ["30"]), (429, None, ["1", "2"]),
    (429, "Wed, 21 Oct 2015 07:28:00 GMT", ["1", "2"]),
], ids=["503-seconds", "503-capped", "503-none", "503-zeros", "503-5000-digits", "503-negative",
        "503-fraction", "503-latin1-superscript", "503-http-date",
        "429-seconds", "429-none", "429-http-date"])
@pytest.mark.parametrize("edge", EDGES)
def test_a_replicas_busy_answer_carries_a_retry_after_at_both_edges(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str, status: int,
    sent: str | None, relayed: list[str],
) -> None:
    """A relayed 503's Retry-After is the replica's own when it says seconds (capped at an
    hour), else 1 (the picker had replaced the replica's with 1). A 429 from a replica that
    says no number of seconds: the client is told when the replica's busy back-off ends (at
    least 1 s; it doubles while the replica keeps answering 429, 2 s at most by default); it
    had no Retry-After. One rule at both edges (`verdicts.relayed_retry_after`, `busy_wait`)."""
    body = (b'{"error": {"message": ' + _SAYS[status] + b', "param": null, "code": %d}}'
            % status)
    head = b"retry-after: %s\r\n" % sent.encode("latin-1") if sent is not None else b""
    phrase = b"Service Unavailable" if status == 503 else b"Too Many Requests"
    quiet.answer = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (status, phrase)
                    + head + b"content-length: %d\r\n\r\n" % len(body) + body)
    quiet.end = "keep"
    resp = _chat(silent[1][edge], stream=False)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["message"] == ("maintenance" if status == 503 else "slow down")
    assert len(got := resp.headers.get_list("retry-after")) == 1 and got[0] in relayed, got


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("edge", EDGES)
def test_an_http_1_0_client_is_served_at_both_edges(
    edges: Edges, edge: str, stream: bool,
) -> None:
    """An HTTP/1.0 client gets its answer, without chunked framing (RFC 9112 6.1), at both
    edges: Envoy closed such a connection without a byte unless told to take HTTP/1.0
    (`accept_http_10`)."""
    host, port = _base(edges, edge).removeprefix("http://").split(":")
    body = (b'{"model": "%s", "max_tokens": 3, "stream": %s, '
            b'"messages": [{"role": "user", "content": "hi"}]}'
            % (MODEL.encode(), b"true" if stream else b"false"))
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, got = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].endswith(b" 200 ok"), raw[:200]
    assert not any(line.startswith(b"transfer-encoding") for line in lines), head
    if stream:
        assert got.startswith(b"data: {") and got.endswith(b"data: [DONE]\n\n"), got[-80:]
    else:
        assert b'"object":"chat.completion"' in got.replace(b" ", b""), got[:200]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32-le"])
@pytest.mark.parametrize("edge", EDGES)
def test_a_body_in_utf16_or_with_a_bom_is_read_as_vllm_reads_it(
    edges: Edges, edge: str, encoding: str,
) -> None:
    """Python's json (vLLM's parser) reads JSON bytes in UTF-8 with a BOM, UTF-16 or UTF-32;
    so does the gateway at both edges, and the replica gets it as JSON it reads."""
    text = orjson.dumps({"model": MODEL, "max_tokens": 3,
                         "messages": [{"role": "user", "content": "h\u00e9"}]}).decode()
    resp = httpx.post(f"{_base(edges, edge)}/v1/chat/completions", timeout=10,
                      headers={"content-type": "application/json"},
                      content=text.encode(encoding))
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "chat.completion"


@pytest.mark.parametrize("edge", EDGES)
def test_a_stream_opened_without_data_is_cut_at_the_first_byte_timeout(
    silent: tuple[BadReplica, dict[str, str]], quiet: BadReplica, edge: str,
) -> None:
    """A stream's head and a line the client dispatches no event for (``event: ping``, no
    data: a proxy in front of a replica sends such), then nothing: no first event yet, so the
    first-byte timeout still runs -- the same answer at both edges (the picker took the line
    for the first event and waited for the idle timeout)."""
    quiet.answer, quiet.rest = sse_head() + chunked(b"event: ping\n\n", last=False), chunked(
        b'data: {"x": 1}\n\n')  # rest: never sent
    start = time.monotonic()
    resp = _chat(silent[1][edge], stream=True)
    assert time.monotonic() - start < 10
    assert resp.status_code == 200, resp.text  # (the line went out: the stream had started)
    assert resp.content == b":event: ping\n\n" + stream_error(  # (a comment line: `sse`)
        "The replica did not answer in time (first byte timeout).", "GatewayTimeoutError", 504)

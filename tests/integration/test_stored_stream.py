"""``GET /v1/responses/{id}?stream=true``: vLLM's resumption of a background response's event
stream, relayed as it arrives (not buffered whole), with the same endings as a proxied
stream. The replica is a real loopback server (`tests/support/bad_replica.py`) that holds the
rest of its stream until the test has read the first event through the gateway, so "streamed"
is shown without any timing; the client is the official `openai` one."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from gateway.stored import NO_EVENTS, wants_stream
from tests.support.bad_replica import BadReplica, End, chunked, sse_head
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import sim_proc

MODEL = "bad-model"
RID = "resp_stored1"


def _event(kind: str, seq: int, **fields: object) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


SHELL = {"id": RID, "object": "response", "created_at": 1, "model": MODEL, "output": [],
         "status": "in_progress", "tool_choice": "auto", "tools": [], "parallel_tool_calls": True}
CREATED = _event("response.created", 0, response=SHELL)
DELTA = _event("response.output_text.delta", 1, item_id="msg_1", output_index=0,
               content_index=0, delta="hi", logprobs=[])
COMPLETED = _event("response.completed", 2, response={**SHELL, "status": "completed"})
WHOLE = orjson.dumps({**SHELL, "status": "queued", "background": True})


def _store_one(replica: BadReplica, base: str) -> None:
    """Create the stored response RID through the gateway (which then knows its replica)."""
    replica.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n" % len(WHOLE) + WHOLE)
    assert httpx.post(f"{base}/v1/responses", timeout=10,
                      json={"model": MODEL, "input": "x"}).status_code == 200


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    with BadReplica(MODEL) as replica:
        proc, base = gateway_proc(upstreams=[replica.url],
                                  env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with proc:
            replica.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n" % len(WHOLE) + WHOLE)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            created = client.responses.create(model=MODEL, input="x", background=True)
            assert created.id == RID  # the gateway now knows where it lives
            yield replica, base


@pytest.fixture
def replica(gw: tuple[BadReplica, str]) -> Iterator[BadReplica]:
    replica = gw[0]
    replica.gate, replica.end = threading.Event(), "keep"
    yield replica
    replica.rest, replica.get_answer = b"", None
    replica.gate.set()


def test_a_stored_response_streams_as_it_arrives(
    gw: tuple[BadReplica, str], replica: BadReplica,
) -> None:
    base = gw[1]
    replica.get_answer = sse_head() + chunked(CREATED, last=False)
    replica.rest = chunked(DELTA, COMPLETED)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.responses.retrieve(RID, stream=True, starting_after=-1)
    events = iter(stream)
    assert next(events).type == "response.created"  # before the replica sent the rest
    replica.gate.set()
    assert [e.type for e in events] == ["response.output_text.delta", "response.completed"]
    path, _, query = replica.gets[-1].partition(b"?")  # the query reaches vLLM as sent
    assert path == f"/v1/responses/{RID}".encode()
    assert sorted(query.split(b"&")) == [b"starting_after=-1", b"stream=true"]


def test_a_stream_vllm_does_not_keep_is_a_502_saying_so(
    gw: tuple[BadReplica, str], replica: BadReplica,
) -> None:
    """vLLM keeps events only for a response created with background and stream true; for
    another it sends the stream's head, then breaks the connection."""
    replica.get_answer, replica.end = sse_head(), "reset"
    client = openai.OpenAI(base_url=f"{gw[1]}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.InternalServerError) as err:
        client.responses.retrieve(RID, stream=True)
    assert err.value.status_code == 502
    assert err.value.body == {"message": NO_EVENTS, "type": "BadGatewayError", "param": None,
                              "code": 502}


@pytest.mark.parametrize(
    ("head", "rest", "end", "message"),
    [
        (sse_head(chunked_body=False) + CREATED, DELTA, "close", "before it was complete"),
        (sse_head() + chunked(CREATED, last=False), chunked(DELTA, last=False), "reset",
         "failed mid-stream"),
        (sse_head() + chunked(CREATED, last=False),
         chunked(DELTA + b"data: Internal Server Error\n\n", COMPLETED), "keep",
         "not a JSON object"),
    ],
    ids=["ended-early", "reset", "malformed"],
)
def test_a_broken_stored_stream_ends_with_an_error_event(
    gw: tuple[BadReplica, str], replica: BadReplica, head: bytes, rest: bytes, end: End,
    message: str,
) -> None:
    replica.get_answer, replica.rest, replica.end = head, rest, end
    with httpx.stream("GET", f"{gw[1]}/v1/responses/{RID}?stream=true", timeout=10) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_bytes()
        got = next(chunks)
        replica.gate.set()
        got += b"".join(chunks)
    events = [e for e in got.split(b"\n\n") if e]
    assert events[:2] == [CREATED.strip(), DELTA.strip()]
    error = orjson.loads(events[2].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and message in error["message"]
    assert events[3:] == [b"data: [DONE]"]


def test_a_whole_object_to_a_stream_is_a_502_not_an_empty_stream(
    gw: tuple[BadReplica, str], replica: BadReplica,
) -> None:
    """A replica that ignores `stream` (an older vLLM, or not vLLM) answers the object whole:
    the SDK would read it as a stream without events, which looks complete."""
    replica.get_answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % len(WHOLE) + WHOLE)
    client = openai.OpenAI(base_url=f"{gw[1]}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.InternalServerError, match="not the stream asked for"):
        client.responses.retrieve(RID, stream=True)


def test_the_picker_answers_a_whole_object_to_a_stream_as_the_proxy_does() -> None:
    """Behind Envoy (the endpoint picker) the same 502 as through the HTTP proxy, where the
    picker used to let the JSON 200 through as it was; the stream itself still passes."""
    with BadReplica(MODEL) as replica:
        config = {"pools": {"default": {"served_model": MODEL, "replicas": [replica.url]}},
                  "health": {"failure_threshold": 1000}}
        epp = epp_proc(config=config)
        with epp:
            envoy, base = envoy_proc(epp.picker)
            with envoy:
                _store_one(replica, base)
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                       timeout=10)
                replica.get_answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                      b"content-length: %d\r\n\r\n" % len(WHOLE) + WHOLE)
                with pytest.raises(openai.InternalServerError) as err:
                    client.responses.retrieve(RID, stream=True)
                assert err.value.status_code == 502
                assert err.value.body == {
                    "message": "The replica's answer is not the stream asked for "
                               "(application/json).",
                    "type": "BadGatewayError", "param": None, "code": 502}
                assert client.responses.retrieve(RID).status == "queued"  # no stream: whole
                replica.get_answer = sse_head() + chunked(CREATED, DELTA, COMPLETED)
                events = [e.type for e in client.responses.retrieve(RID, stream=True)]
                assert events == ["response.created", "response.output_text.delta",
                                  "response.completed"]


def test_without_stream_the_object_comes_whole(
    gw: tuple[BadReplica, str], replica: BadReplica,
) -> None:
    replica.get_answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % len(WHOLE) + WHOLE)
    client = openai.OpenAI(base_url=f"{gw[1]}/v1", api_key="x", max_retries=0, timeout=10)
    assert client.responses.retrieve(RID).status == "queued"
    assert client.responses.retrieve(RID, stream=False).status == "queued"


def test_an_unknown_id_is_a_404_before_any_stream(gw: tuple[BadReplica, str]) -> None:
    client = openai.OpenAI(base_url=f"{gw[1]}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_not_here", stream=True)


@pytest.mark.parametrize(
    ("query", "stream"),
    [(b"", False), (b"stream=true", True), (b"stream=True&starting_after=3", True),
     (b"stream=1", True), (b"stream=false", False), (b"stream=true&stream=false", False),
     (b"streaming=true", False), (b"stream=%74rue", True)],
)
def test_wants_stream_reads_the_query_as_vllm_does(query: bytes, stream: bool) -> None:
    assert wants_stream(query) is stream


def test_head_with_stream_is_the_streams_head_only(
    gw: tuple[BadReplica, str], replica: BadReplica,
) -> None:
    replica.get_answer = sse_head() + chunked(CREATED, last=False)
    replica.rest = chunked(COMPLETED)  # never asked for: the head went out at the first event
    resp = httpx.head(f"{gw[1]}/v1/responses/{RID}?stream=true", timeout=10)
    assert (resp.status_code, resp.content) == (200, b"")
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.headers["x-kvgate-route"] == "response-affinity"


def test_a_stored_stream_past_the_shutdown_grace_ends_with_an_error_event() -> None:
    """As a proxied stream: at the end of `server.shutdown_grace_s` it ends with an error event
    and [DONE], not a cut connection, and the process exits 0."""
    with BadReplica(MODEL) as replica:
        gw, base = gateway_proc(upstreams=[replica.url],
                                env={"KVGATE_SERVER__SHUTDOWN_GRACE_S": "1"})
        with gw:
            _store_one(replica, base)
            replica.get_answer = sse_head() + chunked(CREATED, last=False)
            replica.rest = chunked(COMPLETED)  # held until the test ends: a long stream
            try:
                with httpx.stream("GET", f"{base}/v1/responses/{RID}?stream=true",
                                  timeout=30) as resp:
                    chunks = resp.iter_bytes()
                    got = next(chunks)
                    gw.signal(signal.SIGTERM)
                    got += b"".join(chunks)
            finally:
                replica.gate.set()
            events = [e for e in got.split(b"\n\n") if e]
            assert events[0] == CREATED.strip() and events[-1] == b"data: [DONE]"
            error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
            assert error["code"] == 503 and "shutting down" in error["message"]
            assert gw.popen is not None and gw.popen.wait(15) == 0


def test_a_client_that_stops_reading_a_stored_stream_is_reset() -> None:
    """As a proxied stream: once kvgate has been blocked handing it a chunk for
    `upstream.idle_timeout_s`, the connection is reset (not left to uvicorn as an app that
    did not finish, an ERROR line a client could repeat at will)."""
    many = b"".join(_event("response.output_text.delta", i, item_id="m", output_index=0,
                           content_index=0, delta="w" * 400, logprobs=[])
                    for i in range(1, 100_001))  # ~50 MB: more than the socket buffers hold
    with BadReplica(MODEL) as replica:
        gw, base = gateway_proc(upstreams=[replica.url],
                                env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "1"})
        with gw:
            _store_one(replica, base)
            replica.get_answer = sse_head(chunked_body=False) + CREATED + many
            replica.end = "close"
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
            s.sendall(f"GET /v1/responses/{RID}?stream=true HTTP/1.1\r\nhost: x\r\n\r\n"
                      .encode())
            try:  # never read: the gateway blocks handing it a chunk
                wait_for(lambda: "stopped reading" in gw.output(), timeout=60,
                         what="the stalled stream to end")
            finally:
                s.close()
            assert "ASGI callable returned without completing response" not in gw.output()


def test_a_background_stream_is_resumed_through_the_gateway() -> None:
    """With the real simulator (vLLM's event store): a background streamed response's events
    are replayed after `starting_after`; a response without kept events is a 502 saying
    why, not a broken connection."""
    sim, url = sim_proc(None, "--time-scale", "20", "--enable-store", model="sim-model")
    with sim:  # `with` starts it (a `.start()` here too started a second one, left running)
        gw, base = gateway_proc(upstreams=[url])
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            first = list(client.responses.create(model="sim-model", input="resume me",
                                                 background=True, stream=True,
                                                 max_output_tokens=8))
            assert first[0].type == "response.created" and first[-1].type == "response.completed"
            rid = first[0].response.id
            again = list(client.responses.retrieve(rid, stream=True, starting_after=2))
            assert [e.sequence_number for e in again] == [e.sequence_number for e in first[3:]]
            assert again[-1].type == "response.completed"
            plain = client.responses.create(model="sim-model", input="x", max_output_tokens=2)
            with pytest.raises(openai.InternalServerError, match="background and stream"):
                client.responses.retrieve(plain.id, stream=True)


def test_a_client_that_stops_reading_as_a_stored_stream_ends_is_let_go() -> None:
    """The replica's last bytes come while the client's socket is full (one event larger than
    every buffer, then the terminal event, in one read): the stream's last send waited for
    that client as long as it kept its connection. Past the idle timeout it is reset."""
    big = _event("response.output_text.delta", 1, item_id="msg_1", output_index=0,
                 content_index=0, delta="x" * (8 << 20), logprobs=[])
    with BadReplica(MODEL) as replica:
        proc, base = gateway_proc(upstreams=[replica.url],
                                  env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "1"})
        with proc:
            _store_one(replica, base)
            replica.get_answer = sse_head() + chunked(CREATED, big + COMPLETED)
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                client.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
                client.sendall(f"GET /v1/responses/{RID}?stream=true HTTP/1.1\r\n"
                               "host: x\r\n\r\n".encode())
                wait_for(lambda: "stopped reading" in proc.output(None), timeout=60,
                         what="the stalled client to be let go")
            finally:
                client.close()

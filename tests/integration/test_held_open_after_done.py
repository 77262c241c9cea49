"""A stream whose replica (or a proxy in front of it) sends `data: [DONE]` and then holds the
body open instead of ending it. vLLM ends the body right after [DONE]; kvgate waited for that
end up to `upstream.idle_timeout_s` (120 s by default): the client's stream stayed open, the
request held its replica's in-flight count and the tenant's concurrency, and at the timeout
kvgate sent a 504 error event after the [DONE] and counted the answered request a 504. Now the
end is waited for a moment only, then the stream ends as it is and the connection is dropped.

A Responses API stream ends with its terminal event (``response.completed``), not [DONE]:
proxied (``POST /v1/responses``) or stored (``GET /v1/responses/{id}?stream=true``), one held
open after it was the same 120 s and 504 error event (the stored stream's read loop did not
bound it at all). Both end a moment after that event now.

A real gateway, a loopback replica that holds the body open, raw HTTP to see every byte.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import orjson

from tests.integration.test_stored_stream import COMPLETED, CREATED, DELTA, RID, WHOLE
from tests.support.bad_replica import BadReplica, chunked, sse_head, whole
from tests.support.gateway import (
    gateway_proc,
    inflight,
    metric_values,
    request_statuses,
    wait_for,
)

EVENT = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hello"},
                 "finish_reason": "stop"}]}) + b"\n\n"
DONE = b"data: [DONE]\n\n"


def test_a_stream_held_open_after_its_done_ends_at_once() -> None:
    with BadReplica("m") as bad:
        bad.answer = sse_head() + chunked(EVENT + DONE, last=False)
        bad.rest, bad.gate = b"0\r\n\r\n", threading.Event()  # the end: never, in this test
        gw, base = gateway_proc(upstreams=[bad.url],
                                env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "10"})
        with gw:
            started = time.monotonic()
            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30, json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}) as resp:
                body = b"".join(resp.iter_raw())
            assert time.monotonic() - started < 5
            assert body == EVENT + DONE
            assert inflight(base) == 0
            assert request_statuses(base) == {"200": 1.0}
        bad.gate.set()


def test_a_responses_stream_held_open_after_its_last_event_ends_at_once() -> None:
    """Proxied and stored: the body after ``response.completed`` is waited for a moment."""
    events = CREATED + DELTA + COMPLETED
    with BadReplica("m") as bad:
        bad.answer = whole(WHOLE)  # RID, stored through the gateway (which learns its home)
        gw, base = gateway_proc(upstreams=[bad.url],
                                env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "10"})
        with gw:
            assert httpx.post(f"{base}/v1/responses", timeout=10,
                              json={"model": "m", "input": "x"}).status_code == 200
            bad.answer = bad.get_answer = sse_head() + chunked(events, last=False)
            bad.rest, bad.gate = b"0\r\n\r\n", threading.Event()  # the end: never
            for method, path, body in [
                    ("POST", "/v1/responses", {"model": "m", "input": "x", "stream": True}),
                    ("GET", f"/v1/responses/{RID}?stream=true", None)]:
                started = time.monotonic()
                with httpx.stream(method, f"{base}{path}", json=body, timeout=30) as resp:
                    got = b"".join(resp.iter_raw())
                assert time.monotonic() - started < 5, path
                assert got == events, path
            assert inflight(base) == 0
            assert request_statuses(base) == {"200": 2.0}
        bad.gate.set()


def test_a_crlf_stream_whose_last_lf_comes_alone_ends_at_once() -> None:
    """A replica (or a proxy re-framing with CRLF, as sse-starlette does) whose last event's
    end comes in two reads, ``\\r\\n\\r`` then ``\\n``, and holds the body open after. The lone
    LF was held as the start of a next event, so the end was waited for until the idle
    timeout: a 504 error event after the [DONE] (the LF never sent), the request counted 504
    and its replica charged a failure. Now it ends as a LF-framed one does, byte for byte."""
    event = EVENT.replace(b"\n", b"\r\n")
    done = DONE.replace(b"\n", b"\r\n")
    with BadReplica("m") as bad:
        bad.answer = sse_head() + chunked(event + done[:-1], last=False)
        bad.drip, bad.drip_s = [chunked(b"\n", last=False)], 0.2  # (a read of its own)
        bad.rest, bad.gate = b"0\r\n\r\n", threading.Event()  # the end: never, in this test
        gw, base = gateway_proc(upstreams=[bad.url],
                                env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "3"})
        with gw:
            with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30, json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True}) as resp:
                body = b"".join(resp.iter_raw())
            assert body == event + done
            assert inflight(base) == 0
            assert request_statuses(base) == {"200": 1.0}
            assert sum(metric_values(base, "kvgate_replica_failures_total").values()) == 0
        bad.gate.set()


def test_a_client_that_closes_at_the_done_before_the_replicas_end_got_a_whole_answer() -> None:
    """The official SDK closes its response at `data: [DONE]`; a replica's body ends just
    after (vLLM sends its last chunk on a later turn of its loop, later still under load). A
    client closing first was taken for one that left mid-answer: the request counted a 499
    and its usage lost (the tenant's tokens settled by estimate). It answered whole: a 200
    with its usage now."""
    usage = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
             b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,'
             b'"total_tokens":4}}\n\n')
    with BadReplica("m") as bad:
        bad.answer = sse_head() + chunked(EVENT + usage + DONE, last=False)
        bad.rest, bad.gate = b"0\r\n\r\n", threading.Event()  # the body's end: after the client
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            stream = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True})
            chunks = list(stream)  # (closed at the [DONE])
            assert chunks[0].choices[0].delta.content == "hello"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1
            wait_for(lambda: bool(request_statuses(base)), what="the request counted")
            bad.gate.set()
            assert request_statuses(base) == {"200": 1.0}
            tokens = metric_values(base, "kvgate_tokens_total")
            assert tokens['{kind="completion",pool="default",tier="default"}'] == 1.0
            wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
        bad.gate.set()

"""The proxy's retry, failover and timeout rules, in process: the gateway runs with an
in-process `Transport` (the seam every upstream exchange goes through), so each rule is
checked against a scripted replica without processes or sockets. The same rules are checked
against real simulators in tests/integration/test_gateway_failover.py."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.app import GatewayApp
from gateway.config import load_config
from gateway.h1conn import UpstreamProtocolError
from gateway.replicas import HealthRules, Replica
from gateway.stream_end import stream_error
from gateway.transport import Transport, UpstreamResponse
from gateway.verdicts import judge

# never connected to: the transport fakes them
A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
OK = orjson.dumps({"id": "c", "object": "text_completion", "model": "sim-model", "choices": [
    {"index": 0, "text": "hi", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
Behaviour = Callable[[], Any]  # returns a FakeResponse, or raises / hangs


class FakeResponse:
    def __init__(self, status: int, chunks: list[bytes | BaseException | None],
                 content_type: str = "application/json") -> None:
        self.status = status
        self.content_type = content_type
        self.content_length: str | None = None
        self.retry_after: str | None = None
        self.passed: list[tuple[bytes, bytes]] = []
        self._chunks = list(chunks)
        self.ended: str | None = None  # "released" or "aborted"

    async def read_chunk(self) -> bytes:
        if not self._chunks:
            return b""
        item = self._chunks.pop(0)
        if item is None:  # the replica sends nothing more, and keeps the connection
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")
        if isinstance(item, BaseException):
            raise item
        return item

    def at_hand(self) -> bool:
        return not self._chunks or self._chunks[0] is not None

    async def read_all(self) -> bytes:
        out = b""
        while chunk := await self.read_chunk():
            out += chunk
        return out

    def release(self) -> None:
        self.ended = "released"

    def abort(self) -> None:
        self.ended = "aborted"


class FakeTransport:
    """Answers /health and /v1/models; POSTs follow the replica's scripted behaviour."""

    def __init__(self, script: dict[str, Behaviour], posts: list[str]) -> None:
        self._script = script
        self._posts = posts
        self.closed = False

    async def post(
        self, url: str, body: bytes, headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        if on_send is not None:
            on_send()  # (no connection limit here: sent at once)
        base = url[: url.index("/v1/")]
        self._posts.append(base)
        result: UpstreamResponse = await self._script[base]()
        return result

    async def get(self, url: str, timeout_s: float, headers: dict[str, str]) -> tuple[int, bytes]:
        if url.endswith("/v1/models"):
            return 200, b'{"object":"list","data":[{"id":"sim-model"}]}'
        return 200, b""

    async def open(self, url: str, headers: dict[str, str],
                   method: str = "GET") -> UpstreamResponse:
        return FakeResponse(404, [b"{}"])

    async def close(self) -> None:
        self.closed = True


def ok() -> Behaviour:
    async def answer() -> FakeResponse:
        return FakeResponse(200, [OK])
    return answer


def status(code: int, body: bytes = b'{"error":{"message":"x","type":"t","code":1}}') -> Behaviour:
    async def answer() -> FakeResponse:
        return FakeResponse(code, [body])
    return answer


def refused() -> Behaviour:
    async def answer() -> FakeResponse:
        raise ConnectionRefusedError("refused")
    return answer


def hang() -> Behaviour:
    async def answer() -> FakeResponse:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")
    return answer


def stream_reset() -> Behaviour:
    async def answer() -> FakeResponse:
        first = (b'data: {"id":"c","object":"text_completion",'
                 b'"choices":[{"index":0,"text":"a"}]}\n\n')
        return FakeResponse(200, [first, aiohttp.ClientPayloadError("reset")],
                            content_type="text/event-stream")
    return answer


async def _call(app: GatewayApp, body: dict[str, Any], path: str = "/v1/completions",
                send_blocks: Callable[[dict[str, Any]], bool] = lambda _: False,
                ) -> tuple[int, bytes, dict[bytes, bytes]]:
    """One request; its client takes no message `send_blocks` names (its socket is full: the
    send waits until the handler is cut)."""
    raw = orjson.dumps(body)
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "http_version": "1.1", "scheme": "http"}
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if send_blocks(msg):
            await asyncio.sleep(3600)
        sent.append(msg)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body_out, dict(start["headers"])


def _run(script: dict[str, Behaviour], requests: list[dict[str, Any]],
         upstream: dict[str, Any] | None = None, *, together: bool = False,
         path: str = "/v1/completions", health: dict[str, Any] | None = None,
         ) -> tuple[list[tuple[int, bytes]], list[str]]:
    """Each request answered in turn (``together``: all at once)."""
    posts: list[str] = []

    def factory(max_connections: int, connect_timeout_s: float) -> Transport:
        return FakeTransport(script, posts)

    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"served_model": "sim-model", "replicas": list(script)}},
        "tenancy": {"auth": False}, "upstream": upstream or {},
        "routing": {"scrape_interval_ms": 60_000}, "health": health or {}})

    async def run() -> list[tuple[int, bytes]]:
        app = GatewayApp(cfg, transport=factory)
        await app.startup()
        try:
            if together:
                done = await asyncio.gather(*(_call(app, body, path) for body in requests))
                return [(code, data) for code, data, _ in done]
            out = []
            for body in requests:
                code, data, _ = await _call(app, body, path)
                out.append((code, data))
            return out
        finally:
            await app.shutdown()

    return asyncio.run(run()), posts


REQ = {"model": "sim-model", "prompt": "hello", "max_tokens": 2}


def test_a_refused_replica_fails_over_and_is_taken_out() -> None:
    answers, posts = _run({A: refused(), B: ok()}, [REQ] * 6)
    assert all(code == 200 for code, _ in answers)
    assert posts.count(A) <= 1  # down at the first refusal, not after N requests
    if posts[0] == A:
        assert posts[1] == B


def test_an_unresolvable_replica_is_named_so_and_fails_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The resolver's error (`socket.gaierror`, as asyncio raises it for a name that does not
    resolve): down at once like a refused connection, and the log line says why."""
    def unresolvable() -> Behaviour:
        async def answer() -> FakeResponse:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answer

    with caplog.at_level(logging.INFO, logger="gateway.proxy"):
        answers, posts = _run({A: unresolvable(), B: ok()}, [REQ] * 4)
    assert all(code == 200 for code, _ in answers) and posts.count(A) == 1
    reasons = [getattr(r, "reason", None) for r in caplog.records
               if r.getMessage() == "replica did not answer"]
    assert reasons == ["cannot resolve host 127.0.0.1"]


def test_busy_everywhere_passes_the_last_answer_through() -> None:
    answers, posts = _run({A: status(503), B: status(503)}, [REQ])
    assert answers[0][0] == 503
    assert orjson.loads(answers[0][1])["error"]["message"]
    assert sorted(posts) == [A, B]  # each replica tried once, none twice


# vLLM's 500 for one request (an exception while serving it), not its dead engine's
INTERNAL = (b'{"error":{"message":"list index out of range","type":"InternalServerError",'
            b'"param":null,"code":500}}')


def first(n: int, then: Behaviour, before: Behaviour) -> Behaviour:
    """``before`` for the first ``n`` requests, ``then`` after."""
    calls = 0

    async def answer() -> FakeResponse:
        nonlocal calls
        calls += 1
        result: FakeResponse = await (before if calls <= n else then)()
        return result
    return answer


def test_an_internal_error_on_two_replicas_is_the_requests_answer() -> None:
    """vLLM's 500 for a request that fails wherever it runs (a bug its input triggers) was
    tried on every replica (each a prefill paid, on top of the SDK's own two retries of a
    500): after a second replica fails it alike, its 500 is the answer, as vLLM sent it."""
    answers, posts = _run({A: status(500, INTERNAL), B: status(500, INTERNAL),
                           C: status(500, INTERNAL)}, [REQ])
    assert answers == [(500, INTERNAL)]
    assert len(posts) == 2


def test_a_request_that_fails_everywhere_ejects_no_replica() -> None:
    """Three such requests (one client and its SDK's retries) charged a failure to every
    replica they met: a quiet pool was ejected whole, and every tenant got 503s. Two
    replicas failing one request alike is the request's fault, not theirs."""
    poison = status(500, INTERNAL)
    answers, _ = _run({A: first(3, ok(), poison), B: first(3, ok(), poison)}, [REQ] * 4,
                      health={"failure_threshold": 3})
    assert [code for code, _ in answers] == [500, 500, 500, 200]


@pytest.mark.parametrize("pool", [[A], [A, B]], ids=["one-replica", "other-down"])
def test_a_request_failing_on_the_only_replica_left_does_not_eject_it(pool: list[str]) -> None:
    """With no other replica to try a request that fails with an internal 500, the failure
    was charged to the one that answered: three such requests (one client's, with its SDK's
    retries) ejected the pool's only replica, and every tenant got 503s. Nothing tells the
    request's fault from the replica's there, and ejecting the last replica only stops the
    requests it serves well."""
    poison = status(500, INTERNAL)
    script = {A: first(3, ok(), poison), B: refused()}
    answers, _ = _run({url: script[url] for url in pool}, [REQ] * 5,
                          health={"failure_threshold": 3})
    served = [code for code, _ in answers]  # (the first may meet the other replica's
    # refusal after this one's 500: a 502, this replica charged once)
    assert served[:3] in ([500] * 3, [502, 500, 500]) and served[3:] == [200, 200], served


ERROR_EVENT = (b'data: {"error":{"message":"list index out of range","type":'
               b'"InternalServerError","param":null,"code":500}}\n\ndata: [DONE]\n\n')


def stream_error_event(after_output: bool) -> Behaviour:
    """vLLM's stream ending with an error event of code 500 (an exception while serving the
    request), after some output or before any."""
    async def answer() -> FakeResponse:
        first = (b'data: {"id":"c","object":"text_completion",'
                 b'"choices":[{"index":0,"text":"a"}]}\n\n')
        chunks: list[bytes | BaseException | None] = [first] if after_output else []
        return FakeResponse(200, [*chunks, ERROR_EVENT], content_type="text/event-stream")
    return answer


@pytest.mark.parametrize("after_output", [True, False], ids=["mid-stream", "before-output"])
def test_a_stream_failing_on_the_only_replica_left_does_not_eject_it(after_output: bool) -> None:
    """The streamed counterpart: a stream's 5xx error event on a pool's only replica was
    charged to it, and three of them (one client's poison request and its SDK's retries)
    ejected it: every tenant got 503s while its /health said 200 (a dead engine's /health
    says 503, so it still leaves the pool)."""
    streamed = {**REQ, "stream": True}
    answers, _ = _run({A: first(3, ok(), stream_error_event(after_output))},
                      [streamed] * 3 + [REQ, REQ], health={"failure_threshold": 3})
    served = [code for code, _ in answers]
    assert served[:3] == ([200] * 3 if after_output else [502] * 3), served
    assert served[3:] == [200, 200], served


def test_a_stream_failing_alike_on_two_replicas_ejects_none_and_stops_there() -> None:
    """A stream whose every try opened with vLLM's error event of code 500 (an exception
    while serving that request, not a dead engine) was tried on every replica, each charged
    a failure: three such requests ejected a quiet pool whole. As for a whole 500: tried on
    one other replica only, and a second one alike is the request's fault, no replica's."""
    poison = stream_error_event(after_output=False)
    streamed = {**REQ, "stream": True}
    answers, posts = _run({A: first(3, ok(), poison), B: first(3, ok(), poison),
                           C: first(3, ok(), poison)}, [streamed], health={"failure_threshold": 3})
    assert [code for code, _ in answers] == [502] and len(posts) == 2, posts
    answers, _ = _run({A: first(3, ok(), poison), B: first(3, ok(), poison)},
                      [streamed] * 3 + [REQ, REQ], health={"failure_threshold": 3})
    assert [code for code, _ in answers] == [502, 502, 502, 200, 200]


def test_a_replica_failing_what_another_serves_is_still_ejected() -> None:
    """Its 500 is charged once another replica answered the same request."""
    answers, posts = _run({A: status(500, INTERNAL), B: ok()}, [REQ] * 8,
                          health={"failure_threshold": 3, "eject_base_s": 60})
    assert all(code == 200 for code, _ in answers)
    assert posts.count(A) == 3  # ejected at its third failure, never tried again


def test_a_client_error_is_not_retried() -> None:
    body = b'{"error":{"message":"bad prompt","type":"BadRequestError","param":null,"code":400}}'
    answers, posts = _run({A: status(400, body), B: status(400, body)}, [REQ])
    assert answers == [(400, body)] and len(posts) == 1


@pytest.mark.parametrize(
    ("request_body", "upstream", "tries"),
    [
        # the first-byte timeout is per try: each replica is tried, then 504
        ({**REQ, "stream": True}, {"first_byte_timeout_s": 0.2}, 2),
        # a whole answer comes after its last token: the total timeout bounds its wait
        (REQ, {"first_byte_timeout_s": 0.05, "total_timeout_s": 0.3}, 1),
    ],
    ids=["stream-first-byte", "whole-total"],
)
def test_no_first_byte_in_time_is_a_504(
    request_body: dict[str, object], upstream: dict[str, float], tries: int,
) -> None:
    answers, posts = _run({A: hang(), B: hang()}, [request_body], upstream=upstream)
    code, body = answers[0]
    assert code == 504 and orjson.loads(body)["error"]["type"] == "GatewayTimeoutError"
    assert len(posts) == tries and len(set(posts)) == tries


def test_a_stream_reset_after_the_first_byte_ends_the_stream_with_an_error() -> None:
    answers, posts = _run({A: stream_reset(), B: stream_reset()}, [{**REQ, "stream": True}])
    code, body = answers[0]
    assert code == 200 and b'"text":"a"' in body
    assert b'"error"' in body and body.rstrip().endswith(b"data: [DONE]")
    assert len(posts) == 1  # bytes reached the client: never retried


UNAUTHORIZED = b'{"error":"Unauthorized"}'  # vLLM's --api-key middleware


def test_a_replica_refusing_the_gateways_key_fails_over_and_is_taken_out() -> None:
    answers, posts = _run({A: status(401, UNAUTHORIZED), B: ok()}, [REQ] * 6)
    assert all(code == 200 for code, _ in answers)
    assert posts.count(A) <= 1  # down at the first refusal: every request would fail there


def test_refused_gateway_credentials_are_a_502_not_the_clients_401() -> None:
    answers, posts = _run({A: status(401, UNAUTHORIZED), B: status(403, b"forbidden")}, [REQ])
    code, body = answers[0]
    err = orjson.loads(body)["error"]
    assert code == 502 and (err["type"], err["code"]) == ("BadGatewayError", 502)
    assert "refused the gateway's credentials" in err["message"]
    assert sorted(posts) == [A, B]  # another replica may hold the right key: tried once each


def test_refused_credentials_stay_a_502_when_the_retry_budget_is_spent() -> None:
    # no budget: the refusal is not retried, and the client is told why, not "try again"
    answers, posts = _run({A: status(401, UNAUTHORIZED), B: status(401, UNAUTHORIZED)}, [REQ],
                          upstream={"retry_budget_ratio": 0, "retry_budget_min": 0})
    code, body = answers[0]
    assert code == 502 and "refused the gateway's credentials" in orjson.loads(body)["error"][
        "message"]
    assert len(posts) == 1


def test_a_refusing_replica_is_warned_about_once_until_it_serves_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    replica = Replica("p", A, HealthRules())

    def warnings() -> int:
        return sum("refused the gateway's credentials" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="gateway.verdicts"):
        assert judge(replica, 401, UNAUTHORIZED, 0.0) == "refused"
        for cycle in range(1, 4):  # /health needs no key: back every cycle, refused again
            replica.probe_recovered()
            assert judge(replica, 403, b"forbidden", cycle * 100.0) == "refused"
        assert warnings() == 1
        replica.probe_recovered()
        assert judge(replica, 200, OK, 500.0) == "ok"  # the key was fixed
        assert judge(replica, 401, UNAUTHORIZED, 600.0) == "refused"  # and broken again
        assert warnings() == 2


DEAD = (b'{"error":{"message":"The server had an error while processing your request.",'
        b'"type":"InternalServerError","param":null,"code":500}}')  # vLLM's dead engine


def test_no_usable_replica_says_why_without_naming_any_replica() -> None:
    answers, posts = _run({A: status(500, DEAD), B: refused()}, [REQ, REQ])
    assert sorted(posts) == [A, B]  # the first request found both down; the second, none
    code, body = answers[1]
    message = orjson.loads(body)["error"]["message"]
    assert code == 503
    assert message == ("No healthy replica for the model `sim-model` (2 replicas: "
                       "1 its engine died (500), 1 cannot connect)."), message
    assert "127.0.0.1" not in message


def test_a_first_byte_timeout_stays_a_504_when_the_retry_budget_runs_out_meanwhile() -> None:
    """Two streams time out at once; the one retry the budget holds goes to one of them. The
    other is a timeout all the same (504), not "busy or failing, try again" (503)."""
    answers, posts = _run({A: hang(), B: hang()}, [{**REQ, "stream": True}] * 2, upstream={
        "first_byte_timeout_s": 0.2, "retry_budget_ratio": 0, "retry_budget_min": 1},
        together=True)
    assert len(posts) == 3  # two first tries, one retry
    for code, body in answers:
        err = orjson.loads(body)["error"]
        assert (code, err["type"]) == (504, "GatewayTimeoutError"), body
        assert "first byte timeout" in err["message"]


def stream_after(delay_s: float) -> Behaviour:
    async def answer() -> FakeResponse:
        await asyncio.sleep(delay_s)  # its prefill
        event = (b'data: {"id":"c","object":"text_completion",'
                 b'"choices":[{"index":0,"text":"a","finish_reason":"stop"}]}\n\n')
        return FakeResponse(200, [event, b"data: [DONE]\n\n"], content_type="text/event-stream")
    return answer


def in_turn(*behaviours: Behaviour) -> Behaviour:
    """The replica's n-th request gets the n-th behaviour."""
    queue = list(behaviours)

    async def answer() -> Any:
        return await queue.pop(0)()
    return answer


LONG = "word " * 100_000  # ~125,000 tokens: ~16 s of prefill at the prior's 8,000 tokens/s


@pytest.mark.parametrize(
    ("behaviour", "requests"),
    [
        # another request got its first token while the cut one waited: the queue moves
        (in_turn(stream_after(0.1), hang()), [REQ, REQ]),
        # the prompt alone takes longer to prefill than the first-byte timeout
        (hang(), [{**REQ, "prompt": LONG}]),
    ],
    ids=["others-answered-meanwhile", "long-prompt"],
)
def test_a_first_byte_cut_on_a_progressing_replica_is_not_its_failure(
    behaviour: Behaviour, requests: list[dict[str, Any]],
) -> None:
    """A replica whose requests are all still in prefill is judged hung by a first-byte cut
    only when nothing says it is working: with one failure enough to eject, a slow but
    progressing replica must stay in rotation."""
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"served_model": "sim-model", "replicas": [A]}},
        "tenancy": {"auth": False}, "routing": {"scrape_interval_ms": 60_000},
        "upstream": {"first_byte_timeout_s": 0.4, "max_attempts": 1},
        "health": {"failure_threshold": 1, "interval_s": 60}})

    async def run() -> None:
        app = GatewayApp(cfg, transport=lambda *_: FakeTransport({A: behaviour}, []))
        await app.startup()
        try:
            done = await asyncio.gather(*(_call(app, {**r, "stream": True}) for r in requests))
            assert [code for code, _, _ in done][-1] == 504
            assert app.rt is not None
            replica = app.rt.pools.by_name["p"].replicas[0]
            assert (replica.state, replica.failed) == ("healthy", 0)
            assert (replica.inflight, replica.inflight_prefill) == (0, 0)
        finally:
            await app.shutdown()

    asyncio.run(run())


def test_a_first_byte_cut_on_a_replica_doing_nothing_is_its_failure() -> None:
    """The rule still sees a hung engine: short prompts, nothing answered meanwhile."""
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"served_model": "sim-model", "replicas": [A]}},
        "tenancy": {"auth": False}, "routing": {"scrape_interval_ms": 60_000},
        "upstream": {"first_byte_timeout_s": 0.2, "max_attempts": 1},
        "health": {"failure_threshold": 1, "interval_s": 60}})

    async def run() -> None:
        app = GatewayApp(cfg, transport=lambda *_: FakeTransport({A: hang()}, []))
        await app.startup()
        try:
            code, _, _ = await _call(app, {**REQ, "stream": True})
            assert code == 504
            assert app.rt is not None
            replica = app.rt.pools.by_name["p"].replicas[0]
            assert (replica.state, replica.failed) == ("ejected", 1)
        finally:
            await app.shutdown()

    asyncio.run(run())


def ping_then_hang() -> Behaviour:
    async def answer() -> FakeResponse:  # vLLM's --sse-keep-alive-interval, a hung engine
        return FakeResponse(200, [b": keep-alive\n\n", None], content_type="text/event-stream")
    return answer


def test_keep_alive_comments_do_not_stop_the_retry_of_a_hung_stream() -> None:
    """A comment is not a token: a replica that sends only `: keep-alive` is cut at the
    first-byte timeout and another replica answers the same stream (the comments already
    relayed are all the client saw of the first)."""
    first_hangs = in_turn(ping_then_hang(), stream_after(0))  # whichever replica is first
    answers, posts = _run({A: first_hangs, B: first_hangs}, [{**REQ, "stream": True}],
                          upstream={"first_byte_timeout_s": 0.3})
    code, body = answers[0]
    assert code == 200 and len(posts) == 2 and posts[0] != posts[1]
    assert body.startswith(b": keep-alive\n\n")
    assert b'"text":"a"' in body and b"error" not in body
    assert body.endswith(b"data: [DONE]\n\n")


def test_a_stream_another_replica_answers_after_keep_alives_names_it() -> None:
    """The head went out with the hung replica's keep-alive comments, so its x-kvgate-replica
    names that one, and headers cannot change: a comment block names the replica (and the
    route) that answered before its first event (the SDKs skip comment lines)."""
    first_hangs = in_turn(ping_then_hang(), stream_after(0))
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"served_model": "sim-model", "replicas": [A, B]}},
        "tenancy": {"auth": False}, "routing": {"scrape_interval_ms": 60_000},
        "upstream": {"first_byte_timeout_s": 0.3}})
    posts: list[str] = []

    async def run() -> tuple[int, bytes, dict[bytes, bytes]]:
        app = GatewayApp(cfg, transport=lambda *_: FakeTransport(
            {A: first_hangs, B: first_hangs}, posts))
        await app.startup()
        try:
            return await _call(app, {**REQ, "stream": True})
        finally:
            await app.shutdown()

    code, body, headers = asyncio.run(run())
    hung, answered = (f"p/{url.removeprefix('http://')}" for url in posts)
    assert code == 200 and headers[b"x-kvgate-replica"] == hung.encode()
    named = f": x-kvgate-replica: {answered}\n: x-kvgate-route: retry\n\ndata: ".encode()
    assert body.startswith(b": keep-alive\n\n" + named), body
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"x-kvgate") == 2


def test_a_stream_of_keep_alive_comments_only_ends_with_the_timeouts_error_event() -> None:
    """Every replica only pings: the head went out with the first comment, so the 504 comes
    as the stream's error event and [DONE], once."""
    answers, posts = _run({A: ping_then_hang(), B: ping_then_hang()}, [{**REQ, "stream": True}],
                          upstream={"first_byte_timeout_s": 0.2})
    code, body = answers[0]
    assert code == 200 and len(posts) == 2
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert orjson.loads(events[0][6:])["error"]["code"] == 504
    assert events[1:] == [b"data: [DONE]"]


def test_an_error_answer_after_keep_alive_comments_is_the_streams_error_event() -> None:
    """The retry's replica answers an error: the stream is open, so it ends with that error
    as its event (as vLLM ends a failing stream), not with a second response head."""
    bad = b'{\n  "error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}\n}'
    first_hangs = in_turn(ping_then_hang(), status(400, bad))
    answers, posts = _run({A: first_hangs, B: first_hangs}, [{**REQ, "stream": True}],
                          upstream={"first_byte_timeout_s": 0.2})
    code, body = answers[0]
    assert code == 200
    named = f": x-kvgate-replica: p/{posts[1].removeprefix('http://')}\n"  # (who answered)
    assert body == (b": keep-alive\n\n" + named.encode() + b": x-kvgate-route: retry\n\n"
                    b"data: " + orjson.dumps(orjson.loads(bad)) + b"\n\ndata: [DONE]\n\n")


def _response_event(kind: str, seq: int, rid: str) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": seq, "response": {
        "id": rid, "object": "response", "status": "in_progress", "output": []}})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def responses_preamble_then_hang(rid: str = "resp_1") -> Behaviour:
    """vLLM's Responses API stream: `response.created` and `response.in_progress` go out at
    once, before the prompt is scheduled; a hung engine sends nothing after them."""
    async def answer() -> FakeResponse:
        preamble = (_response_event("response.created", 0, rid)
                    + _response_event("response.in_progress", 1, rid))
        return FakeResponse(200, [preamble, b": keep-alive\n\n", None],
                            content_type="text/event-stream")
    return answer


def responses_stream(rid: str) -> Behaviour:
    async def answer() -> FakeResponse:
        preamble = (_response_event("response.created", 0, rid)
                    + _response_event("response.in_progress", 1, rid))
        delta = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.'
                 b'delta","sequence_number":2,"delta":"hi"}\n\n')
        return FakeResponse(200, [preamble, delta, _response_event("response.completed", 3, rid)],
                            content_type="text/event-stream")
    return answer


@pytest.mark.parametrize("background", [False, True])
def test_a_responses_streams_created_events_are_not_its_first_token(background: bool) -> None:
    """The first-byte timeout waits for output, not for the events vLLM sends before the
    prefill: a hung engine is cut after `first_byte_timeout_s` (not the idle timeout) and
    judged hung; the router learns no first token from it. The opening events were held
    (dropped with the try), except a background response's (relayed as they come)."""
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"served_model": "sim-model", "replicas": [A]}},
        "tenancy": {"auth": False}, "routing": {"scrape_interval_ms": 60_000},
        "upstream": {"first_byte_timeout_s": 0.2, "idle_timeout_s": 30, "total_timeout_s": 30},
        "health": {"failure_threshold": 1, "interval_s": 60}})

    async def run() -> None:
        transport = FakeTransport({A: responses_preamble_then_hang()}, [])
        app = GatewayApp(cfg, transport=lambda *_: transport)
        await app.startup()
        try:
            body = {"model": "sim-model", "input": "hi", "stream": True, "background": background}
            code, out, _ = await asyncio.wait_for(_call(app, body, "/v1/responses"), 10)
            assert code == 200 and out.count(b"event: response.created") == background
            err = orjson.loads(out.split(b"\n\n")[-3][len(b"data: "):])["error"]
            assert (err["code"], err["message"]) == (
                504, "The replica did not answer in time (first byte timeout).")
            assert app.rt is not None
            replica = app.rt.pools.by_name["p"].replicas[0]
            assert (replica.answers, replica.failed) == (0, 1)
        finally:
            await app.shutdown()

    asyncio.run(run())


def test_a_responses_stream_whose_replica_hangs_after_its_opening_events_is_retried() -> None:
    """The opening events are held until the first output, so a replica that sends only
    them (and keep-alive comments) is replaced: the client sees one response, the other
    replica's, whole."""
    first_hangs = in_turn(responses_preamble_then_hang("resp_hung"), responses_stream("resp_ok"))
    answers, posts = _run({A: first_hangs, B: first_hangs},
                          [{"model": "sim-model", "input": "hi", "stream": True}],
                          upstream={"first_byte_timeout_s": 0.3}, path="/v1/responses")
    code, body = answers[0]
    assert code == 200 and len(posts) == 2 and posts[0] != posts[1]
    assert b"resp_hung" not in body and body.count(b"event: response.created") == 1
    assert body.startswith(b": keep-alive\n\n")  # the hung try's comments kept it open
    assert b'"delta":"hi"' in body and b"event: response.completed" in body


def test_a_responses_stream_ending_right_after_its_opening_events_keeps_them() -> None:
    """A replica that ends the stream with its terminal event unended (no blank line) right
    after the opening events: the held events still reach the client, before it."""
    async def answer() -> FakeResponse:
        preamble = (_response_event("response.created", 0, "resp_x")
                    + _response_event("response.in_progress", 1, "resp_x"))
        last = _response_event("response.completed", 2, "resp_x").rstrip(b"\n")
        return FakeResponse(200, [preamble, last], content_type="text/event-stream")

    answers, _ = _run({A: answer, B: answer}, [{"model": "sim-model", "input": "hi",
                                               "stream": True}], path="/v1/responses")
    code, body = answers[0]
    assert code == 200 and body.startswith(b"event: response.created")
    assert body.index(b"response.in_progress") < body.index(b"event: response.completed")


@pytest.mark.parametrize(("eject_s", "retry_after"), [(20, 20), (300, 60)])
def test_no_usable_replica_says_when_to_retry(eject_s: float, retry_after: int) -> None:
    """Every replica ejected until a known time: Retry-After is the seconds until the soonest
    is tried again (was always 1: the SDKs came back 19 times in vain), capped at a minute."""
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"served_model": "sim-model", "replicas": [A, B]}},
        "tenancy": {"auth": False}, "routing": {"scrape_interval_ms": 60_000},
        "health": {"interval_s": 60, "eject_base_s": eject_s, "eject_max_s": 600}})

    async def run() -> None:
        script = {A: status(500, DEAD), B: refused()}
        app = GatewayApp(cfg, transport=lambda *_: FakeTransport(script, []))
        await app.startup()
        try:
            await _call(app, REQ)  # both tried, both down
            code, _, headers = await _call(app, REQ)
            assert code == 503
            assert int(headers[b"retry-after"]) in (retry_after - 1, retry_after), headers
        finally:
            await app.shutdown()

    asyncio.run(run())


KEEP_ALIVE = b": keep-alive\n\n"


def alive_then_silent() -> Behaviour:
    """A stream head and a keep-alive comment (the request waits there), then nothing."""
    async def answer() -> FakeResponse:
        return FakeResponse(200, [KEEP_ALIVE, None], content_type="text/event-stream")
    return answer


async def _stream_call(
    app: GatewayApp, send_blocks: Callable[[dict[str, Any]], bool],
) -> tuple[int, bytes]:
    """A streamed request whose client takes no body piece `send_blocks` names."""
    status, body, _ = await _call(app, {**REQ, "stream": True}, send_blocks=send_blocks)
    return status, body


def _app(script: dict[str, Behaviour], **upstream: Any) -> GatewayApp:
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"served_model": "sim-model", "replicas": [A, B]}},
        "tenancy": {"auth": False}, "routing": {"scrape_interval_ms": 60_000},
        "health": {"interval_s": 60, "failure_threshold": 100}, "upstream": upstream})
    return GatewayApp(cfg, transport=lambda *_: FakeTransport(script, []))


def test_a_retry_after_a_cut_during_a_blocked_keep_alive_still_ends_with_an_error_event() -> None:
    """The first try's keep-alive comment opens the stream, and the client's socket is full
    while it is written; the first-byte cut takes it back and tries the other replica, which
    sends nothing either: its cut ends the stream with the timeout's error event (a
    `writing` left on by the first cut passed the second for the client's stall: the stream
    ended with no event)."""
    script = in_turn(alive_then_silent(), hang())
    app = _app({A: script, B: script}, first_byte_timeout_s=0.2, max_attempts=2)
    blocked: list[bytes] = []

    def first_keep_alive(msg: dict[str, Any]) -> bool:
        if msg.get("body") == KEEP_ALIVE and not blocked:
            blocked.append(msg["body"])
            return True
        return False

    async def run() -> tuple[int, bytes]:
        await app.startup()
        try:
            return await _stream_call(app, first_keep_alive)
        finally:
            await app.shutdown()

    code, body = asyncio.run(run())
    assert blocked and code == 200
    assert body == stream_error("The replica did not answer in time (first byte timeout).",
                                "GatewayTimeoutError", 504)


def test_a_stream_opened_by_keep_alives_then_answered_non_200_is_recorded_as_its_502_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The next try's replica answers 202: the open stream ends with a 502 error event saying
    so, and the request is recorded as 502 (what the client got), not 202."""
    script = in_turn(alive_then_silent(), status(202, b'{"id": "x"}'))
    app = _app({A: script, B: script}, first_byte_timeout_s=0.2, max_attempts=2)

    async def run() -> tuple[int, bytes]:
        await app.startup()
        try:
            return await _stream_call(app, lambda _: False)
        finally:
            await app.shutdown()

    with caplog.at_level(logging.INFO, logger="gateway.proxy"):
        code, body = asyncio.run(run())
    assert code == 200
    assert body.endswith(stream_error("The upstream replica answered 202."))
    lines = [r for r in caplog.records if r.getMessage() == "request"]
    assert [getattr(r, "status", None) for r in lines] == [502]


def test_no_ready_replica_says_when_to_retry() -> None:
    """A pool whose served name is not known yet, its one replica down for 20 s: "No ready
    replica" says when it is tried again (was always 1), as the no-healthy-replica 503."""
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"replicas": [A]}}, "tenancy": {"auth": False},
        "routing": {"scrape_interval_ms": 60_000},
        "health": {"interval_s": 60, "eject_base_s": 20, "eject_max_s": 600}})

    async def run() -> None:
        app = GatewayApp(cfg, transport=lambda *_: FakeTransport({A: ok()}, []))
        await app.startup()
        try:
            assert app.rt is not None
            pool = app.rt.pools.by_name["p"]
            pool.served_model = None  # not learned yet (the health monitor may have)
            app.rt.pools.public.clear()
            pool.replicas[0].mark_down(app.clock())
            code, body, headers = await _call(app, REQ)
            assert code == 503
            assert b"No ready replica" in body
            assert int(headers[b"retry-after"]) in (19, 20), headers
        finally:
            await app.shutdown()

    asyncio.run(run())


def test_requests_arriving_together_each_see_the_others_picks() -> None:
    """Requests whose picks fall in one event-loop turn (a burst read in one poll of the
    sockets, common on a busy gateway) each count the ones picked before them: the HTTP edge
    yields a turn between a pick and the request's lease (the disconnect watch's), and every
    request picked in that turn saw the replicas without the others -- two cold prompts
    arriving together both went to the first replica, one waiting behind the other's
    prefill while the second replica idled."""
    prompts = [{**REQ, "prompt": f"a different prompt {i}", "stream": True} for i in range(4)]
    answers, posts = _run({A: stream_after(0.05), B: stream_after(0.05)}, prompts,
                          together=True)
    assert [code for code, _ in answers] == [200] * 4
    assert Counter(posts) == {A: 2, B: 2}, posts


def test_an_answer_that_is_not_readable_http_says_so() -> None:
    """A replica (or a proxy before it) answering in gzip, or with bytes that are not HTTP:
    the client's 502 says the answer was not readable and why, not "The replica did not
    answer." (it did); the other replica is tried first."""
    def unreadable(why: str) -> Behaviour:
        async def answer() -> FakeResponse:
            raise UpstreamProtocolError(why)
        return answer

    answers, posts = _run({A: unreadable("an answer in b'gzip' encoding"),
                           B: unreadable("invalid HTTP answer: Invalid response status")}, [REQ])
    assert len(posts) == 2
    code, body = answers[0]
    err = orjson.loads(body)["error"]
    assert code == 502 and err["message"].startswith("The replica's answer was not readable ("), err

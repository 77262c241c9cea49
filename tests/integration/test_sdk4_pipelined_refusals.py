"""A request followed on its connection by bytes the gateway refuses (a client that counted
its `Content-Length` short, so the body's tail reads as a broken next request; a pipelined
head that is not HTTP/1.1) is answered first, then the refusal, in order (RFC 9112 9.3.2).
The refusal was written at once and the connection closed: the client read the 400 alone,
its valid request ran on a replica for nothing and was logged as a 499. Real `kvgate serve
--no-auth` in front of a simulated replica, raw sockets as the client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import sim_proc
from tests.support.raw_http import exchange

MODEL = "sim-model"


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[sim_url])
        with gw:
            yield base


def _request(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % len(data) + data)


def _not_499(base: str) -> bool:
    return not any('status="499"' in key for key in metric_values(base, "kvgate_requests_total"))


@pytest.mark.parametrize("half_close", [False, True], ids=["open", "half-closed"])
@pytest.mark.parametrize(("tail", "status"), [
    (b"GARBAGE\r\n\r\n", 400),  # a body longer than its Content-Length
    (b"GET /v1/models HTTP/2.0\r\nhost: x\r\n\r\n", 505),
    (b"GET /v1/models HTTP/1.1\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
], ids=["garbage", "http-2.0", "huge-head"])
def test_a_refused_pipelined_head_waits_for_the_answers_before_it(
    gateway: str, tail: bytes, status: int, half_close: bool,
) -> None:
    port = int(gateway.rsplit(":", 1)[1])
    first = _request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3})
    second = _request({"model": MODEL, "messages": [{"role": "user", "content": "yo"}],
                       "max_tokens": 3, "stream": True})
    got = exchange(port, first + second + tail, half_close=half_close)
    assert [code for code, _ in got] == [200, 200, status]
    assert json.loads(got[0][1])["object"] == "chat.completion"
    assert got[1][1].rstrip().endswith(b"data: [DONE]")
    assert json.loads(got[2][1])["error"]["code"] == status
    wait_for(lambda: inflight(gateway) == 0, what="in-flight back to 0")
    assert _not_499(gateway)


@pytest.fixture(scope="module")
def quick_heads() -> Iterator[str]:
    """A gateway whose header timeout is a second."""
    sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[sim_url], env={"KVGATE_SERVER__HEADER_TIMEOUT_S": "1"})
        with gw:
            yield base


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_head_begun_in_the_read_that_ended_a_request_is_timed(
    quick_heads: str, stream: bool,
) -> None:
    """The start of a next head in the same read as a request's end was timed by nothing: no
    408, the connection held until the keep-alive timeout (120 s). Now its answer comes, then
    the 408, and the connection closes."""
    port = int(quick_heads.rsplit(":", 1)[1])
    first = _request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3, "stream": stream})
    got = exchange(port, first + b"GET /v1/mod", half_close=False)
    assert [code for code, _ in got] == [200, 408]
    assert json.loads(got[1][1])["error"]["code"] == 408
    wait_for(lambda: inflight(quick_heads) == 0, what="in-flight back to 0")
    assert _not_499(quick_heads)


_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"


@pytest.mark.parametrize(("data", "says"), [
    (b"POST /v1/chat/completions HTTP/1.1\nhost: x\ncontent-length: 2\n\n{}", "CRLF"),
    (_HEAD + b"host: y\nx-a: b\r\n\r\n{}", "CRLF"),
    (_HEAD + b"content-length: 2\r\n\r\n{}", "Content-Length is given more than once"),
    (b"GET /v1/my models HTTP/1.1\r\nhost: x\r\n\r\n", "%20"),
    (_HEAD + b"x-a: b\r\n c\r\n\r\n{}", "line folding"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, "TLS"),
    (_HEAD + b"x-a: b\x00c\r\n\r\n{}", "Invalid header value char"),
], ids=["lf-only", "one-bare-lf", "two-content-lengths", "space-in-path", "folded", "tls",
        "nul-in-value"])
def test_a_400_for_bytes_that_are_not_http_says_why(
    gateway: str, data: bytes, says: str,
) -> None:
    """It said "The request is not valid HTTP/1.1." whatever was wrong."""
    port = int(gateway.rsplit(":", 1)[1])
    got = exchange(port, data, half_close=False)
    assert [code for code, _ in got] == [400]
    error = json.loads(got[0][1])["error"]
    assert error["type"] == "BadRequestError"
    assert error["message"].startswith("The request is not valid HTTP/1.1: ")
    assert says in error["message"], error["message"]


@pytest.fixture(scope="module")
def quick_bodies() -> Iterator[str]:
    """A gateway whose body timeout is a second, in front of a slow replica (a stream of 200
    tokens takes a few seconds)."""
    sim, sim_url = sim_proc(None, "--time-scale", "0.2", model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[sim_url], env={"KVGATE_SERVER__BODY_TIMEOUT_S": "1"})
        with gw:
            yield base


def test_a_pipelined_body_is_not_timed_while_an_earlier_stream_runs(quick_bodies: str) -> None:
    """A request pipelined behind a stream, its body cut short: uvicorn stops reading while
    the stream runs, and its body timer fired meanwhile -- the 408 went out in the middle of
    the stream's chunks and the connection closed (the stream cut, logged 499). Now the
    stream ends whole, then the 408 (its body still missing once its turn came)."""
    port = int(quick_bodies.rsplit(":", 1)[1])
    stream = _request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 200, "min_tokens": 200, "stream": True})
    cut = _request({"model": MODEL, "messages": [{"role": "user", "content": "yo"}],
                    "max_tokens": 3})
    got = exchange(port, stream + cut[:-5], half_close=False)
    assert [code for code, _ in got] == [200, 408]
    assert got[0][1].rstrip().endswith(b"data: [DONE]")
    wait_for(lambda: inflight(quick_bodies) == 0, what="in-flight back to 0")
    assert _not_499(quick_bodies)

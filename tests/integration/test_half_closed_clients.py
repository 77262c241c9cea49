"""A client that half-closes its connection after a whole request (``shutdown(SHUT_WR)``) is
answered: uvicorn took its FIN for a disconnect and the gateway cancelled the request, so the
client read an empty connection. A client that closed its socket and left sends the same FIN:
its request must still stop at once upstream (the replica aborts it), whole or streamed.
Real gateway, real simulator, raw sockets (no HTTP client library half-closes)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.gateway import (
    gateway_proc,
    inflight,
    metric_values,
    request_statuses,
    wait_for,
)
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
MODEL = "sim-model"


def _request(port: int, body: dict[str, object], http: bytes = b"HTTP/1.1") -> socket.socket:
    data = orjson.dumps(body)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions " + http + b"\r\nHost: kvgate\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    out = b""
    while chunk := sock.recv(65536):  # to the server's close: it closes once it answered
        out += chunk
    return out


def _body(stream: bool, max_tokens: int = 5) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def _aborted(sim: str) -> int:
    return int(httpx.get(f"{sim}/sim/stats").json()["aborted"])


def _received(sim: str) -> int:
    return int(httpx.get(f"{sim}/sim/stats").json()["received"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_half_closes_after_its_request_gets_the_answer(
    sim_factory: SimFactory, stream: bool,
) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        sock = _request(_port(base), _body(stream))
        sock.shutdown(socket.SHUT_WR)
        answer = _read_all(sock)
        sock.close()
        # interim 100s may come first (the probe for a client gone); then the answer
        final = answer
        while final.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
            final = final[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
        head, _, rest = final.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), answer[:300]
        assert b"connection: close" in head.lower()
        assert (b"data: [DONE]" in rest) if stream else (b'"finish_reason"' in rest), rest
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_an_http_1_0_client_that_half_closes_is_a_client_gone(sim_factory: SimFactory) -> None:
    """No 1xx may go to an HTTP/1.0 client, so there is no probe: its FIN is taken as it
    was, a client gone (a 499 in the metrics), and it reads nothing."""
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        sock = _request(_port(base), _body(False, 3000), http=b"HTTP/1.0")
        sock.shutdown(socket.SHUT_WR)
        assert _read_all(sock) == b""
        sock.close()
        wait_for(lambda: any('status="499"' in k for k in
                             metric_values(base, "kvgate_requests_total")), what="a 499")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_closes_after_its_request_still_stops_it_upstream(
    sim_factory: SimFactory, stream: bool,
) -> None:
    """The same FIN from a client that closed its socket: the probe's reset says it left,
    and the replica aborts the request within a probe, not after its 3000 tokens."""
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        before = _aborted(sim)
        sock = _request(_port(base), _body(stream, 3000))
        time.sleep(0.05)  # the request reached the replica
        sock.close()
        started = time.monotonic()
        wait_for(lambda: _aborted(sim) > before, timeout=5, what="the replica sees an abort")
        assert time.monotonic() - started < 2.0
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def _pipelined(port: int, bodies: list[dict[str, object]]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    data = b""
    for body in bodies:
        raw = orjson.dumps(body)
        data += (b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw))
    sock.sendall(data)  # every request before any answer
    return sock


def test_a_client_that_pipelines_then_half_closes_gets_every_answer(
    sim_factory: SimFactory,
) -> None:
    """Pipelined requests then a half-close (``printf ... | nc -N``): each is answered in
    order and the connection closes after the last. The FIN was taken for a client gone
    whenever a request waited behind another: the client read nothing."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        sock = _pipelined(_port(base), [_body(False, 3), _body(True, 4), _body(False, 5)])
        sock.shutdown(socket.SHUT_WR)
        answer = _read_all(sock)
        sock.close()
        finals = answer.replace(b"HTTP/1.1 100 Continue\r\n\r\n", b"")
        assert finals.count(b"HTTP/1.1 200 OK\r\n") == 3, answer[:300]
        assert b"data: [DONE]" in finals
        assert finals.count(b'"completion_tokens":') >= 2  # the two whole answers' usage
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_client_that_pipelines_then_closes_still_stops_it_upstream(
    sim_factory: SimFactory,
) -> None:
    """Pipelined requests from a client that closed its socket: the running one is aborted at
    the replica and the one behind it never starts."""
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        before = _aborted(sim)
        sock = _pipelined(_port(base), [_body(True, 3000), _body(False, 3000)])
        time.sleep(0.05)  # the first reached the replica
        sock.close()
        wait_for(lambda: _aborted(sim) > before, timeout=5, what="the replica sees an abort")
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
        total = sum(v for k, v in metric_values(base, "kvgate_requests_total").items())
        assert total == 1  # the pipelined one behind it was never sent on


def test_a_client_that_pipelines_then_resets_still_stops_it_upstream(
    sim_factory: SimFactory,
) -> None:
    """Pipelined requests from a client whose connection resets (no FIN to probe): the
    request being answered is stopped at the replica, not run to its end. uvicorn marks only
    the last request read as gone, which waited behind it and never ran."""
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        before, sent = _aborted(sim), _received(sim)
        sock = _pipelined(_port(base), [_body(False, 3000), _body(False, 3000)])
        # (in flight at the gateway is not yet at the replica)
        wait_for(lambda: _received(sim) > sent, what="the first request at the replica")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, not a FIN
        wait_for(lambda: _aborted(sim) > before, timeout=5, what="the replica sees an abort")
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_half_closed_client_that_leaves_a_stalled_stream_stops_it_upstream(
    sim_factory: SimFactory,
) -> None:
    """The stream started (no 1xx may probe it now) and then went quiet: a replica that
    stalls after 3 tokens. The client still there gets `: keep-alive` comment lines and keeps
    its stream; once it closes its socket, the next comment's reset stops the request at the
    replica within a probe or two. It ran on until the idle timeout (120 s) before."""
    _, sim = sim_factory("--time-scale", "1", "--hang-after-tokens", "3")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        before = _aborted(sim)
        sock = _request(_port(base), _body(True, 3000))
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        got = b""
        while b": keep-alive" not in got:  # the stall is probed, the client still reading
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        assert got.count(b"data: {") >= 3 and b"[DONE]" not in got
        assert _aborted(sim) == before and inflight(base) == 1
        sock.close()
        started = time.monotonic()
        wait_for(lambda: _aborted(sim) > before, timeout=5, what="the replica sees an abort")
        assert time.monotonic() - started < 3.0
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
        assert any('status="499"' in k for k in metric_values(base, "kvgate_requests_total"))


def test_a_half_closed_clients_quiet_crlf_stream_is_probed() -> None:
    """The same quiet stream from a replica (or a proxy re-framing it, as sse-starlette does)
    whose events end with CRLF: kvgate relays them as sent, and took only a LF-framed event's
    end for a boundary where a comment line may go, so such a stream was never probed -- a
    client that left went unseen until the idle timeout, its request held at the replica.
    Its comment lines come as a LF-framed stream's do now."""
    event = orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                          "model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}}]})
    with BadReplica("m") as bad:
        bad.answer = sse_head() + chunked(b"data: " + event + b"\r\n\r\n", last=False)
        bad.rest, bad.gate = b"0\r\n\r\n", threading.Event()  # the rest: never, in this test
        gw, base = gateway_proc(upstreams=[bad.url],
                                env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "8"})
        with gw:
            sock = _request(_port(base), {"model": "m", "stream": True,
                                          "messages": [{"role": "user", "content": "hi"}]})
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(20)
            got = b""
            while b": keep-alive" not in got:  # (before: the idle timeout's error event)
                chunk = sock.recv(65536)
                assert chunk and b'"error"' not in got, got
                got += chunk
            assert got.count(b"data: {") == 1 and inflight(base) == 1
            sock.close()
            wait_for(lambda: inflight(base) == 0, what="the request stopped")
            assert any('status="499"' in k for k in metric_values(base, "kvgate_requests_total"))
        bad.gate.set()


@pytest.mark.parametrize("framing", ["length", "chunked", "upgrade"])
def test_a_client_that_half_closes_before_its_body_ended_is_told_so(
    sim_factory: SimFactory, framing: str,
) -> None:
    """A Content-Length larger than the body sent (or a chunked body without its last chunk),
    then ``shutdown(SHUT_WR)`` (`printf ... | nc -N` with a miscounted length): the body can
    never end. The connection was closed without a byte (uvicorn's disconnect), and the client
    could not tell why; it now reads a 400 saying so. Nothing reaches the replica."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        data = orjson.dumps(_body(False))
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\n"
        if framing == "upgrade":  # `curl --http2`'s h2c upgrade: the body is read apart
            head += b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n" \
                    b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        if framing == "chunked":
            sent = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(data), data)
        else:
            sent = head + b"Content-Length: %d\r\n\r\n%s" % (len(data) + 10, data)
        with socket.create_connection(("127.0.0.1", _port(base))) as sock:
            sock.sendall(sent)
            time.sleep(0.3)  # its body read in part by then
            sock.shutdown(socket.SHUT_WR)
            answer = _read_all(sock)
        head_in, _, body = answer.partition(b"\r\n\r\n")
        assert head_in.startswith(b"HTTP/1.1 400 "), answer[:300]
        error = orjson.loads(body)["error"]
        assert error["type"] == "BadRequestError" and "ended before" in error["message"]
        assert _received(sim) == 0
        # counted as what the client got, not as a client gone (499)
        wait_for(lambda: request_statuses(base) == {"400": 1.0}, what="the 400 counted")
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")

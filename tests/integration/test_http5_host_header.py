"""RFC 9112 3.2: a request's ``Host``. An HTTP/1.1 request without one, any request with two,
or one whose value is no host, gets a 400 in OpenAI's shape before anything runs; they were
served (two Host lines are a request a front proxy and kvgate may read as for two hosts).
HTTP/1.0 may omit it; an empty Host and an IPv6 literal are hosts. Real `kvgate serve
--no-auth` in front of a simulated replica, raw sockets as the client (the SDKs always send
one Host)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.gateway import gateway_proc, metric_values
from tests.support.procs import sim_proc
from tests.support.raw_http import exchange

MODEL = "sim-model"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 3}).encode()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[sim_url])
        with gw:
            yield int(base.rsplit(":", 1)[1])


def _chat(hosts: bytes, version: bytes = b"1.1", close: bool = True) -> bytes:
    return (b"POST /v1/chat/completions HTTP/" + version + b"\r\n" + hosts
            + (b"Connection: close\r\n" if close else b"")
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)


@pytest.mark.parametrize(("hosts", "why"), [
    (b"", "must carry a Host header"),
    (b"Host: a\r\nHost: b\r\n", "Host is given more than once"),
    (b"Host: x\r\nhost: x\r\n", "Host is given more than once"),
    (b"Host: a b/c\r\n", "is not a host name"),
], ids=["none", "two", "two-same", "not-a-host"])
def test_a_missing_repeated_or_bad_host_gets_400(port: int, hosts: bytes, why: str) -> None:
    before = sum(metric_values(f"http://127.0.0.1:{port}", "kvgate_requests_total").values())
    [(status, body)] = exchange(port, _chat(hosts))
    assert status == 400
    error = json.loads(body)["error"]
    assert error["type"] == "BadRequestError" and why in error["message"]
    # refused by the HTTP layer: no request ran
    assert sum(metric_values(f"http://127.0.0.1:{port}", "kvgate_requests_total").values()) \
        == before


def test_two_hosts_on_http_1_0_get_400_too(port: int) -> None:
    [(status, _)] = exchange(port, _chat(b"Host: a\r\nHost: b\r\n", b"1.0"))
    assert status == 400


@pytest.mark.parametrize(("hosts", "version"), [
    (b"", b"1.0"),  # HTTP/1.0 may omit it
    (b"Host: \r\n", b"1.1"),  # RFC 9112 3.2: empty when the target has no authority
    (b"Host: [::1]:8000\r\n", b"1.1"),
    (b"Host: my_gateway.internal:80\r\n", b"1.1"),
], ids=["http-1.0", "empty", "ipv6", "underscore"])
def test_hosts_that_are_fine_are_served(port: int, hosts: bytes, version: bytes) -> None:
    [(status, body)] = exchange(port, _chat(hosts, version))
    assert status == 200, body


def test_a_pipelined_request_without_host_is_refused_after_the_answer_before_it(
    port: int,
) -> None:
    got = exchange(port, _chat(b"Host: x\r\n", close=False) + _chat(b""))
    assert [status for status, _ in got] == [200, 400]
    assert json.loads(got[0][1])["object"] == "chat.completion"

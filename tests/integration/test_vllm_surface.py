"""What a client of vLLM 0.34 sees, through kvgate: a real gateway in front of one simulated
replica, over real sockets. `stream` (and `stream_options.include_usage`) as vLLM's lax
pydantic models read them, `POST /ping`, a `Date` on every answer (no `Server`), vLLM's model
card in `/v1/models`, and the CORS headers on the HTTP guard's own refusals (400/408/431) as
on every other answer to an allowed `Origin`."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from email.utils import parsedate_to_datetime

import httpx
import orjson
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import sim_proc

MODEL = "sim-model"
ORIGIN = "https://app.example"
CONTEXT = 12_288  # the simulated replica's --max-model-len


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sim, url = sim_proc(None, "--time-scale", "50", "--max-model-len", str(CONTEXT), model=MODEL)
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [url]}},
              "server": {"cors_allowed_origins": [ORIGIN], "body_timeout_s": 0.5,
                         "header_timeout_s": 0.5, "max_body_bytes": 1 << 20}}
    with sim:
        gw, base = gateway_proc(config=config)
        with gw:
            yield base


def raw_exchange(base: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `data` on a new connection; (status, headers, body) of the answer."""
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("value", ["true", "True", "1", "yes", "on", "t", "y", 1, 1.0])
def test_stream_true_as_vllm_reads_it(base: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": value}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = events(resp)
    assert data[-1] == "[DONE]" and "text_completion" in data[0]
    assert not any('"usage"' in d for d in data)  # not asked for: kvgate's own is dropped


@pytest.mark.parametrize("value", ["false", "0", "no", "off", "F", "n", 0, None])
def test_stream_false_as_vllm_reads_it(base: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": value}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"], resp.text


@pytest.mark.parametrize("value", ["maybe", "", " true", 2, [], {}])
def test_stream_vllm_refuses_is_a_400(base: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": value}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"


def test_include_usage_as_vllm_reads_it(base: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": "true",
            "stream_options": {"include_usage": "yes"}}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
    usage = [orjson.loads(d) for d in events(resp)[:-1] if '"usage"' in d]
    assert usage and usage[-1]["usage"]["completion_tokens"] == 3  # the client asked for it


def test_ping_answers_get_and_post(base: str) -> None:
    assert httpx.get(f"{base}/ping").status_code == 200
    assert httpx.post(f"{base}/ping").status_code == 200
    assert httpx.post(f"{base}/ping", content=b"{}").status_code == 200
    resp = httpx.put(f"{base}/ping")
    assert resp.status_code == 405 and resp.headers["allow"] == "GET, HEAD, POST"
    assert httpx.post(f"{base}/health").status_code == 405  # vLLM: GET only


def _is_now(date: str) -> bool:
    return abs(parsedate_to_datetime(date).timestamp() - time.time()) < 5


def test_every_answer_has_a_date_and_no_server(base: str) -> None:
    answers = [
        httpx.get(f"{base}/healthz"), httpx.get(f"{base}/nope"),
        httpx.get(f"{base}/v1/models"),
        httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "max_tokens": 2}, timeout=10),
        httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                  "max_tokens": 2, "stream": True}, timeout=10),
    ]
    for resp in answers:
        assert _is_now(resp.headers["date"]), resp.headers
        assert "server" not in resp.headers
    status, headers, _ = raw_exchange(base, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and _is_now(headers["date"]) and "server" not in headers


def test_models_carry_vllms_model_card(base: str) -> None:
    # the context length comes from the replica's own card (asked by the health monitor)
    wait_for(lambda: "max_model_len" in httpx.get(f"{base}/v1/models").json()["data"][0],
             what="the replica's max_model_len")
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "kvgate"
    assert card["max_model_len"] == CONTEXT
    assert 0 < time.time() - card["created"] < 120  # when the gateway first knew the model
    assert card["root"] == MODEL and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"
    one = httpx.get(f"{base}/v1/models/{MODEL}").json()
    assert one == card  # the same card, the same `created`, every time


def _cors(headers: dict[str, str]) -> str | None:
    return headers.get("access-control-allow-origin")


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        # not HTTP/1.1: a header line without a colon
        (f"GET /healthz HTTP/1.1\r\nHost: x\r\nOrigin: {ORIGIN}\r\nno colon here\r\n\r\n", 400),
        # more than `server.max_headers` (100) headers
        (f"GET /healthz HTTP/1.1\r\nHost: x\r\nOrigin: {ORIGIN}\r\n"
         + "".join(f"X-H{i}: v\r\n" for i in range(120)) + "\r\n", 431),
        # a body that never comes (`server.body_timeout_s`)
        (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: {ORIGIN}\r\n"
         "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{", 408),
        # headers that never end (`server.header_timeout_s`)
        (f"GET /healthz HTTP/1.1\r\nHost: x\r\nOrigin: {ORIGIN}\r\nX-Slow: ", 408),
    ],
    ids=["400", "431", "408-body", "408-headers"],
)
def test_the_guards_refusals_carry_cors(base: str, request_bytes: str, status: int) -> None:
    got, headers, body = raw_exchange(base, request_bytes.encode())
    assert got == status, body
    assert _cors(headers) == ORIGIN and headers["vary"] == "origin"
    assert "x-request-id" in headers["access-control-expose-headers"]
    assert orjson.loads(body)["error"]["code"] == status
    # an origin not allowed gets none, as on every other answer
    other = request_bytes.replace(ORIGIN, "https://elsewhere.example").encode()
    got, headers, _ = raw_exchange(base, other)
    assert got == status and _cors(headers) is None


def test_the_apps_refusals_carry_cors_too(base: str) -> None:
    """413 (a body past `server.max_body_bytes`), 400, 404, 405: answered by the app."""
    hdrs = {"Origin": ORIGIN}
    big = httpx.post(f"{base}/v1/completions", headers=hdrs, timeout=10,
                     json={"model": MODEL, "prompt": "x" * (2 << 20)})
    answers = [big, httpx.post(f"{base}/v1/completions", headers=hdrs, content=b"{bad"),
               httpx.get(f"{base}/nope", headers=hdrs), httpx.put(f"{base}/ping", headers=hdrs)]
    assert [r.status_code for r in answers] == [413, 400, 404, 405]
    for resp in answers:
        assert resp.headers["access-control-allow-origin"] == ORIGIN, resp.status_code


def test_a_lax_stream_reaches_vllm_as_the_client_sent_it() -> None:
    """vLLM's request models check `stream` as the client sent it before pydantic reads it
    (``data.get("stream")`` in their before-validators: `stream_options` only with a stream,
    no `prompt_logprobs` in one), so the replica must get the client's own value: the same
    answer as when the client asks the replica itself."""
    sim, url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, base = gateway_proc(config={"pools": {"p": {"served_model": MODEL,
                                                        "replicas": [url]}}})
        with gw:
            for value in ("false", "0", "no", 1.0):
                body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": value,
                        "stream_options": {"include_usage": True}}
                direct = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
                through = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
                assert (value, through.status_code) == (value, direct.status_code), through.text


def test_the_header_timeout_holds_after_an_upgrade_requests_body(base: str) -> None:
    """The body of a POST asking to upgrade to h2c (`curl --http2`) is read apart from the
    HTTP parser; the next request on the connection must still have its headers timed
    (`server.header_timeout_s`): they were not, so a client could hold the connection
    forever by sending them a byte at a time (slowloris)."""
    body = orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2})
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, "
                  b"HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA"
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
        raw = b""
        while b"text_completion" not in raw or not raw.endswith(b"}"):
            raw += s.recv(65536)
        assert raw.startswith(b"HTTP/1.1 200"), raw
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ended
        raw = b""
        with contextlib.suppress(TimeoutError):  # (10 s: the test fails below)
            while chunk := s.recv(65536):
                raw += chunk
    assert raw.startswith(b"HTTP/1.1 408"), raw


def test_an_upgrade_requests_body_refused_early_is_still_read_past(base: str) -> None:
    """A POST asking to upgrade to h2c whose declared body is past `server.max_body_bytes`
    gets its 413 at once; the connection stays open (no `connection: close`), so the rest
    of the body is read and dropped and a next request on it answered, as for any POST.
    It stalled instead: the body read on (held, unread) until reading paused for good, and
    the client's send hung until the body timeout reset the connection."""
    body = b"x" * (2 << 20)  # the fixture's limit is 1 MiB
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, "
                  b"HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA"
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                  b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                  % (len(body), body))
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 413"), raw[:200]
    assert raw.count(b"HTTP/1.1 200 OK") == 1 and b'"object":"list"' in raw, raw[-300:]

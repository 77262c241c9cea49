"""Clients the other tests do not use: an HTTP/1.0 client, a body starting with a UTF-8 byte
order mark, duplicate JSON keys, a client that reads a stream slowly (or leaves half way),
long header values, a huge integer, a POST that asks to upgrade to h2c (`curl --http2`). Real
simulator, real gateway, over loopback."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import sim_proc

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, str]]:
    sim, url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        proc, base = gateway_proc(upstreams=[url])
        with proc:
            yield base, url


def _http10(base: str, body: bytes) -> bytes:
    """POST `body` to the chat route as an HTTP/1.0 client; everything until the close."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("stream", [False, True])
def test_an_http_1_0_client_gets_no_chunked_framing(gw: tuple[str, str], stream: bool) -> None:
    """RFC 9112: no Transfer-Encoding to an HTTP/1.0 client. A stream (no length known) is
    delimited by the connection's close, its events as sent."""
    raw = _http10(gw[0], orjson.dumps({**CHAT, "stream": stream}))
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 200")
    assert not any(line.startswith(b"transfer-encoding") for line in lines), head
    assert b"connection: close" in lines
    if stream:
        assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n"), body[:80]
    else:
        assert orjson.loads(body)["object"] == "chat.completion"


def test_a_body_with_a_utf8_byte_order_mark_is_read_as_vllm_reads_it(
    gw: tuple[str, str],
) -> None:
    """Python's json (vLLM's) skips a leading BOM, as some Windows tools write one."""
    base, _ = gw
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                      headers={"content-type": "application/json"},
                      content=b"\xef\xbb\xbf" + orjson.dumps(CHAT))
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "chat.completion"
    # a BOM anywhere else is still not JSON
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                      content=b" \xef\xbb\xbf" + orjson.dumps(CHAT))
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"


def test_duplicate_keys_mean_the_last_one_as_for_vllm(gw: tuple[str, str]) -> None:
    """The gateway routes and the replica answers on the same value: the last (the body the
    replica gets is written again, with one of each)."""
    base, sim = gw
    httpx.delete(f"{sim}/sim/requests")
    body = (b'{"model": "nope", "model": "' + MODEL.encode() + b'", "stream": true, '
            b'"stream": false, "max_tokens": 9, "max_tokens": 2, '
            b'"messages": [{"role": "user", "content": "hi"}]}')
    resp = httpx.post(f"{base}/v1/chat/completions", content=body, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2
    forwarded = httpx.get(f"{sim}/sim/requests", params={"n": 1}).json()["requests"][-1]["body"]
    assert (forwarded["model"], forwarded["stream"], forwarded["max_tokens"]) == (
        MODEL, False, 2)


def test_a_slow_reader_gets_the_whole_stream_and_one_leaving_frees_its_slot(
    gw: tuple[str, str],
) -> None:
    base, _ = gw
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            got = b"".join(resp.iter_raw(256))  # small reads: the socket fills up between
        assert got.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in got
        with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            for i, _ in enumerate(resp.iter_raw(64)):
                if i == 20:
                    break  # leaves half way
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_long_header_values_up_to_the_limit_are_served(gw: tuple[str, str]) -> None:
    base, _ = gw
    long = "a" * 60_000  # under server.max_header_bytes (64 KiB) in all
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10,
                           default_headers={"x-custom": long})
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert raw.status_code == 200
    # a 60 KB X-Request-Id is not echoed: a new one is made
    resp = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=10,
                      headers={"x-request-id": long})
    assert resp.status_code == 200 and len(resp.headers["x-request-id"]) == 32
    resp = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=10,
                      headers={"x-custom": "a" * 70_000})
    assert resp.status_code == 431 and resp.json()["error"]["code"] == 431


def test_a_huge_max_tokens_is_a_400(gw: tuple[str, str]) -> None:
    """A 29-digit integer (the SDK sends it as written) and a number beyond a double."""
    base, _ = gw
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=10**28,
                                       messages=[{"role": "user", "content": "hi"}])
    errors = [caught.value.response.json()["error"]]
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, content=(
        b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1e400, '
        b'"messages": [{"role": "user", "content": "hi"}]}'))
    assert resp.status_code == 400
    errors.append(resp.json()["error"])
    for error in errors:
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
        assert "Traceback" not in error["message"]


def _answers(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """`count` whole answers (Content-Length framed) read from `sock`: (status line, body)."""
    buf, out = b"", list[tuple[bytes, bytes]]()
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536) or b"<closed>"
            assert not buf.endswith(b"<closed>"), (out, buf)
        head, _, buf = buf.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(buf) < length:
            buf += sock.recv(65536)
        out.append((head.split(b"\r\n")[0], buf[:length]))
        buf = buf[length:]
    return out


H2C = (b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
       b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n")


@pytest.mark.parametrize("framing", ["length", "length-later", "chunked", "chunked-later"])
def test_an_h2c_upgrade_post_is_served_with_its_body(gw: tuple[str, str], framing: str) -> None:
    """`curl --http2 http://...` asks to upgrade an ordinary POST to h2c. kvgate stays on
    HTTP/1.1 (RFC 9110 7.8 lets a server ignore Upgrade) and must still read the body, which
    the HTTP parser skips for an upgrade request: the request is answered as sent (it was a
    400 "not valid JSON": an empty body), and the connection stays usable: a request
    pipelined after the body is answered too (after a chunked body it was dropped unanswered,
    the connection closed after the first answer)."""
    base, _ = gw
    host, port = base.removeprefix("http://").split(":")
    body = orjson.dumps(CHAT)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if framing.startswith("chunked"):
        head += H2C + b"Transfer-Encoding: chunked\r\n\r\n"
        sent = b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (
            7, body[:7], len(body) - 7, body[7:])
    else:
        head += H2C + b"Content-Length: %d\r\n\r\n" % len(body)
        sent = body
    pipelined = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        if framing.endswith("-later"):  # the body in later reads than the headers, its
            cuts = [0, 5, len(sent) - 4, len(sent) - 1, len(sent)]  # last CRLFs split too
            sock.sendall(head)
            for start, end in itertools.pairwise(cuts):
                time.sleep(0.2)
                sock.sendall(sent[start:end] + (pipelined if end == len(sent) else b""))
        else:
            sock.sendall(head + sent + pipelined)
        answers = _answers(sock, 2)
    status, answer = answers[0]
    assert status.startswith(b"HTTP/1.1 200"), answer
    assert orjson.loads(answer)["object"] == "chat.completion"
    assert answers[1][0].startswith(b"HTTP/1.1 200")
    assert orjson.loads(answers[1][1])["object"] == "list"
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_form_fields_are_a_415_naming_json_and_a_json_body_declared_a_form_is_served(
    gw: tuple[str, str],
) -> None:
    """`curl -d 'model=...&prompt=...'`, `requests.post(url, data={...})`: form fields,
    not JSON. vLLM answers 415 for a body not declared JSON; it was a 400 "not valid JSON:
    unexpected character ... column 1". `curl -d '{...}'` declares its JSON a form too: read
    as JSON, as before."""
    base, _ = gw
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                      data={"model": MODEL, "messages": "hi"})
    assert resp.status_code == 415, resp.text
    error = resp.json()["error"]
    assert error["type"] == "UnsupportedMediaTypeError" and error["code"] == 415
    assert "application/json" in error["message"]
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, content=orjson.dumps(CHAT),
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 200 and resp.json()["object"] == "chat.completion"

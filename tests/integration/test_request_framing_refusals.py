"""What a user's odd request framing or path meets at a real `kvgate serve` (over real sockets
and the official openai client): a transfer coding other than chunked is a 501 before the
body is read (the parser undoes only the chunked framing: the app used to read the gzip bytes
as the JSON body and answer a 400 about "surrogates"), a body in Latin-1 is a 400 that says
JSON must be UTF-8, and an OpenAI route neither kvgate nor vLLM serves (`/v1/files`, ...) is
a 404 naming the routes kvgate serves."""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, inflight
from tests.support.procs import sim_proc

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SERVED = "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses and /v1/models"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sim, url = sim_proc()
    with sim:
        gw, base = gateway_proc(upstreams=[url])
        with gw:
            yield base


def exchange(base: str, head: bytes, body: bytes) -> tuple[int, dict[bytes, bytes], Any]:
    """One request on its own connection: (status, headers, JSON body)."""
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                  + head + b"\r\n" + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    top, _, payload = raw.partition(b"\r\n\r\n")
    lines = top.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(payload)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


@pytest.mark.parametrize("codings", [
    b"transfer-encoding: gzip, chunked\r\n",
    b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",  # the same, in two lines
])
def test_a_gzip_transfer_coding_is_a_501_not_a_json_error(base: str, codings: bytes) -> None:
    status, headers, body = exchange(base, codings, chunked(gzip.compress(json.dumps(CHAT)
                                                                          .encode())))
    assert status == 501, body
    assert body["error"]["type"] == "NotImplementedError"
    assert "Transfer-Encoding 'gzip' is not supported" in body["error"]["message"]
    assert headers[b"x-should-retry"] == b"false"  # the SDKs would retry a 5xx in vain
    assert inflight(base) == 0


def test_chunked_framing_alone_is_still_read(base: str) -> None:
    data = json.dumps(CHAT).encode()
    for codings in (b"transfer-encoding: chunked\r\n", b"transfer-encoding: Chunked \r\n"):
        status, _, body = exchange(base, codings, chunked(data))
        assert status == 200, body
        assert body["object"] == "chat.completion"


def test_a_latin_1_body_is_told_json_is_utf_8(base: str) -> None:
    text = json.dumps({**CHAT, "messages": [{"role": "user", "content": "caf\u00e9"}]},
                      ensure_ascii=False)
    raw = text.encode("latin-1")
    status, _, body = exchange(base, b"content-type: application/json; charset=latin-1\r\n"
                               b"content-length: %d\r\n" % len(raw), raw)
    assert status == 400, body
    message = body["error"]["message"]
    assert f"it is not valid UTF-8 (byte {raw.index(0xE9)})" in message, message
    assert "surrogates" not in message


def test_openai_routes_kvgate_does_not_serve_name_what_it_serves(base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=10)
    calls: list[Callable[[], object]] = [
        client.files.list, client.batches.list,
        lambda: client.audio.speech.create(model=MODEL, input="hi", voice="alloy")]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert f"kvgate serves {SERVED}." in str(err.value)
    base_url = httpx.get(f"{base}/v1", timeout=10)  # the base URL itself, opened in a browser
    assert base_url.status_code == 404
    assert base_url.json()["error"]["message"] == f"Unknown path /v1: kvgate serves {SERVED}."
    # vLLM 0.34's WebSocket route: said to be vLLM's, as its other client endpoints are
    realtime = httpx.get(f"{base}/v1/realtime", timeout=10)
    assert realtime.status_code == 404
    assert realtime.json()["error"]["message"] == (
        f"/v1/realtime is a vLLM endpoint that kvgate does not serve (it serves {SERVED}).")


def test_an_http_1_0_client_gets_no_100_continue(base: str) -> None:
    """RFC 9110: an HTTP/1.0 request's `Expect: 100-continue` is ignored, and no 1xx may go
    to an HTTP/1.0 client (one would read "HTTP/1.1 100 Continue" as its answer)."""
    data = json.dumps(CHAT).encode()
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nhost: x\r\nexpect: 100-continue\r\n"
                  b"content-length: %d\r\n\r\n" % len(data) + data)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n"), raw[:60]
    assert b" 100 Continue" not in raw


def test_input_items_of_a_stored_response_names_the_stored_routes(base: str) -> None:
    """vLLM 0.34 serves a stored response's GET and cancel, not OpenAI's `input_items` (the
    SDK's `responses.input_items.list`): its 404 says which ones there are."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.input_items.list("resp_abc")
    assert ("Unknown path /v1/responses/resp_abc/input_items: kvgate serves GET "
            "/v1/responses/{id} and POST /v1/responses/{id}/cancel") in str(err.value)

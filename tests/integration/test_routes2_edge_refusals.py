"""The HTTP guard's own refusals (bad HTTP 400, a body cut short 400, 408, 431) on Anthropic's
routes are Anthropic-shaped, as the app's errors there are: the Anthropic SDK reads the type
and the message (they were OpenAI's ``{"error": {...}}``, its ``type`` lost). The OpenAI
routes keep OpenAI's shape. A real `kvgate serve` before one simulated replica, raw sockets
for what no client sends, the official Anthropic SDK for a header block past the limit and an
oversized body."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import sim_proc

anthropic: Any = pytest.importorskip("anthropic", reason="run scripts/setup (test extra)")

LIMIT = 50_000  # server.max_body_bytes
TURNS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sim, url = sim_proc()
    with sim:
        gw, base = gateway_proc(upstreams=[url], env={
            "KVGATE_SERVER__BODY_TIMEOUT_S": "1", "KVGATE_SERVER__MAX_BODY_BYTES": str(LIMIT)})
        with gw:
            yield base


def _exchange(base: str, data: bytes, *, half_close: bool = False) -> tuple[int, Any]:
    """`data` on its own connection (then, `half_close`, the client's end of sending): the
    answer's status and JSON body."""
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    top, _, payload = raw.partition(b"\r\n\r\n")
    return int(top.split(b"\r\n")[0].split()[1]), json.loads(payload)


def _anthropic(answer: tuple[int, Any], status: int) -> str:
    got, doc = answer
    assert got == status, doc
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    message: str = doc["error"]["message"]
    return message


HEAD = b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def test_bad_http_on_messages_is_anthropic_shaped(base: str) -> None:
    _anthropic(_exchange(base, HEAD + b"no colon here\r\n\r\n"), 400)
    counted = b"POST /v1/messages/count_tokens HTTP/1.1\r\nhost: x\r\n"
    _anthropic(_exchange(base, counted + b"content-length: 9x\r\n\r\n"), 400)


def test_a_body_cut_short_and_a_slow_body_on_messages(base: str) -> None:
    cut = _exchange(base, HEAD + b"content-length: 100\r\n\r\n{\"model\"", half_close=True)
    assert "declared end" in _anthropic(cut, 400)
    slow = _exchange(base, HEAD + b"content-length: 100\r\n\r\n{\"model\"")
    assert "did not arrive in time" in _anthropic(slow, 408)
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_the_openai_routes_keep_openais_shape(base: str) -> None:
    status, doc = _exchange(base, HEAD.replace(b"/v1/messages", b"/v1/chat/completions")
                            + b"no colon here\r\n\r\n")
    assert status == 400 and doc["error"]["type"] == "BadRequestError"


def test_the_sdk_reads_the_guards_431_and_the_413(base: str) -> None:
    huge = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0,
                               default_headers={"x-padding": "p" * 70_000})
    with pytest.raises(anthropic.APIStatusError) as headers:
        huge.messages.create(model="sim-model", max_tokens=2, messages=TURNS)
    assert headers.value.status_code == 431
    assert headers.value.body["error"]["type"] == "invalid_request_error"
    assert "headers exceed" in headers.value.body["error"]["message"]
    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as large:
        client.messages.create(model="sim-model", max_tokens=2, system="x" * LIMIT,
                               messages=TURNS)
    assert large.value.status_code == 413
    assert large.value.body["error"]["type"] == "request_too_large"
    assert str(LIMIT) in large.value.body["error"]["message"]

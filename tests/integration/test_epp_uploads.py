"""Request bodies still arriving through Envoy are bounded as at the HTTP edge: all together
(`server.max_pending_body_bytes`), and each in time (`server.body_timeout_s`). Envoy streams
a body to the picker as it comes (``FULL_DUPLEX_STREAMED``) and the picker holds it until its
end, so unfinished uploads held the picker's memory without bound (30 of 7 MiB: +300 MB RSS
with a 64 MiB bound). Past the bound a body is the HTTP edge's 503 with Retry-After; the
bytes come back when an upload ends, finished or not. A body still arriving `body_timeout_s`
after its headers is the HTTP edge's 408 (Envoy's stream idle timeout, restarted by each
byte, let one trickle for ever).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import inflight, request_statuses, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
BOUND = 1_000_000


@dataclass
class Stack:
    envoy: str
    epp: str


@contextmanager
def _stack(server: dict[str, Any]) -> Iterator[Stack]:
    procs: list[Proc] = []
    try:  # (a long context, so a prompt of 700,000 characters is served)
        sim, url = sim_proc(None, "--time-scale", "1000", "--max-model-len", "400000",
                            model=MODEL)
        procs.append(sim.start())
        epp = epp_proc(config={
            "pools": {"default": {"served_model": MODEL, "replicas": [url]}}, "server": server})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        yield Stack(base, epp.base)
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture
def stack() -> Iterator[Stack]:
    with _stack({"max_pending_body_bytes": BOUND}) as started:
        yield started


def _unfinished(base: str, sent: int) -> socket.socket:
    """An upload that declares 100,000 bytes more than it sends."""
    body = json.dumps({"model": MODEL, "prompt": "q" * (sent + 100_000),
                       "max_tokens": 2}).encode()
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    sock.sendall(body[:sent])
    return sock


def _status(client: openai.OpenAI) -> tuple[int, str | None, Any]:
    """A prompt of 700,000 characters (Envoy hands it to the picker in parts): its status,
    Retry-After and error object."""
    try:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="p" * 700_000, max_tokens=2)
        return raw.status_code, raw.headers.get("retry-after"), None
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.headers.get("retry-after"), exc.body


def test_unfinished_uploads_are_bounded_all_together(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.envoy}/v1", api_key="x", max_retries=0,
                           timeout=30)
    assert _status(client)[0] == 200  # alone, it fits
    held = _unfinished(stack.envoy, 800_000)
    try:
        seen = [_status(client)]

        def refused() -> bool:  # the held upload's bytes reach the picker as they come
            seen[0] = _status(client)
            return seen[0][0] == 503

        wait_for(refused, timeout=20, what="a body past the bound of all arriving bodies refused")
        _, retry_after, error = seen[0]
        assert retry_after == "1"
        assert error["type"] == "ServiceUnavailableError", error
        assert "too many request bodies" in error["message"]
    finally:
        held.close()  # the client leaves mid-upload: its bytes come back
    wait_for(lambda: _status(client)[0] == 200, timeout=20, what="the bound free again")
    wait_for(lambda: inflight(stack.epp) == 0, what="no exchange left in flight")


def test_a_body_not_in_in_time_is_a_408() -> None:
    with _stack({"body_timeout_s": 1}) as stack:
        held = _unfinished(stack.envoy, 1_000)
        held.settimeout(30)  # (Envoy's stream idle timeout is 600 s)
        answer = b""
        with held:
            while chunk := held.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        error = json.loads(body)["error"]
        assert error["type"] == "RequestTimeoutError", error
        assert error["message"] == "The request body did not arrive in time."
        wait_for(lambda: request_statuses(stack.epp).get("408") == 1, what="counted 408")
        assert inflight(stack.epp) == 0

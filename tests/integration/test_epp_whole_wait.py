"""A non-streamed answer comes whole, after its last token (vLLM sends nothing before), so
the HTTP edge bounds its wait by the total timeout only (`gateway/timeouts.py`). Behind
Envoy the same: the router's per-try idle timeout (`first_byte_timeout_s`, for a replica
that sends no head) applies to streams only; it cut every non-streamed generation longer
than `first_byte_timeout_s` with a 504 (which the SDK retries twice) where the HTTP edge
answered 200. A client cannot lift it from a stream by sending the route's marker header.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.config import UpstreamConfig
from gateway.epp.wire import WHOLE
from tests.support.epp import both_edges
from tests.support.procs import sim_proc

MODEL = "sim-model"
SETTINGS = {"first_byte_timeout_s": 1.0, "idle_timeout_s": 1.0, "total_timeout_s": 30.0,
            "max_attempts": 1}
SLOW_MS = 3000  # the replica's wait before it starts a request: past every first-byte bound


@pytest.fixture(scope="module")
def edges() -> Iterator[dict[str, str]]:
    sim, url = sim_proc(None, "--time-scale", "20", "--latency-ms", str(SLOW_MS), model=MODEL)
    with sim, both_edges(url, MODEL, SETTINGS,
                         upstream=UpstreamConfig(first_byte_timeout_s=1.5,
                                                 total_timeout_s=30.0)) as every:
        yield every


def _ask(base: str, stream: bool, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=20, headers=headers, json={
        "model": MODEL, "max_tokens": 2, "stream": stream,
        "messages": [{"role": "user", "content": "take your time"}]})


@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_a_slow_whole_answer_is_waited_for(edges: dict[str, str], edge: str) -> None:
    resp = _ask(edges[edge], stream=False)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_a_slow_stream_is_still_cut_at_first_byte(edges: dict[str, str], edge: str) -> None:
    resp = _ask(edges[edge], stream=True, headers={WHOLE: "1"})  # the marker: not the client's
    assert resp.status_code == 504, resp.text
    # the HTTP edge's words at both (the picker said "The upstream replica answered 504." for
    # Envoy's own plain-text timeout: no replica answered)
    assert resp.json()["error"] == {
        "message": "The replica did not answer in time (first byte timeout).",
        "type": "GatewayTimeoutError", "param": None, "code": 504}

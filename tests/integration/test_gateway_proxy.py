"""kvgate as a drop-in OpenAI base URL: the official client, sync and async, through the gateway
to real simulated replicas; what the replicas receive; request ids and routing headers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, list[str]]]:
    """Two simulated replicas behind a quick-form gateway, shared by this module's tests."""
    sims: list[Proc] = []
    try:
        _, urls = start_sims(sims, 2, "--time-scale", "50", model=MODEL)
        gw, base = gateway_proc(upstreams=urls)
        with gw:
            yield base, urls
    finally:
        for proc in sims:
            proc.stop()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def last_request(sim_url: str) -> dict[str, Any]:
    items = httpx.get(f"{sim_url}/sim/requests?n=1").json()["requests"]
    assert items, "the replica received nothing"
    item: dict[str, Any] = items[-1]
    return item


def test_models_lists_the_public_names(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    assert [m.id for m in client(base).models.list()] == [MODEL]


def test_models_retrieve_answers_a_public_name_and_404s_others(
    fleet: tuple[str, list[str]],
) -> None:
    base, _ = fleet
    model = client(base).models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "kvgate")
    with pytest.raises(openai.NotFoundError) as caught:
        client(base).models.retrieve("org/no-such-model")
    assert caught.value.body == {
        "message": f"The model `org/no-such-model` does not exist. Models served here: {MODEL}"
                   " (GET /v1/models lists them).",
        "type": "NotFoundError", "param": "model", "code": "model_not_found"}


def test_chat_non_streamed_with_headers_and_request_id(fleet: tuple[str, list[str]]) -> None:
    base, sims = fleet
    raw = client(base).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5,
        extra_headers={"X-Request-Id": "req-abc-123"},
    )
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert raw.headers["x-request-id"] == "req-abc-123"
    pool, _, replica = raw.headers["x-kvgate-replica"].partition("/")
    assert pool == "default" and f"http://{replica}" in sims
    assert raw.headers["x-kvgate-route"]
    received = last_request(f"http://{replica}")
    # (with a kvgate id appended: two requests may share a client's id)
    assert re.fullmatch("req-abc-123-[0-9a-f]{32}", received["headers"]["x-request-id"])


def test_generated_request_id(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    raw = client(base).completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert len(raw.headers["x-request-id"]) == 32


def test_body_forwarded_untouched_except_model_and_usage(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    raw = client(base).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "keep me"}], max_tokens=3,
        stream=True, temperature=0.5,
        extra_body={"ignore_eos": True, "top_k": 7, "priority": 0, "cache_salt": "client-salt"},
    )
    list(raw.parse())
    replica = raw.headers["x-kvgate-replica"].partition("/")[2]
    body = last_request(f"http://{replica}")["body"]
    assert body == {
        "model": MODEL, "messages": [{"role": "user", "content": "keep me"}], "max_tokens": 3,
        "stream": True, "temperature": 0.5, "ignore_eos": True, "top_k": 7, "priority": 0,
        "stream_options": {"include_usage": True},
    }


def test_chat_stream_strips_usage_unless_asked(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    c = client(base)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "count"}]
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                            stream=True))
    assert all(ch.usage is None for ch in chunks)
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    asked = list(c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 16


def test_raw_sse_ends_with_done(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = resp.read().decode()
    assert text.endswith("data: [DONE]\n\n")
    assert '"usage"' not in text


def test_completions_and_embeddings(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    c = client(base)
    comp = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=4)
    assert comp.choices[0].text and comp.usage and comp.usage.completion_tokens == 4
    emb = c.embeddings.create(model=MODEL, input=["a", "b"])
    assert len(emb.data) == 2 and emb.data[0].embedding


async def test_async_client_stream_and_not(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "async"}]
    done = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
    assert done.choices[0].finish_reason == "length"
    stream = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                             stream=True)
    reasons = [ch.choices[0].finish_reason async for ch in stream if ch.choices]
    assert reasons[-1] is not None
    await c.close()


def test_metrics_count_requests_and_tokens(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    client(base).completions.create(model=MODEL, prompt="metrics", max_tokens=2)
    text = httpx.get(f"{base}/metrics").text
    assert 'kvgate_requests_total{pool="default"' in text
    assert 'kvgate_tokens_total{kind="completion",pool="default",tier="default"}' in text
    assert "kvgate_inflight_requests" in text and "kvgate_overhead_seconds" in text


def test_health_and_readiness(fleet: tuple[str, list[str]]) -> None:
    base, _ = fleet
    assert httpx.get(f"{base}/healthz").status_code == 200
    assert httpx.get(f"{base}/readyz").status_code == 200

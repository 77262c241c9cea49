"""`kvgate sim`'s Responses API (vLLM 0.34): non-stream, the event stream, the per-replica store."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai.types.responses import ResponseCompletedEvent, ResponseInputParam

from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[str, str]]:
    """Two replicas with the response store on (flag, and vLLM's environment variable)."""
    a, a_url = sim_proc(None, "--time-scale", "50", "--enable-store", model=MODEL)
    b_cmd, b_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    b = Proc(b_cmd.cmd, ready_url=b_cmd.ready_url, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    with a, b:
        yield a_url, b_url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_non_streamed_response_text_and_usage(sims: tuple[str, str]) -> None:
    client = _client(sims[0])
    resp = client.responses.create(model=MODEL, input="Tell me a story",
                                   instructions="Be brief.", max_output_tokens=6, store=False)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "incomplete"  # max_output_tokens reached
    assert len(resp.output_text) == 24  # 6 tokens of 4 characters
    assert resp.usage is not None
    assert resp.usage.output_tokens == 6
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6
    assert resp.usage.input_tokens_details.cached_tokens == 0
    # instructions are part of the prompt: the same input without them is shorter
    bare = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=6,
                                   store=False)
    assert bare.usage is not None and bare.usage.input_tokens < resp.usage.input_tokens


def test_message_list_input_and_prefix_cache_hit(sims: tuple[str, str]) -> None:
    client = _client(sims[0])
    long = "A long shared system prompt for the responses test. " * 30
    items: ResponseInputParam = [
        {"role": "system", "content": long},
        {"role": "user", "content": [{"type": "input_text", "text": "hi there"}]}]
    first = client.responses.create(model=MODEL, input=items, store=False)
    again = client.responses.create(model=MODEL, input=items, store=False)
    assert first.status == "completed" and first.output_text == again.output_text
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens >= 64


def test_stream_event_sequence(sims: tuple[str, str]) -> None:
    stream = _client(sims[0]).responses.create(model=MODEL, input="stream it",
                                               max_output_tokens=5, stream=True, store=False)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert isinstance(events[-1], ResponseCompletedEvent), events[-1]
    done = events[-1].response
    assert len(text) == 20 and done.output_text == text
    assert done.usage is not None and done.usage.output_tokens == 5


def test_raw_stream_is_named_events_without_done(sims: tuple[str, str]) -> None:
    body = {"model": MODEL, "input": "raw", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{sims[0]}/v1/responses", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: response.created" and lines[1].startswith("data: {")
    assert "data: [DONE]" not in lines


def test_store_previous_response_and_other_replica(sims: tuple[str, str]) -> None:
    a, b = _client(sims[0]), _client(sims[1])
    first = a.responses.create(model=MODEL, input="Remember the number 7. " * 20, store=True)
    assert a.responses.retrieve(first.id).output_text == first.output_text
    follow = a.responses.create(model=MODEL, input="What was it?",
                                previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and first.usage is not None
    # the earlier turn is part of the prompt (and its prefix is cached)
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError) as info:  # the store lives on one replica only
        b.responses.create(model=MODEL, input="What was it?", previous_response_id=first.id)
    assert info.value.body == {"message": f"Response with id '{first.id}' not found.",
                               "type": "invalid_request_error", "param": "response_id",
                               "code": 404}
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):  # finished: nothing to cancel
        a.responses.cancel(first.id)


def test_store_disabled_ignores_store_and_refuses_background(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50")
    client = _client(url)
    resp = client.responses.create(model=MODEL, input="x", store=True)
    with pytest.raises(openai.NotFoundError):  # silently not stored, as vLLM does
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", background=True)
    assert "VLLM_ENABLE_RESPONSES_API_STORE" in info.value.message


def test_background_response_can_be_cancelled(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "0.05", "--enable-store")  # slow: still running
    client = _client(url)
    resp = client.responses.create(model=MODEL, input="a long job", background=True,
                                   max_output_tokens=500)
    assert resp.status == "queued"
    assert client.responses.retrieve(resp.id).status in ("queued", "in_progress")
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(resp.id).status == "cancelled"
    stats = httpx.get(f"{url}/sim/stats").json()
    assert stats["in_flight"] == 0 and stats["aborted"] == 1


def test_background_response_completes(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--enable-store")
    client = _client(url)
    resp = client.responses.create(model=MODEL, input="quick job", background=True,
                                   max_output_tokens=3)
    for _ in range(500):
        got = client.responses.retrieve(resp.id)
        if got.status not in ("queued", "in_progress"):
            break
    assert got.status == "incomplete" and len(got.output_text) == 12


def test_response_messages_come_after_usage(sims: tuple[str, str]) -> None:
    r = httpx.post(f"{sims[0]}/v1/responses", json={
        "model": MODEL, "input": "x " * 800, "max_output_tokens": 2, "store": False,
        "enable_response_messages": True})
    keys = list(r.json())
    assert keys.index("input_messages") > keys.index("usage")
    assert len(r.content) - r.content.index(b'"usage"') > 1024

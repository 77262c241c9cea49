"""Tool calling and the Responses API end to end through kvgate (issue 10, items 2-3): the
official openai client, a real gateway, simulated vLLM replicas. A tool-calling client runs its
whole loop (forced call, the tool's result sent back, the final text), streamed and not; the
Responses API answers with usage, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sims = [sim_proc(None, "--time-scale", "50", model=MODEL) for _ in range(2)]
    with sims[0][0], sims[1][0]:
        gw, url = gateway_proc(upstreams=[s[1] for s in sims])
        with gw:
            yield url


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_calling_loop_through_the_gateway(base: str, stream: bool) -> None:
    c = client(base)
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]
    if stream:
        chunks = [ch for ch in c.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
            stream=True) if ch.choices]
        deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].id and deltas[0].function is not None
        call_id, name = deltas[0].id, deltas[0].function.name
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        reply = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                          tool_choice="required")
        assert reply.choices[0].finish_reason == "tool_calls"
        calls = reply.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1
        call_id, name, arguments = calls[0].id, calls[0].function.name, \
            calls[0].function.arguments
    assert name == "get_weather"
    assert set(json.loads(arguments)) >= {"city", "days"}  # the schema's required fields
    messages += [
        {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function",
                                              "function": {"name": name,
                                                           "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 21}'},
    ]
    final = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                      max_tokens=5)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.usage is not None and final.usage.prompt_tokens > 0


def test_responses_api_with_usage_through_the_gateway(base: str) -> None:
    c = client(base)
    whole = c.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    assert whole.output_text and whole.status == "incomplete"  # cut at max_output_tokens
    assert whole.usage is not None and whole.usage.output_tokens == 4
    assert whole.usage.input_tokens > 0
    with c.responses.stream(model=MODEL, input="Hello again", max_output_tokens=4) as s:
        kinds = [event.type for event in s]
        streamed = s.get_final_response()
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")  # vLLM: completed
    assert "response.output_text.delta" in kinds
    assert streamed.usage is not None and streamed.usage.output_tokens == 4

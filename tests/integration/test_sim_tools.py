"""`kvgate sim` tool calls and reasoning through the official openai client (vLLM 0.34 shapes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from tests.support.procs import sim_proc

MODEL = "sim-model"
WEATHER: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detailed": {"type": "boolean"}},
        "required": ["city", "days", "unit"]}}}
CLOCK: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
MSG: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    proc, url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with proc:
        yield url


@pytest.fixture(scope="module")
def thinker() -> Iterator[str]:
    proc, url = sim_proc(None, "--time-scale", "50", "--reasoning", model=MODEL)
    with proc:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize(("choice", "name", "finish"), [
    ("required", "get_weather", "tool_calls"),  # the first tool
    ({"type": "function", "function": {"name": "get_time"}}, "get_time", "stop"),
])
def test_forced_tool_call_non_streamed(sim: str, choice: Any, name: str, finish: str) -> None:
    resp = _client(sim).chat.completions.create(model=MODEL, messages=MSG,
                                                tools=[WEATHER, CLOCK], tool_choice=choice)
    choice0 = resp.choices[0]
    assert choice0.finish_reason == finish  # vLLM: "stop" for a named function, as OpenAI
    calls = choice0.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    if name == "get_weather":
        assert args == {"city": "city-sim", "days": 1, "unit": "celsius"}  # required only
    else:
        assert args == {"tz": "tz-sim"}
    assert resp.usage is not None
    assert resp.usage.completion_tokens == -(-len(call.function.arguments) // 4)


def test_forced_tool_call_streamed(sim: str) -> None:
    stream = _client(sim).chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER], tool_choice="required", stream=True)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    head = deltas[0]
    assert head.index == 0 and head.id and head.type == "function"
    assert head.function is not None and head.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert json.loads(arguments) == {"city": "city-sim", "days": 1, "unit": "celsius"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_auto_tool_choice_keeps_text(sim: str) -> None:
    resp = _client(sim).chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER],
                                                max_tokens=3)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
])
def test_tool_choice_errors(sim: str, kwargs: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": MSG, "tools": [WEATHER], **kwargs}
    if args["tools"] is None:
        del args["tools"]
    with pytest.raises(openai.BadRequestError) as info:
        _client(sim).chat.completions.create(**args)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


def test_reasoning_streams_delta_reasoning_before_content(thinker: str) -> None:
    stream = _client(thinker).chat.completions.create(
        model=MODEL, messages=MSG, stream=True, max_tokens=60)
    kinds: list[str] = []
    for chunk in stream:
        if not chunk.choices:
            continue
        extra = chunk.choices[0].delta.model_extra or {}
        assert "reasoning_content" not in extra  # vLLM 0.34's name is "reasoning"
        if extra.get("reasoning"):
            kinds.append("reasoning")
        if chunk.choices[0].delta.content:
            kinds.append("content")
    assert kinds and kinds[0] == "reasoning" and "content" in kinds
    first_content = kinds.index("content")
    assert "reasoning" not in kinds[first_content + 1:]


def test_reasoning_non_streamed_message(thinker: str, sim: str) -> None:
    resp = _client(thinker).chat.completions.create(model=MODEL, messages=MSG, max_tokens=60)
    message = resp.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning")
    assert isinstance(reasoning, str) and reasoning and message.content
    assert len(reasoning) % 4 == 0 and 16 <= len(reasoning) <= 64  # 4 to 16 tokens
    plain = _client(sim).chat.completions.create(model=MODEL, messages=MSG, max_tokens=60)
    assert (plain.choices[0].message.model_extra or {}).get("reasoning") is None
    assert plain.choices[0].message.content == (reasoning + (message.content or ""))[
        : len(plain.choices[0].message.content or "")]

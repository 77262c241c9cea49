"""The official openai client reads the same answers through kvgate as from the replica itself,
for the request features vLLM users combine: streamed tool-call deltas with `n` > 1, streamed
logprobs of several choices, stop strings with `max_completion_tokens`, legacy completions
with `echo`, `logprobs` and a batch of token-id prompts, `with_streaming_response`, the async
client's `async for`. Streams are compared as what a client assembles from them (the text,
tool calls, logprobs and finish reason of each choice, and the usage), not chunk by chunk: the
engine may put several tokens in one chunk, as vLLM does with a busy step. One simulated
replica behind a real gateway (the quick form)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import Any

import openai
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import sim_proc

MODEL = "sim-model"
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris? \U0001f326 na\u00efve"}]
CHAT_STREAMS: dict[str, dict[str, Any]] = {
    "tool-call deltas, n=2": {"tools": TOOLS, "tool_choice": "required", "n": 2},
    "named tool, usage": {"tools": TOOLS, "stream_options": {"include_usage": True},
                          "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}}},
    "logprobs, n=2": {"logprobs": True, "top_logprobs": 2, "n": 2, "max_tokens": 6},
    "stop, seed, user": {"stop": ["e", "x"], "max_completion_tokens": 30, "seed": 3,
                         "user": "u-1", "stream_options": {"include_usage": True}},
}


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    """(through the gateway, straight to the replica)."""
    sim, url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[url])
        with gw:
            yield (openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30),
                   openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30))


def assembled(chunks: Iterable[Any]) -> dict[Any, Any]:
    """What a client builds from a chat or completions stream: per choice index its text,
    tool calls (arguments joined, ids left out: they are random), logprob tokens and finish
    reason; and the usage chunk."""
    out: dict[Any, Any] = {}
    for chunk in chunks:
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            mine = out.setdefault(choice.index, {"text": "", "tools": {}, "tokens": []})
            delta = getattr(choice, "delta", None)
            mine["text"] += (delta.content or "") if delta is not None else choice.text
            for call in (delta.tool_calls or []) if delta is not None else []:
                name, args = mine["tools"].get(call.index, ("", ""))
                fn = call.function
                mine["tools"][call.index] = (name + ((fn and fn.name) or ""),
                                             args + ((fn and fn.arguments) or ""))
            if choice.logprobs is not None:
                lp = choice.logprobs
                mine["tokens"] += [t.token for t in lp.content or []] if delta else lp.tokens
            mine["finish"] = choice.finish_reason or mine.get("finish")
    return out


@pytest.mark.parametrize("extra", CHAT_STREAMS.values(), ids=CHAT_STREAMS.keys())
def test_chat_streams_assemble_the_same(
    clients: tuple[openai.OpenAI, openai.OpenAI], extra: dict[str, Any],
) -> None:
    seen = [assembled(c.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                **{"max_tokens": 12, **extra}))
            for c in clients]
    assert seen[0] == seen[1]
    assert seen[0][0]["finish"] in ("stop", "length", "tool_calls")
    assert ("usage" in seen[0]) == ("stream_options" in extra)  # asked for, or not there


@pytest.mark.parametrize("prompt", [["def f(", "x = "], [[11, 12, 13, 14], [11, 12, 15]]],
                         ids=["texts", "token ids"])
def test_completions_batches_with_echo_and_logprobs(
    clients: tuple[openai.OpenAI, openai.OpenAI], prompt: list[Any],
) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "n": 2,
                            "logprobs": 1, "echo": isinstance(prompt[0], str)}
    streamed = [assembled(c.completions.create(stream=True, **args)) for c in clients]
    assert streamed[0] == streamed[1]
    assert sorted(k for k in streamed[0] if k != "usage") == [0, 1, 2, 3]  # prompts x n
    whole = [c.completions.create(**args).model_dump(exclude={"id", "created"})
             for c in clients]
    assert whole[0] == whole[1]


def test_streaming_response_and_the_async_client(
    clients: tuple[openai.OpenAI, openai.OpenAI],
) -> None:
    gw, direct = clients
    with gw.chat.completions.with_streaming_response.create(
            model=MODEL, messages=ASK, max_tokens=5, stream=True) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    expected = assembled(direct.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, stream=True))

    async def via_async() -> dict[Any, Any]:
        async with openai.AsyncOpenAI(base_url=str(gw.base_url), api_key="x",
                                      max_retries=0, timeout=30) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=5, stream=True)
            return assembled([chunk async for chunk in stream])

    assert asyncio.run(via_async()) == expected

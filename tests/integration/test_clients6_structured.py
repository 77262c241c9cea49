"""Structured output through kvgate to the simulator, as JavaScript clients ask for it.

The Vercel AI SDK's `generateObject` (ai 6, @ai-sdk/openai 3) and LangChain JS's
`withStructuredOutput` (@langchain/openai 1.5) send a chat `response_format` of type
`json_schema` (the AI SDK's Responses model: `text.format`) and parse the answer's content as
JSON. vLLM's guided decoding makes it JSON matching the schema; the simulator wrote its usual
words, so every one of them failed ("No object generated: could not parse the response",
`SyntaxError: Unexpected token`). The request bodies below are the ones those clients sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.gateway import two_tier_gateway

ADMIN = "clients6-structured-admin-0123456789"
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["a", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _post(gw: tuple[str, dict[str, str]], path: str, body: dict[str, Any]) -> httpx.Response:
    base, keys = gw
    return httpx.post(f"{base}{path}", json=body, timeout=10,
                      headers={"authorization": f"Bearer {keys['default']}"})


def _valid(value: Any) -> None:
    assert isinstance(value, dict) and set(value) == {"a", "n"}
    assert isinstance(value["a"], str) and isinstance(value["n"], int)


def test_ai_sdk_generate_object_on_chat(gw: tuple[str, dict[str, str]]) -> None:
    fmt = {"type": "json_schema",
           "json_schema": {"schema": SCHEMA, "strict": True, "name": "response"}}
    answer = _post(gw, "/v1/chat/completions", {
        "model": "open", "response_format": fmt,
        "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] == []
    _valid(orjson.loads(choice["message"]["content"]))


def test_streamed_structured_output_joins_to_json(gw: tuple[str, dict[str, str]]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "extract", "schema": SCHEMA}}
    answer = _post(gw, "/v1/chat/completions", {
        "model": "open", "stream": True, "response_format": fmt,
        "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 200, answer.text
    chunks = [orjson.loads(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    _valid(orjson.loads(text))
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


def test_json_object_mode_is_json(gw: tuple[str, dict[str, str]]) -> None:
    answer = _post(gw, "/v1/chat/completions", {
        "model": "open", "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 200, answer.text
    assert isinstance(orjson.loads(answer.json()["choices"][0]["message"]["content"]), dict)


def test_ai_sdk_generate_object_on_responses(gw: tuple[str, dict[str, str]]) -> None:
    answer = _post(gw, "/v1/responses", {
        "model": "open", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "x"}]}],
        "text": {"format": {"type": "json_schema", "strict": True, "name": "response",
                            "schema": SCHEMA}}})
    assert answer.status_code == 200, answer.text
    message = next(o for o in answer.json()["output"] if o["type"] == "message")
    _valid(orjson.loads(message["content"][0]["text"]))


def test_plain_chat_stays_text(gw: tuple[str, dict[str, str]]) -> None:
    answer = _post(gw, "/v1/chat/completions", {
        "model": "open", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 200, answer.text
    assert not answer.json()["choices"][0]["message"]["content"].startswith("{")

"""A forced tool call on `/v1/messages`, as the Anthropic Node SDK (@anthropic-ai/sdk 1.17) asks.

`messages.create({tools, tool_choice: {type: "any"}})` (or `{type: "tool", name}`) must answer
a `tool_use` block with stop_reason "tool_use" (vLLM maps it to chat's forced call); streamed
(`messages.stream`), the input arrives as `input_json_delta` events the SDK joins. The
simulator answered text, so the SDK's tool loops never saw a call. Through a real gateway
(authentication on) before one simulated replica, with the SDK's headers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.gateway import two_tier_gateway

ADMIN = "clients6-anthropic-tools-admin-0123456789"
TOOLS = [{"name": "get_weather", "description": "w", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}]


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _post(gw: tuple[str, dict[str, str]], body: dict[str, Any]) -> httpx.Response:
    base, keys = gw
    headers = {"x-api-key": keys["default"], "anthropic-version": "2023-06-01",
               "user-agent": "Anthropic/JS 1.17.0", "x-stainless-lang": "js"}
    return httpx.post(f"{base}/v1/messages", json={
        "model": "open", "max_tokens": 100, "tools": TOOLS,
        "messages": [{"role": "user", "content": "weather?"}], **body},
        headers=headers, timeout=10)


def test_tool_choice_any_answers_tool_use(gw: tuple[str, dict[str, str]]) -> None:
    answer = _post(gw, {"tool_choice": {"type": "any"}})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["stop_reason"] == "tool_use"
    [block] = got["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["id"].startswith("toolu_")
    assert isinstance(block["input"]["city"], str) and isinstance(block["input"]["days"], int)


def test_named_tool_streams_input_json_deltas(gw: tuple[str, dict[str, str]]) -> None:
    answer = _post(gw, {"tool_choice": {"type": "tool", "name": "get_weather"}, "stream": True})
    assert answer.status_code == 200, answer.text
    events = [orjson.loads(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: ")]
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["input"] == {}
    joined = "".join(e["delta"]["partial_json"] for e in events
                     if e["type"] == "content_block_delta")
    assert set(orjson.loads(joined)) == {"city", "days"}
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert events[-1]["type"] == "message_stop"


def test_unknown_named_tool_is_an_anthropic_400(gw: tuple[str, dict[str, str]]) -> None:
    answer = _post(gw, {"tool_choice": {"type": "tool", "name": "nope"}})
    assert answer.status_code == 400
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_auto_keeps_text(gw: tuple[str, dict[str, str]]) -> None:
    answer = _post(gw, {})
    assert answer.status_code == 200, answer.text
    assert answer.json()["content"][0]["type"] == "text"

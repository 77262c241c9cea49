"""A forced tool call on vLLM's Anthropic route (``/v1/messages``).

vLLM turns Anthropic's ``tool_choice`` into chat's: ``{"type": "any"}`` is ``"required"``,
``{"type": "tool", "name": N}`` names the function, ``"auto"`` and ``"none"`` keep text. A forced
call answers a ``tool_use`` block whose ``input`` the simulator makes as for chat (the smallest
value of the tool's ``input_schema``), with ``stop_reason`` "tool_use"; streamed, its JSON comes
in ``input_json_delta`` events. The Anthropic SDKs' tool loops read exactly those.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from loadtest.sim.errors import SimError
from loadtest.sim.tools import arguments_for

__all__ = ["forced_tool_use", "tool_use_events"]


def forced_tool_use(body: dict[str, Any]) -> dict[str, Any] | None:
    """The `tool_use` block a forced `tool_choice` answers, or None (text)."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("any", "tool"):
        return None
    named = [t for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)] if (
        isinstance(tools, list)) else []
    if not named:
        raise SimError(400, "tool_choice requires `tools`", param="tool_choice")
    tool = named[0]
    if kind == "tool":
        assert isinstance(choice, dict)
        tool = next((t for t in named if t["name"] == choice.get("name")), {})
        if not tool:
            raise SimError(400, f"tool_choice names an unknown tool: {choice.get('name')!r}",
                           param="tool_choice")
    schema = tool.get("input_schema") or {"type": "object", "properties": {}}
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": tool["name"],
            "input": arguments_for(schema)}


def tool_use_events(block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The content block's start, its input as JSON in pieces of 8 characters, its stop."""
    text = orjson.dumps(block["input"]).decode()
    events: list[tuple[str, dict[str, Any]]] = [
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {**block, "input": {}}})]
    events += [("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
        "type": "input_json_delta", "partial_json": text[i:i + 8]}})
        for i in range(0, len(text), 8)]
    events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    return events

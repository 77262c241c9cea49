"""Tool calling: which function a request forces, and deterministic arguments for its schema.

vLLM forces a call with guided decoding when ``tool_choice`` is ``"required"`` or names a
function (vllm/entrypoints/openai/chat_completion/serving.py); the model then writes the
arguments as JSON. The simulator writes the smallest JSON object that satisfies the schema's
``required`` properties, one value per JSON-schema type, so the same request always gets the same
arguments. ``"auto"`` (the default when ``tools`` are given) and ``"none"`` keep plain text: vLLM
answers ``"auto"`` only with ``--enable-auto-tool-choice`` and a model-specific parser, and what a
model would then choose is not something a simulator can know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from loadtest.sim.errors import SimError

__all__ = ["ToolPlan", "arguments_for", "plan_structured_output", "plan_tool_call"]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A forced call: the function's name, its arguments (JSON text), and how it was forced."""

    name: str
    arguments: str
    required: bool  # tool_choice "required" (finish_reason "tool_calls"); False: named ("stop")
    # a chat `response_format` (structured output): the JSON is the message's content, no call
    content: bool = False


def _bad(message: str, param: str = "tool_choice") -> SimError:
    return SimError(400, message, "BadRequestError", param)


def _functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("1 validation error: 'tools' must be a list of objects", "tools")
    out = []
    for tool in tools:
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
            fn.get("name"), str
        ):
            raise _bad("1 validation error: each tool needs type 'function' and a function "
                       "name", "tools")
        out.append(fn)
    return out


def plan_tool_call(body: dict[str, Any]) -> ToolPlan | None:
    """The forced call of a chat request, or None when the answer is text."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise _bad("When using `tool_choice`, `tools` must be set.")
        return None
    functions = _functions(tools)
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        fn, required = functions[0], True  # the simulator always calls the first tool
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
        choice.get("function"), dict
    ):
        name = choice["function"].get("name")
        match = [f for f in functions if f["name"] == name]
        if not match:
            raise _bad(f"The tool specified in `tool_choice` ({name!r}) does not match any of "
                       "the specified `tools`.")
        fn, required = match[0], False
    else:
        raise _bad("1 validation error: 'tool_choice' must be 'none', 'auto', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}")
    args = arguments_for(fn.get("parameters") or {"type": "object", "properties": {}})
    return ToolPlan(fn["name"], orjson.dumps(args).decode(), required)


def plan_structured_output(body: dict[str, Any]) -> ToolPlan | None:
    """A chat `response_format` of `json_schema` or `json_object`: vLLM's guided decoding makes
    the content JSON matching the schema, which clients parse (the Vercel AI SDK's
    `generateObject`, LangChain's `withStructuredOutput`, the openai SDKs' `parse`); free text
    there failed them all. Called after `check_response_format` validated the shape."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return ToolPlan("", "{}", False, content=True)
    if kind != "json_schema" or not isinstance(fmt, dict):
        return None
    schema = fmt["json_schema"].get("schema") or {"type": "object", "properties": {}}
    return ToolPlan("", orjson.dumps(arguments_for(schema)).decode(), False, content=True)


def arguments_for(schema: Any) -> Any:
    """The smallest value that satisfies ``schema`` (required properties only)."""
    return _value(schema, "value", 0)


def _value(schema: Any, name: str, depth: int) -> Any:
    if not isinstance(schema, dict) or depth > 8:
        return name
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _value(options[0], name, depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required = schema.get("required")
        required = required if isinstance(required, list) else []
        return {str(key): _value(props.get(key, {}), str(key), depth + 1) for key in required}
    if kind == "array":
        count = schema.get("minItems", 0)
        item = _value(schema.get("items", {}), name, depth + 1)
        return [item] * count if isinstance(count, int) and count > 0 else []
    if kind == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if kind == "number":
        return max(1.5, float(schema.get("minimum", 1.5)))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = f"{name}-sim"
    min_len = schema.get("minLength", 0)
    return text.ljust(min_len, "x") if isinstance(min_len, int) else text

"""Deterministic tool-call arguments from JSON schemas, and which call a request forces."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loadtest.sim.errors import SimError
from loadtest.sim.tools import arguments_for, plan_tool_call


@pytest.mark.parametrize(("schema", "expected"), [
    ({"type": "object", "properties": {"a": {"type": "string"}}}, {}),  # nothing required
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
     {"a": "a-sim"}),
    ({"type": "object", "required": ["n", "x", "b", "z"], "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
        "z": {"type": "null"}}}, {"n": 1, "x": 1.5, "b": True, "z": None}),
    ({"type": "object", "required": ["e", "c", "d"], "properties": {
        "e": {"type": "string", "enum": ["x", "y"]}, "c": {"const": 3},
        "d": {"type": "string", "default": "dflt"}}}, {"e": "x", "c": 3, "d": "dflt"}),
    ({"type": "object", "required": ["l", "o"], "properties": {
        "l": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        "o": {"type": "object", "required": ["k"], "properties": {"k": {"type": "string"}}}}},
     {"l": [1, 1], "o": {"k": "k-sim"}}),
    ({"type": "object", "required": ["u", "t"], "properties": {
        "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "t": {"type": ["null", "integer"], "minimum": 4}}}, {"u": 1, "t": 4}),
    ({"type": "object", "required": ["s"], "properties": {"s": {"type": "string",
                                                              "minLength": 10}}},
     {"s": "s-simxxxxx"}),
])
def test_arguments_satisfy_required_fields(schema: dict[str, Any], expected: Any) -> None:
    assert arguments_for(schema) == expected


def _tool(name: str, **params: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params or None}}


def test_plan_required_named_auto_none() -> None:
    tools = [_tool("a"), _tool("b", type="object", properties={"q": {"type": "string"}},
                               required=["q"])]
    required = plan_tool_call({"tools": tools, "tool_choice": "required"})
    assert required is not None and (required.name, required.required) == ("a", True)
    assert json.loads(required.arguments) == {}
    named = plan_tool_call({"tools": tools, "tool_choice": {"type": "function",
                                                           "function": {"name": "b"}}})
    assert named is not None and (named.name, named.required) == ("b", False)
    assert json.loads(named.arguments) == {"q": "q-sim"}
    for choice in (None, "auto", "none"):
        assert plan_tool_call({"tools": tools, "tool_choice": choice}) is None
    assert plan_tool_call({}) is None


@pytest.mark.parametrize("body", [
    {"tool_choice": "required"},
    {"tools": [_tool("a")], "tool_choice": {"type": "function", "function": {"name": "x"}}},
    {"tools": [_tool("a")], "tool_choice": "sometimes"},
    {"tools": [{"type": "function"}], "tool_choice": "required"},
])
def test_plan_rejects_bad_requests(body: dict[str, Any]) -> None:
    with pytest.raises(SimError) as info:
        plan_tool_call(body)
    assert info.value.status == 400

"""`chat_view` reads an Anthropic body without its ``cache_control`` marks (they move to the
newest turn each time; vLLM ignores them) and leaves the body itself as sent."""

from __future__ import annotations

import copy
from typing import Any

from gateway.vllm_routes import chat_view
from routing.canon import canonical_text

MARK = {"type": "ephemeral"}


def _body(marked: bool) -> dict[str, Any]:
    mark: dict[str, Any] = {"cache_control": MARK} if marked else {}
    return {
        "system": [{"type": "text", "text": "be brief", **mark}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}, **mark}],
        "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "a.txt", **mark}], **mark},
            {"type": "image", "source": {"type": "base64", "data": "AAAA"}, **mark},
            {"type": "tool_use", "id": "t2", "name": "ls",
             "input": {"cache_control": "an argument, not a mark"}}]}],
    }


def test_marks_are_no_part_of_the_routing_view() -> None:
    marked = _body(marked=True)
    sent = copy.deepcopy(marked)
    assert canonical_text(chat_view(marked)) == canonical_text(chat_view(_body(marked=False)))
    assert marked == sent  # the body sent on keeps its marks
    view = chat_view(marked)
    assert view["messages"][1]["content"][2]["input"] == {
        "cache_control": "an argument, not a mark"}

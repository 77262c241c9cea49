"""Flow control charges every output sequence a request asks for (`n`, a list of prompts)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.body import ParsedBody
from gateway.flow import _sequences


@pytest.mark.parametrize(("body", "expected"), [
    ({}, 1),
    ({"n": 1}, 1),
    ({"n": 4}, 4),
    ({"n": 0}, 1),  # vLLM refuses it; the refund path charges it its prompt only
    ({"n": True}, 1),
    ({"n": "3"}, 1),
    ({"n": None}, 1),
    ({"prompt": ["a", "b", "c"]}, 3),  # a completions batch: one output per prompt
    ({"prompt": [[1, 2], [3]], "n": 2}, 4),
    ({"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
    ({"prompt": ["one"]}, 1),
])
def test_sequences_from_the_body(body: dict[str, Any], expected: int) -> None:
    assert _sequences(ParsedBody(body, "m", False, 10)) == expected

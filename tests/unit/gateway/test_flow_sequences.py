"""Flow control charges every output sequence a request asks for (`n`, a list of prompts)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.body import ParsedBody, parse_body
from gateway.flow import asked_tokens
from gateway.flow.cost import _prompts, _sequences
from routing.flow import request_cost


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


def test_a_batch_longer_than_the_context_is_still_charged_its_outputs() -> None:
    """Each prompt of a batch is checked against the context on its own (vLLM, the
    simulator): 20 prompts of ~400 tokens each may each generate `max_tokens`. Capping the
    output by the context minus the whole batch's prompt charged them nothing."""
    parsed = ParsedBody({"prompt": ["x" * 1600] * 20, "max_tokens": 100}, "m", False, 8000)
    assert _prompts(parsed) == 20
    assert request_cost(8000, 100, 256, 4096, _sequences(parsed), _prompts(parsed)) == 10000
    # one prompt alone still fits its output beside itself only
    assert request_cost(4000, 1000, 256, 4096, 1, 1) == 4096
    assert request_cost(8000, 1000, 256, 4096, 2, 2) == 8000 + 2 * 96


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 5000}, {"max_tokens": 5000, "n": 3}])
def test_an_embedding_asks_for_its_prompt_only(extra: dict[str, Any]) -> None:
    """No output, whatever the body carries: flow control charged it the expected output
    (or its `max_tokens`), TPM admission its `max_tokens` x `n`."""
    raw = orjson.dumps({"model": "m", "input": "x" * 400, **extra})
    embedding = parse_body(raw, "embeddings")
    assert asked_tokens(embedding, embedding.prompt_tokens, 256) == embedding.prompt_tokens
    assert asked_tokens(embedding, embedding.prompt_tokens, 256, 4096) == 100
    # the same fields on a completion are output asked for
    completion = parse_body(orjson.dumps({"model": "m", "prompt": "x" * 400, **extra}),
                            "completions")
    assert asked_tokens(completion, completion.prompt_tokens, 256) > 100 + 255

"""A whole answer's usage with a total alone (vLLM's rerank) is read as its prompt tokens;
usage with prompt or completion counts keeps them (its total is not read)."""

from __future__ import annotations

from gateway.sse import body_usage


def test_a_total_alone_is_the_prompt() -> None:
    assert body_usage(b'{"id":"r","usage":{"total_tokens":110000},"results":[]}') == {
        "prompt_tokens": 110000}


def test_counts_named_win_over_the_total() -> None:
    got = body_usage(b'{"usage":{"prompt_tokens":7,"total_tokens":9,"completion_tokens":2}}')
    assert got == {"prompt_tokens": 7, "completion_tokens": 2}
    assert body_usage(b'{"usage":{"input_tokens":3,"output_tokens":1}}') == {
        "prompt_tokens": 3, "completion_tokens": 1}

"""What vLLM 0.34 refuses before a request runs, refused the same by the simulator's parser:
message contents, prompt nesting, token ids beyond the vocabulary, `response_format`,
`prompt_logprobs`."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.sim.errors import SimError
from loadtest.sim.inputs import VOCAB_SIZE, prompt_items
from loadtest.sim.parse import parse_generation

USER = {"role": "user", "content": "hello there"}
CHAT: dict[str, Any] = {"model": "m", "messages": [USER]}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}}}


def _refusal(body: dict[str, Any], chat: bool = True) -> SimError:
    with pytest.raises(SimError) as err:
        parse_generation(body, chat, 4096)
    return err.value


@pytest.mark.parametrize("content", [
    {"type": "text", "text": "hi"},  # one part, not a list of them
    {"text": "hi"},
    7,
    ["text", 3],
    [["nested"]],
])
def test_a_content_that_is_no_string_or_list_of_parts_is_a_400(content: Any) -> None:
    err = _refusal({**CHAT, "messages": [USER, {"role": "user", "content": content}]})
    assert (err.status, err.type, err.param) == (400, "Bad Request", "messages")
    assert err.message.startswith("1 validation error: 'messages[1].content'")


@pytest.mark.parametrize("content", [
    "text", None, [], [{"type": "text", "text": "hi"}], ["a string part"],
    [{"type": "image_url", "image_url": {"url": "data:,"}}],
])
def test_contents_vllm_takes_still_pass(content: Any) -> None:
    message = {"role": "assistant", "content": content}
    assert parse_generation({**CHAT, "messages": [USER, message]}, True, 4096).prompt.text


@pytest.mark.parametrize(("raw", "items"), [
    ("one", ["one"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_the_four_prompt_forms(raw: Any, items: list[Any]) -> None:
    assert prompt_items(raw, "input") == items


@pytest.mark.parametrize("raw", [
    [["a"]], [["a", "b"]], [[["a"]]], [[[1]]], ["a", [1, 2]], [1, "a"], [[1], 2], {"a": 1}, [], 3,
])
def test_any_other_nesting_or_mix_is_a_400(raw: Any) -> None:
    with pytest.raises(SimError) as err:
        prompt_items(raw, "input")
    assert (err.value.status, err.value.type, err.value.param) == (400, "Bad Request", "input")
    err2 = _refusal({"model": "m", "prompt": raw}, chat=False)
    assert (err2.status, err2.param) == (400, "prompt")


@pytest.mark.parametrize("prompt", [[5, VOCAB_SIZE], [[1, 2], [3, VOCAB_SIZE + 9]]])
def test_a_token_id_beyond_the_vocabulary_is_vllms_400(prompt: Any) -> None:
    err = _refusal({"model": "m", "prompt": prompt, "max_tokens": 4}, chat=False)
    top = max(max(p) if isinstance(p, list) else p for p in prompt)
    assert (err.status, err.type, err.param) == (400, "BadRequestError", None)
    assert err.message == f"Token id {top} is out of vocabulary"


def test_the_largest_token_id_of_the_vocabulary_passes() -> None:
    gen = parse_generation({"model": "m", "prompt": [0, VOCAB_SIZE - 1]}, False, 4096)
    assert gen.prompt.ids == [0, VOCAB_SIZE - 1]


@pytest.mark.parametrize(("fmt", "message"), [
    ({"type": "json_schema"}, "1 validation error: Value error, When response_format type is "
     "'json_schema', the 'json_schema' field must be provided."),
    ({"type": "json_schema", "json_schema": None}, "Value error, When response_format type"),
    ({"type": "xml"}, "'response_format.type' must be one of"),
    ({}, "'response_format.type' must be one of"),
    ("json_object", "'response_format.type' must be one of"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "with a string 'name'"),
    ({"type": "json_schema", "json_schema": "{}"}, "with a string 'name'"),
    ({"type": "json_schema", "json_schema": {"name": "o", "schema": "{}"}},
     "'response_format.json_schema.schema' must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "o", "description": 3}},
     "'response_format.json_schema.description' must be a string"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_a_malformed_response_format_is_a_400(fmt: Any, message: str, chat: bool) -> None:
    body = {**CHAT, "response_format": fmt} if chat else {
        "model": "m", "prompt": "hi", "response_format": fmt}
    err = _refusal(body, chat)
    assert (err.status, err.type, err.param) == (400, "Bad Request", "response_format")
    assert message in err.message


@pytest.mark.parametrize("fmt", [
    {"type": "text"}, {"type": "json_object"}, SCHEMA,
    {"type": "json_schema", "json_schema": {"name": "o", "strict": True, "description": "d"}},
])
def test_well_formed_response_formats_pass(fmt: Any) -> None:
    assert parse_generation({**CHAT, "response_format": fmt}, True, 4096).n == 1


@pytest.mark.parametrize(("extra", "message"), [
    ({"prompt_logprobs": "1"}, "`prompt_logprobs` must be an integer."),
    ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": 1, "stream": True},
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -1, "stream": True},
     "`prompt_logprobs` are not available when `stream=True`."),
])
def test_prompt_logprobs_as_vllms_validator_checks_it(extra: dict[str, Any], message: str) -> None:
    err = _refusal({**CHAT, **extra})
    assert (err.status, err.type, err.param) == (400, "Bad Request", "prompt_logprobs")
    assert err.message == f"1 validation error: Value error, {message}"


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 0, "stream": True},
                                   {"prompt_logprobs": 2}, {"prompt_logprobs": -1}])
def test_prompt_logprobs_vllm_takes_still_pass(extra: dict[str, Any]) -> None:
    assert parse_generation({**CHAT, **extra}, True, 4096).n == 1

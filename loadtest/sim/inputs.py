"""The input checks vLLM 0.34 makes before a request runs, for the simulator's parsers.

vLLM refuses these with a 400 before any engine work: the request model's field types
(pydantic, type ``"Bad Request"``, a message starting "1 validation error"), its
before-validators (the same shape, "Value error, ..."), and the engine's input processor (an
out-of-vocabulary token id, type ``BadRequestError``). A simulator that answered them 200
would hide a gateway that mangles or forwards such a body; the wording of the type errors is
the simulator's own (pydantic's lists every union branch), their status and shape are vLLM's.
"""

from __future__ import annotations

from typing import Any

from loadtest.sim import prompt as P
from loadtest.sim.errors import SimError

__all__ = ["VOCAB_SIZE", "check_messages", "check_prompt_logprobs", "check_response_format",
           "check_vocabulary", "prompt_items"]

VOCAB_SIZE = P.VOCAB_MASK + 1  # the simulator's tokenizer: ids are 17-bit hashes
_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
Item = str | list[int]


def _invalid(param: str, what: str) -> SimError:
    return SimError(400, f"1 validation error: {what}", "Bad Request", param)


def _value_error(param: str, message: str) -> SimError:
    """A request model's before-validator refusing the body (vLLM's `VLLMValidationError`)."""
    return SimError(400, f"1 validation error: Value error, {message}", "Bad Request", param)


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Each message's `content`: absent, null, a string, or a list of parts (objects, or
    strings, which vLLM's part union also takes). An object is no content vLLM accepts."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if isinstance(content, list) and all(isinstance(p, str | dict) for p in content):
            continue
        raise _invalid("messages", f"'messages[{i}].content' must be a string or a list of "
                       "content parts")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def prompt_items(raw: Any, name: str) -> list[Item]:
    """vLLM's ``str | list[str] | list[int] | list[list[int]]`` (completions `prompt`,
    embeddings `input`) as a list of prompts; any other nesting or mix is a 400."""
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        return [raw]
    if isinstance(raw, list) and raw and (all(isinstance(s, str) for s in raw)
                                          or all(_is_ids(ids) for ids in raw)):
        return list(raw)
    raise _invalid(name, f"'{name}' must be a string, a list of strings, a list of token ids "
                   "or a list of lists of token ids")


def check_vocabulary(prompts: list[P.Prompt]) -> None:
    """vLLM's input processor: a token id beyond the vocabulary is refused
    (`v1/engine/input_processor.py`), a text prompt cannot hold one."""
    for prompt in prompts:
        if prompt.text is None and (top := max(prompt.ids, default=0)) >= VOCAB_SIZE:
            raise SimError(400, f"Token id {top} is out of vocabulary")


def check_response_format(body: dict[str, Any]) -> None:
    """`response_format`'s shape (vLLM's `ResponseFormat` and `JsonSchemaResponseFormat`).
    The schema itself is not compiled, as vLLM's structured-output backend would."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema" and fmt.get("json_schema") is None:  # the before-validator
        raise _value_error("response_format", "When response_format type is 'json_schema', "
                           "the 'json_schema' field must be provided.")
    if not isinstance(fmt, dict) or kind not in _FORMAT_TYPES:
        raise _invalid("response_format", "'response_format.type' must be one of "
                       + ", ".join(f"'{t}'" for t in _FORMAT_TYPES))
    schema = fmt.get("json_schema")
    if kind != "json_schema" or schema is None:
        return
    if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
        raise _invalid("response_format", "'response_format.json_schema' must be an object "
                       "with a string 'name'")
    for key, kind_, what in (("schema", dict, "an object"), ("description", str, "a string")):
        value = schema.get(key)
        if value is not None and not isinstance(value, kind_):
            raise _invalid("response_format", f"'response_format.json_schema.{key}' must be "
                           f"{what}")


def check_prompt_logprobs(body: dict[str, Any]) -> None:
    """The request models' before-validator on `prompt_logprobs` (the values themselves are
    not simulated: answers carry `prompt_logprobs: null`)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return
    if not isinstance(value, int | float):  # vLLM's test: a boolean passes
        raise _value_error("prompt_logprobs", "`prompt_logprobs` must be an integer.")
    if body.get("stream") and (value > 0 or value == -1):
        raise _value_error("prompt_logprobs",
                           "`prompt_logprobs` are not available when `stream=True`.")
    if value < 0 and value != -1:
        raise _value_error("prompt_logprobs", "`prompt_logprobs` must be a positive value or -1.")

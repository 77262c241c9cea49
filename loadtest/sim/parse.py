"""Validation of chat/completions bodies into what the engine and the streamer need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadtest.sim import prompt as P
from loadtest.sim.errors import SimError
from loadtest.sim.inputs import (
    check_messages,
    check_prompt_logprobs,
    check_response_format,
    check_vocabulary,
    prompt_items,
)
from loadtest.sim.logprobs import MAX_LOGPROBS
from loadtest.sim.tools import ToolPlan, plan_structured_output, plan_tool_call

__all__ = ["ChoicePlan", "GenRequest", "item_prompt", "parse_generation", "parse_prompt",
           "parse_prompts", "validate_cache_salt"]

MAX_N = 128  # a sanity bound of the simulator's (vLLM's own is the KV cache)


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    """One of the ``n`` sequences: its own text (seed), natural end and stop-string cut."""

    seed: int
    eos_after: int | None
    visible_chars: int | None
    max_tokens: int = 0  # its prompt's (max_tokens, or what fits beside the prompt)
    prompt: int = 0  # which of a batch's prompts it answers


@dataclass(slots=True)
class GenRequest:
    chat: bool
    stream: bool
    include_usage: bool
    prompt: P.Prompt
    salt: str | None
    max_tokens: int
    eos_after: int | None
    visible_chars: int | None  # text is cut here (a stop string matched), else None
    seed: int
    priority: int
    request_id: str | None
    tool: ToolPlan | None = None  # a forced tool call: the output is its arguments
    reasoning_tokens: int = 0  # the first tokens are a thinking phase (``--reasoning``)
    return_token_ids: bool = False  # vLLM extra: prompt and output token ids in the answer
    # `stream_options.continuous_usage_stats` (vLLM extra, with include_usage): usage so far
    # on every chunk
    continuous_usage: bool = False
    # the n sequences (`n`); choices[0] is the fields above, so n=1 is unchanged
    choices: tuple[ChoicePlan, ...] = ()
    # alternatives per token when log probabilities were asked for (chat `top_logprobs`,
    # completions `logprobs: k`), None when not
    logprobs: int | None = None

    @property
    def n(self) -> int:
        return max(1, len(self.choices))

    # a completions batch (a list of prompts): one entry each; prompts[0] is `prompt`
    prompts: tuple[P.Prompt, ...] = ()
    echo: bool = False  # completions: the prompt text comes before the output

    def plan(self, index: int) -> ChoicePlan:
        if not self.choices:
            return ChoicePlan(self.seed, self.eos_after, self.visible_chars, self.max_tokens)
        return self.choices[index]

    def prompt_of(self, index: int) -> P.Prompt:
        """The prompt choice ``index`` answers."""
        return self.prompts[self.plan(index).prompt] if self.prompts else self.prompt


def validate_cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM 0.34's rules for ``cache_salt``."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise SimError(400, "Parameter 'cache_salt' must be a non-empty string if provided.",
                       param="cache_salt")
    if len(salt) > 128 or any(c in salt for c in "@/\\\x00"):
        raise SimError(400, "Parameter 'cache_salt' must be at most 128 characters and must not "
                       "contain '@', '/', '\\', or NUL.", param="cache_salt")
    return salt


def parse_prompt(body: dict[str, Any], chat: bool) -> P.Prompt:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) for m in messages
        ):
            raise SimError(400, "1 validation error: 'messages' must be a non-empty list of "
                           "objects", "Bad Request", "messages")
        check_messages(messages)
        return P.Prompt(text=P.render_chat(messages, body.get("tools")))
    items = prompt_items(body.get("prompt"), "prompt")
    if len(items) != 1:
        raise SimError(400, "1 validation error: 'prompt' must be one prompt here",
                       "Bad Request", "prompt")
    return item_prompt(items[0], "prompt")


def item_prompt(item: str | list[int], name: str) -> P.Prompt:
    """One prompt of `prompt_items`: a non-empty text or non-empty, non-negative token ids."""
    if isinstance(item, str) and item:
        return P.Prompt(text=item)
    if isinstance(item, list) and item and all(t >= 0 for t in item):
        return P.Prompt(ids=list(item))
    raise SimError(400, f"1 validation error: '{name}' must be a non-empty string or a list of "
                   "token ids", "Bad Request", name)


def parse_prompts(body: dict[str, Any]) -> list[P.Prompt]:
    """A completions request's prompts: a list of strings or of token-id lists is a batch
    (vLLM answers one choice per prompt and ``n``); a string or token ids is one prompt."""
    return [item_prompt(item, "prompt") for item in prompt_items(body.get("prompt"), "prompt")]


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise SimError(400, f"1 validation error: '{name}' must be an integer",
                               "Bad Request", name)
            return value
    return None


def _check_n(body: dict[str, Any]) -> int:
    n = _int_field(body, "n")
    if n is None:
        return 1
    if n < 1:  # vLLM's SamplingParams check
        raise SimError(400, f"n must be at least 1, got {n}.", param="n")
    if n > MAX_N:
        raise SimError(400, f"The simulator supports n up to {MAX_N}, got {n}.", param="n")
    return n


def _check_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise SimError(400, "1 validation error: 'logprobs' must be a boolean", "Bad Request",
                           "logprobs")
        top = _int_field(body, "top_logprobs")
        if top is not None and top > 0 and not wanted:  # the request model's validator
            raise SimError(400, "when using `top_logprobs`, `logprobs` must be set to true.",
                           param="top_logprobs")
        count, name = (top or 0) if wanted else None, "top_logprobs"
    else:
        count, name = _int_field(body, "logprobs"), "logprobs"
    if count is not None and count < 0:
        raise SimError(400, f"`{name}` must be a non-negative value.", param=name)
    if count is not None and count > MAX_LOGPROBS:  # vLLM's --max-logprobs (default 20)
        raise SimError(400, f"Requested sample logprobs of {count}, which is greater than max "
                       f"allowed: {MAX_LOGPROBS}", param=name)
    return count


def _check_sampling(body: dict[str, Any]) -> int:
    temp = body.get("temperature")
    if temp is not None and (isinstance(temp, bool) or not isinstance(temp, int | float)):
        raise SimError(400, "1 validation error: 'temperature' must be a number", "Bad Request",
                       "temperature")
    # V1 ignores `priority` under fcfs (the engine orders by arrival only); only the old V0
    # engine answered 400 "Priority scheduling is not enabled" (vllm/v1/core/sched/request_queue.py)
    return _int_field(body, "priority") or 0


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise SimError(400, "1 validation error: 'stop' must be a string or a list of strings",
                   "Bad Request", "stop")


def _check_length(n_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    if n_prompt >= max_model_len:
        raise SimError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your request has {n_prompt} input tokens. Please reduce the "
                       "length of the input messages.", param="input_tokens")
    if max_tokens is None:
        return max_model_len - n_prompt
    if max_tokens < 1:
        raise SimError(400, f"max_tokens must be at least 1, got {max_tokens}.",
                       param="max_tokens")
    if n_prompt + max_tokens > max_model_len:
        raise SimError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                       f"This model's maximum context length is {max_model_len} tokens and your "
                       f"request has {n_prompt} input tokens ({max_tokens} > {max_model_len} - "
                       f"{n_prompt}).", param="max_tokens")
    return max_tokens


def _stop_point(seed: int, length: int, stops: list[str]) -> tuple[int, int] | None:
    """(tokens generated, visible characters) when a stop string ends the text first."""
    if not stops:
        return None
    text = P.generated_text(seed, 0, length)
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    pos, stop = min(found)
    return -(-(pos + len(stop)) // 4), pos


def parse_generation(
    body: dict[str, Any], chat: bool, max_model_len: int, reasoning: bool = False
) -> GenRequest:
    if not chat and body.get("suffix") is not None:  # vLLM's completions refuse it outright
        raise SimError(400, "suffix is not currently supported")
    if body.get("stream_options") and not body.get("stream"):  # the request model's validator
        raise SimError(400, "1 validation error: Value error, Stream options can only be "
                       "defined when `stream=True`.", "Bad Request", "stream_options")
    salt = validate_cache_salt(body)
    priority = _check_sampling(body)
    logprobs = _check_logprobs(body, chat)
    check_prompt_logprobs(body)
    check_response_format(body)
    tool = (plan_tool_call(body) or plan_structured_output(body)) if chat else None
    prompts = [parse_prompt(body, chat)] if chat else parse_prompts(body)
    prompt = prompts[0]
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    requested = _int_field(body, *names)
    limits = [_check_length(p.num_tokens, requested, max_model_len) for p in prompts]
    check_vocabulary(prompts)  # the engine's input check, after the frontend's length check
    max_tokens = limits[0]
    ignore_eos = body.get("ignore_eos") is True
    echo = not chat and body.get("echo") is True
    if echo and any(p.text is None for p in prompts):  # its text would be the detokenized ids
        raise SimError(400, "The simulator does not support echo with a prompt of token ids "
                       "(it cannot detokenize them).", param="echo")
    seed = prompt.seed()
    thinking = P.reasoning_length(seed) if (reasoning and chat and tool is None) else 0
    stops = _stops(body)
    n = _check_n(body)
    # vLLM's order: prompt i's j-th sequence is choice i * n + j
    choices = tuple(_plan_choice(P.choice_seed(p.seed(), j), thinking, limit, ignore_eos, stops,
                                 tool, i)
                    for i, (p, limit) in enumerate(zip(prompts, limits, strict=True))
                    for j in range(n))
    eos_after, visible = choices[0].eos_after, choices[0].visible_chars
    options = body.get("stream_options")
    stream = body.get("stream") is True
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    continuous = (include_usage and isinstance(options, dict)
                  and options.get("continuous_usage_stats") is True)
    rid = body.get("request_id")
    return GenRequest(chat, stream, include_usage, prompt, salt, max_tokens, eos_after, visible,
                      seed, priority, rid if isinstance(rid, str) else None, tool, thinking,
                      body.get("return_token_ids") is True, continuous, choices, logprobs,
                      tuple(prompts) if len(prompts) > 1 else (), echo)


def _plan_choice(seed: int, thinking: int, max_tokens: int, ignore_eos: bool, stops: list[str],
                 tool: ToolPlan | None, prompt: int) -> ChoicePlan:
    if tool is not None:  # guided decoding ends with the JSON object, EOS or not
        return ChoicePlan(seed, -(-len(tool.arguments) // 4), None, max_tokens, prompt)
    natural = None if ignore_eos else thinking + P.natural_length(seed)
    length = max_tokens if natural is None else min(natural, max_tokens)
    stop_point = _stop_point(seed, length, stops)
    eos_after, visible = (stop_point if stop_point else (natural, None))
    return ChoicePlan(seed, eos_after, visible, max_tokens, prompt)

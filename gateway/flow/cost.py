"""What a request may consume, in tokens: flow control holds it against its tenant's share of
the pool, and the tenant's TPM admission reserves it (`Preparer.prepare`); both are settled with
the real usage when the request is over."""

from __future__ import annotations

from gateway.body import ParsedBody
from routing.flow import request_cost

__all__ = ["asked_tokens"]


def asked_tokens(
    parsed: ParsedBody, prompt_tokens: int, expected_output: int, context: int | None = None,
) -> float:
    """What a request may consume: its prompt plus ``n`` times its output (``max_tokens``,
    else ``expected_output``), per `request_cost`; an embedding its prompt alone (it has no
    output: `expected_output_tokens` charged to it held a pool's share, and the tenant's TPM,
    for tokens no replica would ever produce). Flow control holds it; the tenant's TPM
    admission reserves it (`Preparer.prepare`), both settled with the real usage."""
    if not parsed.generates:
        return request_cost(prompt_tokens, 0, 0)
    return request_cost(prompt_tokens, _max_tokens(parsed), expected_output, context,
                        _sequences(parsed), _prompts(parsed))


def _max_tokens(parsed: ParsedBody) -> int | None:
    data = parsed.data
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _sequences(parsed: ParsedBody) -> int:
    """How many outputs the request asks for: ``n`` (vLLM refuses n < 1) per prompt, and a
    completions batch (a list of prompts) has one prompt per entry."""
    value = parsed.data.get("n")
    n = value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1
    return n * _prompts(parsed)


def _prompts(parsed: ParsedBody) -> int:
    """How many prompts a completions batch holds (1 for anything else): vLLM checks each
    against the context on its own, and each gets its own outputs."""
    prompt = parsed.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1

"""Made-up log probabilities in vLLM's shapes (chat `logprobs`/`top_logprobs`, completions
`logprobs: k`).

The simulator has no model, so the values are invented but stable: the same request always
gets the same numbers, the sampled token's log probability is in (-4, 0], and the
alternatives (other words of the simulator's vocabulary) rank below it, so `top_logprobs` is
sorted and its first entry is the sampled token, as under greedy decoding. Output text is 4
characters per token, so a text's tokens are its 4-character slices.
"""

from __future__ import annotations

from typing import Any

import xxhash

from loadtest.sim import prompt as P

__all__ = ["MAX_LOGPROBS", "chat_logprobs", "completion_logprobs", "joined", "prompt_logprobs",
           "tokens_of"]

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def tokens_of(text: str) -> list[str]:
    return [text[i: i + 4] for i in range(0, len(text), 4)]


def _logprob(seed: int, position: int) -> float:
    h = xxhash.xxh32_intdigest(position.to_bytes(8, "little"), seed & 0xFFFFFFFF)
    return -round((h % 4000) / 1000, 4)


def _alternatives(token: str, logprob: float, k: int) -> list[tuple[str, float]]:
    """The sampled token then ``k - 1`` other words, each less likely than the one before."""
    out = [(token, logprob)]
    words = [w for w in P.vocabulary() if w != token]
    base = round(-logprob * 1000)  # varies per token, so the alternatives do too
    for rank in range(1, k):
        # 7 is prime to the vocabulary's 31-32 words: no word comes twice for k <= 20
        out.append((words[(base + rank * 7) % len(words)], round(logprob - 0.75 * rank, 4)))
    return out


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(text: str, seed: int, offset: int, top: int) -> dict[str, Any]:
    """``choice.logprobs`` of chat for ``text``, which starts ``offset`` characters into the
    choice's output (a streamed delta), with ``top`` alternatives per token."""
    content = []
    for i, token in enumerate(tokens_of(text)):
        lp = _logprob(seed, offset // 4 + i)
        content.append({**_entry(token, lp), "top_logprobs": [
            _entry(t, v) for t, v in _alternatives(token, lp, top)]})
    return {"content": content}


def completion_logprobs(text: str, seed: int, offset: int, k: int,
                        shift: int = 0) -> dict[str, Any]:
    """``choice.logprobs`` of completions: tokens, their log probabilities, the sampled token
    and up to ``k`` alternatives each (k=0: the sampled token only, as vLLM), and where each
    token starts in the choice's text (``shift``: the echoed prompt before the output)."""
    tokens = tokens_of(text)
    lps = [_logprob(seed, offset // 4 + i) for i in range(len(tokens))]
    return {
        "text_offset": [shift + offset + 4 * i for i in range(len(tokens))],
        "token_logprobs": lps,
        "tokens": tokens,
        "top_logprobs": [dict(_alternatives(t, lp, max(1, k))) for t, lp in zip(tokens, lps,
                                                                                strict=True)],
    }


def prompt_logprobs(text: str, k: int) -> dict[str, Any]:
    """The echoed prompt's part of completions ``logprobs``: its first token has none (nothing
    comes before it), as vLLM's echo answers."""
    tokens = tokens_of(text)
    lps: list[float | None] = [None]
    lps += [_logprob(len(text), i) for i in range(1, len(tokens))]
    tops = [None if lp is None else dict(_alternatives(t, lp, max(1, k)))
            for t, lp in zip(tokens, lps, strict=False)]
    return {"text_offset": [4 * i for i in range(len(tokens))], "token_logprobs": lps,
            "tokens": tokens, "top_logprobs": tops}


def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects one after the other."""
    return {key: first[key] + then[key] for key in first}

"""Render block ids as deterministic prompt text for live replay.

A block of `block_tokens` tokens becomes exactly `block_tokens * CHARS_PER_TOKEN` characters
(the simulator's token rule, routing.tokens), so the simulator's prefix cache sees the same
sharing as the trace: equal id chains give equal text, different ids give different text in
every 4-character token.
"""

from __future__ import annotations

import xxhash

from routing.tokens import CHARS_PER_TOKEN

__all__ = ["render_prompt"]

_WORDS = (
    "the of and to in is was for on are with as by at from this that which have were "
    "their model cache token prefix request replica batch queue route tenant latency "
    "memory block layer vector weight kernel stream window"
).split()


def _block_text(block_id: int, n_chars: int) -> str:
    # Each 4-char token carries 2 hex digits of a per-block hash, so different blocks differ
    # in every token, plus filler letters from a word to look vaguely like text.
    out: list[str] = []
    size = 0
    i = 0
    while size < n_chars:
        h = xxhash.xxh3_64_intdigest(f"{block_id}:{i}".encode())
        word = _WORDS[h % len(_WORDS)]
        piece = f"{h >> 8 & 0xFFFFFFFFFFFF:012x}{word[:4]:<4}"
        out.append(piece)
        size += len(piece)
        i += 1
    return "".join(out)[:n_chars]


def render_prompt(block_ids: tuple[int, ...], block_tokens: int, prompt_tokens: int) -> str:
    """The prompt text of a request: its blocks' text, cut to `prompt_tokens` tokens."""
    block_chars = block_tokens * CHARS_PER_TOKEN
    text = "".join(_block_text(b, block_chars) for b in block_ids)
    return text[: prompt_tokens * CHARS_PER_TOKEN]

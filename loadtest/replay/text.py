"""Render block ids as deterministic prompt text for live replay.

A block of `block_tokens` tokens becomes exactly `block_tokens * CHARS_PER_TOKEN` characters
(the simulator's token rule, routing.tokens), so the simulator's prefix cache sees the same
sharing as the trace: equal id chains give equal text, different ids give different text in
every 4-character token. Tokens past the last block id (a trace whose `hash_ids` cover less
than `input_length`, or none) are text of the request's own, shared with no other, as
offline, where they have no block hash: the prompt was cut to the ids' length (an empty one,
which vLLM refuses with a 400, for `hash_ids: []`).
"""

from __future__ import annotations

import itertools

import xxhash

from routing.tokens import CHARS_PER_TOKEN

__all__ = ["render_prompt"]

_WORDS = (
    "the of and to in is was for on are with as by at from this that which have were "
    "their model cache token prefix request replica batch queue route tenant latency "
    "memory block layer vector weight kernel stream window"
).split()


_TAILS = itertools.count()  # one text per uncovered tail: keys no block id's text can have


def _block_text(block_id: int | str, n_chars: int) -> str:
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
    want = prompt_tokens * CHARS_PER_TOKEN
    text = "".join(_block_text(b, block_chars) for b in block_ids)
    if len(text) < want:
        text += _block_text(f"tail-{next(_TAILS)}", want - len(text))
    return text[:want]

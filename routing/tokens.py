"""kvgate's tokenizer-free token rule, shared by the simulator, the router and the replayer.

One token is ``CHARS_PER_TOKEN`` characters of text, cut at fixed offsets from the start
(a trailing partial group is one more token). English averages about four characters per
token under common BPE tokenizers, so estimates are of the right size, and the boundaries are
stable: a prefix of the text always tokenizes to a prefix of the tokens.
"""

from __future__ import annotations

CHARS_PER_TOKEN = 4


def count_tokens(n_chars: int) -> int:
    """Tokens in a text of ``n_chars`` characters."""
    return -(-n_chars // CHARS_PER_TOKEN) if n_chars > 0 else 0


def chars_for_tokens(n_tokens: int) -> int:
    """Characters that make exactly ``n_tokens`` whole tokens."""
    return n_tokens * CHARS_PER_TOKEN

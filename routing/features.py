"""Request features: salted, chained prefix block hashes of the canonical prompt.

The canonical text is cut into fixed blocks of ``block_chars`` characters; block *i* is hashed
with xxh3_64 seeded by the hash of block *i-1*, and block 0 by a hash of (model, salt). So a
block hash names its whole prefix, two tenants with different salts never share a hash at any
depth, and only full blocks count.

One exception, for chats: when a conversation's *opening* (its text up to the end of its first
user message, `routing.canon.canonical_text_and_opening`) ends inside block 0, and is at least
one vLLM cache block long (16 tokens: shorter, it is cached nowhere and "hi" would name every
conversation that opens with it), the chain's
first entry is a hash of the opening instead of block 0's, and a prompt shorter than a block
has that one entry instead of none. Every turn of the conversation starts with its opening,
so its turns share a first entry from the first turn on: without it a short conversation (a
system prompt and a question: ~200 characters) had no chain until it outgrew a block and was
placed on load alone, a different replica at each of its first turns, each turn's prefix
computed again (vLLM caches 16-token blocks: a 200-character prompt is 3 of them). Block 0's
text starts with the opening, so two prompts that share block 0 share the opening and keep
sharing the first entry; the entries after it are chained from block 0's hash as before. The
entry stands for one block in the index, as the shorter opening's cache is at most one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xxhash import xxh3_64_intdigest

from routing.canon import canonical_text_and_opening
from routing.config import RouterConfig
from routing.tokens import CHARS_PER_TOKEN, count_tokens
from routing.types import RequestFeatures

__all__ = ["block_hashes", "extract_features", "root_seed"]

_OPENING = 0x6F70656E696E6721  # seeds a chat's opening apart from block 0 (any fixed bits)
# an opening shorter than one of vLLM's cache blocks (16 tokens by default) is no cache at all
# and names no conversation ("hi": every chat of a tenant opening so would share one entry)
_MIN_OPENING = 16 * CHARS_PER_TOKEN


def root_seed(model: str, salt: str) -> int:
    """The seed of block 0: tenants (salts) and models never share a hash chain."""
    return xxh3_64_intdigest(f"{model}\x00{salt}".encode())


def block_hashes(text: str, seed: int, block_chars: int, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the full ``block_chars``-character blocks of ``text`` (at most max)."""
    n = min(len(text) // block_chars, max_blocks)
    out = []
    h = seed
    if text.isascii():  # one encode, then byte slices (the common case, and the fast one)
        data = text.encode("ascii")
        for start in range(0, n * block_chars, block_chars):
            h = xxh3_64_intdigest(data[start : start + block_chars], h)
            out.append(h)
    else:  # blocks are characters, not bytes: slice the text, encode each block
        for start in range(0, n * block_chars, block_chars):
            h = xxh3_64_intdigest(text[start : start + block_chars].encode("utf-8"), h)
            out.append(h)
    return tuple(out)


def extract_features(
    body: Mapping[str, Any],
    *,
    model: str,
    salt: str,
    config: RouterConfig,
    tenant: str = "default",
    tier: str = "default",
    priority: int = 0,
) -> RequestFeatures:
    """Features of a parsed chat/completions ``body`` for the public ``model`` and ``salt``."""
    text, opening = canonical_text_and_opening(body)
    seed = root_seed(model, salt)
    hashes = block_hashes(text, seed, config.block_chars, config.max_blocks)
    if _MIN_OPENING <= opening < config.block_chars:  # (module docstring)
        lead = xxh3_64_intdigest(text[:opening].encode("utf-8", "surrogatepass"), seed ^ _OPENING)
        hashes = (lead, *hashes[1:])
    return RequestFeatures(
        model=model,
        block_hashes=hashes,
        prompt_tokens=count_tokens(len(text)),
        tenant=tenant,
        tier=tier,
        stream=bool(body.get("stream", False)),
        priority=priority,
        prefix_key=xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"), seed),
        prompt_chars=len(text),
        output_tokens=_asked_output(body),
    )


def _asked_output(body: Mapping[str, Any]) -> int:
    """The output tokens ``body`` asks for at most (the names vLLM reads, the newer first)."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return max(value, 0)
    return 0

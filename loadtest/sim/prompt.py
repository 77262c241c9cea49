"""Text <-> tokens for the simulator: prompt rendering, token ids, block hashes, generated text.

Token rule (shared with the router, `routing.tokens`): one token per 4 characters, cut at fixed
offsets from the start of the rendered prompt. A token's id is ``xxh32(group) & 0x1FFFF``
(a 131k vocabulary), so equal text gives equal ids and a text prefix gives an id prefix.

Chat template (documented, stable): optional ``<|tools|>\\n`` + tools as sorted-key JSON + ``\\n``,
then per message ``<|role|>\\n`` + its text content + ``\\n`` (list contents: text parts joined,
other parts as sorted-key JSON; assistant ``tool_calls`` as sorted-key JSON), ending with
``<|assistant|>\\n``.

Block hashes chain like vLLM's: ``h_i = xxh3_64(h_{i-1} || token ids of block i || extras)``
with ``h_-1`` a fixed seed and the cache salt in the first block's extras only; full blocks only.

Generated text is a deterministic sequence of 4-character words, so each generated token is
exactly one token under the rule above.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

from routing.tokens import CHARS_PER_TOKEN

__all__ = [
    "VOCAB_MASK",
    "block_hashes",
    "generated_text",
    "natural_length",
    "render_chat",
    "text_seed",
    "token_ids",
]

VOCAB_MASK = (1 << 17) - 1
_CHARS = CHARS_PER_TOKEN
_NONE_HASH = xxhash.xxh3_64_intdigest(b"kvgate-sim-none-hash")
_JSON_OPTS = orjson.OPT_SORT_KEYS
# 4-character words (leading space included) for generated text
_WORDS = (
    " the", " and", " for", " you", " can", " use", " one", " two", " new", " way", " set",
    " run", " key", " map", " log", " bit", " row", " end", " top", " via", " all", " any",
    " big", " low", " hot", " old", " few", " own", " put", " get", " add", " fix",
)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=_JSON_OPTS).decode()


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                parts.append(_dumps(part))
        return "".join(parts)
    return _dumps(content)


def render_chat(messages: Sequence[dict[str, Any]], tools: Any = None) -> str:
    """The simulator's chat template (see the module docstring)."""
    out: list[str] = []
    if tools:
        out.append(f"<|tools|>\n{_dumps(tools)}\n")
    for message in messages:
        text = _content_text(message.get("content"))
        if message.get("tool_calls"):
            text += _dumps(message["tool_calls"])
        out.append(f"<|{message.get('role', 'user')}|>\n{text}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


def token_ids(text: str) -> list[int]:
    """Token ids of ``text`` under the 4-characters rule."""
    h = xxhash.xxh32_intdigest
    m = VOCAB_MASK
    return [h(text[i : i + _CHARS].encode()) & m for i in range(0, len(text), _CHARS)]


def block_hashes(ids: Sequence[int], block_size: int, salt: str | None = None) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``ids``; ``salt`` enters the first block only."""
    packed = array("I", (t & 0xFFFFFFFF for t in ids)).tobytes()
    width = 4 * block_size
    extra = b"\x00salt\x00" + salt.encode() if salt else b""
    h3 = xxhash.xxh3_64_intdigest
    parent = _NONE_HASH
    out = []
    for b in range(len(ids) // block_size):
        data = parent.to_bytes(8, "little") + packed[b * width : (b + 1) * width]
        parent = h3(data + extra if b == 0 else data)
        out.append(parent)
    return tuple(out)


def text_seed(ids: Sequence[int]) -> int:
    """A per-prompt seed for the generated text and its natural length."""
    return xxhash.xxh3_64_intdigest(array("I", (t & 0xFFFFFFFF for t in ids)).tobytes())


def natural_length(seed: int, lo: int = 8, hi: int = 128) -> int:
    """Where generation would hit EOS for this prompt: ``lo..hi`` tokens, fixed per prompt."""
    return lo + seed % (hi - lo + 1)


def generated_text(seed: int, start: int, count: int) -> str:
    """Generated tokens ``start .. start+count-1`` of the output for ``seed``."""
    words, n = _WORDS, len(_WORDS)
    h = xxhash.xxh32_intdigest
    s32 = seed & 0xFFFFFFFF
    return "".join(words[h(i.to_bytes(4, "little"), s32) % n] for i in range(start, start + count))

"""Text <-> tokens for the simulator: prompt rendering, token ids, block hashes, generated text.

Token rule (shared with the router, `routing.tokens`): one token per 4 characters, cut at fixed
offsets from the start of the rendered prompt. A token's id is ``xxh32(group) & 0x1FFFF``
(a 131k vocabulary), so equal text gives equal ids and a text prefix gives an id prefix.

Chat template (documented, stable): optional ``<|tools|>\\n`` + tools as sorted-key JSON + ``\\n``,
then per message ``<|role|>\\n`` + its text content + ``\\n`` (list contents: text parts joined,
other parts as sorted-key JSON; assistant ``tool_calls`` as sorted-key JSON), ending with
``<|assistant|>\\n``.

Block hashes chain like vLLM's: ``h_i = xxh3_64(h_{i-1} || block i || extras)`` with ``h_-1`` a
fixed seed and the cache salt in the first block's extras only; full blocks only. A text prompt
hashes the text of each block (its token ids are a function of that text, so equal blocks are
equal either way, without a Python step per token); a prompt of token ids hashes the ids.

Generated text is a deterministic sequence of 4-character words, so each generated token is
exactly one token under the rule above.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

from routing.tokens import CHARS_PER_TOKEN, count_tokens

__all__ = [
    "VOCAB_MASK",
    "Prompt",
    "block_hashes",
    "choice_seed",
    "content_text",
    "generated_text",
    "natural_length",
    "reasoning_length",
    "render_chat",
    "text_seed",
    "token_ids",
    "vocabulary",
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


def content_text(content: Any) -> str:
    """A message's content as the template renders it."""
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
        text = content_text(message.get("content"))
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


class Prompt:
    """A rendered prompt: text (chat, or a completions string) or client-given token ids."""

    __slots__ = ("_ids", "text")

    def __init__(self, text: str | None = None, ids: list[int] | None = None) -> None:
        if (text is None) == (ids is None):
            raise ValueError("a Prompt is text or token ids")
        self.text, self._ids = text, ids

    @property
    def num_tokens(self) -> int:
        return count_tokens(len(self.text)) if self.text is not None else len(self.ids)

    @property
    def ids(self) -> list[int]:
        """Token ids (computed on demand for text: only /tokenize needs them)."""
        if self._ids is None:
            self._ids = token_ids(self.text or "")
        return self._ids

    def block_hashes(self, block_size: int, salt: str | None = None) -> tuple[int, ...]:
        if self.text is None:
            return block_hashes(self.ids, block_size, salt)
        return _text_block_hashes(self.text, block_size * _CHARS, salt)

    def seed(self) -> int:
        """A per-prompt seed for the generated text and its natural length."""
        if self.text is None:
            return text_seed(self.ids)
        return xxhash.xxh3_64_intdigest(self.text.encode("utf-8", "surrogatepass"))


def _text_block_hashes(text: str, width: int, salt: str | None) -> tuple[int, ...]:
    extra = b"\x00salt\x00" + salt.encode() if salt else b""
    h3 = xxhash.xxh3_64_intdigest
    ascii_ = text.isascii()
    data = text.encode("ascii") if ascii_ else b""
    parent = _NONE_HASH
    out = []
    for b in range(len(text) // width):
        chunk = (data[b * width : (b + 1) * width] if ascii_
                 else text[b * width : (b + 1) * width].encode("utf-8", "surrogatepass"))
        block = parent.to_bytes(8, "little") + chunk
        parent = h3(block + extra if b == 0 else block)
        out.append(parent)
    return tuple(out)


def text_seed(ids: Sequence[int]) -> int:
    """A per-prompt seed for the generated text and its natural length."""
    return xxhash.xxh3_64_intdigest(array("I", (t & 0xFFFFFFFF for t in ids)).tobytes())


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of an ``n > 1`` request: choice 0 keeps the prompt's own, so
    n=1 answers do not change; the others get their own text and natural length."""
    if index == 0:
        return seed
    return xxhash.xxh3_64_intdigest(index.to_bytes(4, "little"), seed & 0xFFFFFFFFFFFFFFFF)


def natural_length(seed: int, lo: int = 8, hi: int = 128) -> int:
    """Where generation would hit EOS for this prompt: ``lo..hi`` tokens, fixed per prompt."""
    return lo + seed % (hi - lo + 1)


def reasoning_length(seed: int, lo: int = 4, hi: int = 16) -> int:
    """How many leading output tokens are the thinking phase (``--reasoning``), fixed per prompt."""
    return lo + (seed >> 20) % (hi - lo + 1)


def vocabulary() -> tuple[str, ...]:
    """The words generated text is made of (one token each)."""
    return _WORDS


def generated_text(seed: int, start: int, count: int) -> str:
    """Generated tokens ``start .. start+count-1`` of the output for ``seed``."""
    words, n = _WORDS, len(_WORDS)
    h = xxhash.xxh32_intdigest
    s32 = seed & 0xFFFFFFFF
    return "".join(words[h(i.to_bytes(4, "little"), s32) % n] for i in range(start, start + count))

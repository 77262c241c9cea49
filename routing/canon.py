"""Canonical text of an OpenAI request body: what the prefix hashes are computed over.

The text depends only on what the model sees (roles, content parts, tools), never on JSON key
order or whitespace: the body arrives already parsed, strings are taken as they are, and the
few structured parts (tools, non-text content parts, tool calls) are rendered as JSON with
sorted keys. Control characters that do not occur in ordinary text separate the pieces, so
moving text between a role and its content, or between two messages, changes the result.
The order follows a chat template's: tools come first (templates put them in the system
prompt), then the messages in order; so a growing conversation keeps its earlier prefix.
"""

from __future__ import annotations

from base64 import b64encode
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["canonical_text", "canonical_text_and_opening"]

_MSG_END = "\x1e"  # record separator: end of one message / prompt
_FIELD = "\x1f"  # unit separator: role | content | extra fields
_PART = "\x1d"  # group separator: between content parts
_MSG_KEYS = frozenset({"role", "content"})


def _stable_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        # vLLM joins a message's text parts with a newline before the chat template sees them
        # (entrypoints/chat_utils.py, the "string" content format), so ["A", "B"] as parts and
        # "A\nB" as a string are one prompt and one KV cache: the same text here. A part that is
        # not text keeps its own separator.
        text = ""
        last_was_text = False
        for i, part in enumerate(content):
            is_text = isinstance(part, Mapping) and part.get("type") == "text"
            piece = str(part.get("text", "")) if is_text else _stable_json(part)
            if i:
                text += "\n" if is_text and last_was_text else _PART
            text += piece
            last_was_text = is_text
        return text
    return _stable_json(content)


def _message_text(message: Any) -> str:
    if not isinstance(message, Mapping):
        return _stable_json(message) + _MSG_END
    text = f"{message.get('role', '')}{_FIELD}{_content_text(message.get('content'))}"
    if len(message) > 2 or not _MSG_KEYS.issuperset(message):
        extra = {k: v for k, v in message.items() if k not in _MSG_KEYS}
        if extra:
            text += _FIELD + _stable_json(extra)
    return text + _MSG_END


def _ids_text(ids: list[Any]) -> str | None:
    """A prompt of token ids as text of 4 characters an id (`routing.tokens.CHARS_PER_TOKEN`),
    or None when it is not one (an id that is not an int, or beyond 24 bits: vLLM refuses it too).
    Each id is 3 bytes, which base64 writes as 4 characters, so the token estimate counts one
    token an id (as JSON text, ``[1234,567,...]``, it counted ~1.6), and a prefix of the ids
    is a prefix of the text: block boundaries fall between ids, as between tokens of text."""
    if not ids or not all(type(i) is int for i in ids):
        return None
    try:
        packed = b"".join([i.to_bytes(3, "big") for i in ids])
    except OverflowError:  # negative, or >= 2**24
        return None
    return b64encode(packed).decode("ascii")


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return _MSG_END.join(prompt)
        if (text := _ids_text(prompt)) is not None:
            return text
        if all(isinstance(p, list) for p in prompt):  # a batch of token-id prompts
            texts = [_ids_text(p) for p in prompt]
            if None not in texts:
                return _MSG_END.join(t for t in texts if t is not None)
    return _stable_json(prompt)


def canonical_text(body: Mapping[str, Any]) -> str:
    """The text the prefix hashes of ``body`` (chat or completions) are computed over."""
    return canonical_text_and_opening(body)[0]


def canonical_text_and_opening(body: Mapping[str, Any]) -> tuple[str, int]:
    """`canonical_text`, and for a chat its *opening*: the characters up to the end of its
    first user message (tools and system prompt included), which every later turn of the
    conversation starts with; 0 for a body that is not a chat or has no user message."""
    messages = body.get("messages")
    if isinstance(messages, list):
        head = ""
        tools = body.get("tools")
        if tools:
            head = f"tools{_FIELD}{_stable_json(tools)}{_MSG_END}"
        parts = [_message_text(m) for m in messages]
        opening = 0
        for i, m in enumerate(messages):
            if isinstance(m, Mapping) and m.get("role") == "user":
                opening = len(head) + sum(map(len, parts[: i + 1]))
                break
        return head + "".join(parts), opening
    if "prompt" in body:
        return _prompt_text(body["prompt"]), 0
    if "input" in body:  # embeddings, or the Responses API (its `instructions` come first)
        instructions = body.get("instructions")
        head = f"{instructions}{_MSG_END}" if isinstance(instructions, str) and instructions else ""
        return head + _prompt_text(body["input"]), 0
    return "", 0

"""Scanning a relayed SSE stream for the final usage chunk, without decoding every chunk.

Chunks are forwarded as they arrive. Only a chunk that mentions ``"usage"`` is split into
events; the usage numbers are read with a regular expression, and the usage-only chunk
(``"choices": []``) is dropped when kvgate asked for it and the client did not. Comment lines
(``: keep-alive``), error events and ``data: [DONE]`` pass through untouched.
"""

from __future__ import annotations

import re

__all__ = ["StreamScanner", "Usage", "scan_usage"]

_USAGE_KEY = b'"usage"'
_NULL_USAGE = re.compile(rb'"usage"\s*:\s*null')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_COUNTS = re.compile(
    rb'"(prompt_tokens|completion_tokens|cached_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)'
)
# the Responses API names them input/output tokens; kvgate counts in chat/completions names
_ALIASES = {"input_tokens": "prompt_tokens", "output_tokens": "completion_tokens"}
_ENDS = (b"\n\n", b"\r\n\r\n")

Usage = dict[str, int]


def scan_usage(blob: bytes) -> Usage | None:
    """Token counts from a JSON text holding a non-null `usage` object, else None."""
    if _USAGE_KEY not in blob or _NULL_USAGE.search(blob):
        return None
    counts: Usage = {}
    for key, value in _COUNTS.findall(blob):
        name = key.decode()
        counts[_ALIASES.get(name, name)] = int(value)
    return counts or None


class StreamScanner:
    """Feed upstream chunks in order; forward what `feed` returns, then what `flush` returns."""

    __slots__ = ("_partial", "_strip", "ended_event", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self._strip = strip_usage
        self._partial = b""
        self.usage: Usage | None = None
        self.ended_event = True  # the last forwarded byte closed an event

    def feed(self, chunk: bytes) -> bytes:
        if not self._partial and chunk.endswith(_ENDS):
            # the common case: whole events in one read
            return chunk if _USAGE_KEY not in chunk else self._events(chunk)
        data = self._partial + chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if cut == 0:  # no complete event yet: hold the fragment (a client can't use it)
            self._partial = data
            return b""
        self._partial = data[cut:]
        return self._events(data[:cut])

    def flush(self) -> bytes:
        """At the end of the stream: whatever is left, forwarded as is."""
        rest, self._partial = self._partial, b""
        if rest:
            self.ended_event = False
        return rest

    def _events(self, block: bytes) -> bytes:
        if _USAGE_KEY not in block:
            return block
        sep = b"\r\n\r\n" if b"\r\n\r\n" in block else b"\n\n"
        kept = []
        for event in block.split(sep):
            if _USAGE_KEY in event:
                usage = scan_usage(event)
                if usage is not None:
                    self.usage = usage
                    if self._strip and _EMPTY_CHOICES.search(event):
                        continue
            kept.append(event)
        return sep.join(kept)

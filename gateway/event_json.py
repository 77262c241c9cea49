"""Whether a relayed SSE event's data is JSON the client's parser reads (`gateway.sse`
judges events by their first and last bytes; these parse the ones that pass): data that opens
and closes as an object yet does not parse -- ``{not json}``, mismatched brackets, two objects
on two data lines, bytes that are not UTF-8 -- made the official SDK raise a JSONDecodeError
(or a UnicodeDecodeError) mid-stream instead of an APIError."""

from __future__ import annotations

import json

import orjson

__all__ = ["PARSED_BYTES", "first_unparsable", "json_text"]

# an event's data this large at most is parsed (~1 ms); a larger one (a completions echo with
# prompt logprobs: tens of MB) is judged by its first and last bytes only, not parsed on the
# event loop (as `whole.garbled` leaves a large whole answer unparsed)
PARSED_BYTES = 1024 * 1024
_EVENT_BYTES = PARSED_BYTES + 4096  # an event of that much data, its field names and comments


def first_unparsable(block: bytes) -> int | None:
    """Where the first event of `block` (whole events, LF line ends, each judged by its first
    and last bytes already) whose data does not parse as JSON starts, or None: ``{not
    json}``, ``{"a": }``, two objects on two data lines (the client joins them), bytes that
    are not UTF-8. Relayed, the official SDK raised a JSONDecodeError (or a
    UnicodeDecodeError) mid-stream instead of an APIError. One orjson parse per event (~2 us)."""
    pos, size = 0, len(block)
    view = memoryview(block)  # vLLM's events are parsed in place: no copy of each
    while pos < size:
        end = block.find(b"\n\n", pos)
        end = size if end < 0 else end
        if end - pos <= _EVENT_BYTES:  # (a larger one is not copied: `PARSED_BYTES`)
            if block.startswith(b"data: {", pos, end) and block.find(b"\n", pos, end) < 0:
                data = view[pos + 6:end]  # vLLM's chat/completions event: parsed here, the
                try:  # common case (a call less per event); `json_text` when it does not
                    orjson.loads(data)
                except orjson.JSONDecodeError:
                    if not json_text(data):
                        return pos
            else:  # (a Responses API event: its name, then its data)
                joined = _joined_data(block[pos:end])
                if joined is not None and joined[:1] == b"{" and not json_text(joined):
                    return pos
        pos = end + 2
    return None


def _joined_data(event: bytes) -> bytes | None:
    """The data of one event (LF line ends) as the client reads it -- its data lines'
    values, one leading space dropped, joined by LF -- left-stripped; None when it has
    none."""
    values = [line[6:] if line[5:6] == b" " else line[5:]
              for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(values).lstrip(b" \t") if values else None


def json_text(data: bytes | memoryview) -> bool:
    """Whether the client's JSON parser reads `data`: orjson's first; the standard library's
    when orjson refuses (``NaN``, ``1e999``, a lone surrogate escape: Python's `json`, which
    the SDK uses, reads them), from strict UTF-8 as the SDK decodes each line. True, unread,
    past `PARSED_BYTES`."""
    if len(data) > PARSED_BYTES:
        return True
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            json.loads(bytes(data).decode("utf-8"))
        except (ValueError, RecursionError):  # (UnicodeDecodeError, JSONDecodeError: both
            return False  # ValueErrors; nesting past orjson's 1024 levels: the SDK fails too)
    return True

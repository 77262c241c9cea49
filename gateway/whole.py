"""Reading a whole (non-streamed) upstream answer: bounded in size, and timed between its
chunks. The HTTP edge's proxied answers and stored responses read with it (`relay.py`
re-exports it); the endpoint picker reads Envoy's copy of one by the same rule."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import orjson

from gateway.errors import AnswerTooLarge
from gateway.transport import Transport, UpstreamResponse

__all__ = ["CUT_ANSWER", "cut_json", "fetch_whole", "garbled", "json_object", "read_whole",
           "without_bom"]

CUT_ANSWER = "The replica failed while answering."  # a whole answer cut short (reset or close)
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark

_OPENS_OBJECT = re.compile(rb"[ \t\r\n]*\{")
_PARSED_BYTES = 1024 * 1024  # a framed whole answer this large at most is parsed (`garbled`)


async def read_whole(
    resp: UpstreamResponse, limit: int, touch: Callable[[], None] | None = None,
) -> bytes:
    """A whole answer, `AnswerTooLarge` past ``limit`` bytes (declared or read): the caller
    then drops the connection, so the replica stops sending. ``touch`` is called at each
    chunk (`Canceller.touch`): the idle timeout bounds the gaps between a body's chunks, not
    its whole transfer, so a slow but moving body is not cut. A UTF-8 byte order mark
    opening the body is left out (`without_bom`)."""
    declared = resp.content_length
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge(limit)
    parts, size = [], 0
    while chunk := await resp.read_chunk():
        if touch is not None:
            touch()
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(limit)
        parts.append(chunk)
    return without_bom(b"".join(parts))


async def fetch_whole(
    transport: Transport, url: str, headers: dict[str, str], method: str, *, head_s: float,
    idle_s: float, total_s: float, max_bytes: int,
    on_head: Callable[[UpstreamResponse], None] | None = None,
) -> tuple[UpstreamResponse, bytes]:
    """A replica's whole answer to a request without a body (a stored response, the
    tokenizer's info): its head within `head_s` (`on_head` may refuse it), then each gap in
    its body within `idle_s`, all of it within `total_s`. The connection goes back to the
    pool when read whole, else is aborted. TimeoutError and the transport's errors are the
    caller's to name."""
    loop = asyncio.get_running_loop()
    end = loop.time() + total_s
    resp: UpstreamResponse | None = None
    clean = False
    try:
        async with asyncio.timeout(head_s) as bound:
            resp = await transport.open(url, headers, method)
            if on_head is not None:
                on_head(resp)

            def touch() -> None:  # the head came: from here on, the body's gaps
                bound.reschedule(min(loop.time() + idle_s, end))

            touch()
            body = await read_whole(resp, max_bytes, touch)
            clean = True
    finally:
        if resp is not None:
            resp.release() if clean else resp.abort()
    return resp, body


def without_bom(body: bytes) -> bytes:
    """`body` without the UTF-8 byte order mark it may open with (a server in front of a
    replica that writes one; RFC 8259 8.1 lets a JSON parser ignore it). The client's decoder
    would have read it -- Python's `json` with bytes, so httpx and the openai SDK, a browser's
    `fetch` -- but orjson and kvgate's own checks did not: the answer was a 502 "not JSON",
    and an error's message was lost. Relayed without it: a JSON text has none (8.1)."""
    return body[3:] if body[:3] == _BOM else body


def json_object(content_type: str, body: bytes) -> bool:
    """Whether a 200 may be the JSON object every proxied route answers: a JSON media type
    and a body that opens and closes as an object. Not a parse (a whole answer may be tens of
    MB: embeddings); an HTML page labelled JSON, an empty or cut body, ``null``, a string or an
    array are not."""
    if not content_type.startswith("application/json") or not _OPENS_OBJECT.match(body):
        return False
    end = len(body)
    while body[end - 1] in b" \t\r\n":  # (the match above: a "{" is there to stop at)
        end -= 1
    return body[end - 1] == ord("}")


def cut_json(declared: bool, body: bytes) -> bool:
    """Whether a JSON object (`json_object`) is cut short, when no Content-Length framed it
    (``declared``: one did). A body delimited by the end of its connection ends at any clean
    close, so one cut at a nested object's ``}`` still opens and closes as an object --
    relayed, the client got a 200 it could not decode. A body without a Content-Length
    (chunked too: the transport cannot tell which framed it) is parsed; vLLM declares its
    whole answers' length, and a declared length tells the transport when the body is whole.
    Both edges (the picker's Envoy frames an answer as its replica did)."""
    return not declared and _unparsable(body)


def garbled(declared: bool, body: bytes) -> bool:
    """Whether a JSON object (`json_object`) that a Content-Length framed (``declared``: its
    body is whole) does not parse: a replica's or a proxy's bug, relayed as a 200 the SDK
    failed to decode. Parsed when at most `_PARSED_BYTES` (a chat answer; a larger one --
    embeddings, tens of MB -- is not parsed on the event loop); an unframed one is
    `cut_json`'s. Both edges: the 502 "not JSON", a failure of the replica."""
    return declared and len(body) <= _PARSED_BYTES and _unparsable(body)


def _unparsable(body: bytes) -> bool:
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return True
    return False

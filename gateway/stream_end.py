"""How a broken answer is told to the client: a stream's error event and ``data: [DONE]``
(`stream_error`, `error_event`), and which failure a stream's read shows (`stream_failure`,
`unstarted_failure`). Both edges end their streams with these, proxied and stored; split from
`relay.py`, which re-exports them. `next_chunk` reads a stream on: after its ``data: [DONE]``
(a Responses API stream's, proxied or stored: its ``response.completed``,
`StreamScanner.done`) the body's end (vLLM sends it at once) is waited for `AFTER_DONE_S`
in all from then on (`StreamScanner.done_by`), not the idle timeout nor a fresh bound per
read, so a replica or proxy holding the body open (or sending keep-alive comments after the
[DONE]) cannot hold the client, its replica's counters and its tenant's leases, nor have a
504 error event sent after the [DONE]; a connection broken there ends the stream as whole too
(no 502 event after the [DONE], no failure charged, its usage counted). What the replica sends
after its [DONE] within that time is relayed as sent, and nothing of kvgate's follows it."""

from __future__ import annotations

import asyncio
import re

import orjson

from gateway.errors import AnswerTooLarge, KvgateError, UpstreamError, error_body
from gateway.sse import StreamScanner, error_message, html_page
from gateway.transport import TRANSPORT_ERRORS, UpstreamResponse

__all__ = ["AFTER_DONE_S", "CUT_SHORT", "DONE_EVENT", "HTML_PAGE", "INSTEAD_OF_THE_STREAM",
           "MALFORMED", "NOT_SSE", "NOT_STARTED", "ended_early", "error_event", "next_chunk",
           "stream_error", "stream_failure", "unstarted_failure"]

AFTER_DONE_S = 1.0
# what ends a stream's read after its last event: its body's end not in time, or cut off
_AFTER_DONE_ENDS: tuple[type[BaseException], ...] = (TimeoutError, *TRANSPORT_ERRORS)

DONE_EVENT = b"data: [DONE]\n\n"
CUT_SHORT = "The upstream replica ended the stream before it was complete."
MALFORMED = "The upstream replica sent a stream event that is not a JSON object."
NOT_STARTED = "The replica ended its answer before it started."
HTML_PAGE = "The replica answered with an HTML page, not an event stream."
INSTEAD_OF_THE_STREAM = "The replica answered an error instead of the stream: "  # + its message
NOT_SSE = "The replica's answer is not an event stream."
# how an SSE line starts: a field's name (the four SSE knows; a line of no colon is one too)
# or a comment; a body held unended that starts otherwise is some other text (`ended_early`)
_SSE_LINE = re.compile(rb"(?:data|event|id|retry)(?:[:\r\n]|$)|:")
# what a stream's body may leave unended that is read for an error object's message (an error
# page is small; a larger fragment is an event cut short, not parsed)
_ERROR_OBJECT_BYTES = 64 * 1024


def stream_error(message: str, type_: str = "BadGatewayError", code: int = 502) -> bytes:
    """Close a broken stream: an error event, then [DONE]. An incomplete upstream event is
    never forwarded (the scanner holds fragments back), so it is simply dropped: a client
    must not be handed half a JSON object."""
    return b"data: " + error_body(message, type_, code) + b"\n\n" + DONE_EVENT


def error_event(status: int, body: bytes) -> tuple[int, bytes]:
    """A whole error answer (OpenAI-shaped: `openai_shaped`) as a stream's last event, as
    vLLM ends a stream that fails, for a stream whose head already went out; with the status
    it says, which the request is recorded with (any other answer is a 502 event)."""
    try:
        error = orjson.loads(body) if status >= 400 else None
    except orjson.JSONDecodeError:
        error = None
    if not isinstance(error, dict):
        return 502, stream_error(f"The upstream replica answered {status}.")
    return status, b"data: " + orjson.dumps(error) + b"\n\n" + DONE_EVENT


def ended_early(scanner: StreamScanner, started: bool) -> str:
    """Why a stream whose body ended before the stream did (`StreamScanner.complete`) failed,
    for the client's 502 (`started`: its error event): cut short -- unless what the body left
    unended is a JSON error object, no event (a proxy's error page labelled as a stream, an
    error answered with the stream's media type): then that error's message; an HTML page
    (`HTML_PAGE`), or -- nothing sent yet -- other text that is no SSE (`NOT_SSE`): said so.
    What the scanner held is dropped."""
    held = scanner.flush().strip()
    if (said := _body_said(held)) is not None:
        return said
    if started:
        return CUT_SHORT
    return NOT_SSE if held and not _SSE_LINE.match(held) else NOT_STARTED


def _body_said(text: bytes) -> str | None:
    """What a body that came instead of a stream's events says (a JSON error object's
    message, or that it is an HTML page), or None."""
    said = (error_message(text) if text[:1] == b"{" and len(text) <= _ERROR_OBJECT_BYTES
            else None)
    if said is not None:
        return f"{INSTEAD_OF_THE_STREAM}{said}"
    return HTML_PAGE if html_page(text) else None


def stream_failure(scanner: StreamScanner, limit: int) -> KvgateError:
    """The error of a stream whose scanner stopped at a bad event (`StreamScanner.malformed`):
    `AnswerTooLarge` for one past ``limit`` (``upstream.max_answer_bytes``), an HTML page or
    a JSON body (`StreamScanner.stray`: its error's message), else the event that is not JSON.
    Before the stream started it is the client's 502 JSON, after it the error event's message
    (both edges, proxied and stored streams)."""
    if scanner.oversized:
        return AnswerTooLarge(limit)
    if scanner.stray:  # (a 200 that is not the stream asked for, as a text/html one is)
        return UpstreamError(_body_said(scanner.stray.strip()) or NOT_SSE, reason="not_json")
    return UpstreamError(MALFORMED, reason="malformed")


def unstarted_failure(
    scanner: StreamScanner, limit: int, *, error_events: bool = True,
) -> KvgateError | None:
    """The failure a stream's read shows while its head has not gone out (nothing reached
    the client): a bad event (`stream_failure`), even after good ones in the same read (they
    are not sent: the client gets the 502 JSON, and the HTTP edge another replica first,
    rather than those events and an error event), or -- `error_events`, a proxied stream --
    vLLM's error event of code >= 500 (its engine failed before answering; the 502 keeps
    its message). None: the read can go out. Both edges, proxied and stored streams."""
    if scanner.malformed:
        return stream_failure(scanner, limit)
    code = scanner.error_code
    if error_events and code is not None and code >= 500:
        said = f": {scanner.error_message}" if scanner.error_message else "."  # vLLM's words
        return UpstreamError(f"The replica's answer was an error ({code}){said}",
                             reason="error_event")
    return None


async def next_chunk(resp: UpstreamResponse, scanner: StreamScanner) -> bytes:
    """The stream's next chunk; b"" at its end, or `AFTER_DONE_S` after its last event was
    read (however many reads come after it), or when the connection breaks after it (the
    body's end cut off: a reset, a close without the last chunk; the answer was whole, so it
    is not a failure mid-stream). The connection is then not reused: its answer did not end."""
    if scanner.done_by is None:
        if not scanner.done():
            return await resp.read_chunk()
        scanner.done_by = asyncio.get_running_loop().time() + AFTER_DONE_S
    try:
        if resp.at_hand():  # (vLLM's body end comes with its [DONE]): a read that does not
            return await resp.read_chunk()  # wait needs no timer (one per stream was ~5 us)
        async with asyncio.timeout_at(scanner.done_by):
            return await resp.read_chunk()
    except _AFTER_DONE_ENDS:
        return b""

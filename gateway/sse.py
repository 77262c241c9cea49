"""Scanning a relayed SSE stream for the final usage chunk, without decoding every chunk.

Chunks are forwarded as they arrive. Only a chunk that mentions ``"usage"`` is split into
events; the usage numbers are read with a regular expression, and the usage-only chunk
(``"choices": []``) is dropped when kvgate asked for it and the client did not (each other
event keeps its own end: vLLM sends ``\\n\\n``; SSE lets a line end with CRLF or a bare CR
too, so a server or a proxy in between may send ``\\r\\n\\r\\n``, ``\\r\\r`` or a mix, even in
one read; the bytes are relayed as sent, each event whole as it comes, and only a read holding
a CR pays for the general pattern: `_END`). Comment lines
(``: keep-alive``), error events and ``data: [DONE]`` pass through untouched; an error event
(vLLM's mid-stream ``data: {"error": {..., "code": 500}}``; the Responses API's ``error`` and
``response.failed``: `responses_error`) is noted in `error_code`. At the end,
`complete` says whether the stream ended as OpenAI streams do (``data: [DONE]``, a Responses
API terminal event, or an error event) rather than being cut short. An event whose data
cannot be an OpenAI event (not a JSON object, not ``[DONE]``, JSON cut short: a replica or a
proxy gone wrong; judged by its first and last bytes, then parsed) is never forwarded: `feed`
stops before it and sets `malformed` (the SDKs would raise a JSON decode error mid-stream,
with nothing saying which side failed). So is a line that starts with ``<`` or ``{``: no
SSE field does, an HTML page or a JSON body does (a proxy's error page labelled as the
stream: `stray` keeps it; relayed, its lines went to the client as fields it ignores, and the
stream's head with them). So is an event that grows past
``max_event_bytes`` without ending (`oversized` too): an unfinished event split by a read is
joined with the next chunk as long as it is about that chunk's size (a few KiB more at most,
the common case, as cheap as before); a larger one is held back in pieces, and only the new
bytes are searched for its end, so a replica sending one endless event costs kvgate linear
time and bounded memory, not a copy of the whole fragment per chunk (50 MB sent so held the
event loop for half a minute).
What the official SDK misreads in legal SSE is not relayed as sent: a UTF-8 byte order mark
opening the stream is left out (`feed`), `id:` lines too, and an event of fields without data
goes out as comment lines (`_plain_fields`).
`body_usage` finds the top-level ``usage`` of a whole (non-streamed) JSON body.
"""

from __future__ import annotations

import re

import orjson

from gateway.event_json import first_unparsable, json_text

__all__ = ["MAX_EVENT_BYTES", "StreamScanner", "Usage", "body_usage", "carries_output",
           "comment_only", "error_message", "first_malformed", "html_page", "no_event",
           "output_chars", "preamble_only", "responses_error", "scan_usage"]

_USAGE_KEY = b'"usage"'
_NULL_USAGE = re.compile(rb'"usage"\s*:\s*null')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_COUNTS = re.compile(
    rb'"(prompt_tokens|completion_tokens|cached_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)'
)
_TOTAL = re.compile(rb'"total_tokens"\s*:\s*(\d+)')
# the Responses API names them input/output tokens; kvgate counts in chat/completions names
_ALIASES = {"input_tokens": "prompt_tokens", "output_tokens": "completion_tokens"}
# how a read of whole events may end: a line's end (LF, CRLF or CR) then an empty line's (the
# CR of a CRLF may end a read: the event is whole at it). vLLM's `\n\n` first: the fast path
_ENDS = (b"\n\n", b"\n\r\n", b"\r\r", b"\n\r", b"\r\r\n")
# an event's end, whatever its line ends (longest first at one position)
_END = rb"\r\n\r\n|\r\n\r|\r\n\n|\r\r\n|\n\r\n|\r\r|\n\r|\n\n"
# a streamed event carrying generated output: chat `content`/`reasoning` (vLLM >= 0.34)/
# `reasoning_content` (older), completions `text`, tool-call `arguments`, responses' text
# `delta` -- a non-empty string value
_OUTPUT = re.compile(
    rb'"(?:content|reasoning|reasoning_content|text|arguments|delta)"\s*:\s*"[^"]'
)
# ... and that string's characters as sent (an escape counts its few bytes: an estimate)
_OUTPUT_TEXT = re.compile(
    rb'"(?:content|reasoning|reasoning_content|text|arguments|delta)"\s*:\s*"'
    rb'([^"\\]*(?:\\.[^"\\]*)*)"'
)
# Responses API events (`"type": "response.…"`) carry new output in `delta` fields only: their
# `.done` events and `response.completed` repeat the whole text (`text`, `part`, `output`)
_RESPONSES_EVENT = re.compile(rb'"type"\s*:\s*"response\.')
_DELTA_TEXT = re.compile(rb'"delta"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"')
MAX_EVENT_BYTES = 256 * 1024 * 1024  # = upstream.max_answer_bytes' default
# a held fragment up to a chunk's size and this much more is joined with the chunk and searched
# whole (an event split by a read); a larger one is kept in pieces and only new bytes searched
_JOIN_BYTES = 4096
_MESSAGE_CHARS = 512  # of an upstream error event's message, kept for a client's 502
# how a block of comment lines and blank lines starts (no event: SSE dispatches no empty one)
_QUIET = b":\r\n"
# what may be held after whole events that is no event: nothing, or a line end
_LINE_ENDS = (b"", b"\n", b"\r", b"\r\n")
_CR = ord("\r")  # (`_CR in block` is a memchr: 8x faster than `b"\r" in block`)
# an event whose data is an error object, nested (vLLM >= 0.10.1) or flat (older), or
# Anthropic's (``{"type": "error", "error": {"type": ...}}``: vLLM's `/v1/messages` stream
# failing). Generated text cannot match: inside a JSON string a quote is escaped and a newline
# is `\n`.
_ERROR_EVENT = re.compile(
    rb'(?:^|[\r\n])data:[ \t]*\{\s*"(?:error"\s*:|object"\s*:\s*"error"'
    rb'|type"\s*:\s*"error"\s*,\s*"error"\s*:)[^\r\n]*'
)
_CODE = re.compile(rb'"code"\s*:\s*"?(\d{3})\b')
# the Responses API's failures: its ``error`` event (``{"type": "error", "code": ..., "message":
# ...}``, flat: OpenAI's, a proxy's or a server's in front of vLLM) and ``response.failed``
# (its `response.error` says why). Candidates only: the event's JSON decides (`responses_error`)
_RESPONSES_ERROR = re.compile(
    rb'(?:^|[\r\n])data:[ \t]*\{[^\r\n]*"type"\s*:\s*"(?:error|response\.failed)"[^\r\n]*')
# what the Responses API's error codes (strings) stand for. OpenAI's API reference lists a
# failed response's `error.code` (ResponseErrorCode): server_error, rate_limit_exceeded,
# invalid_prompt, vector_store_timeout and the image family (invalid_image, invalid_image_format,
# invalid_base64_image, invalid_image_url, invalid_image_mode, image_too_large, image_too_small,
# image_parse_error, image_content_policy_violation, image_file_too_large, image_file_not_found,
# unsupported_image_media_type, empty_image_file, failed_to_download_image): all but the first,
# the rate limit and vector_store_timeout are faults of the request (`_client_code`), as are
# its error objects' invalid_request_error and context_length_exceeded. Any other: a server error.
_RESPONSES_STATUS = {"rate_limit_exceeded": 429, "server_error": 500,
                     "vector_store_timeout": 500}
_CLIENT_CODES = frozenset({"unsupported_image_media_type", "empty_image_file",
                           "failed_to_download_image"})
# an Anthropic error's type (it has no code), and the status it stands for (else a 500:
# vLLM's `internal_error`, Anthropic's `api_error`)
_ANTHROPIC_TYPE = re.compile(rb'"error"\s*:\s*\{\s*"type"\s*:\s*"(\w+)"')
_ANTHROPIC_STATUS = {b"invalid_request_error": 400, b"authentication_error": 401,
                     b"permission_error": 403, b"not_found_error": 404,
                     b"request_too_large": 413, b"rate_limit_error": 429,
                     b"overloaded_error": 503}
# the data of an OpenAI event is a JSON object, or `[DONE]`: it starts with `{` or `[DONE]`
# (a JSON array, string or number is JSON, but the SDKs read each event as an object: the
# official openai client raised a TypeError at `data: [1, 2]`, no APIError).
# Per chunk, `startswith` judges the first line and one regex search with a literal prefix
# the later ones (an anchor such as `^` or `(?:^|\n)` would defeat the prefix scan and cost
# ten times more; a JSON text holds no raw newline, so generated text never starts a line);
# only a hit reads the lines (`first_malformed`).
# Its last byte is `}` or `]` too: an event whose JSON was cut short and ended anyway (a
# replica or a proxy gone wrong) is caught by one more search per chunk for an event's end
# after neither (`_unended`); the events that pass are then parsed, one orjson parse each
# (`gateway.event_json`, ~2 us): data that opens and closes as an object yet does not parse
# (``{not json}``, bytes that are not UTF-8) made the SDK raise a JSONDecodeError mid-stream.
_DATA = b"data:"
_BARE = b"data"  # a data field's line without its colon: its value is empty, as ``data:``'s
_GOOD_FIRST = (b"data: {", b"data: [DONE]", b"data:{", b"data:[DONE]")
_BAD_LATER = re.compile(rb"\ndata:[ \t]*(?![ \t{]|\[DONE\])")
_DONE = b"[DONE]"
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark
# SSE fields the official SDK misreads (`_plain_fields`). An `id:` line is left out of every
# event: it serves an EventSource's reconnection only (a POST's stream has none), and once the
# SDK has read one it dispatches an empty event at every comment block after it (`:
# keep-alive`: vLLM's, a proxy's, kvgate's own), then fails on it. (A JSON text holds no raw
# line end: generated text never starts a line.)
_ID_LINE = re.compile(rb"(?:^|(?<=[\r\n]))id(?::[^\r\n]*)?(?:\r\n|\r|\n)")
# An event of fields without data (`event: ping`, `retry: 3000`), comment lines among them
# or not: SSE dispatches none, the SDK does -- with data "", which it fails to parse as JSON
# (a JSONDecodeError mid-stream, calling the replica directly too): made comment lines. (A
# bare `data` line is a data field with an empty value, as `data:` is: SSE dispatches an
# event with data "" for either, and both are malformed, `_bad_event`.)
_FIELD = rb"(?:event|id|retry)(?::[^\n]*)?\n"
_FIELDS_ONLY = re.compile(rb"(?:^|\n\n)(?::[^\n]*\n)*(?:" + _FIELD + rb")(?:" + _FIELD
                          + rb"|:[^\n]*\n)*\n")
# Only a read holding a line that is neither data, a Responses API event's name nor blank (or a
# CR) may hold either: vLLM's reads pay one search with a literal prefix, as `_BAD_LATER`.
_PLAIN_FIRST = (_DATA, b"event: response.")
_ODD_LATER = re.compile(rb"\n(?!\n|data:|event: response\.|\Z)")
# ... nor a Responses API event's name not followed by its data (`event: response.created`
# then a blank line: the SDK reads any `response.*` event's data as JSON, and failed on "")
_BARE_NAME = re.compile(rb"event: response\.[^\n]*\n(?!data:)")
# a line starting with `<` or `{`: no SSE field's name does, an HTML page's or a JSON body's do
_BODY_FIRST, _BODY_LINES = (b"<", b"{"), (b"\n<", b"\n{", b"\r<", b"\r{")
_STRAY_BYTES = 64 * 1024  # of such lines, kept for the client's 502 (an error page is small)
_SEP = re.compile(_END)
_SPLIT = re.compile(rb"(" + _END + rb")")  # (each event's end kept)
_CUT_END = re.compile(rb"\n\n(?<=[^}\]]\n\n)")  # an event's end after neither
_USAGE_OBJ = re.compile(rb'"usage"\s*:\s*(\{|null)')
_BRACES = re.compile(rb"[{}]")
# how a whole stream ends: chat/completions with [DONE]; the Responses API (no [DONE]) with
# its terminal event (or an `error` event), named in the `event:` line and the data's `type`;
# Anthropic's Messages API (`/v1/messages`, no [DONE] either) with `message_stop`
_DONE_LINE = re.compile(rb"(?:^|\n)data:[ \t]*\[DONE\][ \t]*$")
_TERMINAL = re.compile(rb'(?:event:[ \t]*|"type"\s*:\s*")'
                       rb'(?:response\.(?:completed|incomplete|failed)|error|message_stop)\b')
_ENDED = re.compile(  # (an `event:` line's start: generated text may say "event: ...")
    rb'(?:(?:^|\n)event:[ \t]*|"type"\s*:\s*")response\.(?:completed|incomplete|failed)\b')

# the Responses API's events vLLM sends as the stream opens, before the prompt is scheduled
_PREAMBLE = frozenset({b"response.created", b"response.in_progress", b"response.queued"})
_EVENT_NAME = re.compile(rb"^event:[ \t]*(\S+)", re.MULTILINE)
_DATA_LINE = re.compile(rb"^data:", re.MULTILINE)

Usage = dict[str, int]


def preamble_only(block: bytes) -> bool:
    """Whether `block` (whole events) holds only the Responses API's opening events
    (``response.created``, ``response.in_progress``): vLLM sends them before the prefill, so
    they are no answer yet. Judged by the ``event:`` lines, one per event (a JSON text
    holds no raw newline, so neither pattern matches inside an event's data)."""
    if _CR in block:
        block = _lf(block)
    names = _EVENT_NAME.findall(block)
    return (bool(names) and len(names) == len(_DATA_LINE.findall(block))
            and all(name in _PREAMBLE for name in names))


def scan_usage(blob: bytes) -> Usage | None:
    """Token counts from a JSON text holding a non-null `usage` object, else None."""
    if _USAGE_KEY not in blob or _NULL_USAGE.search(blob):
        return None
    return _counts(blob)


def _counts(blob: bytes) -> Usage | None:
    counts: Usage = {}
    for key, value in _COUNTS.findall(blob):
        name = key.decode()
        counts[_ALIASES.get(name, name)] = int(value)
    if "prompt_tokens" not in counts and "completion_tokens" not in counts and (
            total := _TOTAL.search(blob)) is not None:
        # vLLM's rerank usage has a total alone, all of it prompt (a cross-encoder reads
        # the query once a document): read as nothing, a 10,000-document rerank was
        # charged kvgate's estimate and counted in no token metric
        counts["prompt_tokens"] = int(total.group(1))
    return counts or None


def body_usage(body: bytes) -> Usage | None:
    """The top-level `usage` of a whole JSON answer, wherever it sits in the body.

    vLLM puts fields after `usage` (``prompt_logprobs``, ``prompt_token_ids``, the Responses
    API's ``input_messages``/``output_messages``...), so it is not always near the end. The
    common case -- one ``"usage": {`` key in the body -- costs one regex scan and a parse of
    that object's few bytes only; several (a nested object of the same name) parse the body."""
    if _USAGE_KEY not in body:
        return None
    found = _USAGE_OBJ.findall(body, 0)
    if not found:
        return None
    if len(found) > 1:
        try:
            top = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        usage = top.get("usage") if isinstance(top, dict) else None
        return _counts(orjson.dumps(usage)) if isinstance(usage, dict) else None
    m = _USAGE_OBJ.search(body)
    assert m is not None
    if m.group(1) == b"null":
        return None
    depth = 0
    for brace in _BRACES.finditer(body, m.start(1)):
        depth += 1 if brace.group() == b"{" else -1
        if depth == 0:
            return _counts(body[m.start(1):brace.end()])
    return None


def first_malformed(block: bytes) -> int | None:
    """Where the first event of `block` (whole events) whose data is neither a JSON object
    nor ``[DONE]`` starts, or None. An event's data is judged by its first and last bytes
    (SSE lets one event's data span several ``data:`` lines, which the client joins): a JSON
    object starts with ``{`` and ends with ``}``, and parses; the only other data is
    ``[DONE]``."""
    start = 0
    for end in _SEP.finditer(block):
        if _bad_event(block[start:end.start()]):
            return start
        start = end.end()
    return None


def _bad_event(event: bytes) -> bool:
    if _body_lines(event):
        return True  # an HTML page's line, a JSON body's (`StreamScanner.stray`)
    data = [line[5:] for line in event.splitlines() if line.startswith(_DATA) or line == _BARE]
    if not data:
        return False  # comment lines, or fields without data
    first, last = data[0].lstrip(b" \t"), data[-1].rstrip(b" \t")
    if first[:1] == b"[":
        return len(data) > 1 or first.rstrip(b" \t") != _DONE
    return first[:1] != b"{" or last[-1:] != b"}" or not json_text(b"\n".join(data))


def _body_lines(event: bytes) -> bool:
    """Whether `event` has a line that starts with ``<`` or ``{``: a body's, not SSE."""
    return event[:1] in _BODY_FIRST or any(line in event for line in _BODY_LINES)


def html_page(text: bytes) -> bool:
    """Whether `text` (an event, or what a stream's body left unended) has a line that
    starts with ``<`` after blank lines: an HTML page, not SSE."""
    text = text.lstrip(b" \t\r\n")
    return text[:1] == b"<" or b"\n<" in text or b"\r<" in text


def _unended(block: bytes) -> bool:
    """Whether some event of `block` (whole events) may end otherwise than with ``}`` or
    ``]`` -- a comment, a field after the data, data cut short -- or `block` has CR line
    ends (rare: CRLF, or bare CR): judged event by event (`first_malformed`) then. One regex
    search with a literal prefix, as `_BAD_LATER`'s."""
    return _CR in block or _CUT_END.search(block) is not None


def _anthropic_status(event: bytes) -> int:
    """The status an error event without a code stands for: by its Anthropic type, else 500."""
    kind = _ANTHROPIC_TYPE.search(event)
    return 500 if kind is None else _ANTHROPIC_STATUS.get(kind.group(1), 500)


def error_message(text: bytes) -> str | None:
    """The message of a JSON error object (nested ``{"error": {"message": ...}}``, flat
    ``{"object": "error", "message": ...}`` or ``{"error": "..."}``): an error event's data, or
    a body that was no stream (`gateway.stream_end.ended_early`); at most `_MESSAGE_CHARS` of
    it; None when `text` is not JSON or says none. Parsed only for an error, which is rare."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error", data) if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return message[:_MESSAGE_CHARS] if isinstance(message, str) and message else None


def responses_error(data: bytes) -> tuple[int, str | None] | None:
    """The status and message of a Responses API failure event's data: its ``error`` event
    (flat: ``code``, ``message``; not Anthropic's, whose ``error`` is an object) or
    ``response.failed`` (its ``response.error``); None for any other event. A numeric code
    (or three digits) is that status when it is an error status (`error_status`), a known name
    its status, a code naming the request's fault (`_client_code`) or an error naming a
    ``param`` a 400, any other a 500."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    kind = doc.get("type")
    if kind == "error" and not isinstance(doc.get("error"), dict):
        error: object = doc
    elif kind == "response.failed":
        response = doc.get("response")
        error = response.get("error") if isinstance(response, dict) else None
    else:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    if isinstance(code, str) and code.isdigit() and len(code) == 3:
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool):
        status = error_status(code)
    elif isinstance(code, str) and code in _RESPONSES_STATUS:
        status = _RESPONSES_STATUS[code]
    elif (isinstance(code, str) and _client_code(code)) or (isinstance(param, str) and param):
        status = 400  # the request's fault: another replica would answer the same
    else:
        status = 500
    text = message[:_MESSAGE_CHARS] if isinstance(message, str) and message else None
    return status, text


def error_status(code: int) -> int:
    """An error's numeric code as the status it stands for: an HTTP error status (400-599);
    anything else (a 200, a 999: no error status) a 500, as an unknown code is."""
    return code if 400 <= code <= 599 else 500


def _client_code(code: str) -> bool:
    """A Responses API error code naming a fault of the request (`_RESPONSES_STATUS`): the
    ``invalid_*`` and ``image_*`` families, a limit ``*_exceeded`` (the rate limit aside: a
    429), and the rest of the image codes."""
    return (code.startswith(("invalid_", "image_")) or code.endswith("_exceeded")
            or code in _CLIENT_CODES)


def carries_output(block: bytes) -> bool:
    """Whether relayed events carry generated output (not vLLM's role-only first chat chunk,
    a keep-alive or usage): the first such chunk sent is the TTFT, at both edges."""
    return _OUTPUT.search(block) is not None


def output_chars(block: bytes) -> int:
    """The characters of generated output that relayed events carry (`carries_output`'s
    fields), for an estimate of the tokens a stream delivered when it ends without its usage
    (`ProxiedRequest.spent_tokens`). About 1 us per event: counted only for a stream under a
    TPM limit or flow control (`Preparer`)."""
    fields = _DELTA_TEXT if _RESPONSES_EVENT.search(block) else _OUTPUT_TEXT
    return sum(map(len, fields.findall(block)))


def comment_only(block: bytes) -> bool:
    """True when a block of whole SSE lines holds only comments (``: keep-alive``) and blank
    lines."""
    return all(not line or line.startswith(b":") for line in block.splitlines())


def no_event(block: bytes) -> bool:
    """True when a block of whole SSE lines makes the client dispatch no event: no ``data``
    field, only comments (``: keep-alive``), blank lines or fields that are nothing without
    data (``event: ping``, ``id: 7``, ``retry: 3000``; SSE dispatches an event only when it
    has data). vLLM sends none of these but its keep-alives; a proxy in front of it may."""
    if block.startswith(_DATA) or b"\ndata:" in block or b"\rdata:" in block:
        return False  # (the common case: an event; substring searches, no split)
    if _BARE not in block:
        return True
    return _BARE not in block.splitlines()  # a data field with no value (and no colon)


class StreamScanner:
    """Feed upstream chunks in order; forward what `feed` returns, then what `flush` returns."""

    __slots__ = ("_failed", "_last", "_max", "_more", "_more_bytes", "_opened", "_partial",
                 "_strip", "done_by", "error_code", "error_message", "malformed", "oversized",
                 "stray", "usage")

    def __init__(self, strip_usage: bool, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._strip = strip_usage
        self._max = max_event_bytes
        self._partial = b""  # an unfinished event, held back (a client can't use it) ...
        self._more: list[bytes] = []  # ... and, once it is large, the pieces that came after
        self._more_bytes = 0  # their bytes
        self._last = b""  # the last block of whole events forwarded (keep-alives aside)
        self._opened = False  # a first byte came (`feed`: a byte order mark before it)
        self._failed = False  # a Responses API failure event came: its stream's last
        self.usage: Usage | None = None
        self.error_code: int | None = None  # status code of the last error event seen
        self.error_message: str | None = None  # ... and its message (bounded), if it has one
        self.malformed = False  # an event that is not an OpenAI event came: stop there
        self.oversized = False  # ... one larger than `max_event_bytes` (malformed too)
        # ... lines of an HTML page or a JSON body, no SSE (malformed too): the first such event
        self.stray = b""
        # the loop time by which the body's end must come once the stream's end was read
        # (`gateway.stream_end.next_chunk` sets it): whatever follows that end, it was whole
        self.done_by: float | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of `chunk` (with what was held back) to forward. After a
        malformed event: the events before it only, and `malformed` is set (feed no more).
        A UTF-8 byte order mark opening the stream is left out, as an SSE client's decoder
        leaves it out (the official SDK does not: it read the first line as a field named
        ``\ufeffdata`` and lost the first event, silently)."""
        if not self._opened and chunk:
            self._opened = True
            if chunk[:3] == _BOM:
                chunk = chunk[3:]
        out = self._feed(chunk)
        suspect = ((not out.startswith(_GOOD_FIRST) and out.startswith(_BARE))
                   or _BAD_LATER.search(out) is not None or _unended(out)
                   or b"\ndata\n" in out or b"\ndata\r" in out
                   or out[:1] in _BODY_FIRST or b"\n<" in out or b"\n{" in out)
        bad = first_malformed(out) if suspect else first_unparsable(out)
        if bad is not None:
            self.malformed = True
            if _body_lines(event := _first_event(out[bad:])):
                self.stray = event[:_STRAY_BYTES]
            self._drop()
            out = out[:bad]
        if out and (not out.startswith(_PLAIN_FIRST) or _CR in out
                    or _ODD_LATER.search(out) is not None
                    or _BARE_NAME.search(out) is not None):
            out = _plain_fields(out)
        if b'error"' in out:  # cheap pre-check; a real error event is rare
            if b"cache_salt" in out:  # an error echoing the request, the tenant's salt in it
                out = _salt_hidden(out)
            self._errors(out)
        if out and (out[0] not in _QUIET or not comment_only(out)):  # keep-alives aside
            self._last = out
        return out

    def _errors(self, block: bytes) -> None:
        for m in _ERROR_EVENT.finditer(block):
            code = _CODE.search(m.group())
            self.error_code = (error_status(int(code.group(1))) if code
                               else _anthropic_status(m.group()))
            self.error_message = error_message(m.group().partition(b"data:")[2])
        if b'"type"' in block:
            for m in _RESPONSES_ERROR.finditer(block):
                said = responses_error(m.group().partition(b"data:")[2])
                if said is not None:
                    self.error_code, self.error_message = said
                    self._failed = True

    def _feed(self, chunk: bytes) -> bytes:
        partial = self._partial
        if not partial:
            if chunk.endswith(_ENDS):
                # the common case: whole events in one read
                return chunk if _USAGE_KEY not in chunk else self._events(chunk)
            data = chunk
        elif not self._more and len(partial) <= len(chunk) + _JOIN_BYTES:
            # an event split by a read: joining costs about what reading the chunk does
            data = partial + chunk
        elif b"\n\n" in chunk or (_CR in chunk and _SEP.search(chunk) is not None) \
                or self._ends_at_seam(chunk):
            data = b"".join((partial, *self._more, chunk))
            self._more.clear()
            self._more_bytes = 0
        else:
            # a large held event goes on: keep the piece, search only the new bytes
            if chunk:
                self._more.append(chunk)
                self._more_bytes += len(chunk)
                if len(partial) + self._more_bytes > self._max:
                    self._oversize()
            return b""
        if _CR not in data:  # vLLM's framing
            lf = data.rfind(b"\n\n")
            cut = lf + 2 if lf >= 0 else 0
        else:
            cut = max((m.end() for m in _SEP.finditer(data)), default=0)
        # no complete event yet: hold the fragment (a client can't use it)
        self._partial = rest = data[cut:]
        if len(rest) > self._max:
            self._oversize()
        return self._events(data[:cut]) if cut else b""

    def _ends_at_seam(self, chunk: bytes) -> bool:
        """Whether an event's end begins in the held bytes and ends in `chunk`'s first 3."""
        head = chunk[:3]
        if b"\n" not in head and b"\r" not in head:  # every end's last byte is one of them
            return False
        held = b"".join((self._partial, *self._more[-3:]))  # held pieces are never empty
        return _SEP.search(held[-3:] + head) is not None

    def _held(self) -> bytes:
        return b"".join((self._partial, *self._more)) if self._more else self._partial

    def _drop(self) -> None:
        self._partial = b""
        self._more.clear()
        self._more_bytes = 0

    def _oversize(self) -> None:  # no OpenAI event is this large: not relayed
        self.malformed = self.oversized = True
        self._drop()

    def complete(self) -> bool:
        """Whether what was fed so far ends as a whole stream: its last event (comment lines
        aside) is ``data: [DONE]`` or a Responses API terminal event, or an error event was
        seen, or that end was read before (`done_by`: what a proxy sends after it changes
        nothing). A stream a replica ended early (a clean close mid-answer) is not complete."""
        if self.error_code is not None or self.done_by is not None:
            return True
        held = self._held()  # (a LF held alone: a CRLF's, whose CR ended the last event)
        last = _last_event(held if held.strip() else self._last)
        return _DONE_LINE.search(last) is not None or _TERMINAL.search(last) is not None

    def done(self) -> bool:
        """Whether the events forwarded so far end the stream (nothing held): with ``data:
        [DONE]``, or a Responses API stream (proxied or stored) with its terminal event or
        its failure (`responses_error`) -- vLLM ends the body right after either. A chat
        error event is not: vLLM's chat streams send their [DONE] after it. A line end held
        alone is no event: the LF of a CRLF whose CR ended the last one, or a blank line after
        it, in a read of its own (flushed at the end)."""
        last = self._last
        if self._failed and self._partial in _LINE_ENDS and not self._more:
            return True  # the Responses API's `error` event ends its stream (no [DONE] comes)
        if self._partial not in _LINE_ENDS or self._more or (b"[DONE]" not in last and (
                b"response." not in last or (  # every Responses event: look for its ends
                    b"response.completed" not in last and b"response.incomplete" not in last
                    and b"response.failed" not in last))):
            return False
        last = _last_event(last)
        return _DONE_LINE.search(last) is not None or _ENDED.search(last) is not None

    def flush(self) -> bytes:
        """At the end of the stream: whatever is left, forwarded as is."""
        rest = self._held()
        self._drop()
        return rest

    def _events(self, block: bytes) -> bytes:
        """`block` (whole events) with its usage read, and its usage-only event dropped when
        stripping. Each event kept keeps its own end: a read may mix the two kinds (a proxy
        re-framing some events with CRLF), and a split on one kind alone dropped the events
        around the usage chunk, or their separator."""
        if _USAGE_KEY not in block:
            return block
        if block[:1] == b"\n":  # the LF of a CRLF whose CR ended the last read's event: its
            return b"\n" + self._events(block[1:])  # (not dropped with a usage-only one)
        if _CR not in block:  # vLLM's framing: `bytes.split`, 6x the regex's speed
            return b"\n\n".join([e for e in block.split(b"\n\n") if self._keeps(e)])
        parts = _SPLIT.split(block)  # each event, then its own end; what follows the last
        kept, dropped = [], b""
        for event, end in zip(parts[:-1:2], parts[1::2], strict=True):
            if self._keeps(event):
                kept.append(event + end)
                dropped = b""
            else:
                dropped = event + end
        rest = parts[-1]  # (line ends only, blank lines': relayed as sent)
        if dropped.endswith(b"\r") and not rest and not self._partial:
            # the read ended at its end's CR, maybe a CRLF's: held, to be dropped with the
            # LF the next read may start with (relayed as sent if the stream ends there)
            self._partial = dropped
        kept.append(rest)
        return b"".join(kept)

    def _keeps(self, event: bytes) -> bool:
        """Whether `event` is forwarded: not a usage-only one when stripping (its usage is
        read either way)."""
        if _USAGE_KEY not in event:
            return True
        usage = scan_usage(event)
        if usage is None:
            return True
        # merged: an Anthropic stream's counts come in two events (`message_start`'s
        # input_tokens, `message_delta`'s output_tokens); OpenAI's last usage holds them all
        self.usage = usage if self.usage is None else {**self.usage, **usage}
        return not (self._strip and _EMPTY_CHOICES.search(event))


def _plain_fields(block: bytes) -> bytes:
    """`block` (whole events) without its `id:` lines (`_ID_LINE`), and each event of fields
    without data made comment lines (`_quieted`)."""
    if block[:2] == b"id" or b"\nid" in block or b"\rid" in block:
        block = _ID_LINE.sub(b"", block)
    if _FIELDS_ONLY.search(_lf(block) if _CR in block else block) is not None:
        block = _quieted(block)
    return block


def _quieted(block: bytes) -> bytes:
    """`block` (whole events) with each event of fields without data (`_FIELDS_ONLY`) made
    comment lines: still a keep-alive for the client, and no event the SDK dispatches."""
    parts = _SPLIT.split(block)  # each event, then its own end; what follows the last
    out: list[bytes] = []
    for event, end in zip(parts[:-1:2], parts[1::2], strict=True):
        lines = event.splitlines()
        if not any(line.startswith(_DATA) for line in lines):
            event = b"\n".join(line if line[:1] == b":" else b":" + line for line in lines)
        out += (event, end)
    out.append(parts[-1])
    return b"".join(out)


def _lf(block: bytes) -> bytes:
    """`block` with every line end a LF (for judging it: what is relayed keeps its own)."""
    return block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def _first_event(block: bytes) -> bytes:
    """The first event of a block of whole events."""
    end = _SEP.search(block)
    return block if end is None else block[:end.start()]


# an error event's data (its data lines joined, as a client joins them): chat/completions'
# ``{"error": ...}`` (or vLLM's flat one), the Responses API's ``{"type": "error", ...}`` and
# ``response.failed`` (its response's `error`); the quotes are unescaped, so a model's text
# naming them (inside a JSON string) is no match
_ERROR_DATA = re.compile(
    rb'[ \t]*\{.*?(?:"error"\s*:|"(?:object|type)"\s*:\s*"error")', re.DOTALL)
_LINE_END = re.compile(rb"(\r\n|\r|\n)")  # (each line's end kept)


def _salt_hidden(block: bytes) -> bytes:
    """`block` with any `cache_salt` value its error events echo hidden: a replica's error
    event mid-stream, as its error answers (`gateway.upstream_errors.without_salt`), may echo
    the request, the salt the gateway put in it included; the events that are not errors (a
    model's text) are left as they are."""
    parts = _SPLIT.split(block)  # each event, then its own end; what follows the last
    out: list[bytes] = []
    for event, end in zip(parts[:-1:2], parts[1::2], strict=True):
        out += (_event_salt_hidden(event), end)
    out.append(_event_salt_hidden(parts[-1]))
    return b"".join(out)


def _event_salt_hidden(event: bytes) -> bytes:
    """One event, its echoed salt hidden when it is an error naming cache_salt. Judged and
    masked on its data lines joined: SSE lets an event's data span several ``data:`` lines
    (the client joins them with LF), and "cache_salt" may sit on one, its value on the next."""
    # (imported here: gateway.upstream_errors reads this module's `error_message`)
    from gateway.upstream_errors import without_salt

    if b"cache_salt" not in event:
        return event
    pieces = _LINE_END.split(event)  # line, end, line, end, ..., line
    at = [i for i in range(0, len(pieces), 2) if pieces[i].startswith(_DATA)]
    heads = [5 + (pieces[i][5:6] == b" ") for i in at]  # "data:" and its one optional space
    joined = b"\n".join(pieces[i][head:] for i, head in zip(at, heads, strict=True))
    if _ERROR_DATA.match(joined) is None:
        return event
    hidden = without_salt(joined)
    if hidden is joined:
        return event
    # as many lines as before: no LF is in what `without_salt` replaces or puts instead
    for i, head, value in zip(at, heads, hidden.split(b"\n"), strict=True):
        pieces[i] = pieces[i][:head] + value
    return b"".join(pieces)


def _last_event(block: bytes) -> bytes:
    """The last event of a block of whole events, comment lines left out."""
    if _CR in block:
        block = _lf(block)
    if b"\n:" in block or block[:1] == b":":
        block = b"\n".join(line for line in block.splitlines() if line[:1] != b":")
    tail = block.rstrip()
    return tail[tail.rfind(b"\n\n") + 1:]

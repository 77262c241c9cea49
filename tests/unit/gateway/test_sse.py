"""The stream scanner: bytes pass through, the usage chunk is read (and stripped on request)."""

from __future__ import annotations

import pytest

from gateway.sse import (
    StreamScanner,
    body_usage,
    comment_only,
    no_event,
    preamble_only,
    scan_usage,
)

CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
         b'"total_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}\n\n')
DONE = b"data: [DONE]\n\n"
COMMENT = b": keep-alive\n\n"
EXPECTED_USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 4}


def run(chunks: list[bytes], strip: bool) -> tuple[bytes, StreamScanner]:
    scanner = StreamScanner(strip)
    out = b"".join(scanner.feed(c) for c in chunks) + scanner.flush()
    return out, scanner


def split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i:i + n] for i in range(0, len(data), n)]


STREAM = CHUNK + COMMENT + CHUNK + USAGE + DONE


@pytest.mark.parametrize("size", [1, 3, 7, 50, len(STREAM)])
@pytest.mark.parametrize("strip", [True, False])
def test_any_split_gives_the_same_bytes_and_usage(size: int, strip: bool) -> None:
    out, scanner = run(split_every(STREAM, size), strip)
    expected = CHUNK + COMMENT + CHUNK + DONE if strip else STREAM
    assert out == expected
    assert scanner.usage == EXPECTED_USAGE


def test_crlf_events() -> None:
    stream = STREAM.replace(b"\n\n", b"\r\n\r\n")
    out, scanner = run(split_every(stream, 11), True)
    assert out == (CHUNK + COMMENT + CHUNK + DONE).replace(b"\n\n", b"\r\n\r\n")
    assert scanner.usage == EXPECTED_USAGE


CRLF_STREAM = STREAM.replace(b"\n\n", b"\r\n\r\n")
CRLF_KEPT = (CHUNK + COMMENT + CHUNK + DONE).replace(b"\n\n", b"\r\n\r\n")


@pytest.mark.parametrize("at", range(len(CRLF_STREAM) + 1))
def test_a_crlf_stream_split_anywhere_loses_nothing(at: int) -> None:
    out, scanner = run([CRLF_STREAM[:at], CRLF_STREAM[at:]], True)
    assert out == CRLF_KEPT
    assert scanner.usage == EXPECTED_USAGE and scanner.complete() and not scanner.malformed


def _mixed(seps: tuple[bytes, ...], events: tuple[bytes, ...]) -> bytes:
    return b"".join(e.removesuffix(b"\n\n") + sep for e, sep in zip(events, seps, strict=True))


EVENTS = (CHUNK, COMMENT, CHUNK, USAGE, DONE)
# each event of the stream ended by either separator (a proxy re-framing some of them)
MIXED = [tuple(b"\r\n\r\n" if bits >> i & 1 else b"\n\n" for i in range(len(EVENTS)))
         for bits in range(1, 2 ** len(EVENTS) - 1)]


@pytest.mark.parametrize("seps", MIXED)
@pytest.mark.parametrize("size", [1, 7, 4096])
def test_mixed_separators_in_one_read_keep_each_event_and_its_end(
        seps: tuple[bytes, ...], size: int) -> None:
    """The usage chunk a client did not ask for is stripped; every other event goes out as
    it came, its own separator with it (a lost one merged two events, or left the stream
    ending without its [DONE]: "ended before complete")."""
    kept = tuple(sep for e, sep in zip(EVENTS, seps, strict=True) if e is not USAGE)
    expected = _mixed(kept, (CHUNK, COMMENT, CHUNK, DONE))
    out, scanner = run(split_every(_mixed(seps, EVENTS), size), True)
    assert out == expected
    assert scanner.usage == EXPECTED_USAGE and scanner.complete() and scanner.done()
    assert not scanner.malformed


@pytest.mark.parametrize(
    ("blob", "usage"),
    [
        (b'{"usage": null}', None),
        (b'{"choices":[]}', None),
        (b'{"usage": {"prompt_tokens": 1, "completion_tokens": 2}}',
         {"prompt_tokens": 1, "completion_tokens": 2}),
    ],
)
def test_scan_usage(blob: bytes, usage: dict[str, int] | None) -> None:
    assert scan_usage(blob) == usage


def test_null_usage_on_every_chunk_is_forwarded() -> None:
    chunk = b'data: {"choices":[{"delta":{}}],"usage":null}\n\n'
    out, scanner = run([chunk, chunk, DONE], True)
    assert out == chunk + chunk + DONE
    assert scanner.usage is None


def test_truncated_stream_flushes_the_fragment() -> None:
    scanner = StreamScanner(True)
    assert scanner.feed(CHUNK + b'data: {"par') == CHUNK
    assert scanner.flush() == b'data: {"par'


def test_responses_usage_is_counted_in_chat_names() -> None:
    blob = (b'{"type":"response.completed","response":{"usage":{"input_tokens":5000,'
            b'"input_tokens_details":{"cached_tokens":64},"output_tokens":900}}}')
    assert scan_usage(blob) == {"prompt_tokens": 5000, "cached_tokens": 64,
                                "completion_tokens": 900}


def test_a_broken_stream_ends_with_whole_events_only() -> None:
    import orjson

    from gateway.stream_end import stream_error

    scanner = StreamScanner(True)
    assert scanner.feed(CHUNK + b'data: {"id":"x","choi') == CHUNK  # the fragment is held
    tail = stream_error("The upstream replica failed mid-stream.")
    events = [e for e in tail.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert orjson.loads(events[0].removeprefix(b"data: "))["error"]["code"] == 502
    assert b"choi" not in tail


# vLLM 0.34's mid-stream engine death (chat_completion/serving.py): an error event, then [DONE]
DEAD = (b'data: {"error":{"message":"The server had an error while processing your request.",'
        b'"type":"InternalServerError","param":null,"code":500}}\n\n')
FLAT = b'data: {"object":"error","message":"boom","type":"InternalServerError","code":503}\n\n'


@pytest.mark.parametrize("size", [1, 5, 64, 4096])
@pytest.mark.parametrize(
    ("event", "code", "message"),
    [(DEAD, 500, "The server had an error while processing your request."),
     (FLAT, 503, "boom"),
     (b'data: {"error": "overloaded", "code": 503}\n\n', 503, "overloaded"),
     (b'data: {"error": {"code": 500}}\n\n', 500, None),
     (b'data: {"error": {"message": "' + b"m" * 600 + b'", "code": 500}}\n\n', 500, "m" * 512)])
def test_an_error_event_is_noted_and_passed_through(
    size: int, event: bytes, code: int, message: str | None,
) -> None:
    """Its code and message (bounded) are kept: a stream failing with it before it reached
    the client is a 502 that says what the replica said (`relay.unstarted_failure`)."""
    stream = CHUNK + event + DONE
    out, scanner = run(split_every(stream, size), False)
    assert out == stream
    assert (scanner.error_code, scanner.error_message) == (code, message)


def test_generated_text_about_errors_is_not_an_error_event() -> None:
    text = (b'data: {"choices":[{"delta":{"content":"data: {\\"error\\": 1}\\n'
            b'{\\"error\\":{\\"code\\":500}}"}}]}\n\n')
    _, scanner = run([text, DONE], False)
    assert scanner.error_code is None


@pytest.mark.parametrize(
    ("block", "only"),
    [(COMMENT, True), (COMMENT + COMMENT, True), (COMMENT + CHUNK, False), (CHUNK, False),
     (b"event: response.created\ndata: {}\n\n", False)],
)
def test_comment_only(block: bytes, only: bool) -> None:
    assert comment_only(block) is only


@pytest.mark.parametrize(
    ("block", "none"),
    [(COMMENT, True), (b"\n\n", True), (b"event: ping\n\n", True), (b"retry: 3000\n\n", True),
     (b"id: 7\r\n\r\n", True), (b"event: data\r\rid: data:\r\r", True), (CHUNK, False),
     (COMMENT + CHUNK, False), (b"event: ping\r\ndata: {}\r\n\r\n", False),
     (b"event: ping\rdata: {}\r\r", False), (b"id: 7\ndata\n\n", False)],
)
def test_no_event(block: bytes, none: bool) -> None:
    """What the client's SSE parser dispatches no event for: no `data` field in it."""
    assert no_event(block) is none


USAGE_OBJ = b'"usage":{"prompt_tokens":7,"total_tokens":10,"completion_tokens":3,' \
            b'"prompt_tokens_details":{"cached_tokens":4}}'


@pytest.mark.parametrize(
    "body",
    [
        # usage followed by more than 1 KiB of other fields (prompt_logprobs, token ids, ...)
        b'{"id":"c","choices":[{"text":"x"}],' + USAGE_OBJ + b',"prompt_token_ids":['
        + b",".join(b"%d" % i for i in range(2000)) + b"]}",
        # Responses API: usage before input/output messages
        b'{"id":"resp_1",' + USAGE_OBJ + b',"input_messages":[' + b'{"role":"user"},' * 200
        + b'{"role":"user"}]}',
        # a nested object also named usage: the top-level one wins
        b'{"choices":[{"message":{"content":"x"}}],' + USAGE_OBJ
        + b',"output":[{"usage":{"prompt_tokens":999}}]}',
    ],
)
def test_body_usage_finds_the_top_level_usage_anywhere(body: bytes) -> None:
    assert body_usage(body) == EXPECTED_USAGE
    assert scan_usage(body[-1024:]) != EXPECTED_USAGE  # what the old last-1-KiB read missed


@pytest.mark.parametrize("body", [b'{"usage":null}', b'{"id":"x"}', b'{"usage":{"prompt'])
def test_body_usage_absent(body: bytes) -> None:
    assert body_usage(body) is None


@pytest.mark.parametrize(
    ("chunks", "complete"),
    [
        ([b'data: {"a":1}\n\n', b"data: [DONE]\n\n"], True),
        ([b'data: {"a":1}\n\ndata: [DONE]\r\n\r\n'], True),
        ([b'data: {"a":1}\n\n', b"data: [DONE]\n"], True),  # one newline short
        ([b"data: [DONE]\n\n", b": keep-alive\n\n"], True),
        ([b"data: [DONE]\n\n", b"\n\n"], True),  # blank lines (no event) in a read alone
        ([b"data: [DONE]\r\n\r\n", b"\r\n\r\n"], True),
        ([b'data: {"a":1}\n\n', b"\n\n"], False),
        ([b'data: {"error":{"code":500}}\n\n'], True),  # the error event says it
        ([b'event: response.completed\ndata: {"type":"response.completed"}\n\n'], True),
        ([b'data: {"type":"response.incomplete","response":{}}\n\n'], True),
        ([b'event: error\ndata: {"type":"error","code":"x","message":"m"}\n\n'], True),
        ([], False),
        ([b'data: {"a":1}\n\n'], False),
        ([b'data: {"a":1}\n\n', b'data: {"a"'], False),  # half an event
        ([b'data: {"text":"data: [DONE]"}\n\n'], False),  # [DONE] inside generated text
        ([b'event: response.output_text.delta\ndata: {"delta":"response.completed"}\n\n'],
         False),
    ],
)
def test_complete_is_how_a_whole_stream_ends(chunks: list[bytes], complete: bool) -> None:
    scanner = StreamScanner(strip_usage=False)
    for chunk in chunks:
        scanner.feed(chunk)
    assert scanner.complete() is complete



@pytest.mark.parametrize(
    ("chunks", "done"),
    [
        ([b'data: {"a":1}\n\n', b"data: [DONE]\n\n"], True),
        ([b'data: {"a":1}\n\ndata: [DONE]\r\n\r\n'], True),
        ([b"data: [DONE]\n\n", b": keep-alive\n\n"], True),
        ([b'data: {"a":1}\n\n', b"data: [DONE]\n"], False),  # its end not in yet
        # a CRLF's LF in a read of its own, after the CR that ended the [DONE]
        ([b'data: {"a":1}\r\n\r\ndata: [DONE]\r\n\r', b"\n"], True),
        ([b'event: response.completed\r\ndata: {"type":"response.completed"}\r\n\r', b"\n"],
         True),
        ([b'data: {"a":1}\r\n\r\ndata: [DONE]\r\n', b"\r"], True),
        ([b"data: [DONE]\r\n\r\n", b"\r\n"], True),  # a blank line more
        ([b"data: [DONE]\r\r", b"\r"], True),
        ([b'data: {"a":1}\r\n\r', b"\n", b"data: [DONE]"], False),  # not in yet
        ([b'data: {"error":{"code":500}}\n\n'], False),  # vLLM sends its [DONE] next
        ([b'data: {"type":"response.completed"}\n\n'], True),  # the Responses API's end
        ([b'event: response.incomplete\ndata: {"type":"response.incomplete"}\n\n'], True),
        ([b'event: response.failed\ndata: {}\n\n', b": keep-alive\n\n"], True),
        ([b'event: response.completed\ndata: {"type":"response.completed"}\n'], False),
        ([b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
          b'"delta":"event: response.completed"}\n\n'], False),  # generated text saying so
        # the Responses API's error event ends its stream: no [DONE] follows on this API
        ([b'event: error\ndata: {"type":"error","code":"x"}\n\n'], True),
        ([b'data: {"text":"data: [DONE]"}\n\n'], False),
    ],
)
def test_done_is_a_stream_ended_by_its_last_event(chunks: list[bytes], done: bool) -> None:
    scanner = StreamScanner(strip_usage=False)
    for chunk in chunks:
        scanner.feed(chunk)
    assert scanner.done() is done


RESPONSES_EVENT = b'event: response.output_text.delta\ndata: {"type":"x","delta":"hi"}\n\n'


@pytest.mark.parametrize("size", [1, 7, 4096])
@pytest.mark.parametrize(
    "stream",
    [
        STREAM,
        STREAM.replace(b"\n\n", b"\r\n\r\n"),
        RESPONSES_EVENT * 3,
        CHUNK.replace(b"data: ", b"data:") + DONE,  # no space after the colon
        b'data: {"a":\ndata: 1}\n\n' + DONE,  # one event's data on two lines
        b'data: {"content":"data: oops"}\n\n' + DONE,  # the words inside generated text
        b'data: {"a": 1} \t\n\n' + DONE,  # blanks after the JSON text
        b'data: {"a": 1}\nevent: x\n\n' + COMMENT + DONE,  # a field after the data
    ],
    ids=["chat", "crlf", "responses", "no-space", "two-lines", "text", "blanks", "field-after"],
)
def test_well_formed_events_pass(size: int, stream: bytes) -> None:
    out, scanner = run(split_every(stream, size), False)
    assert out == stream and not scanner.malformed


@pytest.mark.parametrize("size", [1, 7, 4096])
@pytest.mark.parametrize(
    "bad",
    [
        b"data: hello\n\n",
        b"data: <html>\n\n",
        b"data:\n\n",  # empty data
        b"data\n\n",  # ... a data field without its colon: the same (SSE: an event, data "")
        b"data\ndata: {}\n\n",
        b"data: \r\n\r\n",
        b"event: response.output_text.delta\ndata: Internal Server Error\n\n",
        b'data: "a string"\n\n',
        b'data: {"id":"c","choices":[{"ind\n\n',  # JSON cut short, the event ended anyway
        b'data: {"id":"c",\r\ndata: "choi\r\n\r\n',  # ... on its last data line
        b'data: [1, 2\n\n',
        b'data: [1, 2]\n\n',  # JSON, but no object: the SDK raised a TypeError at it
        b'data: 42\n\n',
        b'data: null\n\n',
        b'data: []\r\n\r\n',
        b'data: [\ndata: "DONE"]\n\n',
        b'data: [DONE]x\n\n',
    ],
    ids=["text", "html", "empty", "bare", "bare-first-line", "empty-crlf", "named-event",
         "json-string", "cut-json", "cut-json-lines", "cut-array", "array", "number", "null",
         "empty-array-crlf", "array-lines", "done-and-more"],
)
def test_a_malformed_event_stops_the_stream_before_it(size: int, bad: bytes) -> None:
    """Neither a JSON object nor [DONE]: the SDK would raise a JSON decode error on it (a
    TypeError on a JSON array, number or null). The events before it are forwarded; nothing
    from it on is."""
    scanner = StreamScanner(False)
    out = b""
    for piece in split_every(CHUNK + COMMENT + CHUNK + bad + CHUNK + DONE, size):
        out += scanner.feed(piece)
        if scanner.malformed:
            break
    assert scanner.malformed
    assert out == CHUNK + COMMENT + CHUNK
    assert scanner.flush() == b""


@pytest.mark.parametrize("size", [3, 7, 4096])
def test_a_byte_order_mark_opening_the_stream_is_left_out(size: int) -> None:
    """SSE decoders leave out a BOM opening the stream; the official SDK read the first line
    as a field named ``\\ufeffdata`` and lost the first event. Only the stream's first bytes:
    a BOM later is data."""
    out, scanner = run(split_every(b"\xef\xbb\xbf" + CHUNK + CHUNK + DONE, size), False)
    assert out == CHUNK + CHUNK + DONE and not scanner.malformed and scanner.complete()


@pytest.mark.parametrize("size", [1, 7, 4096])
@pytest.mark.parametrize(
    ("sent", "relayed"),
    [
        # an id (with data, alone, CRLF-framed): left out -- the SDK dispatched an empty
        # event at every comment block after one, and failed to parse it
        (b'id: 7\ndata: {"a": 1}\n\n' + COMMENT + DONE, b'data: {"a": 1}\n\n' + COMMENT + DONE),
        (b'data: {"a": 1}\nid: 7\n\n' + DONE, b'data: {"a": 1}\n\n' + DONE),
        (CHUNK + b"id: 7\n\n" + DONE, CHUNK + b"\n" + DONE),
        (b'id: 7\r\ndata: {"a": 1}\r\n\r\n' + DONE, b'data: {"a": 1}\r\n\r\n' + DONE),
        # fields without data: comment lines (SSE dispatches no event; the SDK did, with
        # data "", and failed to parse it)
        (b"retry: 3000\n\n" + CHUNK + DONE, b":retry: 3000\n\n" + CHUNK + DONE),
        (CHUNK + b"event: ping\n\n" + DONE, CHUNK + b":event: ping\n\n" + DONE),
        (CHUNK + b"event: ping\r\n\r\n" + DONE, CHUNK + b":event: ping\r\n\r\n" + DONE),
        # ... with comment lines among them (SSE leaves those out; the SDK still dispatched)
        (CHUNK + b": note\nevent: ping\n\n" + DONE, CHUNK + b": note\n:event: ping\n\n" + DONE),
        (b"retry: 3000\n: note\n\n" + CHUNK + DONE, b":retry: 3000\n: note\n\n" + CHUNK + DONE),
        # a Responses API event's name without data (its name passed the fast path, which
        # looked at line starts only: the SDK read it as `response.*` data "" and failed)
        (RESPONSES_EVENT + b"event: response.in_progress\n\n" + RESPONSES_EVENT,
         RESPONSES_EVENT + b":event: response.in_progress\n\n" + RESPONSES_EVENT),
        (b"event: response.created\n\n" + RESPONSES_EVENT,
         b":event: response.created\n\n" + RESPONSES_EVENT),
        (b"event: response.created\n: note\n\n" + RESPONSES_EVENT,
         b":event: response.created\n: note\n\n" + RESPONSES_EVENT),
        # what stays: a Responses API event's name, a comment, an unknown field
        (RESPONSES_EVENT + COMMENT + b"idle: 1\n\n", RESPONSES_EVENT + COMMENT + b"idle: 1\n\n"),
    ],
    ids=["id-then-comment", "id-after-data", "id-alone", "id-crlf", "retry", "event-ping",
         "event-crlf", "comment-first", "comment-after", "responses-event-later",
         "responses-event-first", "responses-event-comment", "kept"],
)
def test_fields_the_sdk_misreads_are_not_relayed(size: int, sent: bytes, relayed: bytes) -> None:
    from openai._streaming import SSEDecoder

    out, scanner = run(split_every(sent, size), False)
    assert out == relayed and not scanner.malformed
    # every event the SDK's decoder dispatches has data: none it would fail to parse
    assert all(sse.data for sse in SSEDecoder().iter_bytes(iter([out])))


def test_the_malformed_event_is_found_among_whole_events() -> None:
    from gateway.sse import first_malformed

    assert first_malformed(CHUNK + b"data: x\n\n" + DONE) == len(CHUNK)
    assert first_malformed(b"data: x\n\n") == 0
    crlf = CHUNK.replace(b"\n\n", b"\r\n\r\n")
    assert first_malformed(crlf + b"event: e\r\ndata: x\r\n\r\n") == len(crlf)
    assert first_malformed(CHUNK + DONE) is None


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_an_event_whose_end_straddles_small_pieces_is_found(size: int) -> None:
    crlf = (CHUNK + CHUNK + DONE).replace(b"\n\n", b"\r\n\r\n")
    out, scanner = run(split_every(crlf, size), False)
    assert out == crlf and scanner.complete() and not scanner.malformed


def test_an_event_past_the_bound_is_never_forwarded() -> None:
    """One endless event (a replica gone wrong): held in pieces up to the bound, then the
    stream is malformed (and `oversized`); the events before it went out."""
    scanner = StreamScanner(False, max_event_bytes=1000)
    out = scanner.feed(CHUNK + b'data: {"x":"')
    for _ in range(20):
        out += scanner.feed(b"a" * 100)
        if scanner.malformed:
            break
    assert out == CHUNK
    assert scanner.malformed and scanner.oversized
    assert scanner.flush() == b""


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("size", [1, 2, 3, 700])
def test_a_large_event_held_in_pieces_ends_where_its_end_straddles_them(
        sep: bytes, size: int) -> None:
    """An event larger than a read or two is held in pieces (only new bytes searched); its end,
    split across pieces of any size, still closes it, and nothing is lost or reordered."""
    big = b'data: {"id":"c","choices":[{"delta":{"content":"' + b"x" * 20_000 + b'"}}]}' + sep
    stream = (CHUNK + big + CHUNK + DONE).replace(b"\n\n", sep)
    head = len(CHUNK) + 9000
    out, scanner = run([stream[:head], *split_every(stream[head:], size)], False)
    assert out == stream and scanner.complete() and not scanner.malformed


def _named(kind: str) -> bytes:
    return b"event: " + kind.encode() + b'\ndata: {"type":"' + kind.encode() + b'"}\n\n'


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (_named("response.created") + _named("response.in_progress"), True),
        (_named("response.in_progress"), True),
        (_named("response.created") + _named("response.output_text.delta"), False),
        (_named("response.created") + b'data: {"type":"x"}\n\n', False),  # an unnamed event
        (b'data: {"type":"response.created"}\n\n', False),  # no event lines: not judged
        (b"", False),
    ],
    ids=["both", "one", "then-output", "unnamed-event", "no-names", "empty"],
)
def test_preamble_only_is_the_responses_api_opening_alone(block: bytes, expected: bool) -> None:
    assert preamble_only(block) is expected

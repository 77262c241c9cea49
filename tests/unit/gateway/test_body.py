"""Request parsing and rewriting: parsed once, only `model`/`stream_options`/`cache_salt`/
`priority` change (and `stream`/`include_usage` given as vLLM's lax pydantic reads them become
JSON booleans, but a false `stream`, forwarded as sent)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ValidationError

from gateway.body import parse_body, prompt_chars, rewrite_body
from gateway.errors import BadRequest

# the single-tenant (--no-auth) gateway's modes: strip a client's salt, keep its priority
NO_AUTH: dict[str, Any] = {"cache_salt": None, "priority": None, "client_salt": "strip",
                           "client_priority": "keep"}


def _rewrite(body: dict[str, Any], served: str = "m", **kw: Any) -> tuple[bytes, bool]:
    """A multi-tenant rewrite (salt "S", client priority dropped) of a chat body."""
    args: dict[str, Any] = {**NO_AUTH, "cache_salt": "S", "client_priority": "drop", **kw}
    return rewrite_body(parse_body(orjson.dumps(body), "chat"), "chat", served, **args)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{bad", None),
        (b"[1, 2]", None),
        (b'{"messages": []}', "model"),
        (b'{"model": 7}', "model"),
        (b'{"model": ""}', "model"),
        (b'{"model": "m", "stream": "maybe"}', "stream"),
        (b'{"model": "m", "stream": 2}', "stream"),
        # the gateway rewrites stream_options: a malformed one was silently replaced, and a
        # truthy non-boolean include_usage was answered without the usage the client asked for
        (b'{"model": "m", "stream": true, "stream_options": "x"}', "stream_options"),
        (b'{"model": "m", "stream": true, "stream_options": {"include_usage": "sure"}}',
         "stream_options.include_usage"),
        # what the request's tokens are counted by, of a type vLLM would not take either
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": "m", "max_tokens": "lots"}', "max_tokens"),
        (b'{"model": "m", "max_tokens": -2}', "max_tokens"),
        (b'{"model": "m", "max_completion_tokens": 2.5}', "max_completion_tokens"),
        (b'{"model": "m", "n": 0.5}', "n"),
    ],
)
def test_bad_bodies_are_400_naming_the_param(raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_body(raw, "chat")
    assert info.value.status == 400
    assert info.value.param == param


@pytest.mark.parametrize(
    ("kind", "body", "chars"),
    [
        ("chat", {"messages": [{"role": "user", "content": "abcd"}]}, 4),
        ("chat", {"messages": [{"content": [{"type": "text", "text": "ab"}, "cd"]}]}, 4),
        ("chat", {"messages": "nonsense"}, 0),
        ("completions", {"prompt": "abcdef"}, 6),
        ("completions", {"prompt": ["ab", "c"]}, 3),
        ("embeddings", {"input": "xyz"}, 3),
        ("responses", {"input": "hello"}, 5),
        # token ids: one token's characters each (they were 0: no TPM reservation, no load)
        ("completions", {"prompt": [1, 2, 3]}, 12),
        ("completions", {"prompt": [[1, 2], [3]]}, 12),
        ("embeddings", {"input": [[7] * 10, "abcd"]}, 44),
        ("completions", {"prompt": [True, 1.5, None]}, 0),
        ("completions", {"prompt": 5}, 0),
        # the Responses API's messages: their content, a string or parts
        ("responses", {"input": [{"role": "user", "content": "hello"}]}, 5),
        ("responses", {"input": [{"role": "user",
                                  "content": [{"type": "input_text", "text": "abc"}]}]}, 3),
        # the Responses API's instructions (a system prompt) and vLLM's chat form of
        # embeddings (`messages`) were 0
        ("responses", {"instructions": "be brief", "input": "hello"}, 13),
        ("embeddings", {"messages": [{"role": "user", "content": "abcd"}]}, 4),
    ],
)
def test_prompt_chars(kind: str, body: dict[str, object], chars: int) -> None:
    assert prompt_chars(body, kind) == chars


def test_rewrite_keeps_everything_but_model_and_drops_client_salt() -> None:
    raw = orjson.dumps({
        "model": "public", "messages": [{"role": "user", "content": "hi"}],
        "priority": 3, "ignore_eos": True, "top_k": 5, "cache_salt": "stolen",
    })
    parsed = parse_body(raw, "chat")
    out, strip = rewrite_body(parsed, "chat", "served-fp8", **NO_AUTH)
    sent = orjson.loads(out)
    assert sent == {
        "model": "served-fp8", "messages": [{"role": "user", "content": "hi"}],
        "priority": 3, "ignore_eos": True, "top_k": 5,
    }
    assert strip is False


@pytest.mark.parametrize(
    ("kind", "options", "sent_options", "strip"),
    [
        ("chat", None, {"include_usage": True}, True),
        ("chat", {"include_usage": False}, {"include_usage": True}, True),
        ("chat", {"continuous_usage_stats": True},
         {"continuous_usage_stats": False, "include_usage": True}, True),
        ("chat", {"continuous_usage_stats": True, "include_usage": True},
         {"continuous_usage_stats": True, "include_usage": True}, False),
        ("chat", {"include_usage": True}, {"include_usage": True}, False),
        ("completions", None, {"include_usage": True}, True),
        ("responses", None, None, False),
    ],
)
def test_streams_ask_for_usage(
    kind: str, options: dict[str, bool] | None, sent_options: dict[str, bool] | None, strip: bool
) -> None:
    body: dict[str, object] = {"model": "m", "stream": True, "prompt": "x"}
    if options is not None:
        body["stream_options"] = options
    out, stripped = rewrite_body(parse_body(orjson.dumps(body), kind), kind, "s", **NO_AUTH)
    assert orjson.loads(out).get("stream_options") == sent_options
    assert stripped is strip


def _nested(depth: int, *, objects: bool = False) -> bytes:
    """JSON text nested `depth` levels (arrays, or arrays and objects alternating)."""
    opens = [b'{"a": ' if objects and i % 2 else b"[" for i in range(depth)]
    closes = [b"}" if o.startswith(b"{") else b"]" for o in reversed(opens)]
    return b"".join(opens) + b"1" + b"".join(closes)


@pytest.mark.parametrize("objects", [False, True])
@pytest.mark.parametrize("depth", [129, 255, 300, 1000, 1100, 5000])
def test_excessive_nesting_is_a_400_not_a_500(depth: int, objects: bool) -> None:
    # orjson parses up to 1024 levels but writes only 254: such a body used to pass the parser
    # and fail in the rewrite with a 500. Beyond orjson's 1024 the same 400, not "not valid
    # JSON: depth limit exceeded" (the body is valid JSON)
    raw = b'{"model": "m", "prompt": "x", "x": ' + _nested(depth - 1, objects=objects) + b"}"
    with pytest.raises(BadRequest) as info:
        parse_body(raw, "completions")
    assert info.value.status == 400 and "deeper than 128" in info.value.message


def test_ordinary_nesting_and_brackets_in_strings_pass() -> None:
    raw = (b'{"model": "m", "prompt": "' + b"[{" * 500 + b'", "response_format": '
           + _nested(127, objects=True) + b"}")
    parsed = parse_body(raw, "completions")
    out, _ = rewrite_body(parsed, "completions", "served", **NO_AUTH)
    assert orjson.loads(out)["prompt"] == "[{" * 500


def test_a_wide_body_is_not_a_deep_one() -> None:
    # thousands of brackets, four levels: checked on the parsed body, not by scanning the text
    messages = [{"role": "user", "content": [{"type": "text", "text": "[x]"}]}] * 5000
    raw = orjson.dumps({"model": "m", "messages": messages})
    assert len(parse_body(raw, "chat").data["messages"]) == 5000


REWRITES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    ("salt added", {"model": "m"}, {}, {"model": "m", "cache_salt": "S"}),
    (
        "client salt stripped",
        {"model": "m", "cache_salt": "evil"},
        {},
        {"model": "m", "cache_salt": "S"},
    ),
    (
        "model rewritten",
        {"model": "m"},
        {"served": "m-fp8"},
        {"model": "m-fp8", "cache_salt": "S"},
    ),
    (
        "priority injected",
        {"model": "m", "priority": -100},
        {"priority": 10},
        {"model": "m", "cache_salt": "S", "priority": 10},
    ),
    (
        "client priority dropped",
        {"model": "m", "priority": -100},
        {},
        {"model": "m", "cache_salt": "S"},
    ),
]


@pytest.mark.parametrize(("case", "body", "kw", "expected"), REWRITES, ids=[r[0] for r in REWRITES])
def test_rewrite_body(
    case: str, body: dict[str, Any], kw: dict[str, Any], expected: dict[str, Any]
) -> None:
    body["messages"] = [{"role": "user", "content": "hi"}]
    out, _ = _rewrite(body, **kw)
    sent = orjson.loads(out)
    assert sent.pop("messages") == [{"role": "user", "content": "hi"}]
    assert sent == expected


def test_reject_mode_refuses_a_client_salt_without_echoing_it() -> None:
    body = {"model": "m", "cache_salt": "client-secret-salt"}
    with pytest.raises(BadRequest) as info:
        _rewrite(body, client_salt="reject")
    assert info.value.param == "cache_salt" and info.value.status == 400
    assert b"client-secret-salt" not in info.value.body()


@pytest.mark.parametrize(("kind", "body", "kept"), [
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x" * 1000}]}, {}),
    ("responses", {"model": "m", "input": "x" * 1000, "store": False}, {"store": False}),
])
def test_shed_keeps_only_what_the_answer_reads(
    kind: str, body: dict[str, Any], kept: dict[str, Any],
) -> None:
    """A request holds its parsed body for the whole exchange: once the upstream body is
    written, the document goes (a large conversation's objects are ~20x its bytes)."""
    parsed = parse_body(orjson.dumps(body), kind)
    parsed.shed()
    assert parsed.data == kept
    assert parsed.model == "m" and parsed.prompt_tokens > 0  # what was read from it stays


@pytest.mark.parametrize(("raw", "why"), [
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}',
     "no low surrogate in string: line 1 column 58"),  # a JS client cut an emoji in two
    (b'{"model": "m", "prompt": "secret\xff"}', "not valid UTF-8"),
    (b'\xef\xbb\xbf\xef\xbb\xbf{"model": "m"}', "byte order mark"),  # one is skipped
    (b'{"model": "m"} {"model": "n"}', "unexpected content after document"),
])
def test_invalid_json_says_where_and_why_without_echoing_the_body(raw: bytes, why: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse_body(raw, "chat")
    assert err.value.message.startswith("The request body is not valid JSON: ")
    assert why in err.value.message
    assert "secret" not in err.value.message and "ud83d" not in err.value.message


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"-NaN"])
def test_nan_and_infinity_are_refused_saying_so(literal: bytes) -> None:
    """Python's json (vLLM's parser) reads them as floats; they are not JSON (RFC 8259), and a
    NaN sampling parameter is nothing a replica should be sent. orjson said "unexpected
    character" or "no digit after sign"."""
    with pytest.raises(BadRequest) as err:
        parse_body(b'{"model": "m", "prompt": "x", "temperature": ' + literal + b"}", "completions")
    assert err.value.message == ("The request body is not valid JSON: NaN and Infinity are "
                                 "not JSON numbers (RFC 8259): line 1 column 46.")


def test_a_leading_byte_order_mark_is_skipped_as_vllm_does() -> None:
    """Python's json (vLLM's FastAPI parser) reads a body starting with a UTF-8 BOM."""
    parsed = parse_body(b'\xef\xbb\xbf{"model": "m", "prompt": "hi"}', "completions")
    assert parsed.model == "m" and parsed.data["prompt"] == "hi"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32",
                                      "utf-32-le", "utf-32-be"])
def test_a_utf16_or_utf32_body_is_read_as_vllm_reads_it(encoding: str) -> None:
    """Python's json, given the bytes, tells UTF-16/32 by the BOM or the zero bytes (vLLM
    answers such a body); orjson refused it (a 400 from the gateway only)."""
    text = '{"model": "m", "prompt": "h\u00e9 \U0001f600", "seed": 18446744073709551615}'
    parsed = parse_body(text.encode(encoding), "completions")
    assert parsed.model == "m" and parsed.data["prompt"] == "h\u00e9 \U0001f600"
    with pytest.raises(BadRequest, match="not valid utf-16"):  # a lone surrogate
        parse_body(b"\xff\xfe{\x00\x00\xd8", "completions")
    with pytest.raises(BadRequest, match="integer beyond 64 bits"):  # checked as UTF-8
        parse_body('{"model": "m", "prompt": "x", "seed": 18446744073709551616}'
                   .encode(encoding), "completions")


@pytest.mark.parametrize(("literal", "wide"), [
    (b"18446744073709551615", False), (b"-9223372036854775808", False),
    (b"18446744073709551616", True), (b"-9223372036854775809", True), (b"1" * 300, True),
    (b'"12345678901234567890123"', False), (b"0.12345678901234567890123", False),
    (b"1234567890123456789e3", False),  # a float literal: orjson reads it as the float it is
])
def test_integers_beyond_64_bits_are_refused(literal: bytes, wide: bool) -> None:
    raw = b'{"model": "m", "prompt": "x", "seed": ' + literal + b"}"
    if wide:
        with pytest.raises(BadRequest, match="integer beyond 64 bits"):
            parse_body(raw, "completions")
    else:
        assert parse_body(raw, "completions").data["seed"] == orjson.loads(literal)


class _VllmLike(BaseModel):
    """vLLM's request models declare ``stream: bool | None = False`` (lax pydantic)."""

    stream: bool | None = False


LAX_CANDIDATES: list[object] = [
    True, False, 0, 1, 2, -1, 0.0, 1.0, 0.5, "true", "false", "True", "FALSE", "1", "0", "yes",
    "no", "on", "off", "t", "f", "y", "n", "Y", "On", " true", "true ", "", "2", "1.0", "tru",
    "none", "null", [], {}, [True], {"a": 1},
]


@pytest.mark.parametrize("value", LAX_CANDIDATES, ids=repr)
def test_stream_is_read_as_vllms_pydantic_models_read_it(value: object) -> None:
    """What vLLM takes for `stream` (and `include_usage`) kvgate takes, with the same
    meaning, forwarded as a JSON boolean (a false `stream` as sent); what vLLM refuses is
    kvgate's 400."""
    try:
        expected = _VllmLike.model_validate({"stream": value}).stream
    except ValidationError:
        expected = None
    raw = orjson.dumps({"model": "m", "prompt": "x", "stream": value,
                        "stream_options": {"include_usage": value}})
    if expected is None:
        with pytest.raises(BadRequest) as info:
            parse_body(raw, "completions")
        assert info.value.param == "stream"
        with pytest.raises(BadRequest) as info:
            parse_body(orjson.dumps({"model": "m", "stream_options": {"include_usage": value}}),
                       "completions")
        assert info.value.param == "stream_options.include_usage"
        return
    parsed = parse_body(raw, "completions")
    assert parsed.stream is expected
    out, strip = rewrite_body(parsed, "completions", "m", **NO_AUTH)
    sent = orjson.loads(out)
    if expected:
        assert sent["stream"] is True
    else:  # as sent: vLLM's before-validators test its truth ("false" is true there)
        assert sent["stream"] == value and type(sent["stream"]) is type(value)
    if expected:  # the usage chunk is stripped only when the client did not ask for it
        assert sent["stream_options"]["include_usage"] is True and strip is False
    else:
        assert sent["stream_options"]["include_usage"] is False


@pytest.mark.parametrize(("sent", "read"), [("7", 7), (7.0, 7), (" +7 ", 7), (True, 1), (7, 7)])
def test_output_counts_are_read_as_vllm_reads_them(sent: object, read: int) -> None:
    parsed = parse_body(orjson.dumps({"model": "m", "max_tokens": sent, "n": sent}), "chat")
    assert parsed.data["max_tokens"] == read and parsed.data["n"] == read
    assert type(parsed.data["max_tokens"]) is int


def test_counts_of_other_routes_pass_untouched() -> None:
    """An embedding reads no output count, a completion no `max_output_tokens`."""
    raw = b'{"model": "m", "input": "x", "max_tokens": "lots", "n": "x"}'
    assert parse_body(raw, "embeddings").data["max_tokens"] == "lots"
    raw = b'{"model": "m", "prompt": "x", "max_output_tokens": "lots"}'
    assert parse_body(raw, "completions").data["max_output_tokens"] == "lots"

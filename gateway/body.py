"""The request body: parsed once with orjson, checked just enough, rewritten for the pool.

No schema validation of proxied bodies: vLLM validates them and its 400s pass through. kvgate
checks only what it needs itself (a JSON object nested at most `MAX_JSON_DEPTH` levels, no
integer beyond 64 bits (`wideints.py`), a string `model`, a boolean `stream`, the
`stream_options` it rewrites, a string `previous_response_id`, which it routes by, and the
fields it counts a request's tokens by -- its prompt (`messages`, `prompt`, `input`) of a type
vLLM takes, and the output it asks for (`max_tokens`, `max_completion_tokens`,
`max_output_tokens`, `n`) an integer as vLLM's lax pydantic reads one (``"5"``, ``5.0``),
forwarded as a JSON integer: kvgate reserved its default for a ``"max_tokens": "100000"`` the
replica generated 100000 tokens for). Each is a 400 naming it (`param`) before the request
is admitted; the fields kvgate does not read pass untouched. The two
booleans it reads, `stream` and `stream_options.include_usage`, take what vLLM's pydantic
models take in lax mode (`lax_bool`: ``"true"``, ``1``, ``"off"``, ...), so kvgate and the
replica read the same value, and are forwarded as JSON booleans -- except a false `stream`,
forwarded as sent: vLLM's before-validators test the raw value's truth (``"false"`` is true
there), so ``false`` in its place could turn the replica's answer from a 200 into a 400.
`rewrite_body` is the one place a body changes on its way upstream: the served model, the
tenant's `cache_salt`, the tier's `priority`, the usage request for streams; and
`drop_operator_fields` removes vLLM's operator-only fields for tenants whose tier does not
allow them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

import orjson
from pydantic import TypeAdapter, ValidationError

from gateway.errors import BadRequest
from gateway.jsondepth import MAX_JSON_DEPTH, check_parsed_depth, too_deep_error
from gateway.wideints import check_wide_ints, wide_int_error
from routing.tokens import CHARS_PER_TOKEN, count_tokens
from routing.types import RequestFeatures

__all__ = [
    "OPERATOR_FIELDS", "ClientPriorityMode", "ClientSaltMode", "ParsedBody",
    "drop_operator_fields", "lax_bool", "parse_body", "prompt_chars", "rewrite_body",
]

ClientSaltMode = Literal["strip", "reject"]
ClientPriorityMode = Literal["drop", "keep"]
# vLLM body fields meant for the operator: its internal request id, the KV-transfer handshake
# of disaggregated prefill, and free-form engine arguments. No tenant may set them unless its
# tier says `operator_fields: true`.
OPERATOR_FIELDS = ("request_id", "kv_transfer_params", "vllm_xargs")

# pydantic's lax-mode strings for a bool (compared lower-cased, nothing stripped)
_TRUE = frozenset({"true", "1", "yes", "on", "t", "y"})
_FALSE = frozenset({"false", "0", "no", "off", "f", "n"})
# a UTF-8 byte order mark: Python's json (vLLM's parser) skips one at the start of a body,
# as some Windows tools write it; orjson refuses it
_BOM = b"\xef\xbb\xbf"
_NON_FINITE = re.compile(r"-?(?:NaN|Infinity)")  # Python's json reads them; JSON has no such number
_ORJSON_TOO_DEEP = "depth limit exceeded"  # orjson's reason past its 1024 levels
_ORJSON_INFINITE = "number is infinity"  # orjson's reason for a number beyond a double's range
# an integer literal where orjson stopped (at its first character: a sign or a digit), not
# followed by a fraction or an exponent
_INT_LITERAL = re.compile(r"-?[0-9]+(?![0-9.eE])")

# Endpoints whose streams carry a final usage chunk when `stream_options.include_usage` is set.
USAGE_STREAM_KINDS = frozenset({"chat", "completions"})


# Endpoints whose requests generate no output tokens: their cost is their prompt alone.
NO_OUTPUT_KINDS = frozenset({"embeddings"})

# the output counts kvgate reads (the TPM reservation, flow control's charge:
# `gateway.flow.cost`) on the routes whose vLLM request models declare them, and the least
# each may be here: a negative number of tokens is none (vLLM refuses it too); an `n` below 1
# is vLLM's to refuse ("n must be at least 1, got 0."). The most: what orjson writes back
_ANY = -(2**63)
_OUTPUT_COUNTS = {
    "chat": (("max_completion_tokens", 0), ("max_tokens", 0), ("n", _ANY)),
    "completions": (("max_tokens", 0), ("n", _ANY)),
    "responses": (("max_output_tokens", 0),),
}
_MAX_COUNT = 2**64 - 1  # (`wideints`)
_LAX_INT = TypeAdapter(int)  # a pydantic ``int`` field in lax mode, as vLLM's models read one
# the prompt field kvgate estimates a request's tokens by, and the JSON types vLLM takes for it
_PROMPT_FIELDS: dict[str, tuple[str, tuple[type, ...], str]] = {
    "chat": ("messages", (list,), "an array"),
    "completions": ("prompt", (str, list), "a string or an array"),
    "embeddings": ("input", (str, list), "a string or an array"),
    "responses": ("input", (str, list), "a string or an array"),
}


class ParsedBody:
    __slots__ = ("data", "generates", "model", "prefix", "prompt_tokens", "stream")

    def __init__(
        self, data: dict[str, Any], model: str, stream: bool, prompt_tokens: int,
        generates: bool = True,
    ) -> None:
        self.data = data
        self.model = model
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        # False for an embedding: no output, whatever `max_tokens` or `n` its body carries
        # (flow control's charge and the TPM reservation, `gateway.flow.asked_tokens`)
        self.generates = generates
        # the prompt's routing features when they were computed with the parse, off the event
        # loop (a large body, `gateway/prepare.py`); else the planner computes them
        self.prefix: RequestFeatures | None = None

    def shed(self) -> None:
        """Drop the parsed document once the upstream body is written: its objects take ~20x
        the body's bytes (7 MB of short messages: ~150 MB), and a request holds its
        `ParsedBody` for the whole exchange. Only `store` and `background`, which the
        answer's handling reads, are kept."""
        self.data = {k: self.data[k] for k in ("store", "background") if k in self.data}


def _utf8(raw: bytes) -> bytes:
    """The body as UTF-8, as vLLM's parser (Python's json, given the bytes) reads it: a
    leading UTF-8 BOM skipped, and UTF-16 or UTF-32 (told by its BOM or its zero bytes, RFC
    4627's rule, `json.detect_encoding`) decoded; orjson takes UTF-8 only."""
    if raw.startswith(_BOM):
        return raw[len(_BOM):]
    if raw[:1] not in (b"\x00", b"\xfe", b"\xff") and raw[1:2] != b"\x00":
        return raw  # the common case: UTF-8 (or not JSON at all)
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8":
        return raw
    try:
        return raw.decode(encoding).encode()
    except UnicodeError:  # (lone surrogates too: orjson would refuse them)
        raise BadRequest(f"The request body is not valid JSON: not valid {encoding}.") from None


def _why(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    """orjson's reason, except for bytes that are not UTF-8 (a body in Latin-1 or another
    charset the Content-Type may name; JSON is UTF-8, RFC 8259, and vLLM reads no charset
    either): orjson says "str is not valid UTF-8: surrogates not allowed" at char 0; and for
    NaN or Infinity, which Python's json (vLLM's) reads as floats: orjson says "unexpected
    character" or "no digit after sign"."""
    try:
        raw.decode()
    except UnicodeDecodeError as bad:
        return (f"it is not valid UTF-8 (byte {bad.start}); send JSON as UTF-8, whatever "
                "charset the Content-Type names")
    doc, pos = exc.doc, exc.pos
    wide = _INT_LITERAL.match(doc, pos)
    if wide is not None and str(exc).startswith(_ORJSON_INFINITE):
        # an integer of ~310 digits or more: orjson reads it as a double, and says so
        # ("number is infinity when parsed as double" for a 400-digit `seed`); it is the
        # integer beyond 64 bits that `wideints` names for a shorter one
        raise wide_int_error(wide.group()) from None
    start = pos - 1 if pos and doc[pos - 1] == "-" else pos  # orjson points past a sign
    if _NON_FINITE.match(doc, start):
        line = doc.count("\n", 0, start) + 1
        column = start - doc.rfind("\n", 0, start)
        return f"NaN and Infinity are not JSON numbers (RFC 8259): line {line} column {column}"
    return str(exc)


def parse_body(
    raw: bytes, kind: str, default_model: Callable[[], str] | None = None,
) -> ParsedBody:
    """Parse and check the request; raises `BadRequest` naming the parameter.
    ``default_model``: the model a body without one (absent, null or empty) is for."""
    raw = _utf8(raw)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # where and why, never the body's text
        if str(exc).startswith(_ORJSON_TOO_DEEP):  # valid JSON, deeper than orjson reads
            raise too_deep_error() from None
        raise BadRequest(f"The request body is not valid JSON: {_why(raw, exc)}.") from None
    # deeper than orjson can write back: a 400 before any work (a text with fewer brackets
    # cannot nest deeper: the walk, ~1 us for a chat body, is skipped)
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        check_parsed_depth(data)
    check_wide_ints(raw)  # read as floats by orjson: a 400, not a changed value
    if not isinstance(data, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = data.get("model")
    if (model is None or model == "") and default_model is not None:
        # vLLM's request models make `model` optional: none (or "") is its served model, and
        # curl scripts written against one vLLM leave it out
        model = data["model"] = default_model()
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` must be a non-empty string.", param="model")
    sent = data.get("stream")
    stream = False if sent is None else lax_bool(sent)
    if stream is None:
        raise BadRequest("`stream` must be a boolean.", param="stream")
    if stream and sent is not True:  # as vLLM reads it; a false one is forwarded as sent:
        data["stream"] = True  # vLLM's before-validators test the raw value's truth ("false"
        # is true there: `stream_options` only with a stream, no `prompt_logprobs` in one)
    if kind in USAGE_STREAM_KINDS:
        _check_stream_options(data.get("stream_options"))
    elif kind == "responses":  # routes the request (`previous_response_id`'s replica)
        prev = data.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise BadRequest("`previous_response_id` must be a string.",
                             param="previous_response_id")
    _check_counted(data, kind)
    return ParsedBody(data, model, stream, count_tokens(prompt_chars(data, kind)),
                      kind not in NO_OUTPUT_KINDS)


def _check_counted(data: dict[str, Any], kind: str) -> None:
    """The fields a request's tokens are counted by (`_PROMPT_FIELDS`, `_OUTPUT_COUNTS`): a
    400 naming the one of a type vLLM would not take either, an output count read as vLLM
    reads it. A null is vLLM's to judge (its default, or its own 400)."""
    if (prompt := _PROMPT_FIELDS.get(kind)) is not None:
        name, types, what = prompt
        value = data.get(name)
        if value is not None and not isinstance(value, types):
            raise BadRequest(f"`{name}` must be {what}.", param=name)
    for name, least in _OUTPUT_COUNTS.get(kind, ()):
        value = data.get(name)
        if value is None or (type(value) is int and least <= value <= _MAX_COUNT):
            continue  # (the common case: absent, or a JSON integer in range)
        try:
            count: int | None = _LAX_INT.validate_python(value)
        except ValidationError:
            count = None
        if count is None or not least <= count <= _MAX_COUNT:
            what = "a non-negative integer" if least == 0 else "an integer"
            raise BadRequest(f"`{name}` must be {what} (of at most 64 bits).", param=name)
        data[name] = count  # as vLLM reads it, and as `gateway.flow.cost` reads it


def _check_stream_options(options: Any) -> None:
    """`rewrite_body` rewrites `stream_options`: what it cannot read is a 400, not replaced."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object.", param="stream_options")
    usage = options.get("include_usage")
    if usage is None:
        return
    read = lax_bool(usage)
    if read is None:
        raise BadRequest("`stream_options.include_usage` must be a boolean.",
                         param="stream_options.include_usage")
    options["include_usage"] = read  # as vLLM reads it (`rewrite_body` compares with True)


def lax_bool(value: Any) -> bool | None:
    """A JSON value read as pydantic reads a ``bool`` field in lax mode (vLLM's request
    models): booleans, the numbers 0 and 1, and the strings ``true/false``, ``1/0``,
    ``yes/no``, ``on/off``, ``t/f``, ``y/n`` in any case; None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return bool(value) if value in (0, 1) else None
    if isinstance(value, str):
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    return None


def _text_len(value: Any, depth: int = 0) -> int:
    """Characters of a prompt or message content, a token id counted as one token's worth
    (`routing.tokens`): a prompt of token ids, a batch of them (completions, embeddings) and
    the Responses API's messages (their ``content``) are estimated like text, not as 0."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return CHARS_PER_TOKEN if depth else 0  # a bare number is no prompt
    if depth > 3:  # vLLM reads no deeper (a batch of token-id lists, a message's parts)
        return 0
    if isinstance(value, list):
        return sum(_text_len(part, depth + 1) for part in value)
    if isinstance(value, dict) and depth:
        text = value.get("text")
        if isinstance(text, str):
            return len(text)
        return _text_len(value.get("content"), depth + 1)
    return 0


def prompt_chars(data: dict[str, Any], kind: str) -> int:
    """A cheap prompt length in characters (the token estimate's input)."""
    if kind == "chat":
        messages = data.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(_text_len(m.get("content")) for m in messages if isinstance(m, dict))
    if kind == "completions":
        return _text_len(data.get("prompt"))
    if kind == "embeddings":  # (vLLM's chat form of embeddings: `messages`, no `input`)
        if "input" not in data and isinstance(messages := data.get("messages"), list):
            return _text_len(messages)
        return _text_len(data.get("input"))
    instructions = data.get("instructions")  # responses: a system prompt before the input
    head = len(instructions) if isinstance(instructions, str) else 0
    return head + _text_len(data.get("input"))


def rewrite_body(
    parsed: ParsedBody,
    kind: str,
    served_model: str,
    *,
    cache_salt: str | None,
    priority: int | None,
    client_salt: ClientSaltMode,
    client_priority: ClientPriorityMode,
) -> tuple[bytes, bool]:
    """The upstream body, and whether the usage chunk must be stripped from the stream.

    `model` becomes the pool's served name. A client's `cache_salt` is never forwarded: it is
    dropped (``client_salt="strip"``) or refused with a 400 (``"reject"``), so no tenant can
    pick another tenant's salt; the gateway sets the tenant's when given. The client's
    `priority` is dropped (vLLM rejects non-zero priority on pools without priority scheduling,
    and tiers, not clients, decide it) unless ``client_priority="keep"`` (the single-tenant
    ``--no-auth`` mode, where the caller owns the replicas); a tier's `priority` always wins.
    Streams ask for usage so kvgate can count tokens (and charge them to the tenant).
    """
    data = parsed.data
    if "cache_salt" in data:
        if client_salt == "reject":
            raise BadRequest(
                "cache_salt is set by the gateway and must not be sent", param="cache_salt"
            )
        del data["cache_salt"]
    if client_priority == "drop":
        data.pop("priority", None)
    if cache_salt is not None:
        data["cache_salt"] = cache_salt
    data["model"] = served_model
    if priority is not None:
        data["priority"] = priority
    strip_usage = False
    if parsed.stream and kind in USAGE_STREAM_KINDS:
        options = data.get("stream_options")
        if not isinstance(options, dict):
            data["stream_options"] = {"include_usage": True}
            strip_usage = True
        elif options.get("include_usage") is not True:
            data["stream_options"] = {**options, "include_usage": True}
            if "continuous_usage_stats" in options:
                # vLLM puts usage on every chunk only with include_usage, which the client did
                # not ask for: forcing it must not add usage the client would not have had
                data["stream_options"]["continuous_usage_stats"] = False
            strip_usage = True
    return orjson.dumps(data), strip_usage


def drop_operator_fields(body: dict[str, Any]) -> None:
    """Remove vLLM's operator-only fields (`OPERATOR_FIELDS`) from a parsed body, in place."""
    for name in OPERATOR_FIELDS:
        body.pop(name, None)

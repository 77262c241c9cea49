"""vLLM's client routes beside the OpenAI ones, answered plausibly (shapes from vLLM 0.34).

Anthropic's ``/v1/messages`` (whole and streamed, its SSE events and its error shape) and
``/v1/messages/count_tokens``, ``/v1/audio/transcriptions`` and ``translations`` (a
multipart form), ``/detokenize``, ``GET /tokenizer_info``, the pooling routes (``/pooling``,
``/classify``, ``/score``, ``/rerank`` and their ``/v1``, ``/v2`` forms). The answers come
from the prompt's text, not a model: enough for a client to parse them and a gateway to relay
them; no engine runs them (they do not show in the load the replica reports). Every request is
logged (``/sim/requests``) with its body, so tests see the salt a replica received.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from email.parser import BytesParser
from email.policy import default
from typing import TYPE_CHECKING, Any

import orjson
import xxhash

from loadtest.sim.anthropic_tools import forced_tool_use, tool_use_events
from loadtest.sim.asgi import Receive, Scope, Send, read_body, send_bytes, send_json
from loadtest.sim.errors import SimError
from loadtest.sim.generate import ConnectionDropped
from loadtest.sim.parse import validate_cache_salt

if TYPE_CHECKING:
    from loadtest.sim.app import SimApp

__all__ = ["CUT_MID_STREAM", "ExtraRoutes"]

CUT_MID_STREAM = "sim:cut-mid-stream"  # a /v1/messages `metadata.user_id` (`_messages`)

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
_SSE = (b"content-type", b"text/event-stream")
# what pydantic reads as true in a form field (vLLM parses its forms with pydantic)
_FORM_TRUE = {"true", "1", "yes", "on", "t", "y"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}


def _text(value: Any) -> str:
    """The text of a prompt field: a string, text blocks, messages, documents."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(_text(v) for v in value)
    if isinstance(value, dict):
        return _text(value.get("text", value.get("content", "")))
    return ""


def _tokens(text: str) -> int:
    return max(1, len(text.split()))


def _score(a: str, b: str) -> float:
    """A stable score in [0, 1) for a pair of texts."""
    return (xxhash.xxh64_intdigest(f"{a}\x00{b}".encode()) % 10_000) / 10_000


class ExtraRoutes:
    def __init__(self, app: SimApp) -> None:
        self.app = app

    def routes(self) -> dict[tuple[str, str], Handler]:
        pooling = {p: self._rerank for p in ("/rerank", "/v1/rerank", "/v2/rerank")}
        pooling |= {"/score": self._score_route, "/v1/score": self._score_route,
                    "/pooling": self._pooling, "/classify": self._classify}
        return {("POST", "/v1/audio/transcriptions"): self._audio,
                ("POST", "/v1/audio/translations"): self._audio,
                ("POST", "/v1/messages"): self._messages,
                ("POST", "/v1/messages/count_tokens"): self._count_tokens,
                ("POST", "/detokenize"): self._detokenize,
                ("GET", "/tokenizer_info"): self._tokenizer_info,
                **{("POST", path): handler for path, handler in pooling.items()}}

    async def _body(self, scope: Scope, receive: Receive, salted: bool) -> dict[str, Any]:
        body = await self.app._json_body(scope, receive)
        self.app._check_model(body)
        if salted:
            validate_cache_salt(body)
        return body

    # -- Anthropic -------------------------------------------------------------------------
    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._body(scope, receive, salted=True)
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise SimError(400, "messages: Field required", param="messages")
            if not isinstance(body.get("max_tokens"), int):
                raise SimError(400, "max_tokens: Field required", param="max_tokens")
            tool_use = forced_tool_use(body)
        except SimError as err:
            await _anthropic_error(send, err)
            return
        prompt = _tokens(_text(body.get("system")) + " " + _text(body["messages"]))
        n = max(1, min(body["max_tokens"], 8))
        words = [f"w{i}" for i in range(n)]
        msg_id = f"msg_{uuid.uuid4().hex}"
        model = self.app.options.model
        stop = "max_tokens" if body["max_tokens"] <= 8 else "end_turn"
        if tool_use is not None:
            stop = "tool_use"
        if not body.get("stream"):
            content = [tool_use] if tool_use else [{"type": "text", "text": " ".join(words)}]
            await send_json(send, 200, {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": prompt, "output_tokens": n}})
            return
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt, "output_tokens": 0}}}),
            *(tool_use_events(tool_use) if tool_use else _text_events(words)),
            ("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": n}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": [_SSE]})
        # a stream cut after its first delta when the client's metadata asks for it (a test's
        # replica failing mid-stream on this route, which the engine's faults do not serve)
        cut = isinstance(body.get("metadata"), dict) and body["metadata"].get(
            "user_id") == CUT_MID_STREAM
        for i, (name, data) in enumerate(events):
            if cut and i == 3:
                raise ConnectionDropped
            chunk = b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._body(scope, receive, salted=False)
        except SimError as err:
            await _anthropic_error(send, err)
            return
        text = _text(body.get("system")) + " " + _text(body.get("messages"))
        await send_json(send, 200, {"input_tokens": _tokens(text)})

    # -- audio -----------------------------------------------------------------------------
    async def _audio(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's transcription / translation: a multipart form with `file` and `model`; the
        request log holds its text fields and the file's size."""
        declared = next((v.decode("latin-1") for k, v in scope["headers"]
                         if k == b"content-type"), "")
        fields = _form_fields(declared, await read_body(receive))
        self.app._log_request(scope, fields)
        if fields is None or "file" not in fields:
            raise SimError(400, "1 validation error: 'file' is required", "Bad Request", "file")
        self.app._check_model(fields)
        size = int(fields["file"])
        text = f"simulated speech of {size} bytes"
        if str(fields.get("stream", "")).strip().lower() in _FORM_TRUE:
            translation = scope["path"].endswith("/translations")
            await _audio_stream(send, self.app.options.model, text, fields, translation)
            return
        await send_json(send, 200, {"text": text, "usage": {"type": "duration", "seconds": 1}})

    # -- tokenizer -------------------------------------------------------------------------
    async def _tokenizer_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's tokenizer configuration, in brief (its fields vary by tokenizer)."""
        await send_json(send, 200, {
            "tokenizer_class": "SimTokenizer", "name_or_path": self.app.options.model,
            "eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m.content }}"
                                                  "{% endfor %}"})

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive, salted=False)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise SimError(400, "1 validation error: 'tokens' must be a list of integers",
                           "Bad Request", "tokens")
        await send_json(send, 200, {"prompt": " ".join(f"t{t}" for t in tokens)})

    # -- pooling ---------------------------------------------------------------------------
    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": self.app.options.model}

    async def _rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive, salted=True)
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list):
            raise SimError(400, "1 validation error: 'query' and 'documents' are required",
                           "Bad Request", "documents")
        scored = sorted(((i, _score(query, _text(d))) for i, d in enumerate(docs)),
                        key=lambda pair: -pair[1])
        top = _top_n(body.get("top_n"), len(docs))
        results = [{"index": i, "document": {"text": _text(docs[i])}, "relevance_score": s}
                   for i, s in scored[:top]]
        total = _tokens(query) * len(docs) + sum(_tokens(_text(d)) for d in docs)
        await send_json(send, 200, {"id": f"rerank-{uuid.uuid4().hex}",
                                    "model": self.app.options.model,
                                    "usage": {"total_tokens": total}, "results": results})

    async def _score_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive, salted=True)
        first = body.get("text_1", body.get("queries"))
        second = body.get("text_2", body.get("documents"))
        if first is None or second is None:
            raise SimError(400, "1 validation error: 'text_1' and 'text_2' are required",
                           "Bad Request", "text_1")
        lefts = first if isinstance(first, list) else [first]
        rights = second if isinstance(second, list) else [second]
        if len(lefts) == 1:
            lefts = lefts * len(rights)
        data = [{"index": i, "object": "score", "score": _score(_text(a), _text(b))}
                for i, (a, b) in enumerate(zip(lefts, rights, strict=False))]
        total = sum(_tokens(_text(a)) + _tokens(_text(b)) for a, b in zip(lefts, rights,
                                                                          strict=False))
        await send_json(send, 200, {**self._head("score"), "data": data, "usage": {
            "prompt_tokens": total, "total_tokens": total}})

    async def _pooling(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive, salted=True)
        items = _inputs(body)
        data = [{"index": i, "object": "pooling", "data": [_score(_text(x), str(j))
                                                           for j in range(4)]}
                for i, x in enumerate(items)]
        await send_json(send, 200, {**self._head("pool"), "data": data,
                                    "usage": _usage(items)})

    async def _classify(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive, salted=True)
        items = _inputs(body)
        data = []
        for i, x in enumerate(items):
            p = _score(_text(x), "label")
            data.append({"index": i, "label": "positive" if p >= 0.5 else "negative",
                         "probs": [1 - p, p], "num_classes": 2})
        await send_json(send, 200, {**self._head("classify"), "data": data,
                                    "usage": _usage(items)})


def _form_fields(declared: str, body: bytes) -> dict[str, Any] | None:
    """A multipart form's text fields, and its `file` part's size (None: not a form)."""
    if not declared.lower().startswith("multipart/form-data"):
        return None
    message = BytesParser(policy=default).parsebytes(
        b"Content-Type: " + declared.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        return None
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if not isinstance(name, str) or not isinstance(payload, bytes):
            return None
        fields[name] = str(len(payload)) if name == "file" else payload.decode("utf-8", "replace")
    return fields


async def _audio_stream(send: Send, model: str, text: str, fields: dict[str, Any],
                        translation: bool) -> None:
    """vLLM's streamed transcription (form field `stream=true`, which the OpenAI Node SDK sends
    as the text `true`): `transcription.chunk` (`translation.chunk`) events with a `delta`, the
    last one's `finish_reason` "stop", a usage chunk when `stream_include_usage` asks, then
    `[DONE]`. Answering it whole instead made a gateway refuse the answer as no stream."""
    kind, prefix = ("translation", "trsl") if translation else ("transcription", "trsc")
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": f"{kind}.chunk",
            "created": int(time.time()), "model": model}
    words = text.split(" ")
    events = [{**head, "choices": [{"delta": {"content": w if i == 0 else f" {w}"},
                                    "finish_reason": "stop" if i == len(words) - 1 else None,
                                    "stop_reason": None}]} for i, w in enumerate(words)]
    if str(fields.get("stream_include_usage", "")).strip().lower() in _FORM_TRUE:
        events.append({**head, "choices": [], "usage": {
            "prompt_tokens": 1, "completion_tokens": len(words), "total_tokens": 1 + len(words)}})
    await send({"type": "http.response.start", "status": 200, "headers": [_SSE]})
    for event in events:
        chunk = b"data: " + orjson.dumps(event) + b"\n\n"
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _text_events(words: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """A text content block's start, one `text_delta` per word, its stop."""
    events: list[tuple[str, dict[str, Any]]] = [
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}})]
    events += [("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
        "type": "text_delta", "text": w if i == 0 else f" {w}"}}) for i, w in enumerate(words)]
    events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    return events


def _top_n(sent: Any, count: int) -> int:
    """Rerank's ``top_n`` as vLLM reads it: an integer (pydantic's lax mode takes one in a
    string too), 0 or less meaning every document; anything else is vLLM's 400 (the
    simulator answered a 500 -- a fault the gateway charges to the replica -- for a bad
    value a client sent)."""
    if sent is None:
        return count
    if (isinstance(sent, str) and sent.strip().lstrip("+-").isdigit()) or (
            isinstance(sent, float) and sent.is_integer()):
        sent = int(sent)
    if not isinstance(sent, int) or isinstance(sent, bool):
        raise SimError(400, "1 validation error: 'top_n' must be an integer", "Bad Request",
                       "top_n")
    return sent if sent > 0 else count


def _inputs(body: dict[str, Any]) -> list[Any]:
    value = body.get("input")
    if value is None:
        raise SimError(400, "1 validation error: 'input' is required", "Bad Request", "input")
    return value if isinstance(value, list) else [value]


def _usage(items: list[Any]) -> dict[str, int]:
    total = sum(_tokens(_text(x)) for x in items)
    return {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0}


async def _anthropic_error(send: Send, err: SimError) -> None:
    """vLLM's Anthropic routes answer errors in Anthropic's shape."""
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
    await send_bytes(send, err.status, orjson.dumps(
        {"type": "error", "error": {"type": kind, "message": err.message}}),
        (b"content-type", b"application/json"))

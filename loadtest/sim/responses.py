"""The Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``, ``.../cancel``.

Shapes and rules from vllm/entrypoints/openai/responses/ (serving.py, api_router.py,
protocol.py): ``input`` (a string or a list of messages) after ``instructions`` as a system
message, ``max_output_tokens``; streams are named SSE events (``event: <type>`` + ``data:``,
no ``[DONE]``) with a ``sequence_number``. The response store is off unless the replica runs with
``--enable-store`` (vLLM: ``VLLM_ENABLE_RESPONSES_API_STORE=1``); without it ``store: true`` is
silently ignored. A stored response lives in this process only, so a ``previous_response_id`` or
``GET``/``cancel`` of an id this replica does not hold is a 404. ``background: true`` needs the
store (400 otherwise) and answers at once with status ``queued``; ``cancel`` stops a queued or
running background response and is a 400 for one that already finished. With ``stream: true``
too, the events are kept (vLLM's event store) and the POST answers them as a stream, as
``GET /v1/responses/{id}?stream=true[&starting_after=N]`` does later: the kept events after
``starting_after``, then the new ones until ``response.completed``. vLLM keeps no events for any
other response: that GET sends the stream's head, then the handler fails and the connection
breaks (vLLM's generator raises after the head went out). The simulator's output is text
(``tools`` are accepted and ignored).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import orjson

from loadtest.sim.asgi import Message, Receive, Scope, Send, send_json
from loadtest.sim.errors import SimError
from loadtest.sim.generate import ConnectionDropped, Generation, Piece
from loadtest.sim.prompt import content_text
from loadtest.sim.spec import RequestOutput

if TYPE_CHECKING:
    from loadtest.sim.app import Handler, SimApp

__all__ = ["ResponsesAPI"]

_PREFIX = "/v1/responses/"


def _not_found(response_id: str) -> SimError:
    return SimError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                    "response_id")


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class _Stored:
    """A stored response: the object as answered and the conversation that led to it (and,
    for a background stream, its events as vLLM's event store keeps them)."""

    __slots__ = ("events", "generation", "messages", "new_event", "response", "task")

    def __init__(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.response = response
        self.messages = messages
        self.task: asyncio.Task[None] | None = None
        self.generation: Generation | None = None
        self.events: list[bytes] | None = None  # whole SSE events, index = sequence_number
        self.new_event = asyncio.Event()

    def keep(self, data: bytes) -> None:
        """Body bytes of the background stream (whole events) into the event store."""
        assert self.events is not None
        self.events.extend(e + b"\n\n" for e in data.split(b"\n\n") if e.startswith(b"event:"))
        self.new_event.set()


class ResponsesAPI:
    def __init__(self, app: SimApp) -> None:
        self.app = app
        self.store: dict[str, _Stored] = {}

    def route(self, method: str, path: str) -> Handler | None:
        if not path.startswith(_PREFIX):
            return None
        if method == "GET" and path.count("/") == 3:
            return self.get
        if method == "POST" and path.endswith("/cancel") and path.count("/") == 4:
            return self.cancel
        return None

    # -- create ----------------------------------------------------------------------------
    def _messages(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        raw = body.get("input")
        if isinstance(raw, str) and raw:
            items: list[Any] = [{"role": "user", "content": raw}]
        elif isinstance(raw, list) and raw and all(isinstance(i, dict) for i in raw):
            items = raw
        else:
            raise SimError(400, "1 validation error: 'input' must be a non-empty string or a list "
                           "of input items", "Bad Request", "input")
        messages = []
        for item in items:
            if "role" in item:
                messages.append({"role": str(item["role"]),
                                 "content": content_text(_texts(item.get("content")))})
            else:  # function_call, function_call_output, ...: kept verbatim in the prompt
                messages.append({"role": "tool", "content": orjson.dumps(item).decode()})
        return messages

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        body = await app._json_body(scope, receive)
        app._check_model(body)
        store = body.get("store") is not False and app.options.enable_store
        background = body.get("background") is True
        if background and not store:
            raise SimError(400, "`store=True` (default) is not supported. Please set "
                           "`store=False` in Responses API or set "
                           "`VLLM_ENABLE_RESPONSES_API_STORE=1` in the env var when starting "
                           "the vLLM server.", "invalid_request_error", "store")
        history: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            stored = self.store.get(str(prev))
            if stored is None:
                raise _not_found(str(prev))
            history = stored.messages
        messages = history + self._messages(body)
        instructions = body.get("instructions")
        system = ([{"role": "system", "content": instructions}]
                  if isinstance(instructions, str) and instructions else [])
        chat_body = {"messages": system + messages, "stream": body.get("stream") is True,
                     "max_completion_tokens": body.get("max_output_tokens"),
                     "cache_salt": body.get("cache_salt"), "priority": body.get("priority"),
                     "request_id": body.get("request_id"),
                     "response_format": _response_format(body)}
        gen = app.parse(chat_body, chat=True)
        gen.include_usage = False
        response_id = "resp_" + uuid.uuid4().hex
        fmt_args = (response_id, body, int(time.time()))
        if not store:
            await app.launch(scope, receive, send, gen, response_id,
                             lambda g: ResponsesFormat(g, *fmt_args))
            return
        entry = _Stored({}, messages)
        self.store[response_id] = entry
        if background:
            entry.response = ResponsesFormat.shell(*fmt_args, status="queued")
            if gen.stream:  # vLLM: the events are kept, and the answer is their stream
                entry.events = []
            entry.task = asyncio.create_task(self._background(scope, gen, entry, fmt_args))
            if entry.events is not None:
                await self._replay(send, entry, 0)
            else:
                await send_json(send, 200, entry.response)
            return
        generation = await app.launch(scope, receive, send, gen, response_id,
                                      lambda g: ResponsesFormat(g, *fmt_args, entry))
        if generation.finished is None:
            self.store.pop(response_id, None)  # aborted or failed: nothing to keep

    async def _background(self, scope: Scope, gen: Any, entry: _Stored,
                          fmt_args: tuple[str, dict[str, Any], int]) -> None:
        """Run a background response: no client connection, the store gets the result."""
        stop = asyncio.Event()

        async def receive() -> Message:
            await stop.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if entry.events is not None and message["type"] == "http.response.body":
                entry.keep(message.get("body", b""))

        entry.response["status"] = "in_progress"
        try:
            await self.app.launch(scope, receive, send, gen, fmt_args[0],
                                  lambda g: ResponsesFormat(g, *fmt_args, entry))
        except SimError:
            entry.response["status"] = "failed"
        finally:
            stop.set()
            entry.new_event.set()

    # -- get / cancel ----------------------------------------------------------------------
    async def get(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = scope["path"][len(_PREFIX):]
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if query.get("stream", "").lower() not in ("1", "true", "t", "yes", "y", "on"):
            await send_json(send, 200, stored.response)
            return
        after = query.get("starting_after", "")
        start = int(after) + 1 if after.lstrip("-").isdigit() else 0
        if stored.events is None:
            # vLLM: the stream's head goes out, then its generator raises "Unknown
            # response_id" and the server breaks the connection
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            raise ConnectionDropped(f"Unknown response_id: {response_id}")
        await self._replay(send, stored, max(start, 0))

    async def _replay(self, send: Send, stored: _Stored, start: int) -> None:
        """The kept events from `start` on, then the new ones until ``response.completed``."""
        assert stored.events is not None
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        index = start
        while True:
            stored.new_event.clear()
            while index < len(stored.events):
                event = stored.events[index]
                await send({"type": "http.response.body", "body": event, "more_body": True})
                index += 1
                if event.startswith(b"event: response.completed\n"):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
            if stored.task is None or stored.task.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return  # cancelled or failed: no more events will come
            await stored.new_event.wait()

    async def cancel(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = scope["path"][len(_PREFIX):-len("/cancel")]
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        if stored.response.get("status") not in ("queued", "in_progress"):
            raise SimError(400, "Cannot cancel a synchronous response.", "invalid_request_error",
                           "response_id")
        stored.response["status"] = "cancelled"
        if stored.task is not None:
            stored.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stored.task
        await send_json(send, 200, stored.response)


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` (json_schema: name and schema inline; json_object) as chat's
    `response_format`, so the output text is JSON as vLLM's guided decoding makes it (the
    Vercel AI SDK's `generateObject` parses it)."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema" or not isinstance(fmt, dict):
        return None
    return {"type": "json_schema", "json_schema": {"name": str(fmt.get("name", "schema")),
                                                   "schema": fmt.get("schema")}}


def _texts(content: Any) -> Any:
    """Input parts (``input_text``/``output_text``) as plain text parts."""
    if isinstance(content, list):
        return [{"type": "text", "text": p["text"]} if isinstance(p, dict) and "text" in p else p
                for p in content]
    return content


class ResponsesFormat:
    """A Responses API answer of one `Generation` (object, or the event stream)."""

    def __init__(self, generation: Generation, response_id: str, body: dict[str, Any],
                 created: int, entry: _Stored | None = None) -> None:
        self.g, self.id, self.body, self.created = generation, response_id, body, created
        self.entry = entry
        self.seq = 0
        self.phase = ""  # "", "reasoning", "message"
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.item_ids = {"reasoning": f"rs_{uuid.uuid4().hex}",
                         "message": f"msg_{uuid.uuid4().hex}"}

    @staticmethod
    def shell(response_id: str, body: dict[str, Any], created: int,
              status: str = "in_progress") -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": created,
                "model": body.get("model"), "status": status, "output": [], "usage": None,
                "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"),
                "previous_response_id": body.get("previous_response_id"),
                "background": body.get("background") is True, "incomplete_details": None,
                "error": None, "metadata": body.get("metadata"), "parallel_tool_calls": True,
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "store": body.get("store") is not False, "service_tier": "auto",
                "reasoning": None, "user": None}

    def _ev(self, kind: str, **fields: Any) -> bytes:
        data = _event(kind, self.seq, **fields)
        self.seq += 1
        return data

    def _item(self, kind: str, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if kind == "reasoning":
            content = [{"type": "reasoning_text", "text": "".join(self.reasoning)}] if done else []
            return {"id": self.item_ids[kind], "type": "reasoning", "summary": [],
                    "content": content, "status": status}
        parts = [self._part(done)] if done else []
        return {"id": self.item_ids[kind], "type": "message", "role": "assistant",
                "status": status, "content": parts}

    def _part(self, done: bool) -> dict[str, Any]:
        return {"type": "output_text", "text": "".join(self.content) if done else "",
                "annotations": [], "logprobs": []}

    def _open(self, kind: str) -> bytes:
        out = self._close()
        self.phase = kind
        index = 1 if kind == "message" and self.reasoning else 0
        out += self._ev("response.output_item.added", output_index=index,
                        item=self._item(kind, False))
        if kind == "message":
            out += self._ev("response.content_part.added", item_id=self.item_ids[kind],
                            output_index=index, content_index=0, part=self._part(False))
        return out

    def _close(self) -> bytes:
        kind, index = self.phase, (1 if self.phase == "message" and self.reasoning else 0)
        item_id = self.item_ids.get(kind, "")
        if kind == "reasoning":
            out = self._ev("response.reasoning_text.done", item_id=item_id, output_index=index,
                           content_index=0, text="".join(self.reasoning))
        elif kind == "message":
            out = self._ev("response.output_text.done", item_id=item_id, output_index=index,
                           content_index=0, text="".join(self.content), logprobs=[])
            out += self._ev("response.content_part.done", item_id=item_id, output_index=index,
                            content_index=0, part=self._part(True))
        else:
            return b""
        self.phase = ""
        return out + self._ev("response.output_item.done", output_index=index,
                              item=self._item(kind, True))

    # -- Format ----------------------------------------------------------------------------
    def start(self) -> bytes:
        shell = self.shell(self.id, self.body, self.created)
        if self.entry is not None:
            self.entry.response = shell
        return (self._ev("response.created", response=shell)
                + self._ev("response.in_progress", response=shell))

    def piece(self, piece: Piece, first: bool) -> bytes:
        out = b""
        if piece.reasoning:
            if self.phase != "reasoning":
                out += self._open("reasoning")
            self.reasoning.append(piece.reasoning)
            out += self._ev("response.reasoning_text.delta", item_id=self.item_ids["reasoning"],
                            output_index=0, content_index=0, delta=piece.reasoning)
        if piece.content:
            if self.phase != "message":
                out += self._open("message")
            self.content.append(piece.content)
            out += self._ev("response.output_text.delta", item_id=self.item_ids["message"],
                            output_index=1 if self.reasoning else 0, content_index=0,
                            delta=piece.content, logprobs=[])
        return out

    def end(self, last: RequestOutput) -> bytes:
        out = b"" if self.phase == "message" else self._open("message")
        out += self._close()
        return out + self._ev("response.completed", response=self._final(last))

    def full(self, reasoning: str, content: str, last: RequestOutput,
             index: int = 0) -> dict[str, Any]:  # the Responses API has one output
        self.reasoning, self.content = ([reasoning] if reasoning else []), [content]
        return self._final(last)

    def _final(self, last: RequestOutput) -> dict[str, Any]:
        response = self.shell(self.id, self.body, self.created, "completed")
        if last.finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        output = [self._item("reasoning", True)] if self.reasoning else []
        response["output"] = [*output, self._item("message", True)]
        prompt, done = self.g.gen.prompt.num_tokens, last.num_output_tokens
        thinking = min(self.g.gen.reasoning_tokens, done)
        response["usage"] = {"input_tokens": prompt,
                             "input_tokens_details": {"cached_tokens": last.cached_tokens},
                             "output_tokens": done,
                             "output_tokens_details": {"reasoning_tokens": thinking},
                             "total_tokens": prompt + done}
        if self.body.get("enable_response_messages") is True:
            # vLLM extra: the prompt and output messages, after `usage` in the body
            response["input_messages"] = self.g.gen.prompt.text
            response["output_messages"] = [{"role": "assistant",
                                            "content": "".join(self.content)}]
        if self.entry is not None and self.entry.response.get("status") != "cancelled":
            self.entry.response = response
            self.entry.messages = [*self.entry.messages,
                                   {"role": "assistant", "content": "".join(self.content)}]
        return response

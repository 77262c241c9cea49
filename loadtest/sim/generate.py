"""Serving one chat/completions request: submit to the engine, stream or answer, abort on exit."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from loadtest.sim import prompt as P
from loadtest.sim.asgi import Receive, Send, send_json, wait_disconnect
from loadtest.sim.faults import Faults
from loadtest.sim.parse import GenRequest
from loadtest.sim.runner import EngineRunner
from loadtest.sim.spec import RequestOutput, RequestSpec

__all__ = ["ConnectionDropped", "Generation"]

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]


class ConnectionDropped(Exception):
    """Raised to make the server drop the connection (the 'dead' fault)."""


class Generation:
    """One request's life on the server side."""

    def __init__(self, runner: EngineRunner, faults: Faults, model: str, block_size: int,
                 gen: GenRequest, response_id: str, engine_id: str,
                 extra_headers: list[tuple[bytes, bytes]]) -> None:
        self.runner, self.faults, self.model, self.gen = runner, faults, model, gen
        self.block_size = block_size
        self.response_id, self.engine_id = response_id, engine_id
        self.headers = extra_headers
        self.created = int(time.time())
        self.sent_tokens = 0
        self.chars_sent = 0

    def spec(self) -> RequestSpec:
        gen = self.gen
        return RequestSpec(
            request_id=self.engine_id,
            block_hashes=gen.prompt.block_hashes(self.block_size, gen.salt),
            prompt_tokens=gen.prompt.num_tokens, max_tokens=gen.max_tokens, eos_after=gen.eos_after,
            priority=gen.priority,
        )

    async def serve(self, receive: Receive, send: Send) -> None:
        track = self.runner.submit(self.spec())
        watcher = asyncio.create_task(wait_disconnect(receive))
        watcher.add_done_callback(lambda _t: self.runner.abort(self.engine_id))
        try:
            if self.gen.stream:
                await self._stream(track.queue, watcher, send)
            else:
                await self._full(track.queue, watcher, send)
        finally:
            watcher.cancel()

    # -- text ------------------------------------------------------------------------------
    def _text(self, count: int) -> str:
        hang = self.faults.hang_after_tokens
        if hang >= 0:  # never send past the hang point, even when outputs arrive batched
            count = min(count, max(0, hang - self.sent_tokens))
        text = P.generated_text(self.gen.seed, self.sent_tokens, count)
        self.sent_tokens += count
        limit = self.gen.visible_chars
        if limit is not None:
            text = text[: max(0, limit - self.chars_sent)]
        self.chars_sent += len(text)
        return text

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        prompt = self.gen.prompt.num_tokens
        return {"prompt_tokens": prompt, "total_tokens": prompt + out.num_output_tokens,
                "completion_tokens": out.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}

    # -- non-streaming ---------------------------------------------------------------------
    async def _full(self, queue: asyncio.Queue[RequestOutput], watcher: asyncio.Task[None],
                    send: Send) -> None:
        parts: list[str] = []
        while True:
            out = await queue.get()
            self._check_dead()
            if out.finish_reason == "abort":
                return
            parts.append(self._text(out.new_tokens))
            if 0 <= self.faults.hang_after_tokens <= self.sent_tokens:
                await watcher
                return
            if out.finish_reason is not None:
                break
        await send_json(send, 200, self._full_body("".join(parts), out), self.headers)

    def _full_body(self, text: str, out: RequestOutput) -> dict[str, Any]:
        if self.gen.chat:
            choice: dict[str, Any] = {
                "index": 0, "logprobs": None, "finish_reason": out.finish_reason,
                "stop_reason": None,
                "message": {"role": "assistant", "content": text, "refusal": None,
                            "tool_calls": [], "reasoning_content": None},
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": out.finish_reason, "stop_reason": None}
            obj = "text_completion"
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model, "choices": [choice], "usage": self._usage(out),
                "prompt_logprobs": None, "kv_transfer_params": None}

    # -- streaming -------------------------------------------------------------------------
    def _chunk(self, text: str | None, finish: str | None, role: bool = False) -> bytes:
        if self.gen.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None,
                      "finish_reason": finish}
            obj = "text_completion"
        if finish is not None:
            choice["stop_reason"] = None
        body = {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model, "choices": [choice]}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _usage_chunk(self, out: RequestOutput) -> bytes:
        obj = "chat.completion.chunk" if self.gen.chat else "text_completion"
        body = {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model, "choices": [], "usage": self._usage(out)}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    async def _stream(self, queue: asyncio.Queue[RequestOutput], watcher: asyncio.Task[None],
                      send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": _SSE_HEADERS + self.headers})
        if self.gen.chat:
            await _body(send, self._chunk(None, None, role=True))
        while True:
            out = await queue.get()
            self._check_dead()
            if out.finish_reason == "abort":
                return
            text = self._text(out.new_tokens)
            if 0 <= self.faults.hang_after_tokens <= self.sent_tokens:
                if text:
                    await _body(send, self._chunk(text, None))
                await watcher
                return
            if text or out.finish_reason is not None:
                await _body(send, self._chunk(text, out.finish_reason))
            if out.finish_reason is not None:
                break
        tail = self._usage_chunk(out) if self.gen.include_usage else b""
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})

    def _check_dead(self) -> None:
        if self.faults.dead:
            self.runner.abort(self.engine_id)
            raise ConnectionDropped("simulated replica death")


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})

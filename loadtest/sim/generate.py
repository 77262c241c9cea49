"""Serving one generation request: submit to the engine, stream or answer, abort on exit.

`Generation` owns the request's life (engine submission, client-disconnect abort, faults,
keep-alive comments, the hang fault); a `Format` turns what each engine output adds into bytes:
`chat_format.py` for chat/completions, `responses.py` for the Responses API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from loadtest.sim import prompt as P
from loadtest.sim.asgi import Receive, Send, send_json, wait_disconnect
from loadtest.sim.errors import dead_engine_error, error_body, sse_error
from loadtest.sim.faults import Faults
from loadtest.sim.parse import GenRequest
from loadtest.sim.runner import EngineRunner
from loadtest.sim.spec import RequestOutput, RequestSpec

__all__ = ["ConnectionDropped", "Format", "Generation", "Piece", "ServeContext"]

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]
KEEP_ALIVE = b": keep-alive\n\n"


class ConnectionDropped(Exception):
    """Raised to make the server close the connection (the 'drop_connections' fault)."""


@dataclass(frozen=True, slots=True)
class ServeContext:
    """What every request of one replica shares."""

    faults: Faults
    model: str
    block_size: int
    legacy_errors: bool = False
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    keep_alive_s: float = 0.0  # --sse-keep-alive-interval (wall seconds, 0 = off)


@dataclass(slots=True)
class Piece:
    """What one engine output adds: thinking text, then answer text (or tool arguments)."""

    reasoning: str
    content: str
    out: RequestOutput


class Format(Protocol):
    """Bytes for one API's answer; `Generation` calls it in order."""

    def start(self) -> bytes: ...  # first bytes of a stream (may be empty)

    def piece(self, piece: Piece, first: bool) -> bytes: ...  # a stream's bytes for one output

    def end(self, last: RequestOutput) -> bytes: ...  # a stream's last bytes

    def full(self, reasoning: str, content: str, last: RequestOutput) -> dict[str, Any]: ...


class Generation:
    """One request's life on the server side."""

    def __init__(self, ctx: ServeContext, runner: EngineRunner, gen: GenRequest, engine_id: str,
                 headers: list[tuple[bytes, bytes]],
                 reply_headers: Callable[[], list[tuple[bytes, bytes]]] | None = None) -> None:
        self.ctx, self.runner, self.gen = ctx, runner, gen
        self.engine_id = engine_id
        self.headers = headers
        self.reply_headers = reply_headers  # extra headers of a non-streamed answer, at reply time
        self.created = int(time.time())
        self.sent_tokens = 0
        self.chars_sent = 0
        self.finished: RequestOutput | None = None  # the last output once the request finished

    def spec(self) -> RequestSpec:
        gen = self.gen
        return RequestSpec(
            request_id=self.engine_id,
            block_hashes=gen.prompt.block_hashes(self.ctx.block_size, gen.salt),
            prompt_tokens=gen.prompt.num_tokens, max_tokens=gen.max_tokens, eos_after=gen.eos_after,
            priority=gen.priority,
        )

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        """Chat/completions usage; `cached_tokens` only with --enable-prompt-tokens-details
        (vllm/entrypoints/openai/chat_completion/serving.py)."""
        prompt = self.gen.prompt.num_tokens
        details = ({"cached_tokens": out.cached_tokens} if self.ctx.prompt_tokens_details
                   else None)
        return {"prompt_tokens": prompt, "total_tokens": prompt + out.num_output_tokens,
                "completion_tokens": out.num_output_tokens, "prompt_tokens_details": details}

    async def serve(self, receive: Receive, send: Send, fmt: Format) -> None:
        track = self.runner.submit(self.spec())
        watcher = asyncio.create_task(wait_disconnect(receive))
        watcher.add_done_callback(lambda _t: self.runner.abort(self.engine_id))
        try:
            if self.gen.stream:
                await self._stream(track.queue, watcher, send, fmt)
            else:
                await self._full(track.queue, watcher, send, fmt)
        finally:
            watcher.cancel()

    # -- text ------------------------------------------------------------------------------
    def _piece(self, out: RequestOutput) -> Piece:
        count = out.new_tokens
        hang = self.ctx.faults.hang_after_tokens
        if hang >= 0:  # never send past the hang point, even when outputs arrive batched
            count = min(count, max(0, hang - self.sent_tokens))
        start, self.sent_tokens = self.sent_tokens, self.sent_tokens + count
        tool = self.gen.tool
        if tool is not None:
            return Piece("", tool.arguments[4 * start: 4 * (start + count)], out)
        think = self.gen.reasoning_tokens
        split = min(max(think - start, 0), count)
        text = P.generated_text(self.gen.seed, start, count)
        limit = self.gen.visible_chars
        if limit is not None:
            text = text[: max(0, limit - self.chars_sent)]
        self.chars_sent += len(text)
        return Piece(text[: 4 * split], text[4 * split:], out)

    def _hung(self) -> bool:
        return 0 <= self.ctx.faults.hang_after_tokens <= self.sent_tokens

    async def _next(self, queue: asyncio.Queue[RequestOutput], send: Send | None) -> RequestOutput:
        """The next engine output; a stream gets `: keep-alive` comments while it waits."""
        interval = self.ctx.keep_alive_s
        if send is None or interval <= 0:
            return await queue.get()
        while True:
            try:
                return await asyncio.wait_for(queue.get(), interval)
            except TimeoutError:
                await _body(send, KEEP_ALIVE)

    async def _hang(self, watcher: asyncio.Task[None], send: Send) -> None:
        """A hung engine: no output until the client leaves; the frontend's keep-alive timer
        still runs, so a stream keeps getting comment lines."""
        interval = self.ctx.keep_alive_s
        while interval > 0 and not watcher.done():
            done, _ = await asyncio.wait({watcher}, timeout=interval)
            if not done:
                await _body(send, KEEP_ALIVE)
        await watcher

    def _fault(self) -> str | None:
        faults = self.ctx.faults
        if faults.drop_connections:
            self.runner.abort(self.engine_id)
            raise ConnectionDropped("simulated dropped connection")
        return "dead" if faults.dead else None

    # -- non-streaming ---------------------------------------------------------------------
    async def _full(self, queue: asyncio.Queue[RequestOutput], watcher: asyncio.Task[None],
                    send: Send, fmt: Format) -> None:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            out = await self._next(queue, None)
            if self._fault() == "dead":
                await send_json(send, 500, error_body(dead_engine_error(),
                                                      self.ctx.legacy_errors))
                return
            if out.finish_reason == "abort":
                return
            piece = self._piece(out)
            reasoning.append(piece.reasoning)
            content.append(piece.content)
            if self._hung():
                await watcher
                return
            if out.finish_reason is not None:
                break
        self.finished = out
        extra = self.reply_headers() if self.reply_headers is not None else []
        await send_json(send, 200, fmt.full("".join(reasoning), "".join(content), out),
                        self.headers + extra)

    # -- streaming -------------------------------------------------------------------------
    async def _stream(self, queue: asyncio.Queue[RequestOutput], watcher: asyncio.Task[None],
                      send: Send, fmt: Format) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": SSE_HEADERS + self.headers})
        head = fmt.start()
        if head:
            await _body(send, head)
        first = True
        while True:
            out = await self._next(queue, send)
            if self._fault() == "dead":
                await send({"type": "http.response.body",
                            "body": sse_error(dead_engine_error(), self.ctx.legacy_errors)})
                return
            if out.finish_reason == "abort":
                return
            piece = self._piece(out)
            if self._hung():
                if piece.reasoning or piece.content:
                    await _body(send, fmt.piece(piece, first))
                await self._hang(watcher, send)
                return
            data = fmt.piece(piece, first)
            if data:
                first = False
                await _body(send, data)
            if out.finish_reason is not None:
                break
        self.finished = out
        await send({"type": "http.response.body", "body": fmt.end(out)})


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


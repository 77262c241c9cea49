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
from loadtest.sim.parse import ChoicePlan, GenRequest
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
    index: int = 0  # the choice it belongs to (`n > 1`)
    offset: int = 0  # characters of the choice's content sent before this piece's


class _Choice:
    """One of the request's n sequences: its engine request and what was sent of it."""

    __slots__ = ("chars_sent", "content", "content_chars", "engine_id", "first", "index", "last",
                 "plan", "reasoning", "sent_tokens")

    def __init__(self, index: int, plan: ChoicePlan, engine_id: str) -> None:
        self.index, self.plan, self.engine_id = index, plan, engine_id
        self.sent_tokens = 0
        self.chars_sent = 0
        self.content_chars = 0  # of the answer (or tool arguments), not the thinking
        self.first = True  # nothing of it streamed yet
        self.last: RequestOutput | None = None  # its last output once finished
        self.reasoning: list[str] = []
        self.content: list[str] = []


class Format(Protocol):
    """Bytes for one API's answer; `Generation` calls it in order."""

    def start(self) -> bytes: ...  # first bytes of a stream (may be empty)

    def piece(self, piece: Piece, first: bool) -> bytes: ...  # a stream's bytes for one output

    def end(self, last: RequestOutput) -> bytes: ...  # a stream's last bytes

    # a whole answer's body (of choice ``index``, when the API has n choices)
    def full(self, reasoning: str, content: str, last: RequestOutput,
             index: int = 0) -> dict[str, Any]: ...


class Generation:
    """One request's life on the server side.

    ``n > 1`` is n engine requests submitted together, as vLLM fans a request out into n
    child sequences: the engine admits them in one step and caches the first one's full prompt
    blocks when it schedules them (vLLM V1), so the others hit them and the prompt is computed
    once; each then decodes its own text. A completions batch (a list of prompts) is that per
    prompt: choice ``i * n + j`` is prompt i's j-th.
    """

    def __init__(self, ctx: ServeContext, runner: EngineRunner, gen: GenRequest, engine_id: str,
                 headers: list[tuple[bytes, bytes]],
                 reply_headers: Callable[[], list[tuple[bytes, bytes]]] | None = None) -> None:
        self.ctx, self.runner, self.gen = ctx, runner, gen
        self.engine_id = engine_id
        self.headers = headers
        self.reply_headers = reply_headers  # extra headers of a non-streamed answer, at reply time
        self.created = int(time.time())
        self.choices = [_Choice(j, gen.plan(j), engine_id if j == 0 else f"{engine_id}.{j}")
                        for j in range(gen.n)]
        self._by_id = {c.engine_id: c for c in self.choices}
        self._per_prompt = len(self.choices) // max(1, len(gen.prompts))  # n
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished: RequestOutput | None = None  # the last output once the request finished

    def spec(self, index: int = 0) -> RequestSpec:
        gen, plan = self.gen, self.choices[index].plan
        prompt = gen.prompt_of(index)
        return RequestSpec(
            request_id=self.choices[index].engine_id,
            block_hashes=prompt.block_hashes(self.ctx.block_size, gen.salt),
            prompt_tokens=prompt.num_tokens, max_tokens=plan.max_tokens or gen.max_tokens,
            eos_after=plan.eos_after, priority=gen.priority,
        )

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        """Chat/completions usage, completion tokens summed over the choices as vLLM does;
        `cached_tokens` only with --enable-prompt-tokens-details
        (vllm/entrypoints/openai/chat_completion/serving.py)."""
        if len(self.choices) == 1:
            prompt, done, cached = (self.gen.prompt.num_tokens, out.num_output_tokens,
                                    out.cached_tokens)
        else:  # each prompt of a batch counted once; its lead sequence's cache hit
            leads = [c.last or out for c in self._leads()]
            prompt = sum(p.num_tokens for p in self.gen.prompts) or self.gen.prompt.num_tokens
            done = sum((c.last or out).num_output_tokens for c in self.choices)
            cached = sum(o.cached_tokens for o in leads)
        details = {"cached_tokens": cached} if self.ctx.prompt_tokens_details else None
        return {"prompt_tokens": prompt, "total_tokens": prompt + done,
                "completion_tokens": done, "prompt_tokens_details": details}

    async def serve(self, receive: Receive, send: Send, fmt: Format) -> None:
        for choice in self.choices:
            self.runner.submit(self.spec(choice.index), self._queue)
        watcher = asyncio.create_task(wait_disconnect(receive))
        watcher.add_done_callback(lambda _t: self._abort())
        try:
            if self.gen.stream:
                await self._stream(watcher, send, fmt)
            else:
                await self._full(watcher, send, fmt)
        finally:
            watcher.cancel()

    def _leads(self) -> list[_Choice]:
        """The first sequence of each prompt (choice i * n of a batch of prompts)."""
        return self.choices[:: self._per_prompt]

    def _abort(self) -> None:
        for choice in self.choices:
            self.runner.abort(choice.engine_id)

    async def _output(self, send: Send | None) -> tuple[_Choice, RequestOutput]:
        out = await self._next(self._queue, send)
        choice = self._by_id[out.request_id]
        if out.finish_reason is not None:
            choice.last = out
        return choice, out

    def _done(self) -> bool:
        return all(c.last is not None for c in self.choices)

    # -- text ------------------------------------------------------------------------------
    def _piece(self, choice: _Choice, out: RequestOutput) -> Piece:
        count = out.new_tokens
        hang = self.ctx.faults.hang_after_tokens
        if hang >= 0:  # never send past the hang point, even when outputs arrive batched
            count = min(count, max(0, hang - choice.sent_tokens))
        start, choice.sent_tokens = choice.sent_tokens, choice.sent_tokens + count
        tool = self.gen.tool
        if tool is not None:
            return self._content(choice, "", tool.arguments[4 * start: 4 * (start + count)], out)
        think = self.gen.reasoning_tokens
        split = min(max(think - start, 0), count)
        text = P.generated_text(choice.plan.seed, start, count)
        limit = choice.plan.visible_chars
        if limit is not None:
            text = text[: max(0, limit - choice.chars_sent)]
        choice.chars_sent += len(text)
        return self._content(choice, text[: 4 * split], text[4 * split:], out)

    @staticmethod
    def _content(choice: _Choice, reasoning: str, content: str, out: RequestOutput) -> Piece:
        piece = Piece(reasoning, content, out, choice.index, choice.content_chars)
        choice.content_chars += len(content)
        return piece

    def _hung(self, choice: _Choice) -> bool:
        return 0 <= self.ctx.faults.hang_after_tokens <= choice.sent_tokens

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
            self._abort()
            raise ConnectionDropped("simulated dropped connection")
        return "dead" if faults.dead else None

    # -- non-streaming ---------------------------------------------------------------------
    async def _full(self, watcher: asyncio.Task[None], send: Send, fmt: Format) -> None:
        while not self._done():
            choice, out = await self._output(None)
            if self._fault() == "dead":
                await send_json(send, 500, error_body(dead_engine_error(),
                                                      self.ctx.legacy_errors))
                return
            if out.finish_reason == "abort":
                return
            piece = self._piece(choice, out)
            choice.reasoning.append(piece.reasoning)
            choice.content.append(piece.content)
            if self._hung(choice):
                await watcher
                return
        self.finished = self.choices[0].last
        extra = self.reply_headers() if self.reply_headers is not None else []
        await send_json(send, 200, self._whole(fmt), self.headers + extra)

    def _whole(self, fmt: Format) -> dict[str, Any]:
        """The answer's body: one choice per sequence, in index order."""
        bodies = [fmt.full("".join(c.reasoning), "".join(c.content), c.last, c.index)
                  for c in self.choices if c.last is not None]
        body = bodies[0]
        if len(bodies) > 1:
            body["choices"] = [{**b["choices"][0], "index": j} for j, b in enumerate(bodies)]
        return body

    # -- streaming -------------------------------------------------------------------------
    async def _stream(self, watcher: asyncio.Task[None], send: Send, fmt: Format) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": SSE_HEADERS + self.headers})
        head = fmt.start()
        if head:
            await _body(send, head)
        while not self._done():
            choice, out = await self._output(send)
            if self._fault() == "dead":
                await send({"type": "http.response.body",
                            "body": sse_error(dead_engine_error(), self.ctx.legacy_errors)})
                return
            if out.finish_reason == "abort":
                return
            piece = self._piece(choice, out)
            if self._hung(choice):
                if piece.reasoning or piece.content:
                    await _body(send, fmt.piece(piece, choice.first))
                await self._hang(watcher, send)
                return
            data = fmt.piece(piece, choice.first)
            if data:
                choice.first = False
                await _body(send, data)
        self.finished = self.choices[0].last
        assert self.finished is not None
        await send({"type": "http.response.body", "body": fmt.end(self.finished)})


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


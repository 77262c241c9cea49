"""Chat and completions bodies and SSE chunks (vllm/entrypoints/openai/chat_completion/serving.py,
completion/serving.py): role chunk with the first output, `delta.reasoning`, `delta.tool_calls`."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from loadtest.sim import logprobs as L
from loadtest.sim import prompt as P
from loadtest.sim.generate import Generation, Piece
from loadtest.sim.spec import RequestOutput

__all__ = ["ChatFormat"]


class ChatFormat:
    """Chat (``chat=True``) or completions answers of one `Generation`."""

    def __init__(self, generation: Generation, response_id: str) -> None:
        self.g = generation
        self.chat = generation.gen.chat
        self.response_id = response_id
        # vLLM's default tool-call id: "chatcmpl-tool-" + a random hex id
        self.tool_call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"

    def _finish(self, out: RequestOutput) -> str | None:
        reason = out.finish_reason
        tool = self.g.gen.tool
        # "tool_calls" for tool_choice "required", "stop" for a named function (as OpenAI)
        if tool is not None and tool.required and reason == "stop":
            return "tool_calls"
        return reason

    def _tool_call(self, arguments: str) -> dict[str, Any]:
        tool = self.g.gen.tool
        assert tool is not None
        return {"id": self.tool_call_id, "type": "function",
                "function": {"name": tool.name, "arguments": arguments}}

    # -- streaming -------------------------------------------------------------------------
    def start(self) -> bytes:
        return b""  # vLLM sends the role chunk with the first output, not before

    def _echo(self, index: int) -> str:
        """The prompt text a completions choice starts with (``echo``), else ""."""
        return (self.g.gen.prompt_of(index).text or "") if self.g.gen.echo else ""

    def _logprobs(self, text: str, index: int, offset: int,
                  echo: str = "") -> dict[str, Any] | None:
        """``choice.logprobs`` for ``text`` (after ``echo``) when the request asked for them."""
        count = self.g.gen.logprobs
        if count is None:
            return None
        seed = self.g.choices[index].plan.seed
        if self.chat:
            return L.chat_logprobs(text, seed, offset, count)
        out = L.completion_logprobs(text, seed, offset, count, len(self._echo(index)))
        return L.joined(L.prompt_logprobs(echo, count), out) if echo else out

    def _chunk(self, delta: dict[str, Any] | None, text: str, finish: str | None,
               generated: int = 0, piece: Piece | None = None, echo: str = "") -> bytes:
        index = piece.index if piece is not None else 0
        logprobs = (self._logprobs(piece.content, index, piece.offset, echo)
                    if piece is not None and (piece.content or echo) else None)
        if self.chat:
            choice: dict[str, Any] = {"index": index, "delta": delta or {}, "logprobs": logprobs,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        if finish is not None:
            choice["stop_reason"] = None
        body: dict[str, Any] = {"id": self.response_id, "object": obj, "created": self.g.created,
                                "model": self.g.ctx.model, "choices": [choice]}
        if self.g.gen.continuous_usage:  # usage so far on every chunk (the role chunk: 0)
            prompt = self.g.gen.prompt.num_tokens
            body["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt + generated,
                             "completion_tokens": generated}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def piece(self, piece: Piece, first: bool) -> bytes:
        finish = self._finish(piece.out)
        generated = piece.out.num_output_tokens
        if not self.chat:
            echo = self._echo(piece.index) if first else ""  # vLLM: with the first output
            if not piece.content and not echo and finish is None:
                return b""
            return self._chunk(None, echo + piece.content, finish, generated, piece, echo)
        role = Piece("", "", piece.out, piece.index)  # the role chunk carries no logprobs
        head = self._chunk({"role": "assistant", "content": ""}, "", None, 0, role) if (
            first) else b""
        delta: dict[str, Any] = {}
        if self.g.gen.tool is not None and not self.g.gen.tool.content:
            if first:
                delta["tool_calls"] = [{"index": 0, **self._tool_call(piece.content)}]
            elif piece.content:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": piece.content}}]
        else:
            if piece.reasoning:
                delta["reasoning"] = piece.reasoning
            if piece.content:
                delta["content"] = piece.content
        if not delta and finish is None:
            return head
        return head + self._chunk(delta, "", finish, generated, piece)

    def end(self, last: RequestOutput) -> bytes:
        tail = b""
        if self.g.gen.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            body = {"id": self.response_id, "object": obj, "created": self.g.created,
                    "model": self.g.ctx.model, "choices": [], "usage": self.g.usage(last)}
            tail = b"data: " + orjson.dumps(body) + b"\n\n"
        return tail + b"data: [DONE]\n\n"

    # -- non-streaming ---------------------------------------------------------------------
    def full(self, reasoning: str, content: str, last: RequestOutput,
             index: int = 0) -> dict[str, Any]:
        finish = self._finish(last)
        echo = self._echo(index)
        logprobs = self._logprobs(content, index, 0, echo)
        if self.chat:
            tool = self.g.gen.tool if self.g.gen.tool and not self.g.gen.tool.content else None
            message = {"role": "assistant", "content": "" if tool else content, "refusal": None,
                       "tool_calls": [self._tool_call(content)] if tool else [],
                       "reasoning": reasoning or None}
            choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish,
                                      "stop_reason": None, "message": message}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": echo + content, "logprobs": logprobs,
                      "finish_reason": finish, "stop_reason": None}
            obj = "text_completion"
        body = {"id": self.response_id, "object": obj, "created": self.g.created,
                "model": self.g.ctx.model, "choices": [choice], "usage": self.g.usage(last),
                "prompt_logprobs": None, "kv_transfer_params": None}
        if self.g.gen.return_token_ids:
            # `return_token_ids` (vLLM extra): the prompt's ids come AFTER usage in a chat body
            # (ChatCompletionResponse.prompt_token_ids), inside the choice for completions
            prompt_ids = self.g.gen.prompt_of(index).ids
            choice["token_ids"] = P.token_ids(reasoning + content)
            if self.chat:
                body = {**body, "prompt_token_ids": prompt_ids}
            else:
                choice["prompt_token_ids"] = prompt_ids
        return body

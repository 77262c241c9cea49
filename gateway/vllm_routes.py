"""vLLM's client endpoints beside the OpenAI ones: which kvgate proxies, and what differs.

They go through the same steps as chat (key, tenant, model aliasing and its 404, limits,
flow control, plan, pick, retries before any byte, in-flight accounting, the request log);
what differs per route is here, read by the planner and the preparer:

- `/v1/messages` (Anthropic's Messages API) and `/v1/messages/count_tokens` are routed with
  prefix affinity like chat: ``system`` then ``messages`` are the prompt (`chat_view`).
- The tokenizer routes, the pooling ones (pooling models have no prefix cache worth pinning)
  and count_tokens go to the least loaded replica of the pool (no block hashes: the router's
  load rule alone).
- `cache_salt`: the tenant's is set only where vLLM's request model has the field
  (`SALTED`: messages and the pooling requests -- classify, score, rerank, pooling); a
  client's is never forwarded anywhere (`rewrite_body` strips or refuses it first).
- A tier's `priority` goes only to the routes that schedule generation (`PRIORITIZED`).
"""

from __future__ import annotations

from typing import Any

from gateway.body import ParsedBody, prompt_chars
from routing.tokens import count_tokens

__all__ = ["GENERATE_KINDS", "PRIORITIZED", "SALTED", "VLLM_KINDS", "adapt", "chat_view"]

# route -> kind (the proxy's `KINDS` adds them to the OpenAI routes)
VLLM_KINDS: dict[str, str] = {
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/pooling": "pooling",
    "/classify": "classify",
    "/score": "score",
    "/v1/score": "score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
}
# the kinds whose body takes the tenant's `cache_salt` (vLLM 0.34's request models with the
# field: its generation requests and the pooling ones; the tokenizer routes and count_tokens
# compute no KV cache and have no such field)
SALTED = frozenset({"chat", "completions", "responses", "embeddings", "messages", "pooling",
                    "classify", "score", "rerank"})
# the kinds a tier's `priority` is sent with (the scheduler orders generation by it)
PRIORITIZED = frozenset({"chat", "completions", "responses", "embeddings", "messages"})
# the new kinds that generate output (the rest cost their prompt alone)
GENERATE_KINDS = frozenset({"messages"})
_ANTHROPIC = frozenset({"messages", "count_tokens"})


def chat_view(data: dict[str, Any], kind: str = "messages") -> dict[str, Any]:
    """An Anthropic Messages body as the chat body the routing features read: its
    ``system`` (a string or text blocks) as the first message, then its ``messages`` and
    ``tools``, so two requests sharing a system prompt and turns share block hashes."""
    messages = data.get("messages")
    turns: list[Any] = ([_unmarked_turn(m) for m in messages] if isinstance(messages, list)
                        else [])
    system = data.get("system")
    if system:
        turns.insert(0, {"role": "system", "content": _unmarked_content(system)})
    view: dict[str, Any] = {"messages": turns}
    # count_tokens answers whole whatever its body's "stream" says: not read as a stream
    for key in ("tools", "max_tokens", "stream") if kind == "messages" else ("tools",):
        if key in data:
            view[key] = _unmarked_content(data[key]) if key == "tools" else data[key]
    return view


def _unmarked(block: Any, nested: bool = True) -> Any:
    """A content block without Anthropic's ``cache_control`` mark (and a tool_result's own
    blocks without theirs). vLLM ignores the mark, and clients move it to the newest turn
    each time: left in, an earlier block that lost its mark hashed anew (tool_result, image
    and document blocks are hashed as JSON) and the conversation lost its replica from
    there. Only the view is changed: the body sent on keeps its marks."""
    if not isinstance(block, dict) or ("cache_control" not in block and not nested):
        return block
    out = {key: value for key, value in block.items() if key != "cache_control"}
    inner = out.get("content")
    if nested and isinstance(inner, list):  # a tool_result's blocks (none nest deeper)
        out["content"] = [_unmarked(item, nested=False) for item in inner]
    return out


def _unmarked_content(content: Any) -> Any:
    return [_unmarked(block) for block in content] if isinstance(content, list) else content


def _unmarked_turn(turn: Any) -> Any:
    if isinstance(turn, dict) and isinstance(turn.get("content"), list):
        return {**turn, "content": _unmarked_content(turn["content"])}
    return turn


def adapt(parsed: ParsedBody, kind: str) -> None:
    """A parsed body of one of `VLLM_KINDS`' routes made what the rest of the path reads:
    its prompt estimate (what TPM and flow control charge), whether it generates output,
    and ``stream`` only where the route streams (a ``"stream": true`` on a rerank is not an
    SSE answer to wait for)."""
    if kind not in _KNOWN:
        return
    parsed.prompt_tokens = count_tokens(_prompt_chars(parsed.data, kind))
    parsed.generates = kind in GENERATE_KINDS
    if kind != "messages":
        parsed.stream = False


_KNOWN = frozenset(VLLM_KINDS.values())
# the fields each route's prompt is in (their text is what a replica reads)
_TEXT_FIELDS = {
    "tokenize": ("prompt", "messages"),
    "detokenize": ("tokens",),
    "pooling": ("input", "messages"),
    "classify": ("input", "messages"),
    "score": ("text_1", "text_2", "queries", "documents", "data_1", "data_2"),
    "rerank": ("query", "documents"),
}


def _prompt_chars(data: dict[str, Any], kind: str) -> int:
    if kind in _ANTHROPIC:
        return prompt_chars(chat_view(data, kind), "chat")
    return sum(prompt_chars({"prompt": data.get(field)}, "completions")
               for field in _TEXT_FIELDS.get(kind, ()) if field in data)


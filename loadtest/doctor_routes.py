"""Requests on vLLM's routes beside chat, for `kvgate doctor`'s healthy-fleet scenarios: none of
them streams a first token the way a chat completion does (a rerank, a tokenization, a token
count answer at once, whole; an audio upload is a form), so a doctor that read them as chat
would find TTFTs, silent replicas or errors where there are none.

`route_request(n, model, tag)` gives request number ``n``'s (path, JSON body or None, form or
None), cycling through the Anthropic messages route (whole and streamed) and its count_tokens
(sent with ``"stream": true`` too, as some clients do), rerank, score, tokenize, detokenize,
embeddings' pooling sibling and an audio transcription upload.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROUTES", "route_request"]

ROUTES = ("messages", "messages-stream", "count_tokens", "rerank", "score", "tokenize",
          "detokenize", "audio", "pooling")
AUDIO = b"RIFF" + b"\x00" * 60  # a form upload's bytes: the simulator reads no audio


def route_request(n: int, model: str, tag: str
                  ) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(path, JSON body, multipart form fields) of request ``n``; one of body and form."""
    route = ROUTES[n % len(ROUTES)]
    text = f"{tag} request {n}: what is {n} plus {n * 7}?"
    chat = [{"role": "user", "content": text}]
    if route in ("messages", "messages-stream"):
        return "/v1/messages", {"model": model, "max_tokens": 8, "messages": chat,
                                "stream": route == "messages-stream"}, None
    if route == "count_tokens":
        return "/v1/messages/count_tokens", {"model": model, "messages": chat,
                                             "stream": n % 2 == 0}, None
    if route == "rerank":
        return "/v1/rerank", {"model": model, "query": text,
                              "documents": [f"doc {i} {tag}" for i in range(4)]}, None
    if route == "score":
        return "/v1/score", {"model": model, "text_1": text, "text_2": f"answer {n}"}, None
    if route == "tokenize":
        return "/tokenize", {"model": model, "prompt": text}, None
    if route == "detokenize":
        return "/detokenize", {"model": model, "tokens": [1, 2, 3, n % 100]}, None
    if route == "pooling":
        return "/pooling", {"model": model, "input": text}, None
    return "/v1/audio/transcriptions", None, {"model": model, "file": AUDIO}

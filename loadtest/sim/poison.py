"""Per-request faults for tests of client-triggered failures (not vLLM's API): a request whose
``user`` names one fails on every replica alike, while the replica serves every other
request well -- as vLLM 0.34 answers 500 for one request's content (an image URL it cannot
fetch, a chat template that raises) while its engine is fine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from loadtest.sim.asgi import Send, send_json
from loadtest.sim.errors import SimError, error_body
from loadtest.sim.generate import SSE_HEADERS

__all__ = ["POISON_500", "POISON_MIDSTREAM", "POISON_WHOLE", "poisoned"]

POISON_500 = "kvgate-sim-poison-500"  # vLLM's 500 InternalServerError for this request only
POISON_WHOLE = "kvgate-sim-poison-whole"  # a whole JSON answer to this request's stream
# a stream that fails after its first token with a 500 error event (vLLM's GenerationError)
POISON_MIDSTREAM = "kvgate-sim-poison-midstream"


async def poisoned(body: dict[str, Any], send: Send, counters: dict[str, int]) -> bool:
    """Raise the 500 or send the whole answer a poisoned request gets (counted in
    ``counters["poisoned"]``, shown by `/sim/stats`); False for any other request."""
    user = body.get("user")
    if user not in (POISON_500, POISON_WHOLE, POISON_MIDSTREAM):
        return False
    counters["poisoned"] = counters.get("poisoned", 0) + 1
    if user == POISON_500:
        raise SimError(500, "Simulated failure of this request: its image URL could not be "
                       "fetched.", "InternalServerError")
    if body.get("stream") is not True:
        return False
    if user == POISON_MIDSTREAM:
        await _fail_midstream(body, send)
        return True
    await send_json(send, 200, {
        "id": "chatcmpl-poisoned", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model"), "choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "a whole answer"}}]})
    return True


async def _fail_midstream(body: dict[str, Any], send: Send) -> None:
    """One chat chunk of output, then vLLM's error event of code 500 and ``[DONE]``."""
    chunk = {"id": "chatcmpl-poisoned", "object": "chat.completion.chunk",
             "created": int(time.time()), "model": body.get("model"), "choices": [{
                 "index": 0, "delta": {"role": "assistant", "content": "a"},
                 "finish_reason": None}]}
    error = error_body(SimError(500, "Simulated failure of this request mid-stream.",
                                "InternalServerError"), legacy=False)
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    first = orjson.dumps(chunk)
    for event in (first, orjson.dumps(error), b"[DONE]"):
        if event is not first:  # the output goes out alone first, as a generation's does
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"data: " + event + b"\n\n",
                    "more_body": event != b"[DONE]"})

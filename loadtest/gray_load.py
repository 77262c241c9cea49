"""The load of `loadtest.gray_failures`: conversations with shared prefixes, through kvgate,
with the official openai client (async), streamed and not, each request recorded.

Every conversation opens with one of four system prompts (the shared prefixes) and grows
turn by turn; even conversations stream, odd ones do not. The client never retries
(``max_retries=0``): what a request records is what kvgate answered, not what an SDK hid.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import openai

__all__ = ["Record", "run_conversations"]

_SYSTEMS = [f"You are assistant {k}. " + f"Rules of team {k}: be brief and exact. " * 24
            for k in range(4)]


@dataclass(slots=True)
class Record:
    """One request: when it started (s since the load began), how it ended."""

    start: float
    stream: bool
    status: int  # 200, the HTTP status of an error, 0 for a transport error or timeout
    error: str = ""  # the exception's class name ("" when it succeeded)
    ttft: float | None = None  # first content (stream) or the whole answer (not streamed)
    total: float | None = None
    replica: str = ""  # x-kvgate-replica (pool/id), "" when none came back


@dataclass
class Load:
    base_url: str
    model: str
    conversations: int
    think_s: float = 0.05
    max_tokens: int = 24
    timeout_s: float = 30.0
    records: list[Record] = field(default_factory=list)


def _messages(conv: int, turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": _SYSTEMS[conv % len(_SYSTEMS)]}]
    for t in range(turn):
        msgs.append({"role": "user", "content": f"conversation {conv} question {t}: why?"})
        msgs.append({"role": "assistant", "content": f"because of reason {t} of {conv}."})
    msgs.append({"role": "user", "content": f"conversation {conv} question {turn}: and then?"})
    return msgs


async def _one(client: openai.AsyncOpenAI, load: Load, conv: int, turn: int, t0: float) -> None:
    stream = conv % 2 == 0
    start = time.monotonic()
    rec = Record(start - t0, stream, 0)
    create = client.chat.completions.with_raw_response.create
    try:
        raw = await create(model=load.model, messages=_messages(conv, turn),  # type: ignore[arg-type]
                           max_tokens=load.max_tokens, stream=stream)
        rec.replica = raw.headers.get("x-kvgate-replica", "")
        answer = raw.parse()
        if isinstance(answer, openai.AsyncStream):
            async for chunk in answer:
                if rec.ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    rec.ttft = time.monotonic() - start
        else:
            rec.ttft = time.monotonic() - start
        rec.status, rec.total = 200, time.monotonic() - start
    except openai.APIStatusError as exc:
        rec.status, rec.error = exc.status_code, type(exc).__name__
        rec.replica = rec.replica or exc.response.headers.get("x-kvgate-replica", "")
    except openai.APIError as exc:  # connection error, timeout, an error event mid-stream
        rec.status, rec.error = getattr(exc, "status_code", None) or 0, type(exc).__name__
        if rec.status == 0 and rec.ttft is not None:
            rec.error += "(mid-stream)"
    load.records.append(rec)


async def run_conversations(load: Load, duration_s: float, t0: float) -> None:
    """Run the conversations until `duration_s` after `t0` (a request under way finishes)."""
    client = openai.AsyncOpenAI(base_url=f"{load.base_url}/v1", api_key="none",
                                max_retries=0, timeout=load.timeout_s)

    async def conversation(conv: int) -> None:
        turn = 0
        while time.monotonic() - t0 < duration_s:
            await _one(client, load, conv, turn % 12, t0)
            turn += 1
            await asyncio.sleep(load.think_s)

    try:
        await asyncio.gather(*(conversation(c) for c in range(load.conversations)))
    finally:
        await client.close()

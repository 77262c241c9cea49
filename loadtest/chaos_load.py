"""The steady load of `loadtest.chaos`: clients of the official openai SDK (async), each request
recorded with how it ended.

A client loops: it picks a gateway and a tenant's key, then one of chat or completions,
streamed or not, a turn of its conversation (which grows), or a stream it leaves after two
chunks. Every request is bounded by `Load.timeout_s` plus a margin: a request still running
then is a hang. A stream that ends without a `finish_reason` is a truncated success.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import openai

__all__ = ["Load", "Record", "Tenant"]

_SYSTEM = [f"You are helper {k}. " + f"Team {k} rules: be short. " * 20 for k in range(4)]


@dataclass
class Tenant:
    id: str
    tier: str
    key: str
    key_id: str
    revoked: bool = False
    revoked_at: float = 0.0  # time.monotonic() when the revocation was answered 204


@dataclass(slots=True)
class Record:
    start: float  # seconds since `Load.t0`
    kind: str  # chat|completions, -stream, -cancel
    outcome: str  # ok, cancelled, truncated, hang, an exception class name
    status: int = 0
    tenant: str = ""
    message: str = ""  # an error's message (the secrets check reads it)


@dataclass
class Load:
    bases: list[str]
    tenants: list[Tenant]
    rng: random.Random
    clients: int = 12
    think_s: float = 0.25
    timeout_s: float = 30.0
    limit: int = 0  # > 0: stop once this many requests were recorded
    records: list[Record] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    t0: float = field(default_factory=time.monotonic)

    async def run(self) -> None:
        sdks = {(b, t.key): openai.AsyncOpenAI(base_url=f"{b}/v1", api_key=t.key, max_retries=0,
                                                timeout=self.timeout_s)
                for b in self.bases for t in self.tenants}
        try:
            await asyncio.gather(*(self._client(i, sdks) for i in range(self.clients)))
        finally:
            for sdk in sdks.values():
                await sdk.close()

    async def _client(self, i: int, sdks: dict[tuple[str, str], openai.AsyncOpenAI]) -> None:
        rng = random.Random(self.rng.random())
        turns: list[dict[str, str]] = [{"role": "system", "content": _SYSTEM[i % 4]}]
        while not self.stop.is_set():
            tenant = self.tenants[rng.randrange(len(self.tenants))]
            sdk = sdks[(self.bases[rng.randrange(len(self.bases))], tenant.key)]
            kind = rng.choice(["chat", "chat", "chat-stream", "chat-stream", "chat-cancel",
                               "completions", "completions-stream"])
            if len(turns) > 9:
                turns = turns[:1]
            turns.append({"role": "user", "content": f"client {i} asks {rng.random():.6f}?"})
            rec = Record(time.monotonic() - self.t0, kind, "hang", tenant=tenant.id)
            try:
                await asyncio.wait_for(self._one(sdk, kind, turns, rec), self.timeout_s + 15)
            except TimeoutError:
                rec.outcome = "hang"
            self.records.append(rec)
            if self.limit and len(self.records) >= self.limit:
                self.stop.set()
            turns.append({"role": "assistant", "content": f"answer {len(turns)}"})
            await asyncio.sleep(rng.uniform(0, 2 * self.think_s))

    async def _one(self, sdk: openai.AsyncOpenAI, kind: str, turns: list[dict[str, str]],
                   rec: Record) -> None:
        stream = kind.endswith("stream") or kind.endswith("cancel")
        try:
            if kind.startswith("chat"):
                answer: Any = await sdk.chat.completions.create(
                    model="chaos", messages=turns, max_tokens=24, stream=stream)  # type: ignore[arg-type]
            else:
                prompt = " ".join(t["content"] for t in turns)
                answer = await sdk.completions.create(model="chaos", prompt=prompt,
                                                      max_tokens=24, stream=stream)
            rec.outcome = await _read(answer, cancel=kind.endswith("cancel")) if stream else "ok"
            rec.status = 200
        except openai.APIStatusError as exc:
            rec.outcome, rec.status = type(exc).__name__, exc.status_code
            rec.message = str(exc)
        except openai.APIError as exc:  # connection refused or reset, timeout, error event
            cause = exc.__cause__
            rec.outcome = type(exc).__name__
            rec.message = f"{exc} ({type(cause).__name__}: {cause})" if cause else str(exc)
        except Exception as exc:
            rec.outcome, rec.message = f"other:{type(exc).__name__}", str(exc)[:300]

    def summary(self) -> Counter[str]:
        return Counter(r.outcome if not r.status or r.status == 200 else
                       f"{r.outcome}({r.status})" for r in self.records)


async def _read(stream: Any, *, cancel: bool) -> str:
    """Read a stream to its end (or leave it after two chunks); 'truncated' when it ended
    with no choice's finish_reason."""
    finished, chunks = False, 0
    try:
        async for chunk in stream:
            chunks += 1
            for choice in chunk.choices:
                finished = finished or choice.finish_reason is not None
            if cancel and chunks >= 2:
                return "cancelled"
    finally:
        await stream.close()
    return "ok" if finished else "truncated"

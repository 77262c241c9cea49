"""Closed-loop chat load for `kvgate doctor`'s tests and benchmark (aiohttp; streamed when the
load says so, each stream read to its end).

`run_load(base, loads, duration_s)` runs every `Load` at once for ``duration_s`` seconds:
``concurrency`` workers, each sending its next request as soon as the previous one answered.
Prompts are built by kind, so each scenario's traffic says what it is:

- ``short``: a distinct ~40-token question per request;
- ``long-unique``: ``prompt_tokens`` tokens of text unique to each request (nothing to reuse);
- ``pairs``: every prefix of ``prompt_tokens`` tokens is sent twice in a row, then never
  again (perfect prefix routing reuses half the prompt tokens; alternating replicas none);
- ``rag``: a shared 2 KB system prompt, 4-16 KB of retrieved context unique to each request
  and a short query (the seed's cache-return question);
- ``routes``: the routes beside chat, in turn (`doctor_routes`: Anthropic messages and
  count_tokens, rerank, score, tokenize, detokenize, pooling, an audio upload).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.doctor_routes import route_request

__all__ = ["Load", "LoadResult", "prompt", "run_load"]

WORDS = ("alpha", "bravo", "delta", "gamma", "omega", "sigma", "kappa", "theta", "lambda",
         "zeta", "rho", "tau", "phi", "psi", "chi", "beta")
SYSTEM_2KB = ("You are a careful assistant for the support team. Answer from the context only, "
              "cite the document id, and say when the context does not hold the answer. ") * 14


def _text(seed: str, tokens: int) -> str:
    """About ``tokens`` tokens (4 characters each) of text determined by ``seed``."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(WORDS) + str(rng.randrange(1000))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def prompt(kind: str, n: int, prompt_tokens: int, tag: str = "") -> list[dict[str, str]]:
    """The messages of request number ``n`` of a load of this kind."""
    if kind == "short":
        return [{"role": "user", "content": f"{tag} question {n}: what is {n} plus {n * 7}?"}]
    if kind == "long-unique":
        return [{"role": "user", "content": _text(f"{tag}-{n}-{time.time_ns()}", prompt_tokens)}]
    if kind == "pairs":  # request n is one pair's prefix; the worker sends it twice
        body = _text(f"{tag}-pair-{n}", prompt_tokens)
        return [{"role": "system", "content": body},
                {"role": "user", "content": "summarise"}]
    if kind == "rag":
        context_tokens = random.Random(n).randint(1000, 4000)  # 4-16 KB
        context = _text(f"{tag}-doc-{n}-{time.time_ns()}", context_tokens)
        return [{"role": "system", "content": SYSTEM_2KB},
                {"role": "user", "content": f"context:\n{context}\n\nquestion: what is {n}?"}]
    raise ValueError(f"unknown prompt kind {kind!r}")


@dataclass
class Load:
    model: str
    concurrency: int = 1
    kind: str = "short"
    prompt_tokens: int = 0
    max_tokens: int = 16
    api_key: str | None = None
    stream: bool = False


@dataclass
class LoadResult:
    ok: int = 0
    failed: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


async def _worker(session: aiohttp.ClientSession, base: str, load: Load,
                  counter: itertools.count[int],
                  deadline: float, result: LoadResult, tag: str) -> None:
    headers = {"authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    repeat = 2 if load.kind == "pairs" else 1
    while time.monotonic() < deadline:
        n = next(counter)
        if load.kind == "routes":
            await _send(session, base, None, headers, result, route_request(n, load.model, tag))
            continue
        body = {"model": load.model, "max_tokens": load.max_tokens, "ignore_eos": True,
                "messages": prompt(load.kind, n, load.prompt_tokens, tag),
                **({"stream": True} if load.stream else {})}
        for _ in range(repeat):
            await _send(session, base, body, headers, result)


async def _send(session: aiohttp.ClientSession, base: str, body: dict[str, object] | None,
                headers: dict[str, str], result: LoadResult,
                routed: tuple[str, dict[str, Any] | None, dict[str, Any] | None] | None = None
                ) -> None:
    path, data = "/v1/chat/completions", None
    if routed is not None:  # another route: its JSON body, or a multipart form
        path, body, fields = routed
        if fields is not None:
            data = aiohttp.FormData()
            for name, value in fields.items():
                data.add_field(name, value, **({"filename": "a.wav"} if isinstance(
                    value, bytes) else {}))
    try:
        async with session.post(f"{base}{path}", json=body if data is None else None,
                                data=data, headers=headers) as resp:
            await resp.read()
            result.statuses[resp.status] = result.statuses.get(resp.status, 0) + 1
            if resp.status == 200:
                result.ok += 1
            else:
                result.failed += 1
                await asyncio.sleep(0.05)
    except (aiohttp.ClientError, TimeoutError):
        result.failed += 1
        await asyncio.sleep(0.05)


async def run_load(base: str, loads: list[Load], duration_s: float,
                   tag: str = "") -> list[LoadResult]:
    """Run every load at once for ``duration_s``; one result per load."""
    deadline = time.monotonic() + duration_s
    results = [LoadResult() for _ in loads]
    timeout = aiohttp.ClientTimeout(total=duration_s + 60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = []
        for i, (load, result) in enumerate(zip(loads, results, strict=True)):
            counter = itertools.count()  # request numbers, shared by the load's workers
            for _ in range(load.concurrency):
                tasks.append(asyncio.create_task(_worker(
                    session, base, load, counter, deadline, result, f"{tag}{i}")))
        await asyncio.gather(*tasks)
    return results

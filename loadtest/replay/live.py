"""Live replay: send a workload to a running kvgate over HTTP at (time-scaled) arrival times.

Times are measured on the wall clock and reported in workload seconds (wall x time_scale), so
a fleet of simulators running `--time-scale X` gives figures comparable to offline replay.
Hit rate and preemptions come from the replicas' own `/metrics` counters (before/after).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from loadtest.replay.report import ReplayError
from loadtest.replay.summary import Outcome
from loadtest.replay.text import render_prompt
from loadtest.replay.workload import ReplayRequest

__all__ = ["LiveTarget", "ReplicaCounters", "read_counters", "replay_live"]


@dataclass(frozen=True, slots=True)
class LiveTarget:
    base_url: str  # the gateway, e.g. http://127.0.0.1:8000
    model: str
    time_scale: float = 1.0
    api_key: str | None = None
    max_concurrency: int = 512


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    queries: float = 0.0
    hits: float = 0.0
    preemptions: float = 0.0

    def __sub__(self, other: ReplicaCounters) -> ReplicaCounters:
        return ReplicaCounters(
            self.queries - other.queries,
            self.hits - other.hits,
            self.preemptions - other.preemptions,
        )


_COUNTER_NAMES = {
    "vllm:prefix_cache_queries": "queries",
    "vllm:gpu_prefix_cache_queries": "queries",
    "vllm:prefix_cache_hits": "hits",
    "vllm:gpu_prefix_cache_hits": "hits",
    "vllm:num_preemptions": "preemptions",
}


async def read_counters(
    session: aiohttp.ClientSession, replica_urls: Sequence[str]
) -> ReplicaCounters:
    """Prefix-cache queries/hits and preemptions summed over replicas (and engines)."""
    totals = {"queries": 0.0, "hits": 0.0, "preemptions": 0.0}
    for url in replica_urls:
        try:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ReplayError(f"replica {url}: GET /metrics answered {resp.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplayError(f"replica {url} is unreachable ({_reason(exc)})") from None
        for family in text_string_to_metric_families(text):
            field = _COUNTER_NAMES.get(family.name)
            if field is None:
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    totals[field] += sample.value
    return ReplicaCounters(**totals)


async def _one(
    session: aiohttp.ClientSession,
    target: LiveTarget,
    req: ReplayRequest,
    seq: int,
    t0: float,
    sem: asyncio.Semaphore,
    done: Callable[[], None],
) -> Outcome:
    delay = req.arrival_s / target.time_scale - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    body = {
        "model": target.model,
        "prompt": render_prompt(req.block_ids, req.block_tokens, req.prompt_tokens),
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    scale = target.time_scale
    async with sem:
        start = time.perf_counter()
        first: float | None = None
        replica = "?"
        ok = False
        error = ""
        try:
            async with session.post(
                f"{target.base_url}/v1/completions", json=body, headers=headers
            ) as resp:
                replica = resp.headers.get("x-kvgate-replica", "?")
                if resp.status != 200:
                    error = f"HTTP {resp.status}: {_message(await resp.read())}"
                else:
                    async for chunk in resp.content.iter_any():
                        if first is None and b'"text"' in chunk:
                            first = time.perf_counter()
                        if b'data: {"error"' in chunk and not error:
                            error = f"stream error: {_message(chunk.partition(b'data: ')[2])}"
                    ok = not error
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = _reason(exc)
        end = time.perf_counter()
        done()
    base = start - t0
    return Outcome(
        replica=replica,
        start_s=base * scale,
        first_token_s=None if first is None else (first - t0) * scale,
        end_s=(end - t0) * scale,
        ok=ok,
        seq=seq,
        error=error,
    )


def _message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else its start (one short line)."""
    try:
        err = orjson.loads(body.split(b"\n\n")[0]).get("error")
        text = str(err.get("message") if isinstance(err, dict) else err)
    except (orjson.JSONDecodeError, AttributeError):
        text = body[:80].decode("utf-8", "replace")
    return " ".join(text.split())[:120]


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:160] if str(exc) else type(exc).__name__


async def replay_live(
    requests: Sequence[ReplayRequest], target: LiveTarget, replica_urls: Sequence[str],
    done: Callable[[], None] = lambda: None,
) -> tuple[list[Outcome], ReplicaCounters]:
    """Replay `requests`; return their outcomes and the replicas' counter deltas. `done` is
    called as each request finishes (progress). `ReplayError` when a replica's counters
    cannot be read."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=target.max_concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        before = await read_counters(session, replica_urls)
        sem = asyncio.Semaphore(target.max_concurrency)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(
            *(_one(session, target, r, i, t0, sem, done) for i, r in enumerate(requests))
        )
        after = await read_counters(session, replica_urls)
    return list(outcomes), after - before

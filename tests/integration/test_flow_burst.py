"""A burst far over capacity in front of flow control: the bound holds for requests that
arrive together, and a shed request's Retry-After follows how fast the queue really drains.

Two simulated replicas whose streams hang after two tokens (nothing ever frees), flow control
with ``max_inflight: 1``: two requests run, the rest wait. The HTTP edge yields one loop turn
between flow control letting a request through and the request taking its replica (the
disconnect watch's turn, `gateway/proxy.py`): requests let through in that turn all saw the
pool with room, so a burst of 24 concurrent streams put every one of them on the replicas
(24 in flight against a bound of 2, nothing queued).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import openai

from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

BURST = 24


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


async def _burst(base: str, n: int) -> tuple[float, float]:
    """``n`` concurrent streams at once; (in flight, queued) once they have all arrived."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)

    async def one(i: int) -> Any:
        return await client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=50, stream=True)

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    try:
        for _ in range(600):  # the queued ones get no answer's head: until the numbers settle
            await asyncio.sleep(0.05)
            running, queued = await asyncio.gather(asyncio.to_thread(inflight, base),
                                                   asyncio.to_thread(_depth, base))
            if running + queued == n:
                return running, queued
        raise AssertionError("the burst did not arrive")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()


def test_a_burst_of_concurrent_streams_respects_the_saturation_bound(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    sims = [sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")[1]
            for _ in range(2)]
    config = {"pools": {"p": {"served_model": "m", "replicas": sims}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 1, "max_queue": 100}}
    gw, base = gateway_proc(config=config)
    with gw:
        running, queued = asyncio.run(_burst(base, BURST))
        assert (running, queued) == (2, BURST - 2), json.dumps(
            metric_values(base, "kvgate_inflight_requests"))
        wait_for(lambda: _depth(base) == 0 and inflight(base) == 0, 10,
                 "the clients' leaving to empty the queue and the replicas")




async def _shed_waits(base: str, n: int) -> tuple[list[int], float]:
    """``n`` concurrent chat requests at once: the Retry-After of each one shed, and
    the seconds until every request had its answer."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    waits: list[int] = []

    async def one(i: int) -> None:
        try:
            await client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=30)
        except openai.APIStatusError as exc:  # (the top band's full queue: 503)
            assert exc.status_code in (429, 503) and exc.code == "queue_shed", exc.body
            waits.append(int(exc.response.headers["retry-after"]))

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.gather(*(one(i) for i in range(n)))
    took = loop.time() - t0
    await client.close()
    return waits, took


def test_a_shed_burst_is_told_to_come_back_about_when_the_queue_drains(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    """A fresh gateway, a burst of 300 with room for 8 and 100 queued: the Retry-After of the
    shed requests was the 60 s maximum for nearly all (the dispatch rate, averaged from 0 over
    10 s, read a tenth of the pace in the burst's first second) while the whole burst was
    answered within a few seconds (3.3 s here). Now it is within a few times the burst's own
    length (12 s: the pace of its first second, what filled the pool, taken over a second)."""
    sims = [sim_factory("--max-num-seqs", "4", model="m")[1] for _ in range(2)]
    config = {"pools": {"p": {"served_model": "m", "replicas": sims}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 4, "max_queue": 100}}
    gw, base = gateway_proc(config=config)
    with gw:
        waits, took = asyncio.run(_shed_waits(base, 300))
        assert len(waits) >= 100, len(waits)  # (most were refused: the queue was full)
        assert max(waits) <= 5 * took + 1, (sorted(waits), took)
        wait_for(lambda: _depth(base) == 0 and inflight(base) == 0, 10, "the pool to drain")


async def _outcomes(base: str, n: int) -> list[int]:
    """``n`` concurrent streams at once: each one's status (200: streamed to its end)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)

    async def one(i: int) -> int:
        try:
            stream = await client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": f"hello {i}"}],
                max_tokens=20, stream=True)
            async for _ in stream:
                pass
        except openai.APIStatusError as exc:
            assert exc.response.headers.get("retry-after"), exc.response.headers
            return exc.status_code
        return 200

    statuses = list(await asyncio.gather(*(one(i) for i in range(n))))
    await client.close()
    return statuses


def test_a_replica_answering_busy_keeps_the_queue_waiting(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    """The replica takes one request at a time (vLLM's ``--max-num-queued-reqs``-style 503
    "engine is currently busy" beyond it), flow control's bound is two: the second request
    gets the busy 503 and the replica backs off (no new picks for a while). It was then
    unhealthy to the saturation rule, so the pool had no healthy replica, was not saturated,
    and the pump let every queued request through at once to be answered 503: 1 of 12
    served. A replica backing off after a busy answer is full, not gone: the queue waits for
    it (6 of 12 served: the bound lets one more through than the replica takes)."""
    sim = sim_factory("--time-scale", "5", "--max-num-queued-reqs", "1", model="m")[1]
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 2, "max_queue": 100}}
    gw, base = gateway_proc(config=config)
    with gw:
        statuses = asyncio.run(_outcomes(base, 12))
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 4, statuses
        wait_for(lambda: _depth(base) == 0 and inflight(base) == 0, 10, "the pool to drain")

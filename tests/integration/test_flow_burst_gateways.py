"""A burst split over two gateways sharing state (one Redis), flow control on: the fleet-wide
bound holds for requests that arrive at both at once.

Two simulated replicas whose streams hang after two tokens (nothing frees), ``max_inflight:
2`` per replica, fleet-wide: 4 requests may run, the rest wait. Each gateway admitted against
the fleet's load as its peer's records had told it, which said nothing yet of the peer's
share of the same burst: each let 2 per replica through, and the replicas held 4 each, twice
the bound. Now a gateway counts what its peer may have sent unseen within its records' lag
(as many as it sent itself, `routing.flow.unseen`), for as long as ``flow.peer_lag_ms``: the
replicas hold 2 each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

BURST = 40
LIMIT = 2  # flow.max_inflight, per replica


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def _received(sims: list[str]) -> list[int]:
    return [int(httpx.get(f"{s}/sim/stats", timeout=5).json()["received"]) for s in sims]


def _peers(base: str) -> int:
    return int(httpx.get(f"{base}/readyz", timeout=5).json()["sync"]["peers"])


async def _burst(bases: list[str], sims: list[str]) -> list[int]:
    """``BURST`` streams at once, split over ``bases``: what each replica received once every
    request has arrived and the gateways' records have long caught up."""
    clients = [openai.AsyncOpenAI(base_url=f"{b}/v1", api_key="x", max_retries=0, timeout=60)
               for b in bases]

    async def one(i: int) -> Any:
        return await clients[i % 2].chat.completions.create(
            model="llama", messages=[{"role": "user", "content": f"burst {i}"}],
            max_tokens=50, stream=True)

    def arrived() -> bool:
        return sum(inflight(b) + _depth(b) for b in bases) == BURST

    tasks = [asyncio.ensure_future(one(i)) for i in range(BURST)]
    try:
        await asyncio.to_thread(wait_for, arrived, 30, "the burst to arrive")
        await asyncio.sleep(1.5)  # past the records' lag: a late release would show now
        return await asyncio.to_thread(_received, sims)
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, openai.AsyncStream):
                await r.close()
        for c in clients:
            await c.close()


@pytest.fixture
def gateways(redis_url: str, sim_factory: Callable[..., tuple[Proc, str]]
             ) -> Iterator[tuple[list[str], list[str]]]:
    sims = [sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")[1]
            for _ in range(2)]
    config = {"pools": {"p": {"served_model": "m", "replicas": sims}},
              "models": {"llama": {"default": "p"}},
              # a short prompt's load reaches the peer with its next heartbeat (0.5 s): the
              # lag to cover (and records come a few hundred ms late on a loaded machine)
              "flow": {"enabled": True, "max_inflight": LIMIT, "max_queue": 100,
                       "peer_lag_ms": 1000}}
    with ExitStack() as stack:
        bases = []
        for _ in range(2):
            proc, base = gateway_proc(config=config, env={"KVGATE_REDIS_URL": redis_url})
            stack.enter_context(proc)
            bases.append(base)
        wait_for(lambda: all(_peers(b) == 1 for b in bases), 20,
                 "the gateways to see each other")
        yield bases, sims


def test_a_burst_split_over_two_gateways_holds_the_fleet_wide_bound(
        gateways: tuple[list[str], list[str]]) -> None:
    bases, sims = gateways
    received = asyncio.run(_burst(bases, sims))
    assert received == [LIMIT, LIMIT], received
    wait_for(lambda: sum(_depth(b) + inflight(b) for b in bases) == 0, 15,
             "the clients' leaving to empty the queues and the replicas")

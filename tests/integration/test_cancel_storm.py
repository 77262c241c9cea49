"""200 clients of one tenant that give up at random points -- while their request waits for
admission, in flow control's queue, before the first token, mid-stream -- leave nothing
counted: no request in flight, no queue entry, no concurrency lease in Redis, and the tenant's
whole concurrency is usable at once afterwards.

A real gateway with authentication, limits in a real Redis and flow control, two simulated
replicas kept saturated, the official async openai client cancelling its own tasks.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import openai
import redis

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "storm-admin-token-0123456789"
CONCURRENCY = 150


async def _one(client: openai.AsyncOpenAI, i: int) -> str:
    try:
        if i % 4 == 1:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=40)
        elif i % 4 == 3:
            async for _ in await client.responses.create(
                    model="m", input=f"x {i}", max_output_tokens=40, stream=True):
                pass
        else:
            async for _ in await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=40, stream=True, stream_options={"include_usage": i % 2 == 0}):
                pass
    except openai.APIStatusError as exc:
        return f"status {exc.status_code}"
    return "answered"


async def _storm(base: str, key: str) -> list[str | BaseException]:
    rng = random.Random(7)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    tasks = [asyncio.create_task(_one(client, i)) for i in range(200)]
    for task in tasks:
        asyncio.get_running_loop().call_later(rng.uniform(0.0, 4.0), task.cancel)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return outcomes


async def _burst(base: str, key: str) -> list[int]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)

    async def one() -> int:
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        return raw.status_code

    statuses = await asyncio.gather(*(one() for _ in range(CONCURRENCY)))
    await client.close()
    return statuses


def test_clients_giving_up_anywhere_leave_nothing_counted(
    sim_factory: Callable[..., tuple[Proc, str]], redis_url: str,
) -> None:
    # The replicas run at real-time speed (time-scale 1): the storm's work takes longer than its
    # 4 s of cancels on any machine, so most clients give up before their answer. (At 100x a
    # fast machine answered all but 46 of them before they gave up.)
    sims = [sim_factory("--max-num-seqs", "4", "--time-scale", "1", model="s")[1]
            for _ in range(2)]
    config = {"pools": {"p": {"served_model": "s", "replicas": sims}},
              "models": {"m": {"default": "p"}},
              "tiers": {"free": {"limits": {"rpm": 100000, "tpm": 10000000,
                                            "max_concurrency": CONCURRENCY}}},
              "routing": {"scrape_interval_ms": 50},
              "flow": {"enabled": True, "max_waiting": 0, "max_unanswered": 2}}
    env = {"KVGATE_REDIS_URL": redis_url, "KVGATE_SALT_SECRET": AUTH_SECRET,
           "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw:
        with admin_client(base, ADMIN) as admin:
            assert admin.post("/tenants", json={"id": "t", "tier": "free"}).status_code == 201
            key = admin.post("/tenants/t/keys").json()["key"]
        outcomes = asyncio.run(_storm(base, key))
        # (a 429: more clients than the tenant's concurrency at one moment)
        assert all(o in ("answered", "status 429") or isinstance(o, asyncio.CancelledError)
                   for o in outcomes), outcomes
        assert sum(isinstance(o, asyncio.CancelledError) for o in outcomes) > 50
        assert sum(metric_values(base, "kvgate_flow_queued_total").values()) > 0

        # A client's FIN is probed before its queued request is dropped (it may only have
        # half-closed: gateway/halfclose.py, 0.2 s and more), so in-flight can reach 0 while
        # a queued request of a client that left is still in the queue: both are awaited.
        wait_for(lambda: inflight(base) == 0, 15, "nothing in flight")
        wait_for(lambda: sum(metric_values(base, "kvgate_flow_queue_depth").values()) == 0,
                 15, "nothing queued")
        store = redis.Redis.from_url(redis_url)
        try:
            wait_for(lambda: all(store.zcard(k) == 0 for k in store.scan_iter("*:leases")),
                     15, "no concurrency lease left in Redis")
        finally:
            store.close()
        assert asyncio.run(_burst(base, key)) == [200] * CONCURRENCY

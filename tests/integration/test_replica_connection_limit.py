"""`upstream.max_connections` is a limit per replica, with real simulators and a real gateway:
a replica that takes requests and then sends nothing holds its own slots only (a request
routed to a healthy replica of the same pool is not queued behind them), and a replica at its
limit gets its next request once one of its exchanges ends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]


async def until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 30
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def chat(i: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"story {i}"}],
            "max_tokens": 8, "stream": True}


async def stream(c: httpx.AsyncClient, i: int) -> str:
    """One streamed chat completion read to its end; the replica that answered it."""
    async with c.stream("POST", "/v1/chat/completions", json=chat(i)) as resp:
        async for _ in resp.aiter_bytes():
            pass
        assert resp.status_code == 200
        return resp.headers["x-kvgate-replica"]


def test_a_stalled_replica_holds_only_its_own_slots(sim_factory: SimFactory) -> None:
    (_, stalled), (_, good) = sim_factory("--time-scale", "1"), sim_factory("--time-scale", "50")
    httpx.post(f"{stalled}/sim/faults", json={"hang_after_tokens": 0}).raise_for_status()
    gw, base = gateway_proc(upstreams=[stalled, good], args=["--policy", "round_robin"], env={
        "KVGATE_UPSTREAM__MAX_CONNECTIONS": "2", "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "600",
        "KVGATE_HEALTH__INTERVAL_S": "60"})
    good_id = "/" + good.removeprefix("http://")  # as in x-kvgate-replica: pool/host:port

    async def scenario() -> None:
        sim = httpx.AsyncClient(base_url=stalled, timeout=10)
        c = httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(10, read=None))
        held: list[asyncio.Task[str]] = []

        async def stalled_stats() -> dict[str, float]:
            data: dict[str, float] = (await sim.get("/sim/stats")).json()
            return data

        async def inflight() -> float:
            text = (await c.get("/metrics")).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("kvgate_inflight_requests{"))

        try:
            # round robin alternates: fill the stalled replica's two slots (requests that the
            # healthy replica gets in between finish)
            i = 0
            while len(held) < 2:
                before = (await stalled_stats())["received"]
                task = asyncio.create_task(stream(c, i))
                i += 1

                async def placed(task: asyncio.Task[str] = task, before: float = before) -> bool:
                    return task.done() or (await stalled_stats())["received"] > before
                await until(placed, "the request reaching a replica")
                if task.done():
                    assert task.result().endswith(good_id)
                else:
                    held.append(task)
            # the next pick is the healthy replica: answered while the other holds its slots
            assert (await asyncio.wait_for(stream(c, i), 20)).endswith(good_id)
            # the one after is the stalled replica's third: it waits for one of its slots
            third = asyncio.create_task(stream(c, i + 1))
            held.append(third)

            async def three_in_flight() -> bool:
                return await inflight() == 3
            await until(three_in_flight, "the third request in flight at the gateway")
            assert (await asyncio.wait_for(stream(c, i + 2), 20)).endswith(good_id)
            assert (await stalled_stats())["received"] == 2  # still waiting for a slot
            held[0].cancel()  # a client leaves: its slot goes to the waiting request

            async def sent_on() -> bool:
                return (await stalled_stats())["received"] == 3
            await until(sent_on, "the waiting request sent once a slot is free")
            assert not third.done()
        finally:
            for task in held:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
            await c.aclose()
            await sim.aclose()

    with gw:
        asyncio.run(scenario())

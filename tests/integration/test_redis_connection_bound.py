"""A burst of requests of a limited tenant does not open a Redis connection per request.

Every admission of a tenant with limits is one Redis call. The client's connection pool was
redis-py's default: a call past its 100 connections in use failed at once ("Too many
connections"), so a burst of 400 requests put the gateway on per-process fallback limits
("rate limits: cannot reach Redis ... (MaxConnectionsError)"); without that bound, each
admission in flight would be a connection, past Redis's `maxclients` (here a Redis started
with a low one) or the file descriptors. The pool is bounded now
(`tenancy.redis_max_connections`, 64): calls past it wait for a connection, as long as a
call may take (`redis_timeout_s`), and Redis never sees more.

A real gateway on a real Redis, a simulated replica, the official openai client.
"""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from collections.abc import Callable

import openai
import redis

from tests.support.gateway import acme_gateway, admin_client
from tests.support.procs import Proc, free_port

ADMIN = "connection-bound-admin-token-0123456789"
BURST = 400
MAXCLIENTS = 120  # the gateway's own connections (idle ~6, shared homes <= 16) + the bound


async def _burst(base: str, key: str) -> Counter[int]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    statuses: Counter[int] = Counter()

    async def one(i: int) -> None:
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2)
            statuses[raw.status_code] += 1
        except openai.APIStatusError as exc:
            statuses[exc.status_code] += 1

    try:
        await asyncio.gather(*(one(i) for i in range(BURST)))
    finally:
        await client.close()
    return statuses


def test_a_burst_stays_within_the_pool_and_redis_maxclients(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    server = Proc([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--maxclients", str(MAXCLIENTS)], ready_port=port)
    with server:
        url = f"redis://127.0.0.1:{port}/0"
        # a call's timeout above the default (0.5 s): on a shared 2-core machine the
        # gateway's own loop, busy with the burst, delays the calls that far
        gw, base = acme_gateway(sim, url, ADMIN, {"rpm": 1_000_000, "max_concurrency": 10_000},
                                tenancy={"redis_timeout_s": 2.0})
        with gw, admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
            statuses = asyncio.run(_burst(base, key))
            assert statuses == {200: BURST}, statuses
            info = redis.Redis(port=port).info("stats")
            assert info["rejected_connections"] == 0, info["rejected_connections"]
            refused = [line for line in gw.output(None).splitlines() if "cannot reach" in line]
            assert not refused, refused[:3]

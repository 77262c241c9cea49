"""A Redis that answers reads and refuses writes (out of memory under `noeviction`): the
tenancy store loads, the shared rate limits are refused at every admission. Requests are still
served (per-process limits), and `kvgate_redis_up`, its cause and /readyz say so until an
admission goes through again. They said so for one second after each refused admission
(`FallbackRateLimiter`'s recheck), then "up" and not degraded: under light traffic a scrape
or a probe almost never saw it, and the `KvgateRedisDown` alert (2 minutes) could not fire."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import openai

from gateway.tenancy import connect_redis
from tests.support.gateway import (
    acme_gateway,
    admin_client,
    chat_status,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "refusing-writes-admin-token-0123"


def _redis_state(base: str) -> tuple[float, dict[str, float]]:
    up = metric_values(base, "kvgate_redis_up")[""]
    causes = {k: v for k, v in metric_values(base, "kvgate_redis_down_cause").items() if v}
    return up, causes


def _set_maxmemory(url: str, value: str) -> None:
    async def go() -> None:
        r = connect_redis(url)
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", value)
        await r.aclose()
    asyncio.run(go())


def test_a_redis_refusing_writes_stays_reported_between_admissions(
        sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    gw, base = acme_gateway(sim, url, ADMIN, {"rpm": 1000})
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        assert chat_status(client) == 200
        assert _redis_state(base) == (1.0, {})
        _set_maxmemory(url, "1")  # every write refused: OOM
        assert chat_status(client) == 200  # served on per-process limits
        time.sleep(3)  # past the limiter's recheck (1 s), no admission meanwhile
        assert _redis_state(base) == (0.0, {'{cause="oom"}': 1.0})
        tenancy = httpx.get(f"{base}/readyz", timeout=5).json()["tenancy"]
        assert tenancy["degraded"] is True, tenancy
        assert tenancy["reason"] == "rate limits are per-process", tenancy
        _set_maxmemory(url, "0")
        assert chat_status(client) == 200  # the shared limits take it again
        assert _redis_state(base) == (1.0, {})
        assert httpx.get(f"{base}/readyz", timeout=5).json()["tenancy"]["degraded"] is False
        # the shared routing state (its own writes were refused too) resumes at its next try
        wait_for(lambda: httpx.get(f"{base}/readyz", timeout=5).json()["degraded"] is False,
                 timeout=15, what="the gateway to report no degradation")

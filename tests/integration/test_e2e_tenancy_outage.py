"""Redis stops under load and comes back on the same port: no request is lost, `/readyz` and
`/metrics` say the gateway is degraded meanwhile, and it recovers by itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from tests.support.gateway import (
    AUTH_SECRET,
    acme_gateway,
    admin_client,
    gateway_proc,
    metric_values,
    persistent_redis,
    wait_for,
)
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "outage-admin-token-0123456789"


def _state(base: str) -> tuple[bool, float]:
    """(readyz says degraded, kvgate_redis_up)."""
    ready = httpx.get(f"{base}/readyz", timeout=5)
    assert ready.status_code == 200  # degraded, yet still serving
    return bool(ready.json()["degraded"]), metric_values(base, "kvgate_redis_up")[""]


async def _until(cond: Callable[[], bool], what: str, within_s: float = 15) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await asyncio.to_thread(cond):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_redis_outage_under_load_loses_no_request(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url, port = persistent_redis(str(tmp_path))
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"premium": "p"}},
        "tiers": {"premium": {"limits": {"rpm": 100000, "tpm": 10000000,
                                         "max_concurrency": 16}}},
        "tenants": [{"id": "acme", "tier": "premium"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with redis, gw:
        await _outage_under_load(base, redis, tmp_path, port)


async def _outage_under_load(base: str, redis: Proc, data_dir: Path, port: int) -> None:
    with admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    statuses: list[int] = []
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                statuses.append(raw.status_code)
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)

    workers = [asyncio.create_task(worker()) for _ in range(4)]
    try:
        await _until(lambda: len(statuses) >= 20, "traffic before the outage")
        assert await asyncio.to_thread(_state, base) == (False, 1.0)
        await asyncio.to_thread(redis.stop)
        await _until(lambda: _state(base) == (True, 0.0), "degraded while Redis is down")
        during = len(statuses)
        await _until(lambda: len(statuses) >= during + 20, "traffic during the outage")
        again, _, _ = persistent_redis(str(data_dir), port)
        with again:
            await _until(lambda: _state(base) == (False, 1.0), "recovery when Redis is back")
            after = len(statuses)
            await _until(lambda: len(statuses) >= after + 20, "traffic after the recovery")
            stop.set()
            await asyncio.gather(*workers)
    finally:
        stop.set()
        for task in workers:
            task.cancel()
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}


def test_while_redis_is_down_each_gateway_enforces_its_share_of_the_rpm(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    gw, base = acme_gateway(sim, url, ADMIN, {"rpm": 6}, tenancy={"gateway_replicas": 2})
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

        def status() -> int:
            try:
                return client.chat.completions.with_raw_response.create(
                    model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                ).status_code
            except openai.APIStatusError as exc:
                return exc.status_code

        wait_for(lambda: status() == 200, what="the key")  # one of the shared 6 spent
        redis.stop()
        wait_for(lambda: httpx.get(f"{base}/readyz").json()["degraded"], what="degraded")
        # this gateway's share of rpm 6 over gateway_replicas 2: 3 a minute, whatever is
        # left of the shared budget
        assert [status() for _ in range(5)] == [200, 200, 200, 429, 429]


def test_idle_gateway_stops_reporting_degraded_once_redis_is_back(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    # a request with limits during the outage puts the shared limits on the per-process
    # fallback; when Redis is back and no limited request follows, /readyz and
    # kvgate_redis_up must still say so (an alert on kvgate_redis_up == 0 must clear)
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url, port = persistent_redis(str(tmp_path))
    gw, base = acme_gateway(sim, url, ADMIN, {"rpm": 1000})
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        redis.stop()
        wait_for(lambda: _state(base) == (True, 0.0), what="degraded while Redis is down")
        client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        again, _, _ = persistent_redis(str(tmp_path), port)
        with again:
            wait_for(lambda: _state(base) == (False, 1.0), timeout=15,
                     what="recovery without further traffic")

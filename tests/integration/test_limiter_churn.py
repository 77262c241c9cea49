"""Tenants created and removed through the admin API, each making a request, do not grow the
in-memory limiter: a real gateway (in process, served by uvicorn on a loopback port, so its
limiter can be read), a real simulator, the official openai client."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import httpx
import openai
import pytest
import uvicorn

from gateway.app import GatewayApp
from gateway.config import load_config
from gateway.tenancy import MemoryRateLimiter
from gateway.tenancy import limits as limits_mod
from tests.support.gateway import AUTH_SECRET
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
TOKEN = "admin-" + secrets.token_urlsafe(16)
CHURN = 100


def _app(sim: str) -> GatewayApp:
    overrides = {
        "pools": {"p": {"served_model": "sim-model", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        # limits that refill within milliseconds: each bucket is full again at once
        "tiers": {"free": {"limits": {"rpm": 6_000_000, "tpm": 600_000_000}}},
    }
    env = {"KVGATE_ADMIN_TOKEN": TOKEN, "KVGATE_SALT_SECRET": AUTH_SECRET}
    return GatewayApp(load_config("", overrides=overrides, environ=env))


async def _churn(app: GatewayApp, base: str) -> int:
    admin = httpx.AsyncClient(base_url=f"{base}/admin", timeout=10,
                              headers={"authorization": f"Bearer {TOKEN}"})
    try:
        for i in range(CHURN):
            tenant = f"churn-{i}"
            (await admin.post("/tenants", json={"id": tenant, "tier": "free"})).raise_for_status()
            key = (await admin.post(f"/tenants/{tenant}/keys")).json()["key"]
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            answer = await client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert answer.choices[0].message.content is not None
            await client.close()
            assert (await admin.delete(f"/tenants/{tenant}")).status_code == 204
    finally:
        await admin.aclose()
    assert app.rt is not None
    limiter = app.rt.tenancy.limiter
    assert isinstance(limiter, MemoryRateLimiter)
    return limiter.tenants_tracked


def test_removed_tenants_do_not_stay_in_the_limiter(
    sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(limits_mod, "MIN_SWEEP", 16)  # (1024 in production: the same rule)
    monkeypatch.setattr(limits_mod, "KEEP_S", 0.0)  # (61 s in production: the same rule)
    _, sim = sim_factory("--time-scale", "50")
    app = _app(sim)
    port = free_port()

    async def run() -> int:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="warning", lifespan="on"))
        task = asyncio.create_task(server.serve())
        try:
            async with asyncio.timeout(20):
                while not server.started:  # noqa: ASYNC110 - uvicorn exposes no started event
                    await asyncio.sleep(0.01)
            return await _churn(app, f"http://127.0.0.1:{port}")
        finally:
            server.should_exit = True
            await task

    assert asyncio.run(run()) <= 2 * 16

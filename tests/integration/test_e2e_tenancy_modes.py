"""Spill-over under real saturation, and how `kvgate serve` starts with and without auth."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values, wait_for
from tests.support.procs import KVGATE, ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "modes-admin-token-0123456789"


async def _hold(client: openai.AsyncOpenAI) -> None:
    """A long generation that occupies the replica's only sequence slot until cancelled."""
    stream = await client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hold"}], max_tokens=4000,
        stream=True, extra_body={"ignore_eos": True})
    async for _ in stream:
        pass


def _fp8_waiting(base: str) -> float:
    with admin_client(base, ADMIN) as admin:
        pools = {p["pool"]: p for p in admin.get("/replicas").json()["data"]}
    return float(pools["fp8"]["replicas"][0]["waiting"] or 0)


async def test_premium_spills_to_the_free_pool_when_its_pool_is_saturated(
    sim_factory: SimFactory,
) -> None:
    # fp8: one sequence at a time in real time, so two held streams leave one waiting
    _, fp8 = sim_factory("--max-num-seqs", "1", "--time-scale", "1", model="m-fp8")
    _, awq = sim_factory("--time-scale", "50", model="m-awq")
    config = {
        "pools": {"fp8": {"served_model": "m-fp8", "replicas": [fp8]},
                  "awq": {"served_model": "m-awq", "replicas": [awq]}},
        "models": {"llama": {"premium": "fp8", "free": "awq"}},
        "tiers": {"premium": {"spill_to": "awq", "spill_when": {"waiting": 1, "kv_usage": 0.99}},
                  "free": {}},
        "routing": {"scrape_interval_ms": 100},
        "tenants": [{"id": "acme", "tier": "premium"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        held = [asyncio.create_task(_hold(client)) for _ in range(2)]
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while await asyncio.to_thread(_fp8_waiting, base) < 1:
                assert asyncio.get_running_loop().time() < deadline, "fp8 never saturated"
                await asyncio.sleep(0.05)
            raw = await client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert raw.headers["x-kvgate-route"] == "spill"
            assert raw.headers["x-kvgate-replica"].startswith("awq/")
            assert raw.parse().model == "m-awq"
        finally:
            for task in held:
                task.cancel()
            for task in held:
                with contextlib.suppress(BaseException):
                    await task
        spills = metric_values(base, "kvgate_spillovers_total")
        assert spills['{from_pool="fp8",tier="premium",to_pool="awq"}'] >= 1
        sync = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

        def home_again() -> bool:
            raw = sync.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            return raw.headers["x-kvgate-replica"].startswith("fp8/")

        wait_for(home_again, 20, "premium back on its own pool once fp8 drains")


def _serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base_env = {"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""}
    cmd = [*KVGATE, "serve", "--upstream", "http://127.0.0.1:9", "--port", str(free_port()),
           *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={**base_env, **env})


def test_auth_without_a_secret_refuses_to_start_naming_the_fix() -> None:
    result = _serve("--host", "0.0.0.0", env={})
    assert result.returncode == 2
    assert "KVGATE_SALT_SECRET" in result.stderr and "--no-auth" in result.stderr
    assert "Traceback" not in result.stderr
    short = _serve("--host", "0.0.0.0", env={"KVGATE_SALT_SECRET": "short"})
    assert short.returncode == 2 and "at least 16 bytes" in short.stderr


def test_no_auth_serves_one_tenant_and_says_so(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])  # --no-auth
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="anything", max_retries=0)
        reply = client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].message.content
        assert "WITHOUT AUTHENTICATION" in gw.output()
        sent: list[dict[str, Any]] = httpx.get(f"{sim}/sim/requests").json()["requests"]
        assert "cache_salt" not in sent[-1]["body"]  # one tenant, no secret: nothing to isolate


def _waiting(base: str, pool: str) -> float:
    with admin_client(base, ADMIN) as admin:
        pools = {p["pool"]: p for p in admin.get("/replicas").json()["data"]}
    return float(pools[pool]["replicas"][0]["waiting"] or 0)


async def test_free_borrows_the_idle_premium_pool_when_its_own_is_saturated(
    sim_factory: SimFactory,
) -> None:
    _, fp8 = sim_factory("--time-scale", "50", model="m-fp8")
    # awq: one sequence at a time in real time, so two held streams leave one waiting
    _, awq = sim_factory("--max-num-seqs", "1", "--time-scale", "1", model="m-awq")
    config = {
        "pools": {"fp8": {"served_model": "m-fp8", "replicas": [fp8]},
                  "awq": {"served_model": "m-awq", "replicas": [awq]}},
        "models": {"llama": {"premium": "fp8", "free": "awq"}},
        "tiers": {"premium": {},
                  "free": {"borrow_from": "fp8",
                           "spill_when": {"waiting": 1, "kv_usage": 0.99}}},
        "routing": {"scrape_interval_ms": 100},
        "tenants": [{"id": "cheap", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/cheap/keys").json()["key"]
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        sync = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

        def pool_of_next() -> str:
            raw = sync.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            return str(raw.headers["x-kvgate-replica"]).split("/")[0]

        assert pool_of_next() == "awq"  # its own pool while that is not saturated
        held = [asyncio.create_task(_hold(client)) for _ in range(2)]
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while await asyncio.to_thread(_waiting, base, "awq") < 1:
                assert asyncio.get_running_loop().time() < deadline, "awq never saturated"
                await asyncio.sleep(0.05)
            raw = await client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            assert raw.headers["x-kvgate-replica"].startswith("fp8/")  # the idle pool
            assert raw.headers["x-kvgate-route"] == "spill"
            assert raw.parse().model == "m-fp8"
        finally:
            for task in held:
                task.cancel()
            for task in held:
                with contextlib.suppress(BaseException):
                    await task
        spills = metric_values(base, "kvgate_spillovers_total")
        assert spills['{from_pool="awq",tier="free",to_pool="fp8"}'] >= 1
        wait_for(lambda: pool_of_next() == "awq", 20, "free back on its own pool")

"""A replica serving another model than its pool's (a wrong Service selector, another model
rolled out at that address): every request sent there was answered 404 "The model `m-a` does
not exist", retried elsewhere, and the replica ejected as failing, with nothing anywhere saying
why. The health check reads each replica's /v1/models: such a replica is taken out of picks
with the reason, logged once (and once when it serves the pool's model again), shown in
/admin/replicas and /readyz. A replica without /v1/models, or a late one, is not ejected for
that alone. Real simulated replicas, a real gateway, the official openai client; the /v1/models
corner cases on a loopback aiohttp replica (as `test_gateway_health`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from aiohttp import web

from gateway.config import KvgateConfig
from gateway.health import HealthMonitor
from gateway.pool import Pools
from loadtest.fleet import free_port
from tests.support.gateway import admin_client, gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

TOKEN = "wrong-model-admin-token"
WHY = "serves model 'm-b', not the pool's 'm-a'"


def attempts(base: str, replica: str) -> float:
    return sum(v for k, v in metric_values(base, "kvgate_replica_attempts_total").items()
               if f'replica="{replica}"' in k)


def reasons(base: str) -> dict[str, str | None]:
    with admin_client(base, TOKEN) as admin:
        data = admin.get("/replicas").json()["data"]
    return {r["id"]: r["reason"] for pool in data for r in pool["replicas"]}


def test_a_replica_serving_another_model_is_taken_out_and_named(
    procs: list[Proc],
) -> None:
    good, good_url = sim_proc(None, "--time-scale", "50", model="m-a")
    wrong, wrong_url = sim_proc(None, "--time-scale", "50", model="m-b")
    lone, lone_url = sim_proc(None, "--time-scale", "50", model="m-b")  # a pool of it alone
    procs += [good.start(), wrong.start(), lone.start()]
    port = int(wrong_url.rsplit(":", 1)[1])
    gw, base = gateway_proc(config={
        "pools": {"a": {"served_model": "m-a", "replicas": [good_url, wrong_url]},
                  "lone": {"served_model": "m-a", "replicas": [lone_url]}},
        "models": {"llama": {"default": "a"}}, "routing": {"policy": "round_robin"}},
        env={"KVGATE_ADMIN_TOKEN": TOKEN})
    procs.append(gw.start())
    wrong_id, lone_id = wrong_url.removeprefix("http://"), lone_url.removeprefix("http://")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    for i in range(6):  # round robin: half were sent to the wrong replica first
        answer = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": f"q {i}"}], max_tokens=4)
        assert answer.choices[0].message.content
    assert attempts(base, wrong_id) == 0  # never picked: its health check said why
    assert reasons(base)[wrong_id] == WHY
    ready = httpx.get(f"{base}/readyz").json()
    assert ready["not_ready"]["lone"] == f"no healthy replica ({lone_id}: {WHY})"
    wait_for(lambda: gw.output(None).count(WHY) >= 1, what="the log line")

    # the right model rolled out at that address: back, logged once
    wrong.stop()
    fixed, _ = sim_proc(port, "--time-scale", "50", model="m-a")
    procs.append(fixed.start())
    wait_for(lambda: reasons(base)[wrong_id] is None, what="the replica back")
    wait_for(lambda: "serves the pool's model again" in gw.output(None), what="the log line")
    out = gw.output(None)
    assert out.count(WHY) == 2  # once for each replica, not every health check
    assert out.count("serves the pool's model again") == 1


@dataclass
class Models:
    status: int = 200
    delay_s: float = 0.0
    names: list[str] = field(default_factory=lambda: ["m-a"])


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, Models]]:
    how = Models()

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        await asyncio.sleep(how.delay_s)
        cards = [{"id": name, "object": "model", "max_model_len": 4096} for name in how.names]
        return web.json_response({"object": "list", "data": cards}, status=how.status)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", how
    await runner.cleanup()


async def test_models_unknown_or_late_do_not_eject_and_several_names_count(
    replica: tuple[str, Models],
) -> None:
    url, how = replica
    cfg = KvgateConfig.model_validate({
        "pools": {"p": {"served_model": "m-a", "replicas": [url]}},
        "health": {"timeout_s": 0.2, "eject_base_s": 60}})
    pools = Pools(cfg)
    r = pools.by_name["p"].replicas[0]
    now = [0.0]

    async def checked() -> None:  # a gateway started now: the replica is new to it
        await HealthMonitor(pools, cfg.health, lambda: now[0]).poll_once()

    try:
        for status, delay in ((404, 0.0), (500, 0.0), (401, 0.0), (200, 0.5)):
            how.status, how.delay_s = status, delay
            await checked()
            assert (r.state, r.reason) == ("healthy", None), (status, delay)
        how.status, how.delay_s = 200, 0.0
        how.names = ["m-b", "m-a"]  # several --served-model-name values: the pool's among them
        await checked()
        assert (r.state, r.max_model_len) == ("healthy", 4096)
        how.names = ["m-b", "m-c"]
        await checked()
        assert r.state == "ejected"
        assert r.reason == "serves model 'm-b', 'm-c', not the pool's 'm-a'"
        how.names = ["m-b", "m-c", "m-d", "m-e", "m-f"]  # a long list is not all named
        now[0] += 61  # (after the back-off)
        await checked()
        assert r.reason == "serves model 'm-b', 'm-c', 'm-d' and 2 more, not the pool's 'm-a'"
    finally:
        await pools.close()


async def test_a_replica_ejected_by_failures_is_asked_what_it_serves(
    replica: tuple[str, Models],
) -> None:
    """Another model rolled out at an address with no downtime: its requests fail (404), it
    is ejected, and its recovery probe reads its /v1/models and names why."""
    url, how = replica
    cfg = KvgateConfig.model_validate({
        "pools": {"p": {"served_model": "m-a", "replicas": [url]}},
        "health": {"timeout_s": 0.2, "eject_base_s": 60}})
    pools = Pools(cfg)
    r = pools.by_name["p"].replicas[0]
    now = [0.0]
    monitor = HealthMonitor(pools, cfg.health, lambda: now[0])
    try:
        await monitor.poll_once()
        assert r.state == "healthy"
        how.names = ["m-b"]
        r.eject(now[0])  # its requests failed (as `Replica.record_failure` ejects)
        now[0] += 61  # the back-off expired
        await monitor.poll_once()
        assert (r.state, r.reason) == ("ejected", "serves model 'm-b', not the pool's 'm-a'")
        how.names = ["m-a"]
        now[0] += 1
        await monitor.poll_once()
        assert (r.state, r.reason) == ("half_open", None)
    finally:
        await pools.close()

"""Active health against real HTTP on loopback (issue 15, item 2): vLLM answers `/health` on
the event loop that serves requests, so a saturated replica answers late. A slow answer is not a
dead replica: only `slow_threshold` slow probes in a row eject; a refused connection or an
explicit non-200 ejects at once. The replica here is a local aiohttp server whose `/health`
takes as long as the test says (a saturated vLLM's does)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from gateway.config import KvgateConfig
from gateway.health import HealthMonitor
from gateway.pool import Pools
from loadtest.fleet import free_port


@dataclass
class Behaviour:
    delay_s: float = 0.0
    status: int = 200


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, Behaviour]]:
    how = Behaviour()

    async def health(request: web.Request) -> web.Response:
        await asyncio.sleep(how.delay_s)
        return web.Response(status=how.status)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", how
    await runner.cleanup()


def pools_for(url: str, **health: float) -> tuple[Pools, KvgateConfig]:
    cfg = KvgateConfig.model_validate({
        "pools": {"p": {"served_model": "m", "replicas": [url]}},
        "health": {"timeout_s": 0.2, "slow_threshold": 3, "eject_base_s": 60, **health},
    })
    return Pools(cfg), cfg


async def test_slow_health_ejects_only_after_several_slow_probes_in_a_row(
    replica: tuple[str, Behaviour],
) -> None:
    url, how = replica
    pools, cfg = pools_for(url)
    r = pools.by_name["p"].replicas[0]
    monitor = HealthMonitor(pools, cfg.health, lambda: 0.0)
    try:
        how.delay_s = 0.5  # > timeout_s: saturated
        await monitor.poll_once()
        await monitor.poll_once()
        assert r.state == "healthy"  # two slow answers: still in
        how.delay_s = 0.0
        await monitor.poll_once()  # one in time resets the count
        how.delay_s = 0.5
        for _ in range(2):
            await monitor.poll_once()
        assert r.state == "healthy"
        await monitor.poll_once()
        assert r.state == "ejected"  # the third slow probe in a row
        # /readyz says why, as for a refused connection (it said only "no healthy replica")
        assert pools.not_ready(0.0) == {
            "p": f"no healthy replica ({r.id}: /health: no answer within 0.2 s)"}
    finally:
        await pools.close()


def down_reasons(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "reason", "") for r in caplog.records if r.getMessage() == "replica down"]


async def test_explicit_error_ejects_at_once(
    replica: tuple[str, Behaviour], caplog: pytest.LogCaptureFixture
) -> None:
    url, how = replica
    pools, cfg = pools_for(url)
    r = pools.by_name["p"].replicas[0]
    try:
        how.status = 503  # vLLM's /health for a dead engine
        await HealthMonitor(pools, cfg.health, lambda: 0.0).poll_once()
        assert r.state == "ejected"
        assert down_reasons(caplog) == ["/health answered 503"]  # the operator sees why
    finally:
        await pools.close()


async def test_connection_refused_ejects_at_once(caplog: pytest.LogCaptureFixture) -> None:
    pools, cfg = pools_for(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    r = pools.by_name["p"].replicas[0]
    try:
        await HealthMonitor(pools, cfg.health, lambda: 0.0).poll_once()
        assert r.state == "ejected"
        assert down_reasons(caplog) == ["/health: cannot connect"]
    finally:
        await pools.close()


async def test_default_timeout_tolerates_a_saturated_replica(
    replica: tuple[str, Behaviour],
) -> None:
    url, how = replica
    cfg = KvgateConfig.model_validate({"pools": {"p": {"served_model": "m", "replicas": [url]}}})
    pools = Pools(cfg)
    r = pools.by_name["p"].replicas[0]
    try:
        how.delay_s = 1.5  # beyond the old 1 s default timeout
        for _ in range(cfg.health.slow_threshold):
            await HealthMonitor(pools, cfg.health, lambda: 0.0).poll_once()
        assert r.state == "healthy" and r.ejections == 0
    finally:
        await pools.close()


@dataclass
class Card:
    max_model_len: int = 4096
    asked: int = 0


@pytest.fixture
async def carded() -> AsyncIterator[tuple[list[str], Behaviour, Card]]:
    """A replica answering `/health` and a `/v1/models` card of the length the test says, on
    several ports (as many replicas to the gateway)."""
    how, card = Behaviour(), Card()

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=how.status)

    async def models(request: web.Request) -> web.Response:
        card.asked += 1
        return web.json_response({"object": "list", "data": [
            {"id": "m", "object": "model", "max_model_len": card.max_model_len}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    urls = []
    for _ in range(6):
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        urls.append(f"http://127.0.0.1:{port}")
    yield urls, how, card
    await runner.cleanup()


async def test_a_replica_back_after_being_down_is_asked_its_context_length_again(
    carded: tuple[list[str], Behaviour, Card],
) -> None:
    urls, how, card = carded
    pools, cfg = pools_for(urls[0])
    pool = pools.by_name["p"]
    now = [0.0]
    monitor = HealthMonitor(pools, cfg.health, lambda: now[0])
    try:
        await monitor.poll_once()
        await monitor.poll_once()
        assert pool.max_model_len == 4096 and card.asked == 1  # asked once
        how.status = 503  # down, restarted with another --max-model-len
        await monitor.poll_once()
        assert pool.replicas[0].state == "ejected"
        how.status, card.max_model_len = 200, 8192
        now[0] += 61  # the back-off (eject_base_s 60) expired
        await monitor.poll_once()
        assert pool.max_model_len == 8192 and card.asked == 2
    finally:
        await pools.close()


async def test_a_replica_that_left_the_pool_is_forgotten(
    carded: tuple[list[str], Behaviour, Card],
) -> None:
    urls, _, card = carded
    card.max_model_len = 0  # no length in the card (not a vLLM): every replica is asked
    cfg = KvgateConfig.model_validate({
        "pools": {"p": {"replicas": urls[:1]}}, "models": {},
        "health": {"timeout_s": 0.2, "eject_base_s": 60}})
    pools = Pools(cfg)
    monitor = HealthMonitor(pools, cfg.health, lambda: 0.0)
    try:
        await monitor.poll_once()
        assert card.asked == 1 and pools.by_name["p"].served_model == "m"
        for url in urls[1:]:  # discovery churn: replicas come and go
            pools.set_discovered("p", frozenset({url}))
            await monitor.poll_once()
        assert card.asked == 6  # each replica asked once
        assert len(monitor._carded) == 1, monitor._carded  # not one entry per replica seen
    finally:
        await pools.close()

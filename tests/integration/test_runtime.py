"""The gateway's runtime on one AsyncExitStack (issue 10, Structure): every part it starts is
stopped at shutdown, and a start that fails half way stops exactly what had started -- no
task, connection or subscription is left behind. In process, against a real simulator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gateway.app import GatewayApp
from gateway.config import load_config
from gateway.errors import ConfigError
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def _config(sim: str, **extra: Any) -> Any:
    pools = {"a": {"served_model": "sim-model", "replicas": [sim], **extra}}
    overrides = {"pools": pools, "models": {"m": {"default": "a"}}, "tenancy": {"auth": False}}
    return load_config(None, overrides=overrides, environ={})


def _others() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def _settle() -> None:
    for _ in range(5):  # let cancelled tasks' callbacks run
        await asyncio.sleep(0)


def test_start_then_stop_leaves_nothing_running(sim_factory: SimFactory) -> None:
    _, sim = sim_factory()

    async def run() -> None:
        app = GatewayApp(_config(sim))
        await app.startup()
        assert app.rt is not None and app.rt.pools.not_ready(app.clock()) == {}
        assert _others(), "the runtime runs background tasks"
        assert app._readyz()[0] == 200
        await app.shutdown()
        await _settle()
        assert _others() == set()
        assert all(p.transport.closed for p in app.rt.pools.by_name.values())

    asyncio.run(run())


def test_a_start_failing_at_the_end_stops_what_had_started(sim_factory: SimFactory) -> None:
    _, sim = sim_factory()

    async def run() -> None:
        async def boom(app: GatewayApp) -> None:
            assert app.rt is not None and _others()  # everything is running now
            raise RuntimeError("after_start failed")

        app = GatewayApp(_config(sim), after_start=boom)
        with pytest.raises(RuntimeError, match="after_start failed"):
            await app.startup()
        await _settle()
        assert _others() == set()
        assert app.rt is None and app._readyz()[0] == 503
        await app.shutdown()  # nothing left to stop: a no-op

    asyncio.run(run())


def test_a_start_failing_half_way_stops_what_had_started(
    sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, sim = sim_factory()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    async def run() -> None:
        # tenancy and the pools have started when discovery refuses its configuration (no
        # API server outside a cluster: `kvgate serve` checks it first, the runtime again)
        cfg = _config(sim, discovery={"kubernetes": {"service": "vllm", "namespace": "d"}})
        app = GatewayApp(cfg)
        with pytest.raises(ConfigError):
            await app.startup()
        await _settle()
        assert _others() == set()

    asyncio.run(run())

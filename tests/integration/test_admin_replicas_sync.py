"""`GET /admin/replicas` says how the shared routing state is doing, where an operator looks at
the replicas: on or off, degraded and why, the peers heard from, the batches published and
applied, and the recent apply lag. It showed only the member id and the peer count: a sharing
that never came up (a Redis refusing it) looked like a healthy one without peers."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.support.gateway import admin_client, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc

ADMIN = "replicas-sync-admin-token-0123"


def _gateway(sim: str, redis_url: str | None) -> tuple[Proc, str]:
    config: dict[str, Any] = {"pools": {"p": {"served_model": "sim-model", "replicas": [sim]}}}
    env = {"KVGATE_ADMIN_TOKEN": ADMIN, **({"KVGATE_REDIS_URL": redis_url} if redis_url else {})}
    return gateway_proc(config=config, env=env)


def _sync(base: str) -> dict[str, Any]:
    with admin_client(base, ADMIN) as admin:
        answer = admin.get("/replicas")
        assert answer.status_code == 200, answer.text
        sync: dict[str, Any] = answer.json()["sync"]
        return sync


def test_the_shared_state_health_is_shown_with_the_replicas(
        sim_factory: Any, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "50")
    redis, url = redis_proc()
    procs.append(redis.start())
    gws = [_gateway(sim, url) for _ in range(2)]
    for gw, _ in gws:
        procs.append(gw.start())
    (_, a), (_, b) = gws
    client = openai.OpenAI(base_url=f"{a}/v1", api_key="x", max_retries=0)

    def applied_at_b() -> bool:
        client.chat.completions.create(model="sim-model", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
        return bool(_sync(b)["apply_lag_s"]["samples"])

    wait_for(applied_at_b, timeout=30, what="b applying a's routes")
    sync = _sync(b)
    assert sync["enabled"] is True and sync["degraded"] is False and sync["cause"] is None
    assert sync["peers"] == 1 and sync["applied"] >= 1 and sync["published"] >= 1
    lag = sync["apply_lag_s"]
    assert 0.0 <= lag["p50"] <= lag["p99"] <= lag["max"]
    assert isinstance(sync["member"], str)

    redis.stop()
    wait_for(lambda: _sync(b)["degraded"], timeout=30, what="b's sharing degraded")
    down = _sync(b)
    assert down["cause"], down  # why, as the log says it: Redis is not reached
    assert "Redis" not in down["cause"] and "redis://" not in down["cause"]
    ready = httpx.get(f"{b}/readyz", timeout=5).json()["sync"]
    assert ready["degraded"] is True and ready["reason"], ready  # and in /readyz


def test_no_shared_state_says_so(sim_factory: Any, procs: list[Proc]) -> None:
    _, sim = sim_factory()
    gw, base = _gateway(sim, None)
    procs.append(gw.start())
    assert _sync(base) == {"enabled": False}

"""One tenant's poisoned requests -- ones that fail on every replica alike, as vLLM 0.34
answers 500 for one request's content (an image URL it cannot fetch) or a route answers a
stream whole -- must not eject replicas that serve everyone else. Real gateway (authentication
on, two tenants) before three real simulators, round-robin, the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from loadtest.sim.poison import POISON_500, POISON_MIDSTREAM, POISON_WHOLE
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values
from tests.support.procs import Proc, free_port, sim_proc

MODEL = "sim-model"
ADMIN = "eject6-admin-token"  # tests only


@pytest.fixture
def fleet(procs: list[Proc]) -> Iterator[dict[str, Any]]:
    """Three simulators behind a gateway with authentication; yields its base, the
    replicas' URLs and clients of the tenants `hostile` and `victim`."""
    ports = sorted((free_port() for _ in range(3)), key=lambda p: f"127.0.0.1:{p}")
    urls = []
    for port in ports:
        sim, url = sim_proc(port, "--time-scale", "50")
        procs.append(sim.start())
        urls.append(url)
    config = {
        "pools": {"default": {"served_model": MODEL, "replicas": urls}},
        "models": {MODEL: {"default": "default"}},
        "tenants": [{"id": "hostile", "tier": "default"}, {"id": "victim", "tier": "default"}],
        "routing": {"policy": "round_robin"},
        # only requests judge the replicas, and an ejection lasts the whole test
        "health": {"interval_s": 600, "failure_threshold": 2,
                   "eject_base_s": 600, "eject_max_s": 600}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    procs.append(gw.start())
    with admin_client(base, ADMIN) as admin:
        keys = {t: admin.post(f"/tenants/{t}/keys").json()["key"] for t in ("hostile", "victim")}
    clients = {t: openai.OpenAI(base_url=f"{base}/v1", api_key=k, max_retries=0, timeout=30)
               for t, k in keys.items()}
    yield {"base": base, "urls": urls, **clients}


def _healthy(base: str) -> list[float]:
    return list(metric_values(base, "kvgate_replica_healthy").values())


def _poisoned_runs(urls: list[str]) -> int:
    return sum(httpx.get(f"{u}/sim/stats", timeout=10).json().get("poisoned", 0) for u in urls)


def _victim_ok(client: openai.OpenAI, i: int) -> str:
    """One victim request; the replica that answered it (it must be a 200)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": f"victim {i}"}], max_tokens=2)
    assert raw.status_code == 200
    return raw.headers["x-kvgate-replica"]


def test_whole_answers_to_one_tenants_streams_eject_nothing(fleet: dict[str, Any]) -> None:
    """Before: each poisoned stream was tried on all three replicas, each charged a failure:
    the second one ejected the pool, and the victim got 503s."""
    hostile, victim = fleet["hostile"], fleet["victim"]
    for i in range(10):
        with pytest.raises(openai.APIStatusError) as caught:
            hostile.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"poison {i}"}],
                max_tokens=2, stream=True, user=POISON_WHOLE)
        assert caught.value.status_code == 502
        assert "not the stream asked for" in caught.value.message
        _victim_ok(victim, i)
    assert _healthy(fleet["base"]) == [1.0, 1.0, 1.0]
    assert _poisoned_runs(fleet["urls"]) <= 20  # two replicas each at most, not all three


def test_one_tenants_failing_requests_are_not_charged_as_streaks(
    fleet: dict[str, Any],
) -> None:
    """Before: each poisoned request's 500 met a second replica's (both acquitted, the
    streak grew), and the victim's requests served meanwhile made the streak count: the
    replicas were ejected one after another for one tenant's requests."""
    hostile, victim = fleet["hostile"], fleet["victim"]
    served_by = set()
    for i in range(10):
        with pytest.raises(openai.InternalServerError) as caught:
            hostile.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"poison {i}"}],
                max_tokens=2, user=POISON_500)
        assert "could not be fetched" in caught.value.message
        served_by.add(_victim_ok(victim, i))
    assert _healthy(fleet["base"]) == [1.0, 1.0, 1.0]
    assert len(served_by) == 3  # no replica was taken out of the victim's rotation
    assert _poisoned_runs(fleet["urls"]) <= 20


def test_one_tenants_streams_failing_midway_eject_nothing(fleet: dict[str, Any]) -> None:
    """A stream that fails after its first token (vLLM's 500 error event for that request)
    runs on one replica only. Before: each was charged to its replica, and one tenant's
    streams in a row ejected replica after replica. Now its client still gets the replica's
    error; the replicas stay in for the other tenant."""
    hostile, victim = fleet["hostile"], fleet["victim"]
    for i in range(10):
        stream = hostile.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"poison {i}"}],
            max_tokens=2, stream=True, user=POISON_MIDSTREAM)
        with pytest.raises(openai.APIError) as caught:
            for _ in stream:
                pass
        assert "mid-stream" in caught.value.message
    assert _healthy(fleet["base"]) == [1.0, 1.0, 1.0]
    assert len({_victim_ok(victim, i) for i in range(6)}) == 3
    assert _poisoned_runs(fleet["urls"]) == 10

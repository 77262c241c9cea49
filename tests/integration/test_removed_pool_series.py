"""A pool a policy version removes takes its pool-level series with it, once it has lingered
(`upstream.total_timeout_s`, as a drained replica's series), and the counts `kvgate doctor`
reads, so its reports stop naming the pool once their window has passed: real gateway, real
simulators, the admin API's `PUT /policy`, `/metrics` and `GET /admin/doctor`."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
TOKEN = "admin-" + secrets.token_urlsafe(16)
# every family with a pool label, as `GatewayMetrics` names them
POOL_LABELLED = re.compile(
    r'^(kvgate_requests_total|kvgate_request_duration_seconds\w*|kvgate_ttft_seconds\w*|'
    r'kvgate_inter_token_latency_seconds\w*|kvgate_tokens_total|kvgate_upstream_retries_total|'
    r'kvgate_failovers_total|kvgate_tenant_tokens_total|kvgate_spillovers_total)\{[^}]*'
    r'(pool|from_pool|to_pool)="gone"', re.M)


def _policy(a: str, b: str | None) -> dict[str, object]:
    pools: dict[str, object] = {"kept": {"served_model": "sim-model", "replicas": [a]}}
    models: dict[str, object] = {"kept-model": {"default": "kept"}}
    if b is not None:
        pools["gone"] = {"served_model": "sim-model", "replicas": [b]}
        models["gone-model"] = {"default": "gone"}
    return {"pools": pools, "models": models, "tiers": {"default": {}}}


def test_a_removed_pools_series_go_after_it_lingered(sim_factory: SimFactory) -> None:
    (_, a), (_, b) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    config = {**_policy(a, b), "upstream": {"total_timeout_s": 3}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": TOKEN})
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for model in ("kept-model", "gone-model"):
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        metrics = httpx.get(f"{base}/metrics").text
        assert POOL_LABELLED.search(metrics)
        admin = httpx.Client(base_url=f"{base}/admin", timeout=10,
                             headers={"authorization": f"Bearer {TOKEN}"})
        with admin:
            admin.put("/policy", json=_policy(a, None)).raise_for_status()
            removed_at = time.monotonic()

            def gone() -> bool:
                return not POOL_LABELLED.search(httpx.get(f"{base}/metrics").text)
            wait_for(gone, timeout=20, what="the removed pool's series to go")
            assert time.monotonic() - removed_at > 2.5  # not before it lingered
            assert 'pool="kept"' in httpx.get(f"{base}/metrics").text

            def doctor_pools() -> set[str]:  # (a window of ticks taken since: the pool gone)
                report = admin.get("/doctor", params={"window": "10s"}).json()
                return {p["name"] for p in report["pools"]}
            assert "gone" in doctor_pools()  # still in ticks of the window
            wait_for(lambda: doctor_pools() == {"kept"}, timeout=30,
                     what="the doctor's window to pass the removed pool")


def test_a_pool_back_before_it_lingered_keeps_its_series(sim_factory: SimFactory) -> None:
    (_, a), (_, b) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    config = {**_policy(a, b), "upstream": {"total_timeout_s": 2}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": TOKEN})
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(
            model="gone-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        admin = httpx.Client(base_url=f"{base}/admin", timeout=10,
                             headers={"authorization": f"Bearer {TOKEN}"})
        with admin:
            admin.put("/policy", json=_policy(a, None)).raise_for_status()
            admin.put("/policy", json=_policy(a, b)).raise_for_status()  # back at once
            time.sleep(4)  # past the removed pool's linger, and a reap after it
        assert POOL_LABELLED.search(httpx.get(f"{base}/metrics").text)


FLOW_GONE = re.compile(r'^kvgate_flow_\w+\{[^}]*pool="gone"', re.M)


def test_a_removed_pools_flow_control_series_go_too(sim_factory: SimFactory) -> None:
    (_, a), (_, b) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    config = {**_policy(a, b), "upstream": {"total_timeout_s": 2}, "flow": {"enabled": True}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": TOKEN})
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(
            model="gone-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        wait_for(lambda: bool(FLOW_GONE.search(httpx.get(f"{base}/metrics").text)),
                 timeout=10, what="flow control's series of the pool")
        with httpx.Client(base_url=f"{base}/admin", timeout=10,
                          headers={"authorization": f"Bearer {TOKEN}"}) as admin:
            admin.put("/policy", json=_policy(a, None)).raise_for_status()
        wait_for(lambda: not FLOW_GONE.search(httpx.get(f"{base}/metrics").text),
                 timeout=20, what="flow control's series of the removed pool to go")
        client.chat.completions.create(
            model="kept-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert re.search(r'^kvgate_flow_\w+\{[^}]*pool="kept"', httpx.get(f"{base}/metrics").text,
                         re.M)

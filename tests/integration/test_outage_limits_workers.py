"""While Redis is down, a gateway of `server.workers` processes keeps its tenants' limits as one
gateway: each worker enforces limit / (gateway_replicas x workers), not limit / gateway_replicas
(which let a 2-worker gateway admit twice the budget)."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "workers-outage-admin-token-0123"
RPM = 4


def _per_worker(base: str) -> dict[str, float]:
    """Requests each worker answered (kvgate_requests_total summed per `worker` label)."""
    out: dict[str, float] = {}
    for labels, value in metric_values(base, "kvgate_requests_total").items():
        worker = re.search(r'worker="([^"]*)"', labels)
        if worker:
            out[worker.group(1)] = out.get(worker.group(1), 0) + value
    return out


def _knowing(base: str) -> set[str]:
    """Workers that answered a request past authentication (any status but 401)."""
    out = set()
    for labels in metric_values(base, "kvgate_requests_total"):
        worker = re.search(r'worker="([^"]*)"', labels)
        if worker and 'status="401"' not in labels:
            out.add(worker.group(1))
    return out


def _asked(base: str, before: dict[str, float]) -> dict[str, float]:
    """Requests each worker answered since ``before`` (`_per_worker`)."""
    return {w: n - before.get(w, 0.0) for w, n in _per_worker(base).items()
            if n > before.get(w, 0.0)}


def test_two_workers_share_the_rpm_budget_while_redis_is_down(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"rpm": RPM}}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    gw, base = gateway_proc(config=config, env=env, auth=True, args=["--workers", "2"])
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        # both workers know the new key before Redis goes (one that had not reloaded it yet
        # answered 401 on a loaded machine): a worker that took it answered 200 or 429
        for _ in range(200):
            with httpx.Client(timeout=10) as c:
                c.post(f"{base}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"})
            if len(_knowing(base)) == 2:
                break
        assert len(_knowing(base)) == 2, metric_values(base, "kvgate_requests_total")
        before = _per_worker(base)
        redis.stop()
        statuses = []
        for _ in range(40):
            # a connection per request, so the kernel hands them to both workers
            with httpx.Client(timeout=10) as c:
                r = c.post(f"{base}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"})
            statuses.append(r.status_code)
            asked = _asked(base, before)
            if len(asked) == 2 and min(asked.values()) >= RPM:
                break  # each worker has been asked more than a whole budget
        workers = _asked(base, before)
        assert len(workers) == 2 and min(workers.values()) >= RPM, workers  # test premise
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(200) <= RPM, statuses

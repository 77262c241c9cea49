"""A partition: one gateway (two workers) loses Redis while another keeps it, and an admin
revokes a key, issues one and changes the policy through the one in touch; then it heals.

While cut off, the cut-off gateway serves its last state (degraded: the revoked key still
works there until `tenancy.max_staleness_s`, the new one does not yet) and its admin writes
are refused; after the heal every worker of it applies what it missed, reports not degraded,
and nothing is left in flight anywhere. A probe of the split-brain of the tenancy views (no
defect found; kept as a regression test of `SlowLink.cut`'s fault)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    chat_status,
    gateway_proc,
    inflight,
    wait_for,
)
from tests.support.procs import Proc, redis_proc, start_sims
from tests.support.slow_link import SlowLink

pytestmark = pytest.mark.slow

ADMIN = "faults8-admin-token-0123456789"


def _status(base: str, key: str) -> int:
    fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))  # either worker
    with fresh:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                               http_client=fresh)  # type: ignore[arg-type]
        return chat_status(client)


def _ready(base: str) -> dict[str, object]:
    body: dict[str, object] = httpx.get(f"{base}/readyz", headers={"connection": "close"},
                                        timeout=5).json()
    return body


def test_a_healed_partition_leaves_every_gateway_with_the_changes_it_missed(
    procs: list[Proc],
) -> None:
    redis, redis_url = redis_proc()
    procs.append(redis.start())
    _, urls = start_sims(procs, 2, "--time-scale", "50")
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": urls}},
              "models": {"llama": {"default": "p"}},
              "tenants": [{"id": "acme", "tier": "default"}]}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with SlowLink(port, 0.0) as link:
        near, a = gateway_proc(config=config, env={**env, "KVGATE_REDIS_URL": redis_url},
                               auth=True)
        procs.append(near.start())
        far, b = gateway_proc(config={**config, "server": {"workers": 2}}, auth=True,
                              env={**env, "KVGATE_REDIS_URL": f"redis://127.0.0.1:{link.port}/0"})
        procs.append(far.start())
        with admin_client(a, ADMIN) as admin_a, admin_client(b, ADMIN) as admin_b:
            old = admin_a.post("/tenants/acme/keys").json()
            wait_for(lambda: all(_status(b, old["key"]) == 200 for _ in range(4)),
                     what="the key on both workers")
            link.cut()
            wait_for(lambda: _ready(b)["degraded"] is True, timeout=20, what="degraded")
            assert admin_a.delete(f"/tenants/acme/keys/{old['id']}").status_code == 204
            new = admin_a.post("/tenants/acme/keys").json()["key"]
            patched = admin_a.patch("/policy", json={"tiers": {"default": {"priority": 3}}})
            assert patched.status_code == 200
            refused = admin_b.post("/tenants", json={"id": "during", "tier": "default"})
            assert refused.status_code == 503 and "error" in refused.json()
            assert _status(a, old["key"]) == 401 and _status(a, new) == 200
            assert _status(b, new) == 401  # not seen yet (a clean refusal)

            link.heal()

            def caught_up() -> bool:
                return all(_status(b, old["key"]) == 401 and _status(b, new) == 200
                           for _ in range(4))

            wait_for(caught_up, timeout=20, what="the cut-off gateway caught up")
            wait_for(lambda: all(_ready(b)["degraded"] is False for _ in range(4)),
                     timeout=20, what="degraded cleared on both workers")
            versions = {str(_ready(base)["tenancy"]) for base in (a, b, b, b)}
            assert all("'policy_version': 2" in v for v in versions), versions
            assert [t["id"] for t in admin_b.get("/tenants").json()["data"]] == ["acme"]
            wait_for(lambda: inflight(a) == 0 and inflight(b) == 0, what="nothing in flight")

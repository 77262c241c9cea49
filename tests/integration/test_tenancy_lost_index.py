"""A tenant's key index (`<ns>:tkeys:<tenant>`, key id -> key hash) lost while its key
records stay (evicted by a Redis running an `allkeys-*` eviction policy, which picks any key,
or deleted by hand). The index is how the admin API finds a tenant's keys: without it the
tenant was listed with no keys, revoking its key answered 404 while the key kept working,
and deleting the tenant left its keys stored, working again for a tenant made later under the
same id. The gateway's view of the key records now stands in for the lost index."""

from __future__ import annotations

from collections.abc import Callable

import openai
import redis

from tests.support.gateway import acme_gateway, admin_client, chat_status, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "lost-index-admin-token-0123456789"


def test_a_lost_key_index_still_lists_revokes_and_deletes_the_tenants_keys(
    sim_factory: SimFactory, redis_url: str
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"rpm": 1000},
                            tenancy={"poll_interval_s": 0.1})
    r = redis.Redis.from_url(redis_url)
    with gw, admin_client(base, ADMIN) as admin:
        made = admin.post("/tenants/acme/keys").json()
        assert admin.post("/tenants", json={"id": "beta", "tier": "free"}).status_code == 201
        beta_key = admin.post("/tenants/beta/keys").json()["key"]
        acme = openai.OpenAI(base_url=f"{base}/v1", api_key=made["key"], max_retries=0)
        beta = openai.OpenAI(base_url=f"{base}/v1", api_key=beta_key, max_retries=0)
        assert [chat_status(acme), chat_status(beta)] == [200, 200]
        try:
            assert r.delete("kvgate:tkeys:acme", "kvgate:tkeys:beta") == 2
        finally:
            r.close()

        listed = admin.get("/tenants/acme").json()["keys"]
        assert made["id"] in str(listed), listed  # was []
        page = {t["id"]: t["keys"] for t in admin.get("/tenants").json()["data"]}
        assert made["id"] in str(page["acme"]), page
        revoked = admin.delete(f"/tenants/acme/keys/{made['id']}")
        assert revoked.status_code == 204, revoked.text  # was 404, the key still working
        wait_for(lambda: chat_status(acme) == 401, what="the revoked key refused")

        assert admin.delete("/tenants/beta").status_code == 204
        wait_for(lambda: chat_status(beta) == 401, what="the deleted tenant's key refused")
        assert admin.post("/tenants", json={"id": "beta", "tier": "free"}).status_code == 201
        assert admin.get("/tenants/beta").json()["keys"] == []
        again = openai.OpenAI(base_url=f"{base}/v1", max_retries=0,
                              api_key=admin.post("/tenants/beta/keys").json()["key"])
        wait_for(lambda: chat_status(again) == 200, what="the new beta loaded")
        # the old tenant's key was deleted with it: it must not work for the new one (200)
        assert chat_status(beta) == 401

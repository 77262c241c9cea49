"""A gateway started while its Redis refuses writes (here: read-only, as after a failover; the
same path as one not reachable at start) with the store's bootstrap marker already there: the
seeding of the configuration's tenants was postponed and never retried -- only a wiped store
(no marker) was seeded once it answered -- so a tenant newly added to the configuration file
waited for a restart. It is seeded at the first check that finds the store taking writes,
without touching what the store holds (a key made through the admin API still works). Real
redis-server, real gateways, the openai client."""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.integration.test_faults2_redis_read_only import _replica_of
from tests.support.gateway import (
    AUTH_SECRET,
    acme_gateway,
    admin_client,
    chat_status,
    gateway_proc,
    wait_for,
)
from tests.support.procs import Proc, free_port, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "postponed-seed-admin-token-01234"


def test_a_seeding_postponed_at_start_is_done_once_the_store_takes_writes(
        sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    with redis:
        first, base = acme_gateway(sim, url, ADMIN, {})
        with first, admin_client(base, ADMIN) as admin:  # seeds the store (its marker set)
            key = admin.post("/tenants/acme/keys").json()["key"]
        _replica_of(url, free_port())  # read-only from now on
        gw, base = gateway_proc(config={
            "pools": {"p": {"served_model": "m", "replicas": [sim]}},
            "models": {"llama": {"free": "p"}},
            "tiers": {"free": {"limits": {}}},
            "tenants": [{"id": "acme", "tier": "free"}, {"id": "beta", "tier": "free"}],
        }, env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
                "KVGATE_REDIS_URL": url}, auth=True)
        with gw, admin_client(base, ADMIN) as admin:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            assert chat_status(client) == 200  # the stored state is served
            assert admin.get("/tenants/beta").status_code == 404  # not seeded: refused
            _replica_of(url, None)
            wait_for(lambda: admin.get("/tenants/beta").status_code == 200, timeout=20,
                     what="the tenant added to the configuration seeded")
            assert admin.get("/tenants/beta").json()["tier"] == "free"
            assert chat_status(client) == 200  # the admin-made key untouched

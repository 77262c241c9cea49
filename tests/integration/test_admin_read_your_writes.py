"""An admin write is in force on the gateway that answered it: a key works at once, a revoked
key is refused at once (the request path reads an in-memory copy of the tenancy store, which
used to catch up a moment after the write's answer: a new tenant's first key was refused
about three times in five)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "admin-token-0123456789abcdef"
ROUNDS = 20


def test_keys_work_and_stop_working_as_soon_as_the_admin_api_answers(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(
        config={"pools": {"p": {"served_model": "sim-model", "replicas": [sim]}}}, auth=True,
        env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin, httpx.Client(base_url=base) as client:
        fresh, revoked = [], []
        for i in range(ROUNDS):
            assert admin.post("/tenants", json={"id": f"t{i}", "tier": "default"}).status_code \
                == 201
            created = admin.post(f"/tenants/t{i}/keys").json()
            auth = {"authorization": f"Bearer {created['key']}"}
            fresh.append(client.get("/v1/models", headers=auth).status_code)
            assert admin.delete(f"/tenants/t{i}/keys/{created['id']}").status_code == 204
            revoked.append(client.get("/v1/models", headers=auth).status_code)
        assert fresh == [200] * ROUNDS
        assert revoked == [401] * ROUNDS

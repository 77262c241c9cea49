"""An admin write refused because a Redis key under kvgate's namespace holds another type
(written by hand) writes nothing: the tenant deletion's script removed the tenant's record,
then failed on its key index (WRONGTYPE), so the 503 left the tenant gone with its key records
in place, unjournaled and unannounced; the tenant created again under its id got the old
keys back. Two real `kvgate serve` on one real redis-server, the official openai client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import redis

from tests.support.gateway import admin_client, chat_status, shared_gateways, wait_for
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "admin-token-authrev-0123456789ab"
BOUND_S = 3.0  # poll_interval_s (0.5 s) plus a reload, on a loaded machine


@pytest.fixture
def fleet() -> Iterator[tuple[redis.Redis, list[str]]]:
    procs: list[Proc] = []
    try:
        sim, sim_url = sim_proc(None, "--time-scale", "50", model="m")
        procs.append(sim.start())
        rproc, url = redis_proc()
        procs.append(rproc.start())
        config = {"pools": {"p": {"served_model": "m", "replicas": [sim_url]}},
                  "models": {"llama": {"default": "p"}}}
        bases = shared_gateways(procs, url, ADMIN, config)
        with redis.Redis.from_url(url) as raw:
            yield raw, bases
    finally:
        for proc in reversed(procs):
            proc.stop()


def _works(base: str, key: str) -> int:
    return chat_status(openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                     timeout=30))


def test_a_deletion_refused_for_a_wrong_type_deletes_nothing(
        fleet: tuple[redis.Redis, list[str]]) -> None:
    raw, (a, b) = fleet
    with admin_client(a, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "acme"}).status_code == 201
        key = admin.post("/tenants/acme/keys").json()["key"]
        raw.set("kvgate:tkeys:acme", "written by hand")  # the tenant's key index, a string
        refused = admin.delete("/tenants/acme")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["message"].count("WRONGTYPE") == 1
        assert "Traceback" not in refused.text

        raw.delete("kvgate:tkeys:acme")  # the operator removes what was written by hand
        assert admin.get("/tenants/acme").status_code == 200  # nothing was deleted
        assert _works(a, key) == 200 and _works(b, key) == 200
        assert admin.delete("/tenants/acme").status_code == 204
        assert admin.post("/tenants", json={"id": "acme"}).status_code == 201
    assert _works(a, key) == 401
    wait_for(lambda: _works(b, key) == 401, BOUND_S, "the other gateway refuses the key")

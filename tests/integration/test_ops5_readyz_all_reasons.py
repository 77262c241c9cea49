"""/readyz names every tenancy reason that holds, not only the first. On a Redis that evicts
any key, a gateway started with another salt secret than its peer said only "Redis evicts any
key": the split cache (every tenant's cache_salt differs behind each gateway) stayed hidden
until the eviction policy was fixed. Real redis-server, two real gateways."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import httpx

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "ops5-readyz-admin-token-0123456789"


def test_readyz_names_an_evicting_redis_and_another_salt_secret(
        sim_factory: SimFactory, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "50")
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    procs.append(Proc([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                       "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy",
                       "allkeys-lru"], ready_port=port).start())
    bases = []
    for secret in ("ops5-first-salt-secret-0123456789", "ops5-other-salt-secret-0123456789"):
        gw, base = gateway_proc(upstreams=[sim], auth=True, env={
            "KVGATE_SALT_SECRET": secret, "KVGATE_ADMIN_TOKEN": ADMIN,
            "KVGATE_REDIS_URL": f"redis://127.0.0.1:{port}/0"})
        procs.append(gw.start())
        bases.append(base)

    def reason() -> str:
        answer = httpx.get(f"{bases[1]}/readyz", timeout=10)
        assert answer.status_code == 200  # degraded, still ready
        return str(answer.json()["tenancy"]["reason"] or "")

    wait_for(lambda: "other salt secret" in reason(), timeout=30,
             what="/readyz naming the other salt secret")
    said = reason()
    assert "maxmemory-policy allkeys-lru" in said, said
    assert "1 other salt secret(s)" in said, said
    assert ADMIN not in said and "salt-secret-0123456789" not in said

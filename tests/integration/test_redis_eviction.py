"""A Redis that evicts any key when full (`maxmemory-policy allkeys-*`) takes kvgate's state
with it: tenants, keys, the policy, the bootstrap marker (each eviction read as a wiped store)
and leases. The gateway says so once at start (it said nothing: the first sign was a store
"wiped" again and again under memory pressure); not with `noeviction` nor without a
`maxmemory`, nor where CONFIG is refused to its ACL user."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import redis

from tests.support.gateway import acme_gateway
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "eviction-admin-token-0123456789"
SAID = "evicts any key when it is full (maxmemory-policy allkeys-lru)"


def redis_with(*args: str) -> tuple[Proc, str, int]:
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           *args]
    return Proc(cmd, ready_port=port), f"redis://127.0.0.1:{port}/0", port


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction", "allkeys-lru, no CONFIG",
                                    "allkeys-lru, no maxmemory"])
def test_an_evicting_redis_is_named_at_start(sim_factory: SimFactory, policy: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    limit = "0" if "no maxmemory" in policy else "64mb"  # 0: it never evicts
    server, url, port = redis_with("--maxmemory", limit,
                                   "--maxmemory-policy", policy.split(",")[0])
    with server:
        if "no CONFIG" in policy:  # an ACL user with every command but CONFIG
            r = redis.Redis(port=port)
            try:
                r.acl_setuser("kv", enabled=True, passwords=["+kv-pass-0123"], keys=["*"],
                              channels=["*"], commands=["+@all", "-config"])
            finally:
                r.close()
            url = url.replace("redis://", "redis://kv:kv-pass-0123@")
        gw, _ = acme_gateway(sim, url, ADMIN, {"rpm": 100})
        with gw:
            said = SAID in gw.output()
    assert said == (policy == "allkeys-lru"), gw.output()

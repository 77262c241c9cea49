"""A Redis outage in a gateway's log: per component, one line naming it (address and cause),
at most one a minute while it lasts, one when Redis answers again -- no component's own second
opinion beside them (the shared `gateway.tenancy.reachability` lines)."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    persistent_redis,
    wait_for,
)
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "outage-log-admin-token-0123456789"


def _chat(base: str, key: str) -> int:
    return httpx.post(f"{base}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                      json={"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2}, timeout=10).status_code


def test_an_outage_is_one_line_per_component_and_one_when_it_ends(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url, _ = persistent_redis(str(tmp_path))
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"rpm": 100000}}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN, "KVGATE_REDIS_URL": url,
           "KVGATE_TENANCY__POLL_INTERVAL_S": "0.1"}
    gw, base = gateway_proc(config=config, env=env, auth=True, args=["--log-format", "text"])
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        assert _chat(base, key) == 200
        redis.stop()
        end = time.monotonic() + 4  # requests keep coming while Redis is away
        while time.monotonic() < end:
            assert _chat(base, key) == 200  # per-process limits meanwhile
            time.sleep(0.1)
        redis.start()
        wait_for(lambda: not httpx.get(f"{base}/readyz").json()["degraded"], 20, "recovery")
        assert _chat(base, key) == 200  # the rate limits try Redis again
        wait_for(lambda: "rate limits: Redis at" in gw.output(tail=None), 10, "its recovery")
        log = "\n".join(line for line in gw.output(tail=None).splitlines() if "Redis" in line
                        or "tenancy" in line)
    # "date time LEVEL logger [subject: ]message"
    down = Counter(re.findall(r"^\S+ \S+ \S+ \S+ (.*?)cannot reach Redis at ", log, re.M))
    back = Counter(re.findall(r"^\S+ \S+ \S+ \S+ (.*?)Redis at \S+ answers again", log, re.M))
    assert set(down) >= {"", "rate limits: "}, log  # the tenancy store (no subject), the limits
    assert all(n == 1 for n in down.values()), down
    assert back == down, (down, back)
    for own_line in ("reachable again", "Redis unreachable", "tenancy store unreachable"):
        assert own_line not in log, own_line

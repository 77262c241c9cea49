"""KVGATE_REDIS_URL with a password, on a Redis that has none (no requirepass): the tenancy
store served, and the shared routing state was refused with "server replied ERR" and nothing
more, in the log and in /readyz's sync.reason. It now says what is wrong and what to do. A
real redis-server and a real gateway; the password is never shown."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "ops5-nopass-admin-token-0123456789"
PASSWORD = "ops5-unneeded-password"


def test_a_password_redis_does_not_want_is_named(
        sim_factory: SimFactory, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "50")
    redis, url = redis_proc()
    procs.append(redis.start())
    gw, base = gateway_proc(upstreams=[sim], auth=True, args=["--log-format", "text"], env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_REDIS_URL": url.replace("redis://", f"redis://:{PASSWORD}@")})
    procs.append(gw.start())

    def sync_reason() -> str:
        sync = httpx.get(f"{base}/readyz", timeout=10).json().get("sync", {})
        return str(sync.get("reason") or "")

    wait_for(lambda: "requirepass" in sync_reason(), timeout=30, what="sync.reason")
    assert "remove the password from the URL" in sync_reason()
    wait_for(lambda: "has none for its default user" in gw.output(None), timeout=30,
             what="the log line")
    assert PASSWORD not in gw.output(None)

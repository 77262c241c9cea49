"""Redis restarted with a password under a running gateway: the log said "cannot reach Redis
(connection refused)" at once, then nothing of the WRONGPASS/NOAUTH that followed until the
minute's summary line, while /readyz already named it. The refusal, what an operator acts on,
now has its own line at once. A real redis-server and a real gateway."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "ops5-admin-token-0123456789"


def test_a_refusal_after_refused_connections_is_logged_at_once(
        sim_factory: SimFactory, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "50")
    redis, url = redis_proc()
    procs.append(redis.start())
    gw, base = gateway_proc(upstreams=[sim], auth=True, args=["--log-format", "text"], env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN, "KVGATE_REDIS_URL": url})
    procs.append(gw.start())
    redis.stop()
    wait_for(lambda: "(connection refused)" in gw.output(None), timeout=30,
             what="the refused connections' line")
    procs.append(Proc([*redis.cmd, "--requirepass", "the-new-password"],
                      ready_port=redis.ready_port).start())

    def refused() -> bool:
        return "now refused by Redis" in gw.output(None)

    wait_for(refused, timeout=30, what="a line naming the refusal")
    line = next(ln for ln in gw.output(None).splitlines() if "now refused by Redis" in ln)
    assert "NOAUTH" in line and "KVGATE_REDIS_URL gives none" in line
    assert "still" not in line  # not the summary, which comes a minute after the first line

    def readyz_names_it() -> bool:
        reason = httpx.get(f"{base}/readyz", timeout=10).json()["tenancy"]["reason"]
        return "NOAUTH" in (reason or "")

    wait_for(readyz_names_it, timeout=30, what="/readyz naming NOAUTH")

    def store_says_it() -> bool:  # the tenancy store's own line too, not only the sync's
        return any("now refused by Redis" in ln and "shared routing state" not in ln
                   for ln in gw.output(None).splitlines())

    wait_for(store_says_it, timeout=30, what="the tenancy store's line")

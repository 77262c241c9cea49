"""A Redis farther away than `tenancy.redis_timeout_s` (every round trip 0.6 s, the timeout
0.5 s): it answers a `redis-cli PING`, never a load, and the gateway never gets ready. Its
`/readyz` and its log said "store unreachable: timed out", which sends an operator to the
network; they now name the setting and its value."""

from __future__ import annotations

import httpx
import pytest

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc, start_sims
from tests.support.slow_link import SlowLink

pytestmark = pytest.mark.slow

HINT = "timed out (no answer within tenancy.redis_timeout_s, 0.5 s)"


def test_a_redis_slower_than_the_timeout_is_named_with_the_setting(procs: list[Proc]) -> None:
    redis, redis_url = redis_proc()
    procs.append(redis.start())
    _, urls = start_sims(procs, 1)
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": urls}},
              "models": {"llama": {"default": "p"}},
              "tenants": [{"id": "acme", "tier": "default"}]}
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    with SlowLink(port, 0.3) as link:
        gw, base = gateway_proc(config=config, auth=True, ready=False, env={
            "KVGATE_SALT_SECRET": AUTH_SECRET,
            "KVGATE_REDIS_URL": f"redis://127.0.0.1:{link.port}/0"})
        procs.append(gw.start())

        def reason() -> str:
            ready = httpx.get(f"{base}/readyz", timeout=5)
            assert ready.status_code == 503  # never loaded: not ready
            return str(ready.json()["tenancy"]["reason"])

        wait_for(lambda: reason().startswith("store unreachable: timed out"), timeout=20,
                 what="the load timed out")
        assert reason() == f"store unreachable: {HINT}"
        wait_for(lambda: f"Redis at 127.0.0.1:{link.port} ({HINT})" in gw.output(None),
                 what="the log line")

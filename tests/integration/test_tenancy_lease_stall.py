"""Concurrency leases whose release fails while Redis is away are released as soon as Redis
answers again: the tenant is not locked out for the lease TTL (30 s).

Redis goes away by stopping (and restarting with its append-only file, as in production) rather
than by ``DEBUG SLEEP``: a release sent into a stalled Redis may still run when it wakes, so
only a release that surely never reached Redis tells whether the gateway retries it.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from tests.support.gateway import (
    acme_gateway,
    admin_client,
    chat_status,
    persistent_redis,
    wait_for,
)
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "stall-admin-token-0123456789"


def _degraded(base: str) -> bool:
    return bool(httpx.get(f"{base}/readyz").json()["degraded"])


def test_a_lease_whose_release_failed_is_freed_when_redis_answers_again(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    # the replica sends two tokens, then holds the stream until the client leaves
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    redis, url, port = persistent_redis(str(tmp_path))
    gw, base = acme_gateway(sim, url, ADMIN, {"max_concurrency": 1})
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hold"}], max_tokens=50,
            stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # admitted: the one lease is held in Redis
        assert chat_status(client) == 429  # the lease is real

        redis.stop()
        wait_for(lambda: _degraded(base), what="the gateway noticing Redis is gone")
        stream.close()  # the client leaves while Redis is away: the release fails
        httpx.post(f"{sim}/sim/faults", json={"hang_after_tokens": -1}).raise_for_status()
        again, _, _ = persistent_redis(str(tmp_path), port)  # the lease is still in its data
        with again:
            wait_for(lambda: not _degraded(base), what="the gateway back on Redis")
            assert chat_status(client) == 200  # not 429 until the stale lease's TTL runs out
        assert "leases released after Redis answered again" in gw.output()


def test_a_lease_admitted_by_a_stalled_redis_after_the_gateway_gave_up_is_freed(
    sim_factory: SimFactory,
) -> None:
    # a paused Redis (SIGSTOP, a long fork or script) runs the admission it had read when it
    # wakes, after the gateway timed out and admitted the request on its own: that lease,
    # which nobody holds, must not lock the tenant out for the lease TTL (30 s)
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    gw, base = acme_gateway(sim, url, ADMIN, {"max_concurrency": 1})
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        assert chat_status(client) == 200
        assert redis.popen is not None
        redis.popen.send_signal(signal.SIGSTOP)
        try:
            assert chat_status(client) == 200  # admitted on the per-process fallback
        finally:
            redis.popen.send_signal(signal.SIGCONT)
        wait_for(lambda: not _degraded(base), what="the gateway back on Redis")
        port = url.rsplit(":", 1)[1].split("/")[0]
        leases = [shutil.which("redis-cli") or "redis-cli", "-p", port, "ZCARD",
                  "kvgate:rl:{acme}:leases"]
        wait_for(lambda: subprocess.run(leases, capture_output=True, text=True,
                                        check=True).stdout.strip() == "0",
                 what="the stalled admission's lease freed")  # well before its TTL
        assert chat_status(client) == 200

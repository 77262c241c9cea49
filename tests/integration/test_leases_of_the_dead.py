"""A process killed while it holds a tenant's concurrency leases (SIGKILL, the OOM killer, a
pod gone) does not lock the tenant out for the lease TTL (30 s): a worker of ``server.workers``
is freed by its supervisor at once, a whole gateway within ``tenancy.lease_holder_ttl_s``
(its heartbeat's TTL). Real processes: Redis, the simulator, gateways, the openai client
streaming."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "leases-admin-token-0123456789"
LIMIT = 4


def _gateway(sim: str, redis_url: str, **server: Any) -> tuple[Proc, str]:
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"max_concurrency": LIMIT}}},
        "tenants": [{"id": "acme", "tier": "free"}],
        "server": server,
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    return gateway_proc(config=config, env=env, auth=True)


class Held:
    """One stream on a connection of its own, held open (the replica hangs after two tokens);
    `pid` is the gateway process serving it (its `/readyz` names it)."""

    def __init__(self, base: str, key: str) -> None:
        self.http = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=1))
        self.pid = int(self.http.get(f"{base}/readyz").json()["sync"]["member"].rsplit(":", 2)[1])
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                               http_client=self.http)  # type: ignore[arg-type]
        self.stream = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hold"}], max_tokens=50,
            stream=True, extra_body={"ignore_eos": True})
        next(iter(self.stream))  # admitted: its lease is in Redis

    def close(self) -> None:
        with contextlib.suppress(httpx.TransportError):  # its gateway was killed
            self.stream.close()
        self.http.close()


def _admitted(base: str, key: str) -> bool:
    """One more stream admitted for the tenant (200), or refused (429); closed at once."""
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=10,
                               http_client=fresh)  # type: ignore[arg-type]
        try:
            stream = client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "probe"}], max_tokens=5,
                stream=True)
        except openai.RateLimitError:
            return False
        stream.close()
        return True


def _freed_after(base: str, key: str, victim: int, within_s: float) -> float:
    """SIGKILL `victim`; seconds until the tenant is admitted again (fails after `within_s`)."""
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: _admitted(base, key), timeout=within_s,
             what="the tenant admitted again after its gateway process was killed")
    return time.monotonic() - killed


def test_a_killed_worker_frees_its_tenants_leases_at_once(
    redis_url: str, sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--hang-after-tokens", "2", model="m")
    gw, base = _gateway(sim, redis_url, workers=2)
    held: list[Held] = []
    with gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        try:
            held = [Held(base, key) for _ in range(LIMIT)]
            assert not _admitted(base, key)  # the tenant is full
            victim = held[0].pid
            on_victim = sum(h.pid == victim for h in held)
            elapsed = _freed_after(base, key, victim, within_s=3.0)  # was 30 s: the lease TTL
            print(f"worker killed: tenant admitted again after {elapsed:.2f} s")
            # exactly the dead worker's leases were freed: the survivor's still count
            held += [Held(base, key) for _ in range(on_victim)]
            assert not _admitted(base, key)
        finally:
            for h in held:
                h.close()


def test_a_killed_gateway_frees_its_tenants_leases_within_the_heartbeat_ttl(
    redis_url: str, sim_factory: SimFactory,
) -> None:
    """A whole gateway (a pod) gone: nobody sees it die; its heartbeat expires (5 s)."""
    _, sim = sim_factory("--hang-after-tokens", "2", model="m")
    doomed, doomed_base = _gateway(sim, redis_url)
    other, base = _gateway(sim, redis_url)
    held: list[Held] = []
    with doomed, other:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        try:
            held = [Held(doomed_base, key) for _ in range(LIMIT)]
            assert not _admitted(base, key)
            assert doomed.popen is not None
            elapsed = _freed_after(base, key, doomed.popen.pid, within_s=5.0 + 1.5)
            print(f"gateway killed: tenant admitted again after {elapsed:.2f} s")
        finally:
            for h in held:
                h.close()

"""A request never served does not spend its tenant's budget: answered 503 because no
replica of its pool is up (or 502 because its replicas failed before any output), its
admission gives back its request (RPM) and its tokens (TPM) when it is settled.

Charged, the requests a client kept sending through an outage spent its requests per minute,
and once the replica was back its first requests were refused 429 for a minute. A real
gateway (on Redis, and on its own in-memory limits), a real simulator killed and started
again on its port, the official openai client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    chat_status,
    gateway_proc,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "unserved-refund-admin-token-0123456789"
RPM = 4
SLOW_REFILL_HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 1,
                      "eject_base_s": 0.2, "eject_max_s": 1.0}


@pytest.fixture(params=["redis", "memory"])
def state(request: pytest.FixtureRequest) -> Iterator[str | None]:
    if request.param == "memory":
        yield None
        return
    proc, url = redis_proc()
    with proc:
        yield url


def _healthy(base: str) -> float:
    return sum(metric_values(base, "kvgate_replica_healthy").values())


@pytest.mark.parametrize("tpm", [100_000, None])  # (the settle of a tenant without TPM)
def test_requests_refused_for_an_outage_do_not_spend_the_tenants_rpm(
    sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc], state: str | None,
    tpm: int | None,
) -> None:
    sim, url = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"free": "p"}},
              "tiers": {"free": {"limits": {"rpm": RPM, **({"tpm": tpm} if tpm else {})}}},
              "tenants": [{"id": "acme", "tier": "free"}], "health": SLOW_REFILL_HEALTH}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           **({"KVGATE_REDIS_URL": state} if state else {})}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=10)
        sim.kill()
        wait_for(lambda: _healthy(base) == 0, what="the replica seen down")
        outage = [chat_status(client) for _ in range(RPM)]
        assert set(outage) <= {502, 503}, outage
        port = urlsplit(url).port
        assert port is not None
        back, _ = sim_proc(port, "--time-scale", "50", model="m")
        procs.append(back.start())
        wait_for(lambda: _healthy(base) == 1, what="the replica seen up again")
        # the whole minute's budget is there: a refill in the seconds since gives one at most
        after = [chat_status(client) for _ in range(RPM)]
        assert after == [200] * RPM, (outage, after)
        assert chat_status(client) == 429  # and it is a budget: the next one is over it



def test_requests_shed_from_a_full_pools_queue_do_not_spend_the_tenants_rpm(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    """A request flow control sheds (429 past its tier's longest wait) was never served
    either: charged, a few seconds of overload spent the minute's budget."""
    _, url = sim_factory("--time-scale", "0.05", model="m")  # (a slow engine)
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"free": "p"}},
              "tiers": {"free": {"limits": {"rpm": RPM + 2}, "flow": {"max_wait_s": 0.3}}},
              "tenants": [{"id": "acme", "tier": "free"}],
              "flow": {"enabled": True, "max_inflight": 1}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin, ThreadPoolExecutor(1) as pool:
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        holder = pool.submit(  # the pool's one slot while it generates its long answer
            lambda: client.chat.completions.create(
                model="llama", max_tokens=100,
                messages=[{"role": "user", "content": "a long answer"}]))
        wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 1,
                 what="the long answer to take the slot")
        shed = [chat_status(client) for _ in range(RPM)]
        assert not holder.done() and shed == [429] * RPM, shed
        holder.result()
        # 1 of RPM + 2 spent (the long answer): RPM + 1 left, then the budget refuses
        after = [chat_status(client) for _ in range(RPM + 1)]
        assert after == [200] * (RPM + 1), (shed, after)
        # (a refill in the seconds since gives one more at most)
        assert 429 in [chat_status(client) for _ in range(2)]

"""An SDK whose timeout is shorter than the queue's wait does not spend its tenant's RPM.

The official openai client retries a timed-out request twice by itself. A request that timed
out while flow control held it in the queue was never sent to a replica (its tokens were
given back, its concurrency lease too), but its request stayed counted against the tenant's
RPM: one call of a client with a 1 s timeout in front of a pool saturated for longer took
three requests of the budget and got nothing, and the tenant was refused 429 sooner for the
requests it then sent. A request shed from the queue (429), or refused for want of a replica
(503), gives its request back; now one whose client left the queue does too.

One gateway, one simulated replica whose streams hang, ``flow.max_inflight: 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

ADMIN = "ratelimit-queued-timeouts-admin-token-0123"
RPM = 10  # a request back every 6 s


def _abandoned(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_abandoned_total").values())


@pytest.fixture
def gateway(sim_factory: Callable[..., tuple[Proc, str]]) -> Iterator[tuple[str, str]]:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"default": {"limits": {"rpm": RPM}, "flow": {"max_wait_s": 60}}},
              "flow": {"enabled": True, "max_inflight": 1}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    proc, base = gateway_proc(config=config, env=env, auth=True)
    with proc, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "t", "tier": "default"}).status_code == 201
        yield base, str(admin.post("/tenants/t/keys").json()["key"])


def test_timeouts_in_the_queue_do_not_spend_the_rpm(gateway: tuple[str, str]) -> None:
    base, key = gateway
    with httpx.Client(timeout=30) as filler:
        resp = filler.send(filler.build_request(
            "POST", f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": "llama", "stream": True, "max_tokens": 50,
                  "messages": [{"role": "user", "content": "filler"}]}), stream=True)
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        next(chunks)  # it holds the pool's only seat, and its replica hangs
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=2.0)  # 2 retries
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "queued"}], max_tokens=2)
        resp.close()
    # the call and its two retries, each left the queue (counted as the gateway sees it go)
    wait_for(lambda: _abandoned(base) == 3, 20, "three requests abandoned in the queue")
    check = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
    raw = check.chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "after"}], max_tokens=1)
    # the filler and this one are spent (3 more before); a refill may have come meanwhile
    assert int(raw.headers["x-ratelimit-remaining-requests"]) >= RPM - 2

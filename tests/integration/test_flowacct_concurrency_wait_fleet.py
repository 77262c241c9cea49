"""A concurrency refusal's ``Retry-After`` is the fleet's, not one process's: two gateways
share a tenant's leases through Redis, and a request refused by gateway B while gateway A's
stream holds the tenant's only slot is told when that stream is likely over. B holds none of
the leases and used to say 1 s (`HoldTimes` saw this process's leases only), so the openai
SDK's two retries a second apart spent themselves while A's stream ran for seconds.

Two real gateways on a real redis-server before one simulated replica decoding slowly, the
tenant `acme` at ``max_concurrency: 1``; the official openai client.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.support.gateway import admin_client, inflight, shared_gateways, wait_for
from tests.support.procs import Proc

ADMIN = "flowacct-conc-admin-token-0123456789"
TOKENS = 30
ASK: dict[str, Any] = {"model": "llama", "max_tokens": TOKENS, "extra_body": {"ignore_eos": True},
                       "messages": [{"role": "user", "content": "hi"}]}


def _stream(client: openai.OpenAI) -> float:
    t0 = time.monotonic()
    for _ in client.chat.completions.create(**ASK, stream=True):
        pass
    return time.monotonic() - t0


def test_a_refusal_on_another_gateway_says_when_the_fleet_frees_a_slot(
    sim_factory: Callable[..., tuple[Proc, str]], redis_url: str, procs: list[Proc],
) -> None:
    _, sim = sim_factory("--time-scale", "1", "--slowdown", "20", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"free": "p"}},
              "tiers": {"free": {"limits": {"max_concurrency": 1}}},
              "tenants": [{"id": "acme", "tier": "free"}]}
    a, b = shared_gateways(procs, redis_url, ADMIN, config)
    with admin_client(a, ADMIN) as admin:
        key = str(admin.post("/tenants/acme/keys").json()["key"])
    via_a = openai.OpenAI(base_url=f"{a}/v1", api_key=key, max_retries=0, timeout=120)
    via_b = openai.OpenAI(base_url=f"{b}/v1", api_key=key, max_retries=0, timeout=120)
    took = _stream(via_a)  # its hold time is known from now on (on A: B has held nothing)
    assert took >= 3, f"the replica decodes too fast for this test ({took:.1f} s)"
    first = via_a.chat.completions.create(**ASK, stream=True)
    running = threading.Thread(target=lambda: [None for _ in first], daemon=True)
    next(iter(first))  # A holds the tenant's only slot
    running.start()
    with pytest.raises(openai.RateLimitError) as err:
        via_b.chat.completions.create(**ASK)
    said = err.value.response.headers
    assert 2 <= int(said["retry-after"]) <= math.ceil(took) + 1, dict(said)
    # the SDK with its default retries (two) gets in through B once A's stream is over
    sdk = openai.OpenAI(base_url=f"{b}/v1", api_key=key, timeout=120)
    answer = sdk.chat.completions.create(**ASK)
    assert answer.usage is not None and answer.usage.completion_tokens == TOKENS
    running.join(60)
    wait_for(lambda: inflight(a) + inflight(b) == 0, 20, "nothing in flight")


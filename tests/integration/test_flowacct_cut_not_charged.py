"""A request kvgate cut with a 504 before any output is not charged to its tenant's RPM, at
either edge. The HTTP edge retries a try cut at the first-byte timeout on another replica and
charges the client's request once; on its last try, and behind Envoy (the picker cannot send
a cut request again), the client got a 504 and its SDK sends the request again: each 504 was a
request of the RPM, so a tenant at ``rpm: 1`` whose call met a hung replica was refused 429
once the replica answered again, for a request nobody served.

Real simulator (``engine_hang`` switched at run time), real `kvgate serve` / `kvgate epp` behind
a real Envoy, real Redis for the picker's tenancy, the official openai client.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, sim_proc

ADMIN = "flowacct-cut-admin-token-0123456789"
ASK: dict[str, Any] = {"model": "llama", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}


@contextmanager
def _edge(edge: str, sim: str, redis_url: str) -> Iterator[tuple[str, str]]:
    """(the base URL clients use, the base of the process that routes: its /metrics)."""
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"free": "p"}},
              "tiers": {"free": {"limits": {"rpm": 1}}},
              "tenants": [{"id": "acme", "tier": "free"}],
              "upstream": {"first_byte_timeout_s": 1, "max_attempts": 1},
              "health": {"interval_s": 0.2, "timeout_s": 0.5, "stall_after_s": None}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    procs: list[Proc] = []
    try:
        if edge == "http":
            gw, base = gateway_proc(config=config, env=env, auth=True)
            procs.append(gw.start())
            yield base, base
            return
        epp = epp_proc(config=config, env=env, auth=True)
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        yield base, epp.base
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_a_504_cut_before_any_output_leaves_the_rpm(edge: str, redis_url: str) -> None:
    sim, url = sim_proc(None, "--time-scale", "20", "--engine-hang", model="m")
    with sim, _edge(edge, url, redis_url) as (base, routing):
        with admin_client(routing, ADMIN) as admin:
            key = str(admin.post("/tenants/acme/keys").json()["key"])
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as err:  # (a stream: the first-byte cut)
            client.chat.completions.create(**ASK, stream=True)
        assert err.value.status_code == 504, err.value.response.text
        httpx.post(f"{url}/sim/faults", json={"engine_hang": False}, timeout=10)
        wait_for(lambda: inflight(routing) == 0, 20, "the cut request over")
        wait_for(lambda: _healthy(routing), 20, "the replica healthy")
        # its one request of the minute is still there: the cut one cost nothing
        answer = client.chat.completions.create(**ASK)
        assert answer.choices[0].message.content is not None
        with pytest.raises(openai.RateLimitError):  # (and the limit still holds)
            client.chat.completions.create(**ASK)
        wait_for(lambda: inflight(routing) == 0, 20, "nothing in flight")


def _healthy(base: str) -> bool:
    values = metric_values(base, "kvgate_replica_healthy")
    return bool(values) and all(v == 1 for v in values.values())

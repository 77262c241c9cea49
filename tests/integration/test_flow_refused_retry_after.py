"""A request refused at a full queue that has not moved for seconds is told to come back after
at least that long, not after 1 s.

Its Retry-After was the queue ahead of it drained at the pool's recent dispatch rate. When
the pool stalls (its replicas hold their requests), the rate of what went before decays but
stays above zero, and a short queue reads as drained in an instant: a request refused at the
door of a queue stalled for 3 s was told 1 s and came back at once to be refused again, where
one shed from that queue at the same instant is told at least its wait
(`test_flow_stalled_retry_after`).

One real gateway before one simulated replica whose streams hang after a few tokens;
``flow.max_inflight: 1`` and ``max_queue: 1``: one filler stream fills the pool, one request
fills the queue. The official openai client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import openai

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "flow-refused-admin-token-0123456789"
STALL_S = 3


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def test_a_request_refused_at_a_stalled_full_queue_is_told_at_least_the_stall(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "5", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"free": {"flow": {"max_wait_s": 60}}},
              "flow": {"enabled": True, "max_inflight": 1, "max_queue": 1}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw:
        with admin_client(base, ADMIN) as admin:
            assert admin.post("/tenants", json={"id": "t", "tier": "free"}).status_code == 201
            key = str(admin.post("/tenants/t/keys").json()["key"])
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
        filler = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "fill"}], max_tokens=400,
            stream=True)
        next(iter(filler))  # it runs, and hangs: the pool is full
        queued = threading.Thread(target=client.chat.completions.create, daemon=True, kwargs={
            "model": "llama", "messages": [{"role": "user", "content": "queued"}],
            "max_tokens": 2})
        queued.start()
        wait_for(lambda: _depth(base) == 1, 10, "the queue to fill")
        time.sleep(STALL_S)  # the queue stays still this long (nothing can go)
        try:
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "refused"}], max_tokens=2)
            raise AssertionError("a full queue took the request")
        except openai.APIStatusError as exc:
            refused = exc.response
        assert refused.status_code == 503  # (the only tier: the top band; the pool overloaded)
        assert refused.json()["error"]["code"] == "queue_shed"
        assert int(refused.headers["retry-after"]) >= STALL_S  # it was 1
        filler.close()  # the queued request goes; nothing stays counted
        queued.join(30)
        wait_for(lambda: _depth(base) == 0 and inflight(base) == 0, 20, "the pool to drain")

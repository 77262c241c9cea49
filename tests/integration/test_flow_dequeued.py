"""Flow control's counters add up: every request counted in ``kvgate_flow_queued_total`` is,
once the queue is empty again, counted once in ``kvgate_flow_dequeued_total`` under how it
left (released, shed, abandoned, refused, moved, interrupted).

A request refused while queued (its key revoked: 401) used to leave no trace in any flow
counter: queued 4 against released 1 (``kvgate_flow_wait_seconds``), shed 1 and abandoned 1,
so an operator reconciling the queue saw a request missing.

One real gateway with Redis in front of one simulated replica whose streams hang after a few
tokens; ``flow.max_inflight: 1`` makes the pool saturated while one filler stream runs. The
official openai client sends the queued requests.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from functools import partial

import httpx
import openai
import pytest

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "flow-dequeued-admin-token-0123456789"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    procs: list[Proc] = []
    try:
        redis, url = redis_proc()
        procs.append(redis.start())
        sim, sim_url = sim_proc(None, "--hang-after-tokens", "5", model="m")
        procs.append(sim.start())
        config = {"pools": {"p": {"served_model": "m", "replicas": [sim_url]}},
                  "models": {"llama": {"default": "p"}},
                  "tiers": {"free": {}, "impatient": {"flow": {"max_wait_s": 1}}},
                  "flow": {"enabled": True, "max_inflight": 1}}
        env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
               "KVGATE_ADMIN_TOKEN": ADMIN}
        gw, gw_base = gateway_proc(config=config, env=env, auth=True)
        procs.append(gw.start())
        yield gw_base
    finally:
        for proc in reversed(procs):
            proc.stop()


def _tenant(base: str, tier: str) -> tuple[str, str, str]:
    """A new tenant of ``tier``: its id, a key and the key's id."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    with admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": tid, "tier": tier}).status_code == 201
        key = admin.post(f"/tenants/{tid}/keys").json()
    return tid, key["key"], key["id"]


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def _depth_is(base: str, n: int) -> bool:
    return _depth(base) == n


def _by_outcome(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in metric_values(base, "kvgate_flow_dequeued_total").items():
        assert 'pool="p"' in labels
        outcome = labels.split('outcome="')[1].split('"')[0]
        out[outcome] = out.get(outcome, 0.0) + value
    return out


class Queued(threading.Thread):
    """One request sent while the pool is saturated: its status, or the exception's name."""

    def __init__(self, base: str, key: str, timeout: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                    timeout=timeout)
        self.status: int | str = 0

    def run(self) -> None:
        try:
            self.status = self.client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "queued"}], max_tokens=2,
            ).status_code
        except openai.APIStatusError as exc:
            self.status = exc.status_code
        except openai.APIConnectionError as exc:  # its own timeout: it left the queue
            self.status = type(exc).__name__


def test_every_queued_request_is_counted_once_as_it_leaves(base: str) -> None:
    _, key, _ = _tenant(base, "free")
    filler = httpx.Client(timeout=30)
    try:
        resp = filler.send(filler.build_request(
            "POST", f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": "llama", "stream": True, "max_tokens": 50, "ignore_eos": True,
                  "messages": [{"role": "user", "content": "filler"}]}), stream=True)
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        next(chunks)  # it holds the pool's only seat

        revoked_tid, revoked, revoked_id = _tenant(base, "free")
        _, patient, _ = _tenant(base, "free")
        _, hasty, _ = _tenant(base, "impatient")
        refused = Queued(base, revoked)
        released = Queued(base, patient)
        shed = Queued(base, hasty)
        left = Queued(base, patient, timeout=1.5)
        for n, call in enumerate((refused, released, shed, left), 1):
            call.start()
            wait_for(partial(_depth_is, base, n), 10, f"{n} requests queued")
        with admin_client(base, ADMIN) as admin:
            assert admin.delete(f"/tenants/{revoked_tid}/keys/{revoked_id}").status_code == 204
        for call in (refused, shed, left):
            call.join(20)
        # the client that timed out is seen gone by the edge's probe (its socket's reset)
        wait_for(lambda: _depth(base) == 1, 10, "only the patient request left queued")
    finally:
        filler.close()
    released.join(30)
    wait_for(lambda: _depth(base) == 0 and inflight(base) == 0, 10, "the queue to drain")
    assert (refused.status, released.status, shed.status, left.status) == (
        401, 200, 429, "APITimeoutError")
    queued = sum(metric_values(base, "kvgate_flow_queued_total").values())
    assert queued == 4
    outcomes = _by_outcome(base)
    assert outcomes == {"refused": 1, "released": 1, "shed": 1, "abandoned": 1}
    assert sum(outcomes.values()) == queued

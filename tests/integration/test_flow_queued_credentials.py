"""A request waiting in flow control's queue is sent on its caller's credentials in force when
it leaves the queue, not on those it arrived with: a key revoked, or a tenant deleted, while
it waits gets a 401 and never reaches a replica; a salt rotated meanwhile is the one it
carries (the old salt never reaches a replica after `rotate-salt`).

Two gateways on one Redis in front of one simulated replica whose streams hang after a few
tokens; ``flow.max_inflight: 1`` makes the pool saturated while one filler stream runs. The
request waits at gateway A; the key and tenant changes are made through gateway B (they reach
A by Redis), the salt rotation through A. The official openai client sends the request.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "queued-credentials-admin-token-0123"


@dataclass
class Stack:
    a: str
    b: str
    sim: str
    redis: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        redis, url = redis_proc()
        procs.append(redis.start())
        sim, sim_url = sim_proc(None, "--hang-after-tokens", "5", model="m")
        procs.append(sim.start())
        config = {"pools": {"p": {"served_model": "m", "replicas": [sim_url]}},
                  "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
                  "flow": {"enabled": True, "max_inflight": 1}}
        env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
               "KVGATE_ADMIN_TOKEN": ADMIN}
        bases = []
        for _ in range(2):
            gw, base = gateway_proc(config=config, env=env, auth=True)
            procs.append(gw.start())
            bases.append(base)
        yield Stack(bases[0], bases[1], sim_url, url)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _tenant(base: str) -> tuple[str, str, str]:
    """A new tenant of tier free (at most 5 requests at once): its id, a key and the key's
    id."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    with admin_client(base, ADMIN) as admin:
        created = admin.post("/tenants", json={"id": tid, "tier": "free",
                                               "limits": {"max_concurrency": 5}})
        assert created.status_code == 201
        key = admin.post(f"/tenants/{tid}/keys").json()
    return tid, key["key"], key["id"]


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def _ask(base: str, key: str, text: str) -> int:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
    try:
        return client.chat.completions.with_raw_response.create(
            model="llama", messages=[{"role": "user", "content": text}], max_tokens=2
        ).status_code
    except openai.APIStatusError as exc:
        return exc.status_code


def _received(sim: str, text: str) -> list[dict[str, Any]]:
    """The bodies the replica received whose prompt is ``text``."""
    bodies = [r.get("body", r) for r in httpx.get(f"{sim}/sim/requests").json()["requests"]]
    return [b for b in bodies if b.get("messages", [{}])[0].get("content") == text]


class Queued(threading.Thread):
    """One request sent while the pool is saturated: it waits in A's queue."""

    def __init__(self, base: str, key: str, text: str) -> None:
        super().__init__(daemon=True)
        self.base, self.key, self.text, self.status = base, key, text, 0

    def run(self) -> None:
        self.status = _ask(self.base, self.key, self.text)


class Filler:
    """A stream holding the pool's only seat (its replica hangs after a few tokens) until
    `close`."""

    def __init__(self, s: Stack) -> None:
        _, key, _ = _tenant(s.a)
        self.client = httpx.Client(timeout=30)
        req = self.client.build_request(
            "POST", f"{s.a}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": "llama", "stream": True, "max_tokens": 50, "ignore_eos": True,
                  "messages": [{"role": "user", "content": "filler"}]})
        resp = self.client.send(req, stream=True)
        assert resp.status_code == 200
        self.chunks = resp.iter_raw()  # kept: a dropped iterator closes the stream
        next(self.chunks)  # it runs on the replica

    def close(self) -> None:
        self.client.close()


def _with_one_queued(s: Stack, key: str, text: str) -> tuple[Queued, Filler]:
    """A filler holds the only seat, then ``text`` waits in A's queue. Close the filler to
    release it."""
    filler = Filler(s)
    queued = Queued(s.a, key, text)
    queued.start()
    wait_for(lambda: _depth(s.a) == 1, 10, "the request to wait in the queue")
    return queued, filler


def _leases(s: Stack, tid: str) -> int:
    """The tenant's concurrency leases held in Redis (its keys named by its id and the
    incarnation the admin API gave it)."""
    with redis.Redis.from_url(s.redis) as r:
        return sum(int(r.zcard(k)) for k in r.scan_iter(match=f"kvgate:rl:{{{tid}#*}}:leases"))


def _drained(s: Stack, tid: str) -> None:
    """Nothing in flight or queued, and the tenant's concurrency leases all given back."""
    wait_for(lambda: inflight(s.a) == 0 and _depth(s.a) == 0 and _leases(s, tid) == 0, 10,
             "nothing left held")


@pytest.mark.parametrize("change", ["revoke", "delete"])
def test_a_request_queued_when_its_key_goes_is_refused_not_sent(stack: Stack, change: str) -> None:
    tid, key, key_id = _tenant(stack.a)
    text = f"queued {uuid.uuid4().hex}"
    queued, filler = _with_one_queued(stack, key, text)
    assert _leases(stack, tid) == 1  # a queued request holds its lease
    with admin_client(stack.b, ADMIN) as admin:  # through the other gateway
        gone = (admin.delete(f"/tenants/{tid}/keys/{key_id}") if change == "revoke"
                else admin.delete(f"/tenants/{tid}"))
        assert gone.status_code == 204
    wait_for(lambda: _ask(stack.a, key, "probe") == 401, 5, "gateway A to refuse the key")
    filler.close()
    queued.join(30)
    assert queued.status == 401
    assert _received(stack.sim, text) == []
    _drained(stack, tid)


@pytest.mark.parametrize("change", ["revoke", "delete"])
def test_a_request_queued_when_its_key_goes_is_answered_while_the_pool_stays_full(
        stack: Stack, change: str) -> None:
    """The pool stays saturated (the filler holds its seat): the queued request is answered
    401 and leaves the queue, not when its turn comes. It waited out its tier's
    ``max_wait_s`` (30 s) to be shed with a 429, which its SDK retries."""
    tid, key, key_id = _tenant(stack.a)
    text = f"queued {uuid.uuid4().hex}"
    queued, filler = _with_one_queued(stack, key, text)
    with admin_client(stack.b, ADMIN) as admin:
        gone = (admin.delete(f"/tenants/{tid}/keys/{key_id}") if change == "revoke"
                else admin.delete(f"/tenants/{tid}"))
        assert gone.status_code == 204
    queued.join(20)
    assert queued.status == 401
    assert _depth(stack.a) == 0
    wait_for(lambda: _leases(stack, tid) == 0, 10, "its lease back")
    filler.close()
    assert _received(stack.sim, text) == []
    _drained(stack, tid)


def test_a_request_queued_when_its_salt_rotates_carries_the_new_salt(stack: Stack) -> None:
    tid, key, _ = _tenant(stack.a)
    text = f"queued {uuid.uuid4().hex}"
    queued, filler = _with_one_queued(stack, key, text)
    with admin_client(stack.a, ADMIN) as admin:
        assert admin.post(f"/tenants/{tid}/rotate-salt").status_code == 200
    filler.close()
    queued.join(30)
    assert queued.status == 200
    _drained(stack, tid)
    after = f"after {uuid.uuid4().hex}"
    assert _ask(stack.a, key, after) == 200
    [sent], [new] = _received(stack.sim, text), _received(stack.sim, after)
    assert sent["cache_salt"] == new["cache_salt"]
    _drained(stack, tid)

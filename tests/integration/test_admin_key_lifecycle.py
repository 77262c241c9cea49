"""A tenant's keys and limits through its lifecycle, with streams in flight, on two `kvgate
serve` processes sharing one real redis-server (the official openai client on the data path):
a tenant deleted mid-stream, then created again under the same id; a tenant moved to another
tier mid-stream."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial

import httpx
import openai
import pytest
import redis

from tests.support.gateway import admin_client, inflight, shared_gateways, wait_for
from tests.support.gateway import metric_values as metrics
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "admin-token-0123456789abcdef"
BOUND_S = 3.0  # poll_interval_s (0.5 s) plus a reload, on a loaded machine
LIMITS = {"limits": {"max_concurrency": 2}}
CONFIG = {"models": {"llama": {"free": "p", "gold": "p"}},
          "tiers": {"free": LIMITS, "gold": LIMITS}}


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    sim, url = sim_proc(None, "--time-scale", "1", model="m")  # streams of seconds
    with sim:
        yield url


@pytest.fixture(scope="module")
def fleet(sim_url: str) -> Iterator[tuple[str, list[str]]]:
    procs: list[Proc] = []
    try:
        rproc, url = redis_proc()
        procs.append(rproc.start())
        config = {**CONFIG, "pools": {"p": {"served_model": "m", "replicas": [sim_url]}}}
        bases = shared_gateways(procs, url, ADMIN, config)
        yield url, bases
    finally:
        for proc in reversed(procs):
            proc.stop()


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def _status(base: str, key: str) -> int:
    return httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {key}"},
                     timeout=10).status_code


def _answers(base: str, key: str, status: int) -> bool:
    return _status(base, key) == status


def _new_key(admin: httpx.Client, tenant: str, bases: list[str]) -> tuple[str, str]:
    created = admin.post(f"/tenants/{tenant}/keys")
    assert created.status_code == 201, created.text
    key = created.json()["key"]
    for base in bases:
        wait_for(partial(_answers, base, key, 200), BOUND_S, "the key works")
    return key, created.json()["id"]


class Stream(threading.Thread):
    """A streamed chat completion read to its end in a thread: `started` once its first
    chunk arrived; `ended` says how it ended ("done": a finish_reason, else the error's
    class name)."""

    def __init__(self, base: str, key: str) -> None:
        super().__init__(daemon=True)
        self.client = _client(base, key)
        self.started = threading.Event()
        self.chunks = 0
        self.ended = ""

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model="llama", stream=True, max_tokens=48,
                messages=[{"role": "user", "content": "hello"}])
            finish = None
            for chunk in stream:
                self.chunks += 1
                self.started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            self.ended = "done" if finish else "no finish_reason"
        except openai.APIError as exc:
            self.ended = type(exc).__name__
        finally:
            self.started.set()
            self.client.close()


def _streams(bases: list[str], key: str) -> list[Stream]:
    streams = [Stream(base, key) for base in bases]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(20) and not s.ended, s.ended
    return streams


def _leases(url: str, tenant: str) -> int:
    """The concurrency leases in Redis of every tenant made under this id through the admin
    API (their keys named by the id and each one's incarnation)."""
    raw = redis.Redis.from_url(url)
    try:
        return sum(int(raw.zcard(k))
                   for k in raw.scan_iter(match=f"kvgate:rl:{{{tenant}#*}}:leases"))
    finally:
        raw.close()


def _settled(url: str, tenant: str, bases: list[str]) -> Callable[[], bool]:
    return lambda: _leases(url, tenant) == 0 and all(inflight(b) == 0 for b in bases)


def _chat_status(base: str, key: str) -> int:
    try:
        return _client(base, key).chat.completions.with_raw_response.create(
            model="llama", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        ).status_code
    except openai.APIStatusError as exc:
        return exc.status_code


def test_a_tenant_deleted_mid_stream_leaves_no_lease_and_comes_back_clean(
    fleet: tuple[str, list[str]],
) -> None:
    """Two streams (one per gateway) at the tenant's concurrency limit; the tenant deleted
    through one gateway while they run. They end cleanly (run to their end: a request sent
    is not cut), the key is refused on both, no lease or in-flight count is left, and the
    tenant created again under the same id gets its whole limit with a new key (the old
    one stays refused)."""
    url, bases = fleet
    with admin_client(bases[0], ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "gone", "tier": "free"}).status_code == 201
        key, _ = _new_key(admin, "gone", bases)
        streams = _streams(bases, key)
        assert _leases(url, "gone") == 2
        assert admin.delete("/tenants/gone").status_code == 204
        for base in bases:
            wait_for(partial(_answers, base, key, 401), BOUND_S, "the key refused")
        for s in streams:
            s.join(30)
        assert [s.ended for s in streams] == ["done", "done"], [s.chunks for s in streams]
        wait_for(_settled(url, "gone", bases), 5, "no lease nor request left")

        assert admin.post("/tenants", json={"id": "gone", "tier": "free"}).status_code == 201
        new_key, _ = _new_key(admin, "gone", bases)
        assert [_status(b, key) for b in bases] == [401, 401]
        streams = _streams(bases, new_key)  # the whole limit: two at once
        assert _chat_status(bases[0], new_key) == 429  # and no more
        for s in streams:
            s.join(30)
        assert [s.ended for s in streams] == ["done", "done"]
        wait_for(_settled(url, "gone", bases), 5, "no lease nor request left")


def _requests(base: str, tenant: str) -> dict[str, float]:
    """{tier: requests} of `tenant` in the gateway's kvgate_requests_total."""
    out: dict[str, float] = {}
    for labels, value in metrics(base, "kvgate_requests_total").items():
        if f'tenant="{tenant}"' in labels:
            tier = labels.split('tier="')[1].split('"')[0]
            out[tier] = out.get(tier, 0.0) + value
    return out


def test_a_tenant_moved_to_another_tier_mid_stream_is_accounted_where_it_started(
    fleet: tuple[str, list[str]],
) -> None:
    """A stream started in tier `free` while its tenant is moved to `gold` through the other
    gateway: it runs to its end, counted under `free`, its lease released; the next request
    is counted under `gold`."""
    url, bases = fleet
    with admin_client(bases[0], ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "mover", "tier": "free"}).status_code == 201
        key, _ = _new_key(admin, "mover", bases)
        [stream] = _streams(bases[1:], key)
        moved = admin.patch("/tenants/mover", json={"tier": "gold"})
        assert moved.status_code == 200, moved.text
        wait_for(lambda: _planned_tier(bases[1]) == "gold", BOUND_S, "moved")
        stream.join(30)
        assert stream.ended == "done"
        wait_for(_settled(url, "mover", bases), 5, "no lease nor request left")
        counted = _requests(bases[1], "mover")
        assert counted.get("free") == 1, counted
        assert _chat_status(bases[1], key) == 200
        assert _requests(bases[1], "mover").get("gold", 0) >= 1



def _planned_tier(base: str) -> str | None:
    """The tier the gateway plans the tenant `mover` in now (route explain: its own state,
    what its next request uses)."""
    answer: dict[str, str | None] = httpx.post(
        f"{base}/admin/route/explain", headers={"authorization": f"Bearer {ADMIN}"},
        json={"tenant": "mover", "request": {"model": "llama", "messages": []}},
        timeout=10).json()
    return answer.get("tier")


def _sent_salt(sim: str, request_id: str) -> str:
    for item in httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]:
        if item["headers"].get("x-request-id") == request_id:
            return str(item["body"]["cache_salt"])
    raise AssertionError(f"request {request_id} never reached the replica")


def _salt_of(base: str, sim: str, key: str) -> str:
    answer = _client(base, key).chat.completions.with_raw_response.create(
        model="llama", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    return _sent_salt(sim, answer.headers["x-request-id"])


def test_a_tenant_created_again_under_a_deleted_ones_id_gets_another_salt(
    fleet: tuple[str, list[str]], sim_url: str,
) -> None:
    """A tenant deleted, then one created under its id (a new customer given a name that
    was free again): its cache salt must not be the deleted one's, or its requests hit the
    deleted tenant's prefix cache in vLLM (and `cached_tokens` tells it which prefixes the
    other sent). Before, both were salted from the id and epoch 0: the same salt."""
    _, bases = fleet
    with admin_client(bases[0], ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "reborn", "tier": "free"}).status_code == 201
        key, _ = _new_key(admin, "reborn", bases)
        before = _salt_of(bases[1], sim_url, key)
        assert admin.delete("/tenants/reborn").status_code == 204
        assert admin.post("/tenants", json={"id": "reborn", "tier": "free"}).status_code == 201
        key, _ = _new_key(admin, "reborn", bases)
        assert _salt_of(bases[1], sim_url, key) != before

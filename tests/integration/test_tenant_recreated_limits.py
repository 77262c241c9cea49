"""A tenant created again under a deleted one's id starts with its whole limits, on two `kvgate
serve` processes sharing one real redis-server, and on one without Redis (the official openai
client on the data path).

Before, the rate-limit keys in Redis were named by the tenant id alone: the new tenant
inherited the deleted one's bucket (its first request a 429 "requests per minute; retry after
30s" on a 2 RPM tier) and the leases of the deleted one's streams still in flight (a 429 for
concurrency while a stream of a tenant that no longer exists ran)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial

import httpx
import openai
import pytest

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    shared_gateways,
    wait_for,
)
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "admin-token-recreated-0123456789"
BOUND_S = 5.0  # poll_interval_s (0.5 s) plus a reload, on a loaded machine
CONFIG = {"models": {"llama": {"rpm": "p", "conc": "p"}},
          "tiers": {"rpm": {"limits": {"rpm": 2}},
                    "conc": {"limits": {"max_concurrency": 1}}}}


@pytest.fixture(scope="module")
def fleet() -> Iterator[list[str]]:
    procs: list[Proc] = []
    try:
        sim, sim_url = sim_proc(None, "--time-scale", "1", model="m")  # streams of seconds
        procs.append(sim.start())
        rproc, url = redis_proc()
        procs.append(rproc.start())
        config = {**CONFIG, "pools": {"p": {"served_model": "m", "replicas": [sim_url]}}}
        yield shared_gateways(procs, url, ADMIN, config)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _answers(base: str, key: str, status: int) -> bool:
    return httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {key}"},
                     timeout=10).status_code == status


def _created(admin: httpx.Client, tenant: str, tier: str, bases: list[str]) -> str:
    """The tenant created in `tier`, and a key of it that works on every gateway."""
    made = admin.post("/tenants", json={"id": tenant, "tier": tier})
    assert made.status_code == 201, made.text
    created = admin.post(f"/tenants/{tenant}/keys")
    assert created.status_code == 201, created.text
    key = str(created.json()["key"])
    for base in bases:
        wait_for(partial(_answers, base, key, 200), BOUND_S, "the key works")
    return key


def _deleted(admin: httpx.Client, tenant: str, key: str, bases: list[str]) -> None:
    assert admin.delete(f"/tenants/{tenant}").status_code == 204
    for base in bases:
        wait_for(partial(_answers, base, key, 401), BOUND_S, "the key refused")


def _chat(base: str, key: str) -> tuple[int, str | None]:
    """(status, retry-after) of one small chat completion."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="llama", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        return raw.status_code, None
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.headers.get("retry-after")
    finally:
        client.close()


def test_a_tenant_created_again_does_not_inherit_the_deleted_ones_budget(
    fleet: list[str],
) -> None:
    """The deleted tenant used its 2 requests a minute (one through each gateway, the third
    refused); the one created under its id gets 2 again, through either gateway."""
    bases = fleet
    with admin_client(bases[0], ADMIN) as admin:
        key = _created(admin, "spent", "rpm", bases)
        assert [_chat(b, key)[0] for b in bases] == [200, 200]
        assert _chat(bases[1], key)[0] == 429
        _deleted(admin, "spent", key, bases)

        key = _created(admin, "spent", "rpm", bases)
        assert [_chat(b, key) for b in reversed(bases)] == [(200, None), (200, None)]
        status, retry = _chat(bases[0], key)
        assert status == 429 and retry is not None and int(retry) >= 1


class Stream(threading.Thread):
    """A long streamed chat completion read in a thread (`started`: its first chunk) until
    `stop` is set; `ended` says how it ended ("done", else the error's class name)."""

    def __init__(self, base: str, key: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                    timeout=60)
        self.started = threading.Event()
        self.stop = threading.Event()
        self.ended = ""

    def run(self) -> None:
        try:
            stream = self.client.chat.completions.create(
                model="llama", stream=True, max_tokens=4000, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "hello"}])
            with stream:
                for _ in stream:
                    self.started.set()
                    if self.stop.is_set():
                        break
            self.ended = "done"
        except openai.APIError as exc:
            self.ended = type(exc).__name__
        finally:
            self.started.set()
            self.client.close()

    def end(self) -> str:
        self.stop.set()
        self.join(60)
        return self.ended


def test_a_deleted_tenants_stream_in_flight_does_not_count_against_the_new_one(
    fleet: list[str],
) -> None:
    """A stream of the deleted tenant still runs (a request sent is not cut) while the one
    created under its id, with a concurrency limit of 1, sends its first request: admitted.
    Both streams end (their clients stop reading) and their leases go back where they came
    from: the new tenant has its one slot again."""
    bases = fleet
    with admin_client(bases[0], ADMIN) as admin:
        key = _created(admin, "busy", "conc", bases)
        old = Stream(bases[1], key)
        old.start()
        assert old.started.wait(30) and not old.ended, old.ended
        assert _chat(bases[0], key)[0] == 429  # its one slot is taken
        _deleted(admin, "busy", key, bases)

        key = _created(admin, "busy", "conc", bases)
        assert old.is_alive() and not old.ended, old.ended  # (4,000 tokens: runs on)
        assert _chat(bases[0], key) == (200, None)
        new = Stream(bases[0], key)
        new.start()
        assert new.started.wait(30) and not new.ended, new.ended
        assert _chat(bases[1], key)[0] == 429  # the new tenant's own slot is taken
        assert old.is_alive() and not old.ended, old.ended
        assert [old.end(), new.end()] == ["done", "done"]
        wait_for(lambda: all(inflight(b) == 0 for b in bases), 10, "no request left")
        assert [_chat(b, key)[0] for b in bases] == [200, 200]


def test_in_memory_a_tenant_created_again_starts_with_its_whole_budget(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    """The same on one gateway without Redis (its in-memory store and limiter)."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    config = {**CONFIG, "pools": {"p": {"served_model": "m", "replicas": [sim]}}}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin:
        key = _created(admin, "spent", "rpm", [base])
        assert [_chat(base, key)[0] for _ in range(3)] == [200, 200, 429]
        _deleted(admin, "spent", key, [base])
        key = _created(admin, "spent", "rpm", [base])
        assert [_chat(base, key)[0] for _ in range(3)] == [200, 200, 429]

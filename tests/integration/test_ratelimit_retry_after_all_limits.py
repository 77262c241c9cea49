"""A request refused by more than one of its tenant's limits is told to retry when the last
of them allows it, not the first.

A tenant at its concurrency limit whose requests per minute are also spent was answered
``Retry-After: 1`` (the concurrency limit's guess): its retry a second later was refused
again, for the RPM limit, with ``Retry-After: 60``. Now the first answer says 60 (and still
names the concurrency limit, the first that refuses).

Real gateways (two on one real redis-server; one with the in-memory limiter), a simulated
replica, the official openai client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import httpx
import openai

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    shared_gateways,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "retry-after-admin-token-0123456789"
LIMITS = {"rpm": 1, "max_concurrency": 1}


def _config(sim: str) -> dict[str, object]:
    return {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
            "models": {"llama": {"free": "p"}}, "tiers": {"free": {"limits": LIMITS}}}


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def _refusal(base: str, key: str) -> tuple[int, str, int]:
    """(status, message, Retry-After) of a request that must be refused."""
    with _client(base, key) as client:
        try:
            client.chat.completions.create(model="llama", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as exc:
            return exc.status_code, exc.message, int(exc.response.headers["retry-after"])
    raise AssertionError("admitted")


def _while_streaming(base: str, key: str, check: Callable[[], None]) -> None:
    """`check()` while a stream of the tenant runs (its one slot, its one request a minute)."""
    started, done = threading.Event(), threading.Event()

    def stream() -> None:
        with _client(base, key) as client:
            for _ in client.chat.completions.create(
                    model="llama", stream=True, max_tokens=4000,
                    extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "hello"}]):
                started.set()
                if done.is_set():
                    break
        started.set()

    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    try:
        assert started.wait(30)
        assert runner.is_alive(), "the stream ended before the check"
        check()
    finally:
        done.set()
        runner.join(60)


def _new_key(*bases: str) -> str:
    """A key of a new tenant in tier `free`, working on every gateway of `bases`."""
    with admin_client(bases[0], ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "busy", "tier": "free"}).status_code == 201
        made = admin.post("/tenants/busy/keys")
        assert made.status_code == 201, made.text
        key = str(made.json()["key"])
    for base in bases:
        wait_for(partial(_works, base, key), 10, "the key works")
    return key


def _works(base: str, key: str) -> bool:
    return httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {key}"},
                     timeout=10).status_code == 200


def _told_the_last_limits_wait(base: str, key: str) -> None:
    status, message, retry = _refusal(base, key)
    assert status == 429 and "concurrent requests" in message, message
    assert retry > 30, retry  # a minute's request back, not the concurrency limit's 1 s


def test_shared_limits_wait_for_the_last_that_refuses(
        sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc],
        redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "1", model="m")  # a stream of seconds
    first, second = shared_gateways(procs, redis_url, ADMIN, _config(sim))
    key = _new_key(first, second)
    _while_streaming(first, key, lambda: _told_the_last_limits_wait(second, key))


def test_in_memory_limits_wait_for_the_last_that_refuses(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "1", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=_config(sim), env=env, auth=True)
    with gw:
        key = _new_key(base)
        _while_streaming(base, key, lambda: _told_the_last_limits_wait(base, key))

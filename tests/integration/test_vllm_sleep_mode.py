"""A vLLM replica put to sleep (sleep mode: its scheduling paused, its KV cache discarded) keeps
answering `/health` 200, and a request sent there waits until someone wakes it. Its `/metrics`
says so (`vllm:engine_sleep_state{sleep_state="awake"} 0`): kvgate sends it nothing while it
sleeps -- a pool with no other replica is not ready and answers a clear 503 at once -- and
takes it back when it wakes. Real gateway, simulated replicas, the openai client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
MSG: list[Any] = [{"role": "user", "content": "the same long shared prefix " * 40}]


def _sleep(sim: str, level: int) -> None:
    httpx.post(f"{sim}/sim/faults", json={"sleeping": level}).raise_for_status()


def _healthy(base: str, replica: str) -> bool:
    """kvgate's own view of `replica` (host:port): may it be sent a request?"""
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("kvgate_replica_healthy{") and f'"{replica}"' in line:
            return line.rsplit(" ", 1)[1] == "1.0"
    raise AssertionError(f"no kvgate_replica_healthy series for {replica}")


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def test_a_sleeping_replica_alone_is_a_clear_503_and_back_when_awake(
        sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [sim]}}})
    with gw:
        _client(base).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        _sleep(sim, 1)
        wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 503, timeout=20,
                 what="the pool not ready while its only replica sleeps")
        assert "asleep" in httpx.get(f"{base}/readyz").text
        with pytest.raises(openai.APIStatusError) as refused:
            _client(base).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        assert refused.value.status_code == 503
        assert "its engine is asleep" in refused.value.message
        assert refused.value.response.headers.get("retry-after")
        _sleep(sim, 0)
        wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 200, timeout=20,
                 what="the pool ready again")
        reply = _client(base).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        assert reply.choices[0].message.content


def test_requests_go_around_a_sleeping_replica(sim_factory: SimFactory) -> None:
    _, one = sim_factory("--time-scale", "50")
    _, two = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(config={"pools": {"p": {"served_model": MODEL,
                                                    "replicas": [one, two]}}})
    with gw:
        client = _client(base)
        first = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MSG, max_tokens=2)
        pinned = first.headers["x-kvgate-replica"]  # "pool/host:port", the prefix's replica
        address = pinned.partition("/")[2]
        sleeper = one if one.endswith(address) else two
        _sleep(sleeper, 2)
        wait_for(lambda: not _healthy(base, address), timeout=20, what="the sleeper out")
        # its KV cache is discarded: the prefixes remembered there are forgotten
        entries = metric_values(base, "kvgate_affinity_index_entries")
        assert sum(v for labels, v in entries.items() if f'"{address}"' in labels) == 0
        for _ in range(4):  # the same prefix, sent elsewhere, answered
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=MSG, max_tokens=2)
            assert raw.headers["x-kvgate-replica"] != pinned
            assert raw.parse().choices[0].message.content
        assert httpx.get(f"{sleeper}/sim/stats").json()["received"] == 1  # the first only
        _sleep(sleeper, 0)
        wait_for(lambda: _healthy(base, address), timeout=20, what="the sleeper back")

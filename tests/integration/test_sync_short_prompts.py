"""A request whose prompt is shorter than a prefix block has no chain to publish, but its load
is news for the other gateways (their bounded load and flow control count it). It reached them
only with the publisher's next heartbeat: a burst of short prompts (a probe, "hi") split over
two gateways was admitted by each against a fleet it saw idle. Now such a route wakes the
publisher as a chain does: with heartbeats 30 s apart, the peer sees the streams at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

ADMIN = "short-prompts-admin-token-0123"
MODEL = "sim-model"


def _fleet_inflight(base: str) -> tuple[int, int]:
    doc = httpx.get(f"{base}/admin/replicas", timeout=5,
                    headers={"Authorization": f"Bearer {ADMIN}"}).json()
    reps = [r for p in doc["data"] for r in p["replicas"]]
    return sum(r["inflight"] for r in reps), sum(r["inflight_fleet"] for r in reps)


def _peers(base: str) -> int:
    return int(httpx.get(f"{base}/readyz", timeout=5).json()["sync"]["peers"])


@pytest.fixture
def gateways(redis_url: str, sim_factory: Callable[..., tuple[Proc, str]]
             ) -> Iterator[list[str]]:
    sims = [sim_factory("--time-scale", "50", "--hang-after-tokens", "2")[1] for _ in range(2)]
    config = {"pools": {"p": {"replicas": sims, "served_model": MODEL}},
              "models": {MODEL: {"default": "p"}},
              # a heartbeat far beyond the wait below: only a woken publisher can tell
              "sync": {"heartbeat_s": 30, "stale_after_s": 120}}
    with ExitStack() as stack:
        bases = []
        for _ in range(2):
            proc, base = gateway_proc(config=config, env={
                "KVGATE_REDIS_URL": redis_url, "KVGATE_ADMIN_TOKEN": ADMIN})
            stack.enter_context(proc)
            bases.append(base)
        for base in bases:  # a chain each (a batch at once): the gateways meet
            answer = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": "a long prompt " * 40}]})
            assert answer.status_code == 200, answer.text
        wait_for(lambda: all(_peers(b) == 1 for b in bases), 20, "the gateways to meet")
        yield bases


def test_a_short_prompts_load_reaches_the_peer_without_waiting_for_a_heartbeat(
        gateways: list[str]) -> None:
    a, b = gateways
    with ExitStack() as streams:
        for i in range(3):
            resp = streams.enter_context(httpx.stream(
                "POST", f"{a}/v1/chat/completions", timeout=30, json={
                    "model": MODEL, "stream": True, "max_tokens": 50,
                    "messages": [{"role": "user", "content": f"hi {i}"}]}))
            assert resp.status_code == 200
        wait_for(lambda: _fleet_inflight(a)[0] == 3, 10, "A's streams in flight")
        wait_for(lambda: _fleet_inflight(b) == (0, 3), 5,
                 "B to see A's short streams as fleet-wide in-flight")

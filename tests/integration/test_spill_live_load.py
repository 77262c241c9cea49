"""Spill-over reads the home pool's live load, not its last scrape alone.

Tier resolution decided spill-over from the replicas' scraped waiting requests and KV usage
only. In a burst every request between two scrapes saw the same stale levels: a home pool
scraped idle took the whole burst (none spilled) though kvgate had just sent it far more than
it runs, while the spill pool stood idle. The level read now is the scrape reconciled with
kvgate's own requests there still unanswered, so the burst spills the part home cannot take.

A real gateway in front of two pools of real simulated replicas; the scrape interval is long
so that the whole burst falls between two scrapes (the case of any burst at the default).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import openai

from tests.support.gateway import (
    admin_client,
    gateway_proc,
    metric_values,
    shared_gateways,
    wait_for,
)
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]

ADMIN = "spill-live-admin-token-0123456789"
BURST = 32
SEQS = 2  # requests each home replica runs at once (vLLM's --max-num-seqs)
SPILL_WAITING = 2  # spill_when.waiting


def _config(home: list[str], spill: list[str]) -> dict[str, Any]:
    return {"pools": {"home": {"served_model": "m-home", "replicas": home},
                      "big": {"served_model": "m-spill", "replicas": spill}},
            "models": {"llama": {"default": "home"}},
            "tiers": {"default": {"spill_to": "big",
                                  "spill_when": {"waiting": SPILL_WAITING, "kv_usage": 0.95}}},
            "routing": {"scrape_interval_ms": 3000}}


def _pools(sim_factory: SimFactory) -> tuple[list[str], list[str]]:
    """Two home replicas running SEQS requests at once, two spill replicas running many."""
    home = [sim_factory("--time-scale", "1", "--max-num-seqs", str(SEQS), model="m-home")[1]
            for _ in range(2)]
    spill = [sim_factory("--time-scale", "1", model="m-spill")[1] for _ in range(2)]
    return home, spill


def _scraped(base: str) -> None:
    """Wait until every replica was scraped once: their levels known (idle)."""
    wait_for(lambda: len(metric_values(base, "kvgate_replica_waiting")) == 4, timeout=20,
             what="the replicas scraped")


async def _burst(bases: list[str], key: str = "x", gap_s: float = 0.0) -> Counter[str]:
    """BURST concurrent streamed chats, in turn through each of ``bases``, one every
    ``gap_s``, counted by route (``x-kvgate-route``: "spill", or the policy that picked a home
    replica)."""
    clients = [openai.AsyncOpenAI(base_url=f"{b}/v1", api_key=key, max_retries=0, timeout=120)
               for b in bases]

    async def one(i: int) -> str:
        client = clients[i % len(clients)]
        await asyncio.sleep(i * gap_s)
        async with client.chat.completions.with_streaming_response.create(
            model="llama", max_tokens=256, stream=True,
            messages=[{"role": "user", "content": f"burst question {i} " + "word " * 50}],
        ) as raw:
            async for _ in raw.iter_lines():
                pass
            return raw.headers["x-kvgate-route"]

    try:
        return Counter(await asyncio.gather(*(one(i) for i in range(BURST))))
    finally:
        for client in clients:
            await client.close()


def test_a_burst_spills_only_what_the_home_pool_cannot_take(sim_factory: SimFactory) -> None:
    gw, base = gateway_proc(config=_config(*_pools(sim_factory)))
    with gw:
        _scraped(base)
        routes = asyncio.run(_burst([base]))
        spills = metric_values(base, "kvgate_spillovers_total")
    # home runs SEQS requests per replica and queues SPILL_WAITING more before it counts as
    # full: the rest of the burst is more than it can take and spills (before: none did, the
    # home pool scraped idle took all 32 and queued 14 a replica). Scraped idle, a replica
    # is known to run one request at once: home keeps at least 1 + SPILL_WAITING a replica.
    assert sum(routes.values()) == BURST
    assert routes["spill"] >= BURST - 2 * (SEQS + SPILL_WAITING) - 8, routes
    assert BURST - routes["spill"] >= 2 * (1 + SPILL_WAITING), routes
    assert spills == {'{from_pool="home",tier="default",to_pool="big"}': float(routes["spill"])}


def test_gateways_sharing_routing_state_count_each_others_requests(
    sim_factory: SimFactory, procs: list[Proc], redis_url: str,
) -> None:
    """Two gateways share the burst: each one's router steers clear of the home replica the
    other filled, so each saw one home replica full and the other idle by its own count, and
    kept its half home (0 to 12 of 32 spilled). The other gateway's requests count too now
    (`routing.peers`, as the router reads them). The requests come 30 ms apart, so each
    gateway has heard of the other's before its next (shared state is published every
    ``flush_interval_ms``, 20 ms); the burst still falls between two scrapes."""
    config = {**_config(*_pools(sim_factory)), "tenants": [{"id": "acme"}]}
    bases = shared_gateways(procs, redis_url, ADMIN, config)
    with admin_client(bases[0], ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
    for base in bases:
        _scraped(base)
    routes = asyncio.run(_burst(bases, key, gap_s=0.03))
    assert sum(routes.values()) == BURST
    # (home may take more than at once: some of its requests end during the burst's second)
    assert routes["spill"] >= 14, routes

"""One brain, two bodies: live replay (HTTP through kvgate to `kvgate sim` replicas) and offline
replay (the same routing core and engine model in simulated time) agree on a short scenario.

Tolerances: the hit rate comes from the same engine model and the same routing decisions, so it
must match closely (0.05 absolute). Latencies differ by what only live has: HTTP, the gateway
and the simulators' event-loop timers, multiplied by the time scale (x2 here), so TTFT may be
a few tens of simulated milliseconds apart; end-to-end medians within 20 %.
"""

from __future__ import annotations

import asyncio

from loadtest.fleet import Fleet
from loadtest.replay.cli import run_offline
from loadtest.replay.live import LiveTarget, replay_live
from loadtest.replay.offline import FleetSpec
from loadtest.replay.summary import summarize
from loadtest.replay.workload import ReplayRequest, SyntheticSpec, synthetic_multitenant
from tests.support.gateway import metric_values, wait_for

TIME_SCALE = 2.0
SPEC = SyntheticSpec(
    tenants=2, conversations_per_tenant=3, turns=3, system_prompt_tokens=2048,
    user_turn_tokens=128, answer_tokens=64, rag_documents=2, rate_per_s=4.0, seed=3,
)


def _num(summary: dict[str, object], key: str) -> float:
    value = summary[key]
    assert isinstance(value, int | float)
    return float(value)


def _live(reqs: list[ReplayRequest], kv_blocks: int) -> dict[str, object]:
    sim_args = ["--num-gpu-blocks", str(kv_blocks), "--max-model-len", "32768",
                "--time-scale", str(TIME_SCALE)]
    with Fleet() as fleet:
        urls = [fleet.sim("m", *sim_args) for _ in range(2)]
        base = fleet.gateway(urls, "--policy", "cache_aware")
        # ready (a healthy replica) is not yet scraped: until its first scrape the router
        # knows neither a replica's KV capacity nor its load, which offline replay knows from
        # the start -- and on a loaded machine that first scrape can trail readiness long
        # enough for the first requests to be routed blind
        wait_for(lambda: len(metric_values(base, "kvgate_replica_scrape_age_seconds")) == 2,
                 timeout=60, what="a first scrape of both replicas")
        outcomes, delta = asyncio.run(replay_live(reqs, LiveTarget(base, "m", TIME_SCALE), urls))
    return summarize(
        policy="cache_aware", outcomes=outcomes, replicas=sorted({o.replica for o in outcomes}),
        hit_rate=delta.hits / delta.queries, pooled_reference_hit_rate=0.0,
        preemptions=int(delta.preemptions),
    )


def test_live_and_offline_replay_agree() -> None:
    reqs = synthetic_multitenant(SPEC)
    offline = run_offline(reqs, FleetSpec(replicas=2, kv_tokens=4096 * 16), "cache_aware", 0.0)
    live = _live(reqs, 4096)
    assert live["failed"] == 0
    assert live["requests"] == offline["requests"] == len(reqs)
    assert abs(_num(live, "hit_rate") - _num(offline, "hit_rate")) <= 0.05, (live, offline)
    assert _num(offline, "hit_rate") > 0.5  # the scenario really reuses prefixes
    assert abs(_num(live, "ttft_p50_s") - _num(offline, "ttft_p50_s")) <= 0.05, (live, offline)
    assert abs(_num(live, "ttft_p99_s") - _num(offline, "ttft_p99_s")) <= 0.1, (live, offline)
    e2e_live, e2e_off = _num(live, "e2e_p50_s"), _num(offline, "e2e_p50_s")
    assert abs(e2e_live - e2e_off) <= 0.2 * e2e_off, (live, offline)

"""One brain, two bodies: live replay (HTTP through kvgate to `kvgate sim` replicas) and offline
replay (the same routing core and engine model in simulated time) agree on a short scenario.

Both bodies make the same routing decisions: request by request, the live gateway puts each
request on the replica offline replay puts it on (named differently: matched by the first
request's). Tolerances: the hit rate comes from the same engine model and the same decisions,
so it must match closely (0.05 absolute). Latencies differ by what only live has: HTTP, the
gateway and the simulators' event-loop timers, multiplied by the time scale (x2 here), so a
request's TTFT may be a few tens of simulated milliseconds apart: the median within 0.05 s,
each request within 0.1 s but one (with 18 requests the p99 is the slowest one, and one
scheduling hiccup of a loaded machine is 0.1 s at this scale); end-to-end medians within 20 %.
"""

from __future__ import annotations

import asyncio

from loadtest.fleet import Fleet
from loadtest.replay.live import LiveTarget, replay_live
from loadtest.replay.offline import FleetSpec, replay_offline
from loadtest.replay.summary import Outcome, summarize
from loadtest.replay.workload import ReplayRequest, SyntheticSpec, synthetic_multitenant
from routing.config import RouterConfig
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


def _live(reqs: list[ReplayRequest], kv_blocks: int) -> tuple[list[Outcome], float]:
    """The live outcomes (by arrival) and hit rate."""
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
    return sorted(outcomes, key=lambda o: o.seq), delta.hits / delta.queries


def _ttft(o: Outcome) -> float:
    assert o.first_token_s is not None
    return o.first_token_s - o.start_s


def _summary(outcomes: list[Outcome], hit_rate: float) -> dict[str, object]:
    return summarize(policy="cache_aware", outcomes=outcomes, replicas=[], hit_rate=hit_rate,
                     pooled_reference_hit_rate=0.0, preemptions=0)


def test_live_and_offline_replay_agree() -> None:
    reqs = synthetic_multitenant(SPEC)
    res = replay_offline(reqs, FleetSpec(replicas=2, kv_tokens=4096 * 16),
                         RouterConfig(policy="cache_aware"))
    offline_outcomes = sorted(res.outcomes, key=lambda o: o.seq)
    live_outcomes, live_hit_rate = _live(reqs, 4096)
    assert len(live_outcomes) == len(offline_outcomes) == len(reqs)
    assert all(o.ok for o in live_outcomes), [o.error for o in live_outcomes if not o.ok]
    pairs = list(zip(offline_outcomes, live_outcomes, strict=True))
    table = "\n".join(f"{a.seq:3d} offline {a.replica} {_ttft(a):.3f} s, live {b.replica} "
                      f"{_ttft(b):.3f} s" for a, b in pairs)
    # the same decisions: live replica names map one to one onto offline's
    names = {b.replica: a.replica for a, b in pairs}
    assert len(names) == len(set(names.values())) == 2, table
    assert all(names[b.replica] == a.replica for a, b in pairs), table
    assert abs(live_hit_rate - res.hit_rate) <= 0.05, (live_hit_rate, res.hit_rate)
    assert res.hit_rate > 0.5  # the scenario really reuses prefixes
    live, offline = _summary(live_outcomes, live_hit_rate), _summary(offline_outcomes, res.hit_rate)
    assert abs(_num(live, "ttft_p50_s") - _num(offline, "ttft_p50_s")) <= 0.05, table
    apart = [a.seq for a, b in pairs if abs(_ttft(b) - _ttft(a)) > 0.1]
    assert len(apart) <= 1, table
    e2e_live, e2e_off = _num(live, "e2e_p50_s"), _num(offline, "e2e_p50_s")
    assert abs(e2e_live - e2e_off) <= 0.2 * e2e_off, (live, offline)

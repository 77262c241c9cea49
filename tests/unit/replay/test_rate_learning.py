"""The router learns a slower replica within 50 requests, streamed or not, on engines whose
every step carries a large decode batch (a realistic fixed part of the time to first token)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from loadtest.replay.blocks import unit_hashes
from loadtest.sim.costmodel import CostModel, get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.spec import EngineConfig, RequestSpec
from routing.learning import EngineCounters
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

FP8 = get_preset("h100-8b-fp8").cost.busy()  # ~50 ms steps: a large decode batch in each
SCRAPE_S = 0.25
RATE = 0.5  # requests/s: the AWQ replica, with half of them, is about half busy


def _slower(cost: CostModel, k: float) -> CostModel:
    return replace(cost, step_overhead_s=cost.step_overhead_s * k,
                   prefill_token_s=cost.prefill_token_s * k, decode_seq_s=cost.decode_seq_s * k)


def _engine(cost: CostModel) -> Engine:
    return Engine(EngineConfig(cost=cost, num_gpu_blocks=16_384, max_model_len=32_768))


def _requests(n: int) -> list[tuple[float, RequestSpec, RequestFeatures]]:
    """``n`` requests at `RATE`: 500-8,000-token prompts, a third of them on a shared document
    (so some are cache hits: little work, the same fixed time)."""
    rng, doc = random.Random(5), tuple(range(10**6, 10**6 + 64))
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(RATE)
        tokens = rng.randint(500, 8_000)
        blocks = tokens // 64
        ids = doc[:blocks] if rng.random() < 0.33 else ()
        ids += tuple(range(i * 1_000, i * 1_000 + blocks - len(ids) + 1))
        spec = RequestSpec(f"q{i}", unit_hashes(ids, 64, 16, tokens // 16, 1), tokens, 16, None)
        features = RequestFeatures("m", unit_hashes(ids, 64, 64, tokens // 64, 2), tokens,
                                   prefix_key=i + 1)
        out.append((t, spec, features))
    return out


def _learn(costs: dict[str, CostModel], streamed: bool, n: int = 50) -> Router:
    """Round-robin ``n`` requests over the engines; the router sees first tokens (streamed)
    or only the engines' scraped counters and whole answers (not streamed)."""
    router = Router(RouterConfig(policy="round_robin"))
    engines = {rid: _engine(cost) for rid, cost in costs.items()}
    sent: dict[str, tuple[str, RequestFeatures, float]] = {}
    next_scrape = 0.0

    def run_until(t: float) -> None:
        nonlocal next_scrape
        while next_scrape <= t:
            for rid, engine in engines.items():
                for out in engine.advance(next_scrape):
                    replica, features, start = sent[out.request_id]
                    if streamed and out.first_token_time is not None:
                        router.record_first_token(
                            replica, features, out.first_token_time - start, out.first_token_time)
                    if not streamed and out.finish_reason is not None:
                        router.record_answered(replica, features, out.time)
                st = engine.stats
                router.record_counters(rid, EngineCounters(
                    st.prefill_seconds, st.prefill_requests, st.prefill_computed_tokens),
                    next_scrape)
            next_scrape += SCRAPE_S

    views = [ReplicaView(id=rid, pool="p") for rid in engines]
    for t, spec, features in _requests(n):
        run_until(t)
        replica = router.pick(features, views, t).replica
        router.record_route(replica, features, t)
        engines[replica].add_request(spec, t)
        sent[spec.request_id] = (replica, features, t)
    run_until(next_scrape + 30.0)
    return router


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize(
    ("slow", "ratio"),
    [
        (_slower(FP8, 2.0), 2.0),  # the same replica at half the speed
        # the AWQ preset (70B, 4-bit) beside FP8, both busy: a much slower prefill
        (get_preset("a100-70b-awq").cost.busy(), 500e-6 / 40e-6),
    ],
)
def test_a_slower_replica_is_learned_within_50_requests(
    streamed: bool, slow: CostModel, ratio: float
) -> None:
    router = _learn({"fast": FP8, "slow": slow}, streamed)
    learned = router.prefill_rate("fast") / router.prefill_rate("slow")
    assert learned == pytest.approx(ratio, rel=0.3), (router.ttft_fit("fast"),
                                                      router.ttft_fit("slow"))
    # and the fixed part is seen: tens of ms per step, at least one step before a first token
    assert router.ttft_fit("fast").fixed_s > 0.02
    # so a new prompt prefers the fast replica, even with some work queued there
    big = _requests(51)[-1][2]
    views = [ReplicaView(id="fast", pool="p", inflight=1, inflight_prefill_tokens=2_000),
             ReplicaView(id="slow", pool="p")]
    assert Router.pick(_with_policy(router), big, views, 100.0).replica == "fast"


def _with_policy(router: Router) -> Router:
    """The learned router, deciding with cache_aware (it learned under round_robin)."""
    from routing.policies import build_policy

    router.policy = build_policy("cache_aware", router.state)
    return router


def test_the_busy_model_makes_steps_tens_of_ms() -> None:
    idle = get_preset("h100-8b-fp8").cost
    assert idle.step_time(0, 1, 2_000) < 0.01
    assert 0.02 < FP8.step_time(0, 1, 2_000) < 0.1

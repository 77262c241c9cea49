"""The TTFT model: a fixed part plus work / rate per replica, robust, learned from every request."""

from __future__ import annotations

import random

import pytest

from routing.config import RouterConfig
from routing.learning import EngineCounters, TtftModel

CFG = RouterConfig()


def _model(**kw: float) -> TtftModel:
    args = dict(
        prior_tps=CFG.prior_prefill_tps, prior_fixed_s=CFG.prior_fixed_s,
        prior_weight=CFG.prior_weight, decay=CFG.rate_decay, floor_tps=CFG.min_prefill_tps,
        max_fixed_s=CFG.max_fixed_s, outlier_factor=CFG.outlier_factor,
        fleet_weight=CFG.fleet_weight,
    )
    args.update(kw)
    return TtftModel(**args)


def _true(work: float, fixed: float = 0.04, tps: float = 20_000.0) -> float:
    return fixed + work / tps


def test_a_replica_serving_cache_hits_does_not_look_slow() -> None:
    # same engine, same fixed part: one replica gets only hits (little work), one misses.
    # A ratio of sums would learn ~4,000 tokens/s for the first and ~18,000 for the second.
    m, rng = _model(), random.Random(1)
    for _ in range(60):
        hit, miss = rng.uniform(100, 400), rng.uniform(2_000, 12_000)
        m.observe("holder", hit, _true(hit))
        m.observe("other", miss, _true(miss))
    for replica in ("holder", "other"):
        fit = m.fit(replica)
        assert fit.rate == pytest.approx(20_000, rel=0.15), (replica, fit)
        assert fit.fixed_s == pytest.approx(0.04, abs=0.015), (replica, fit)
        for work in (300.0, 8_000.0):
            assert fit.predict(work) == pytest.approx(_true(work), rel=0.15)


def test_one_outlier_moves_the_fit_a_little() -> None:
    m, rng = _model(), random.Random(2)
    for _ in range(40):
        w = rng.uniform(500, 10_000)
        m.observe("r", w, _true(w))
    before = m.fit("r").predict(4_000)
    m.observe("r", 4_000, 60.0)  # a stalled request: 60 s
    assert m.fit("r").predict(4_000) < 1.5 * before


def test_a_slower_replica_is_learned_and_a_change_followed() -> None:
    m, rng = _model(), random.Random(3)
    for _ in range(50):
        w = rng.uniform(200, 8_000)
        m.observe("fast", w, _true(w))
        m.observe("slow", w, _true(w, fixed=0.08, tps=10_000))
    assert m.rate("fast") / m.rate("slow") == pytest.approx(2.0, rel=0.2)
    for _ in range(60):  # the slow one is fixed (another GPU): it catches up
        w = rng.uniform(200, 8_000)
        m.observe("slow", w, _true(w))
    assert m.rate("slow") == pytest.approx(20_000, rel=0.2)


def test_scraped_counters_teach_without_streamed_requests() -> None:
    m, rng = _model(), random.Random(4)
    seconds = requests = tokens = 0.0
    m.observe_counters("r", EngineCounters(0.0, 0.0, 0.0))
    for _ in range(25):  # scrapes: a few requests of different sizes finished in between
        for _ in range(rng.randint(1, 4)):
            w = rng.uniform(100, 10_000)
            seconds, requests, tokens = seconds + _true(w), requests + 1, tokens + w
        m.observe_counters("r", EngineCounters(seconds, requests, tokens))
    fit = m.fit("r")  # interval means spread less than single requests: a looser split
    assert fit.rate == pytest.approx(20_000, rel=0.25)
    for work in (1_000.0, 8_000.0):
        assert fit.predict(work) == pytest.approx(_true(work), rel=0.2)
    # counters that went back (the engine restarted) or did not move teach nothing
    m.observe_counters("r", EngineCounters(1.0, 1.0, 10.0))
    m.observe_counters("r", EngineCounters(1.0, 1.0, 10.0))
    assert m.fit("r") == fit


@pytest.mark.parametrize(
    ("work", "seconds"),
    [(1_000.0, 1e-6), (1e9, 0.01), (100.0, 1e4), (0.0, 0.5)],
)
def test_fits_stay_within_their_bounds(work: float, seconds: float) -> None:
    m = _model()
    for _ in range(100):
        m.observe("r", work, seconds)
    fit = m.fit("r")
    assert 0.0 <= fit.fixed_s <= CFG.max_fixed_s
    assert fit.rate >= CFG.min_prefill_tps


def test_nothing_learned_falls_back_to_the_fleet_then_the_prior() -> None:
    m = _model()
    assert m.fit("new") == m.prior
    for _ in range(30):
        m.observe("a", 5_000, _true(5_000, fixed=0.03, tps=25_000))
        m.observe("a", 500, _true(500, fixed=0.03, tps=25_000))
    assert m.fit("new") == m.fleet
    assert m.fleet.rate == pytest.approx(25_000, rel=0.25)
    m.forget("a")
    assert m.fit("a") == m.fleet


def test_a_replica_left_idle_returns_to_the_fleets_fit() -> None:
    # prefix-tree's cold start: one replica's first tokens all waited behind a queue, so its
    # line put the wait in the fixed part; then it was sent nothing, and an idle replica
    # yields no observation that could correct it. Its peers' observations retire the fit.
    m, rng = _model(), random.Random(5)
    peers = [f"r{i}" for i in range(7)]
    for _ in range(20):
        w = rng.uniform(1_000, 12_000)
        m.observe("stuck", w, 0.97 + rng.uniform(-0.05, 0.05))
        for r in peers:
            m.observe(r, w, _true(w))
    assert m.fit("stuck").predict(500) > 4 * m.fit("r0").predict(500)
    for _ in range(64):  # the peers serve everything: 64 observations each
        for r in peers:
            w = rng.uniform(200, 12_000)
            m.observe(r, w, _true(w))
    assert m.fit("stuck") == m.fleet
    assert m.fit("stuck").predict(500) == pytest.approx(_true(500), rel=0.3)


def test_a_replica_served_its_share_keeps_its_own_fit() -> None:
    m, rng = _model(), random.Random(6)
    for _ in range(200):
        w = rng.uniform(200, 8_000)
        for r in ("a", "b", "c"):
            m.observe(r, w, _true(w))
        m.observe("slow", w, _true(w, fixed=0.08, tps=10_000))
        for r in ("a", "b", "c"):  # the slow replica gets a quarter of its peers' share
            m.observe(r, w, _true(w))
            m.observe(r, w, _true(w))
            m.observe(r, w, _true(w))
    assert m.rate("a") / m.rate("slow") == pytest.approx(2.0, rel=0.2)
    assert m.fit("slow") != m.fleet


@pytest.mark.parametrize("computed", [1e300, float("nan")])
def test_absurd_engine_counters_teach_nothing(computed: float) -> None:
    """One replica's counters saying 1e300 tokens computed overflowed the fit's sums: the
    fleet's fit, every other replica's, became NaN (every cost NaN) for good."""
    m = _model()
    before = m.fleet
    m.observe_counters("bad", EngineCounters(1.0, 1.0, 100.0))
    m.observe_counters("bad", EngineCounters(2.0, 2.0, computed))
    m.observe("bad", computed, 0.5)
    assert m.fleet == before
    assert m.fit("good") == before


class _Engine:
    """One replica's engine counters, scraped into ``m`` interval by interval."""

    def __init__(self, m: TtftModel, replica: str, waiting: float) -> None:
        self.m, self.replica = m, replica
        self.c = EngineCounters(0.0, 0.0, 0.0, waiting)
        m.observe_counters(replica, self.c)

    def intervals(self, rng: random.Random, count: int, waiting: float, skew: bool) -> None:
        """``count`` scrape intervals of one or two prefills each. ``skew``: the engine is
        saturated (``waiting`` > 0): each prefill's time carries a step's worth of other
        prompts' chunks, as a cold start's do (0.33 s more, and a flatter slope)."""
        for _ in range(count):
            c = self.c
            seconds, requests, tokens = c.prefill_seconds, c.prefill_requests, c.computed_tokens
            for _ in range(rng.randint(1, 2)):
                w = rng.uniform(4_000, 12_000)
                t = 0.33 + w / 45_000 if skew else _true(w, fixed=0.01, tps=25_000)
                seconds, requests, tokens = seconds + t, requests + 1, tokens + w
            self.c = EngineCounters(seconds, requests, tokens, waiting)
            self.m.observe_counters(self.replica, self.c)


def test_a_cold_model_learns_no_counter_interval_with_requests_waiting() -> None:
    """prefix-tree's first seconds: a saturated engine's counter intervals read as a fixed
    part of ~0.3 s at a rate faster than the engine's, and cache_aware sent requests behind
    queues 2-5x longer than it predicted. While cold only the intervals without a queue teach."""
    m, rng = _model(cold_observations=32.0), random.Random(7)
    engines = [_Engine(m, f"r{i}", waiting=0.0) for i in range(4)]
    for _ in range(4):  # an interval ending or starting at a queue is skipped too
        for e in engines:
            e.intervals(rng, 2, waiting=5.0, skew=True)
            e.intervals(rng, 3, waiting=0.0, skew=False)
    assert m.cold
    for r in (e.replica for e in engines):
        fit = m.fit(r)
        assert fit.fixed_s < 0.1, (r, fit)
        assert fit.predict(8_000) == pytest.approx(_true(8_000, 0.01, 25_000), rel=0.15), fit


def test_an_interval_is_skipped_when_requests_waited_at_either_scrape() -> None:
    m = _model(cold_observations=32.0)
    before = m.fleet
    m.observe_counters("r", EngineCounters(0.0, 0.0, 0.0, 0.0))
    m.observe_counters("r", EngineCounters(1.0, 2.0, 20_000.0, 3.0))  # waiting at the end
    m.observe_counters("r", EngineCounters(2.0, 4.0, 40_000.0, 0.0))  # ... at the start
    assert m.fleet == before
    m.observe_counters("r", EngineCounters(3.0, 6.0, 60_000.0, 0.0))  # none at either
    assert m.fleet != before
    # a page without the waiting gauge: unknown counts as none (learned, as before)
    m.observe_counters("u", EngineCounters(0.0, 0.0, 0.0))
    fleet = m.fleet
    m.observe_counters("u", EngineCounters(1.0, 2.0, 20_000.0))
    assert m.fleet != fleet


def test_once_warm_an_engine_that_always_queues_is_learned() -> None:
    """A slow replica, or one other clients keep busy, always has requests waiting: skipped
    intervals still count toward the cold period, which ends, and its counters teach."""
    m, rng = _model(cold_observations=8.0), random.Random(8)
    busy = _Engine(m, "busy", waiting=4.0)
    busy.intervals(rng, 8, waiting=4.0, skew=False)
    assert m.fit("busy") == m.prior  # cold: nothing learned, but the clock ran
    assert not m.cold
    busy.intervals(rng, 60, waiting=4.0, skew=True)
    assert m.fit("busy").fixed_s > 0.2  # what the engine's counters say, learned


def test_the_gateway_passes_the_scraped_waiting_to_the_model() -> None:
    from gateway.scrape import parse_vllm_metrics

    page = """\
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 30.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 6.5
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 55000.0
"""
    assert parse_vllm_metrics(page).engine_counters() == EngineCounters(
        6.5, 30.0, 55_000.0, 4.0)

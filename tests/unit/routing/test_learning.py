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

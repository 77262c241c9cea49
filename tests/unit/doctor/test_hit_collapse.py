"""A prefix-cache hit rate that collapses mid-window (a cache flushed, a policy or traffic
change) is named from the window's second half: over the whole window the good half before it
kept the average above the bar, and the doctor said the pool was healthy."""

from __future__ import annotations

import pytest

from gateway.doctor.findings import Context
from gateway.doctor.history import History, read_tick
from gateway.doctor.pool_rules import classify_pool
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import PoolStats, summarise
from gateway.scrape import Sample
from tests.unit.doctor.test_history import Fleet
from tests.unit.doctor.test_rules import pool, replica

TH = Thresholds()
SHARING = {"share_n": 50.0, "share_prompt": 100_000.0, "share_best": 55_000.0,
           "share_chosen": 55_000.0}  # the traffic allows 55 %, and requests go where it is


def _collapsed(before: float, after: float) -> PoolStats:
    """A pool whose engines hit ``before`` then ``after`` of 50,000 queried tokens per half."""
    whole = pool(replica("a", queries=100_000.0, hits=50_000.0 * (before + after)), **SHARING)
    half = {k: v / 2 for k, v in SHARING.items()}
    whole.recent = pool(replica("a", queries=50_000.0, hits=50_000.0 * after), samples=20,
                        requests=250.0, **half)
    whole.recent.span_s = 150.0
    return whole


def test_a_hit_rate_that_collapsed_in_the_second_half_is_named() -> None:
    p = _collapsed(0.55, 0.05)  # 30 % over the window: above half the 55 % allowed
    (f,) = classify_pool(p, TH, Context())
    assert f.cls == "routing" and f.replica is None, f
    assert f.summary.startswith("in the window's last 150 s: hit rate 5% where the traffic's "
                                "prefix sharing allows 55%"), f.summary
    assert f.action.startswith("give the replicas more KV cache")
    whole = [e for e in f.evidence if e.what == "engine hit rate over the whole window"]
    assert [e.value for e in whole] == [pytest.approx(0.3)]


def test_a_steady_good_hit_rate_is_still_healthy() -> None:
    for before, after in ((0.5, 0.5), (0.05, 0.55)):  # steady, or recovered
        p = _collapsed(before, after)
        assert [f.cls for f in classify_pool(p, TH, Context())] == ["healthy"]


def test_the_window_keeps_its_second_half_hit_rate() -> None:
    f = Fleet()
    h = History(1.0, 60.0)
    queries = hits = 0.0
    for i in range(21):
        queries += 1000.0
        hits += 500.0 if i <= 10 else 0.0  # half the tokens hit, then none
        for r in f.reps:
            r.record_scrape(Sample(
                waiting=0.0, running=1.0, kv_usage=0.1, preemptions=0.0,
                prefix_cache_queries=queries, prefix_cache_hits=hits, prompt_tokens=queries,
                generation_tokens=10.0 * i, ttft_sum=0.05 * i, ttft_count=float(i),
                itl_sum=0.01 * i, itl_count=float(i), block_size=16, num_gpu_blocks=1000),
                f.now)
        h.append(read_tick(f.src, f.now, h.layout, False, None))
        f.now += 1.0
    (p,) = summarise(list(h.ticks), 20.0, stale_after_s=1.0).pools
    assert p.engine_hit_rate == pytest.approx(0.25)  # 10 of 20 steps at 50 %
    assert p.recent is not None and p.recent.samples == 10 and p.recent.span_s == 10.0
    assert p.recent.engine_hit_rate == 0.0

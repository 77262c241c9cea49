"""The cache return of a pool with little reuse says why, from the prefix sharing sampled at
routing time: clients that put a timestamp before a shared 1,500-token system prompt got
"little reuse: almost nothing is served from the cache", the same words as a cache that
evicts shared prefixes before their reuse -- two faults with opposite changes (move the
varying part after the shared one; give the cache room or route by prefix)."""

from __future__ import annotations

from gateway.doctor.cache import LITTLE, cache_return
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import PoolStats, ReplicaStats, Window
from tests.unit.doctor.test_report import _window


def _pool(best: float) -> Window:
    """One replica hitting none of 600k prompt tokens; the sampled requests' best replica
    held ``best`` of their 50k prefix tokens."""
    r = ReplicaStats("r", "p", prefill_rate=10_000.0, kv_mean=0.1, queries=6e5, hits=0.0,
                     prompt_tokens=6e5, requests=400.0)
    w = _window([], [r])
    p: PoolStats = w.pools[0]
    p.share_n, p.share_prompt, p.share_best, p.share_chosen = 40, 5e4, best * 5e4, best * 5e4
    return w


def test_prompts_that_differ_from_their_start_are_told_from_evicted_prefixes() -> None:
    th = Thresholds()
    (stamped,) = cache_return(_pool(0.0), th)[1]
    (evicted,) = cache_return(_pool(0.9), th)[1]
    assert stamped.verdict == evicted.verdict == LITTLE
    assert "the traffic itself shares little" in stamped.detail, stamped.detail
    assert "a varying start (a timestamp, a request id)" in stamped.detail
    assert "evicted before they are reused" in evicted.detail, evicted.detail
    assert "90%" in evicted.detail and "timestamp" not in evicted.detail


def test_a_pool_without_sampled_routing_keeps_its_words() -> None:
    r = ReplicaStats("r", "p", prefill_rate=10_000.0, queries=6e5, hits=0.0,
                     prompt_tokens=6e5, requests=400.0)
    (row,) = cache_return(_window([], [r]), Thresholds())[1]
    assert row.detail == "almost nothing is served from the cache"

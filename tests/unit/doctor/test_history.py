"""The rolling history: ticks read from the gateway's own objects, reduced to a window."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.doctor.history import REP, History, Sampler, Sources, read_tick
from gateway.doctor.process_rules import classify_gateway
from gateway.doctor.sharing import PrefixSharing
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import histogram_quantile, increase, summarise
from gateway.metrics import GatewayMetrics
from gateway.replicas import HealthRules, Replica
from gateway.scrape import Sample
from routing.router import Router
from routing.types import RequestFeatures


def test_increase_handles_resets_and_gaps() -> None:
    assert increase([1.0, 3.0, 6.0]) == 5.0
    assert increase([10.0, 12.0, 2.0, 5.0]) == 2.0 + 2.0 + 3.0  # restarted at 0, counted on
    assert increase([math.nan, 4.0, math.nan, 7.0]) == 3.0
    assert increase([]) == 0.0 and increase([math.nan]) == 0.0


def test_histogram_quantile_interpolates_and_caps_at_the_last_bound() -> None:
    bounds = (0.1, 0.2, math.inf)
    assert histogram_quantile(0.5, bounds, [0.0, 10.0, 10.0]) == pytest.approx(0.15)
    assert histogram_quantile(0.99, bounds, [0.0, 0.0, 10.0]) == 0.2
    assert math.isnan(histogram_quantile(0.5, bounds, [0.0, 0.0, 0.0]))


class Fleet:
    """Two replicas in pool "p", a metrics object and a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reps = [Replica("p", f"http://10.0.0.{i}:8000", HealthRules()) for i in (1, 2)]
        self.metrics = GatewayMetrics(lambda: self.reps, lambda: self.now)
        self.router = Router()
        self.errors: dict[str, int] = {}
        self.redis: bool | None = True
        self.loaded = True
        self.cpu = 0.0
        self.src = Sources(lambda: self.reps, self.metrics, self.router,
                           PrefixSharing(self.router, seed=1, clock=lambda: self.now),
                           lambda rid: self.errors.get(rid, 0), lambda: self.redis,
                           lambda: None, cpu=lambda: self.cpu,
                           tenancy_loaded=lambda: self.loaded)
        self.k = 0

    def scrape(self, waiting: float, running: float, kv: float, new: int) -> None:
        """Each replica scraped now; ``new`` more requests started since the last scrape."""
        self.k += new
        k = self.k
        for r in self.reps:
            r.record_scrape(Sample(
                waiting=waiting, running=running, kv_usage=kv, preemptions=0.0,
                prefix_cache_queries=1000.0 * k, prefix_cache_hits=250.0 * k,
                prompt_tokens=1000.0 * k, generation_tokens=50.0 * k, ttft_sum=0.05 * k,
                ttft_count=float(k), itl_sum=0.01 * 49 * k, itl_count=49.0 * k,
                block_size=16, num_gpu_blocks=1000), self.now)


def _ticks(f: Fleet, n: int, **scrape: float) -> History:
    h = History(1.0, 60.0)
    for _ in range(n):
        f.scrape(**scrape)  # type: ignore[arg-type]
        for r in f.reps:
            f.metrics.finished("p", r.id, 200, "least-cost", 0.2, "default", "acme")
            f.metrics.usage("p", {"prompt_tokens": 1000, "cached_tokens": 250}, "default",
                            "acme")
        f.cpu += 0.25
        want = h.want_tenants()
        h.append(read_tick(f.src, f.now, h.layout, want, h.tenant_keys() if want else None))
        f.now += 1.0
    return h


def test_a_window_reduces_gauges_and_counter_increases() -> None:
    f = Fleet()
    h = _ticks(f, 31, waiting=2.0, running=4.0, kv=0.5, new=10)
    w = summarise(list(h.ticks), 20.0, stale_after_s=1.0)
    assert w.ticks == 20 and w.span_s == pytest.approx(20.0)
    assert {r.id for r in w.replicas} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    r = w.replicas[0]
    assert r.samples == 20 and r.fresh == 20 and r.span_s == pytest.approx(20.0)
    assert (r.waiting_share, r.waiting_mean, r.running_mean, r.kv_p90) == (1.0, 2.0, 4.0, 0.5)
    assert r.requests == 200.0 and r.mean_prompt == 1000.0 and r.hit_rate == 0.25
    assert r.ttft_mean == pytest.approx(0.05) and r.itl_mean == pytest.approx(0.01)
    (p,) = w.pools
    assert p.requests == 40.0 and p.prompt_tokens == 40_000.0 and p.cached_tokens == 10_000.0
    assert w.gateway.cpu_share == pytest.approx(0.25)
    assert w.gateway.redis_up == 1.0 and math.isnan(w.gateway.sync_degraded)
    assert w.gateway.tenancy_loaded == 1.0
    (t,) = w.tenants
    assert (t.tenant, t.pool, t.requests, t.cached_reported) == ("acme", "p", 40.0, 40.0)
    assert w.tenant_span_s == pytest.approx(20.0)  # tenant ticks every 10: 10 .. 30


def test_the_cause_of_a_redis_outage_is_kept_in_the_ticks_and_named_after_it_ends() -> None:
    f = Fleet()
    cause: list[str | None] = [None]
    f.src.redis_cause = lambda: cause[0]
    h = _ticks(f, 3, waiting=0.0, running=1.0, kv=0.1, new=3)
    f.redis, cause[0] = False, "oom"
    h = _more(f, h, 4)
    w = summarise(list(h.ticks), 30.0, stale_after_s=1.0)
    assert (w.gateway.redis_up, w.gateway.redis_cause) == (0.0, "oom")
    (now,) = classify_gateway(w.gateway, Thresholds())
    assert "out of memory" in now.summary and now.severity == "warning"
    f.redis, cause[0] = True, None
    h = _more(f, h, 2)
    w = summarise(list(h.ticks), 30.0, stale_after_s=1.0)
    assert (w.gateway.redis_up, w.gateway.redis_cause) == (1.0, "oom")  # the last one seen
    (was,) = classify_gateway(w.gateway, Thresholds())
    assert was.severity == "info" and "out of memory" in was.summary
    recent = summarise(list(h.ticks), 1.0, stale_after_s=1.0).gateway  # after its end only
    assert (recent.redis_down_s, recent.redis_cause) == (0.0, None)


def _more(f: Fleet, h: History, n: int) -> History:
    for _ in range(n):
        h.append(read_tick(f.src, f.now, h.layout, False))
        f.now += 1.0
    return h


def test_a_short_history_covers_less_than_the_window() -> None:
    f = Fleet()
    h = _ticks(f, 5, waiting=0.0, running=1.0, kv=0.1, new=3)
    w = summarise(list(h.ticks), 300.0, stale_after_s=1.0)
    assert w.span_s == pytest.approx(4.0) and w.requested_s == 300.0


def test_stale_scrapes_and_errors_are_counted() -> None:
    f = Fleet()
    h = _ticks(f, 3, waiting=0.0, running=1.0, kv=0.1, new=3)
    for _ in range(6):  # no good scrape any more: the last sample ages, errors grow
        f.errors = {r.id: f.errors.get(r.id, 0) + 4 for r in f.reps}
        h.append(read_tick(f.src, f.now, h.layout, False))
        f.now += 1.0
    w = summarise(list(h.ticks), 6.0, stale_after_s=0.5)
    r = w.replicas[0]
    assert r.fresh == 0 and r.stale_share == 1.0 and r.scrape_errors == 24.0


def test_a_tick_holds_numbers_not_objects_and_shares_its_layout() -> None:
    f = Fleet()
    h = _ticks(f, 3, waiting=1.0, running=2.0, kv=0.3, new=1)
    a, b = h.ticks[0], h.ticks[2]
    assert a.layout is b.layout
    assert len(a.replicas) == 2 * REP.N and a.replica("10.0.0.2:8000", REP.KV) == 0.3
    assert math.isnan(a.replica("nope", REP.KV))
    assert a.tenant_keys == (("acme", "p"),) and h.ticks[1].tenant_keys is None


def test_sharing_probe_measures_best_and_chosen_matches() -> None:
    router = Router()
    hashes = tuple(range(1, 11))  # 10 blocks of 64 tokens
    router.record_route("a", RequestFeatures("m", hashes, 640), 0.0)
    probe = PrefixSharing(router, seed=1, clock=lambda: 0.0)
    probe.observe("p", "b", RequestFeatures("m", hashes, 700))
    assert probe.pools["p"] == [1, 700, 640, 0]  # sampled (the first), best on "a", sent to "b"


def test_sharing_probe_paces_itself_to_a_sample_rate() -> None:
    now = [0.0]
    probe = PrefixSharing(Router(), seed=3, clock=lambda: now[0])
    feats = RequestFeatures("m", (1, 2, 3), 192)
    for i in range(40_000):  # 2,000 requests/s for 20 s
        now[0] = i / 2000.0
        probe.observe("p", "r", feats)
    per_s = probe.pools["p"][0] / 20.0
    assert 10 < per_s < 80  # about TARGET_PER_S, not 2,000
    slow = PrefixSharing(Router(), seed=3, clock=lambda: now[0])
    for i in range(100):  # 5 requests/s: every one sampled
        now[0] = i / 5.0
        slow.observe("p", "r", feats)
    assert slow.pools["p"][0] >= 95


def test_tenant_tokens_and_pool_counts_are_exported_and_kept() -> None:
    f = Fleet()
    f.metrics.usage("p", {"prompt_tokens": 100, "cached_tokens": 40}, "gold", "acme")
    f.metrics.usage("p", {"prompt_tokens": 50}, "gold", "acme")  # no cached_tokens reported
    f.metrics.finished("p", "x", 503, "overflow", 0.1)
    f.metrics.spilled("gold", "p", "q")
    assert f.metrics.tenant_tokens.counts[("acme", "p")] == [2, 150, 40, 1]
    assert f.metrics.pool_counts["p"] == [1, 1, 1, 1]
    page = f.metrics.render().decode()
    assert 'kvgate_tenant_tokens_total{kind="prompt",pool="p",tenant="acme"} 150.0' in page
    assert 'kvgate_tenant_tokens_total{kind="cached",pool="p",tenant="acme"} 40.0' in page


async def test_the_sampler_ticks_until_stopped() -> None:
    f = Fleet()
    f.scrape(waiting=0.0, running=1.0, kv=0.1, new=1)
    h = History(0.05, 10.0)
    sampler = Sampler(f.src, h, lambda: f.now)
    await sampler.start()
    await asyncio.sleep(0.2)
    await sampler.stop()
    n = len(h.ticks)
    assert n >= 3
    await asyncio.sleep(0.1)
    assert len(h.ticks) == n
    assert sampler.now().tenant_keys is not None  # a report's "now" carries the tenants


def test_a_tenancy_never_loaded_reaches_the_window() -> None:
    f = Fleet()
    f.redis, f.loaded = False, False
    h = _ticks(f, 5, waiting=0.0, running=1.0, kv=0.1, new=1)
    w = summarise(list(h.ticks), 20.0, stale_after_s=1.0)
    assert (w.gateway.redis_up, w.gateway.tenancy_loaded) == (0.0, 0.0)


def test_flow_controls_queue_reaches_the_window() -> None:
    """Queued so far, queued now and shed so far per pool, each tick; no flow control:
    unknown (NaN)."""
    f = Fleet()
    off = summarise(list(_ticks(f, 6, waiting=0.0, running=1.0, kv=0.1, new=2).ticks), 5.0, 1.0)
    assert math.isnan(off.pools[0].flow_queued) and math.isnan(off.pools[0].flow_shed)
    queued = [0.0]

    def flow() -> dict[str, tuple[float, float, float]]:
        queued[0] += 10.0  # 10 requests queued a second, 5 in the queue: 0.5 s each
        return {"p": (queued[0], 5.0, queued[0] / 2)}  # and 5 shed a second

    f.src.flow = flow
    w = summarise(list(_ticks(f, 6, waiting=0.0, running=1.0, kv=0.1, new=2).ticks), 5.0, 1.0)
    (p,) = w.pools
    assert (p.flow_queued, p.flow_depth_mean, p.flow_shed) == (50.0, 5.0, 25.0)
    assert p.flow_wait_mean == pytest.approx(0.5)


def test_a_hung_engines_frozen_counters_are_counted_through_a_late_scrape() -> None:
    """Requests running, no token for 8 ticks; one tick's scrape is late (stale): it
    repeats the counters and does not end the count. A stale last sample adds no time (it
    voided the count, which read 0 s when a busy host delayed the last scrape)."""
    f = Fleet()
    h = _ticks(f, 4, waiting=0.0, running=4.0, kv=0.1, new=2)
    for k in range(8):
        if k != 4:  # no scrape this tick: the last one is 1 s old then (stale_after_s 0.5)
            f.scrape(waiting=0.0, running=4.0, kv=0.1, new=0)
        h.append(read_tick(f.src, f.now, h.layout, False, None))
        f.now += 1.0
    r = summarise(list(h.ticks), 20.0, stale_after_s=0.5).replicas[0]
    assert r.fresh < r.samples
    assert (r.frozen_s, r.frozen_running) == (8.0, 4.0)
    h.append(read_tick(f.src, f.now + 1.0, h.layout, False, None))  # stale now
    assert summarise(list(h.ticks), 20.0, stale_after_s=0.5).replicas[0].frozen_s == 8.0

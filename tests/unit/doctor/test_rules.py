"""The doctor's rules on hand-made numbers: each class fires on its signature, and only then."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.doctor.classify import classify
from gateway.doctor.findings import Context, Finding
from gateway.doctor.pool_rules import classify_pool
from gateway.doctor.process_rules import classify_gateway
from gateway.doctor.replica_rules import classify_replica
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import GatewayStats, PoolStats, ReplicaStats, Window

TH = Thresholds()
CTX = Context()


def replica(rid: str = "r1", **kw: Any) -> ReplicaStats:
    """A busy, healthy replica unless told otherwise (10 s window, 40 samples)."""
    base: dict[str, Any] = dict(
        samples=40, span_s=10.0, fresh=40, healthy_share=1.0, inflight_mean=4.0, inflight_max=6,
        waiting_share=0.05, waiting_mean=0.05, running_mean=4.0, running_max=6.0,
        running_when_waiting=3.0, kv_p90=0.2, kv_mean=0.15, kv_max=0.25, preemptions=0.0,
        queries=40_000.0, hits=10_000.0, prompt_tokens=40_000.0, generation_tokens=8000.0,
        requests=100.0, ttft_mean=0.03, itl_mean=0.01, itl_n=8000.0, scrape_errors=0.0,
        stale_share=0.0, prefill_rate=8000.0, capacity_tokens=448_000.0)
    base.update(kw)
    return ReplicaStats(rid, "p", **base)


def classes(findings: list[Finding]) -> list[str]:
    return [f.cls for f in findings]


def test_a_busy_normal_replica_is_healthy_and_says_why() -> None:
    (f,) = classify_replica(replica(), TH, CTX)
    assert (f.cls, f.severity, f.action) == ("healthy", "ok", "none")
    assert f.summary.startswith("nothing above thresholds")
    assert {e.metric for e in f.evidence} >= {"vllm:num_requests_waiting",
                                              "vllm:kv_cache_usage_perc"}


def test_an_idle_replica_is_healthy_idle() -> None:
    (f,) = classify_replica(replica(requests=2.0, waiting_share=0.0), TH, CTX)
    assert f.cls == "healthy" and f.summary.startswith("idle")


def test_an_idle_replica_says_the_requests_kvgate_sent_it_that_failed() -> None:
    """A pool's only replica answering 500 to 15 requests (fewer than min_replica_attempts):
    its engine started none, and the row said 'idle: 0 requests started' and nothing else."""
    (f,) = classify_replica(replica(requests=0.0, waiting_share=0.0, attempts=15.0,
                                    failed=15.0), TH, CTX, alone=True)
    assert (f.cls, f.severity) == ("healthy", "ok")
    assert "kvgate sent it 15, 15 failed" in f.summary, f.summary
    assert "judged from 20" in f.summary, f.summary
    (f,) = classify_replica(replica(requests=2.0, waiting_share=0.0, attempts=2.0), TH, CTX)
    assert "failed" not in f.summary, f.summary


def test_queue_bound_says_how_many_seats() -> None:
    r = replica(waiting_share=0.9, waiting_mean=12.0, running_mean=4.0, running_max=4.0,
                running_when_waiting=4.0, kv_p90=0.05, ttft_mean=0.8, itl_mean=0.008)
    (f,) = classify_replica(r, TH, CTX)
    assert f.cls == "queue-bound" and f.severity == "critical"
    assert f.action.startswith("raise --max-num-seqs from 4 to 16")
    waiting = next(e for e in f.evidence if e.threshold_name == "queue_waiting_share")
    assert (waiting.metric, waiting.value, waiting.threshold) == (
        "vllm:num_requests_waiting", 0.9, 0.5)


def test_queue_bound_target_is_capped_by_kv_headroom() -> None:
    r = replica(waiting_share=0.6, waiting_mean=40.0, running_when_waiting=8.0, kv_p90=0.4,
                ttft_mean=1.0, itl_mean=0.01)
    (f,) = classify_replica(r, TH, CTX)
    assert f.cls == "queue-bound" and f.severity == "warning"
    assert "from 8 to 16" in f.action  # 8 x 0.8 / 0.4: the KV cache holds twice the batch


def test_transient_waiting_with_a_short_ttft_is_not_queue_bound() -> None:
    # requests that arrive mid-step wait for the next one: waiting > 0 often, TTFT ~ a step
    r = replica(waiting_share=0.7, waiting_mean=1.2, ttft_mean=0.012, itl_mean=0.008)
    assert classes(classify_replica(r, TH, CTX)) == ["healthy"]


def test_long_prompts_waiting_are_prefill_bound_not_queue_bound() -> None:
    r = replica(waiting_share=0.9, waiting_mean=6.0, ttft_mean=2.5, itl_mean=0.03,
                prompt_tokens=300_000.0, requests=100.0, queries=300_000.0, hits=3000.0)
    (f,) = classify_replica(r, TH, CTX)
    assert f.cls == "prefill-bound"
    names = {e.threshold_name for e in f.evidence}
    assert names == {"ttft_high_s", "itl_high_s", "long_prompt_tokens", "low_hit_rate"}


def test_long_prompts_with_a_good_hit_rate_are_not_prefill_bound() -> None:
    r = replica(ttft_mean=1.5, prompt_tokens=300_000.0, queries=300_000.0, hits=200_000.0)
    assert classes(classify_replica(r, TH, CTX)) == ["healthy"]


@pytest.mark.parametrize(("preemptions", "waiting", "severity"),
                         [(30.0, 0.1, "critical"), (0.0, 0.8, "warning")])
def test_kv_bound_with_preemptions_or_requests_waiting_for_blocks(
        preemptions: float, waiting: float, severity: str) -> None:
    r = replica(kv_p90=0.98, kv_mean=0.95, preemptions=preemptions, waiting_share=waiting,
                ttft_mean=0.5, itl_mean=0.02)
    fs = classify_replica(r, TH, CTX)
    assert classes(fs) == ["KV-bound"] and fs[0].severity == severity
    assert "--max-num-seqs" in fs[0].action and "fp8" in fs[0].action


def test_full_kv_without_preemptions_or_waiting_is_fine() -> None:
    # prefix caching keeps KV usage high on purpose; nothing is evicted or waits
    assert classes(classify_replica(replica(kv_p90=0.97), TH, CTX)) == ["healthy"]


@pytest.mark.parametrize(("kw", "action"), [
    ({"running_mean": 90.0}, "add replicas (or lower --max-num-seqs)"),
    ({"running_mean": 6.0, "prompt_tokens": 200_000.0, "queries": 200_000.0, "hits": 0.0},
     "lower --max-num-batched-tokens"),
    ({"running_mean": 6.0}, "add replicas or a faster model/GPU pair"),
])
def test_decode_bound_action_depends_on_batch_and_prompts(kw: dict[str, Any], action: str) -> None:
    (f,) = classify_replica(replica(itl_mean=0.08, **kw), TH, CTX)
    assert f.cls == "decode-bound" and f.action.startswith(action)


def test_decode_bound_excludes_prefill_and_queue_bound() -> None:
    r = replica(itl_mean=0.09, ttft_mean=3.0, waiting_share=0.9, running_when_waiting=4.0,
                prompt_tokens=300_000.0, queries=300_000.0, hits=0.0)
    assert classes(classify_replica(r, TH, CTX)) == ["decode-bound"]


def test_a_replica_kvgate_cannot_scrape_is_a_gateway_finding() -> None:
    r = replica(fresh=0, stale_share=1.0, scrape_errors=300.0, requests=math.nan)
    fs = classify_replica(r, TH, Context(scrape_interval_s=0.25, interval_s=0.25))
    assert classes(fs) == ["gateway"] and fs[0].severity == "critical"
    assert fs[0].evidence[0].metric == "kvgate_scrape_errors_total"


def test_a_draining_replica_is_not_a_scrape_problem() -> None:
    r = replica(fresh=0, stale_share=1.0, scrape_errors=300.0, draining=True)
    assert classes(classify_replica(r, TH, CTX)) == ["healthy"]


def pool(*replicas: ReplicaStats, **kw: Any) -> PoolStats:
    p = PoolStats("p", samples=kw.pop("samples", 40), requests=kw.pop("requests", 500.0), **kw)
    p.replicas = list(replicas)
    return p


def test_in_flight_imbalance_names_the_hot_replica() -> None:
    hot = replica("hot", inflight_mean=12.0, running_mean=10.0, waiting_mean=2.0)
    (f,) = classify_pool(pool(hot, replica("a"), replica("b")), TH, CTX)
    assert (f.cls, f.replica) == ("routing", "hot")
    assert "routing.load_factor" in f.action


def test_a_slow_replica_shows_in_time_per_request_when_in_flight_is_balanced() -> None:
    # the router balances in-flight counts: the slow one serves fewer requests at equal load
    slow = replica("slow", inflight_mean=6.0, requests=60.0, running_mean=0.3, waiting_mean=0.0)
    fast = replica("fast", inflight_mean=5.0, requests=400.0)
    (f,) = classify_pool(pool(slow, fast), TH, CTX)
    assert (f.cls, f.replica) == ("routing", "slow")
    assert f.summary.startswith("imbalance: time per request on slow 1000 ms")
    assert "sit before slow's engine" in f.action


def test_a_fast_replica_taking_most_requests_is_not_held_before_its_engine() -> None:
    # seen on a CPU-starved host: 3.6 in flight through the gateway, 1.7 in the engine (the
    # relay of the streams' last tokens), 5x faster than the slow peer that gets little --
    # less than `imbalance_min` requests outside the engine is not a frontend stall
    fast = replica("fast", inflight_mean=3.6, running_mean=1.3, waiting_mean=0.4,
                   requests=370.0, itl_mean=0.007, ttft_mean=0.02)
    slow = replica("slow", inflight_mean=0.16, running_mean=0.16, waiting_mean=0.0,
                   requests=12.0, itl_mean=0.035, ttft_mean=0.05)
    # nothing waits on the fast one; the slow one, 5x slower and sent little, is named
    (f,) = classify_pool(pool(fast, slow), TH, CTX)
    assert (f.cls, f.replica) == ("routing", "slow")
    assert f.summary.startswith("slow engine, routed around: slow's engine is 5.0x slower")
    held = replica("fast", inflight_mean=5.6, running_mean=1.3, waiting_mean=0.4,
                   requests=370.0, itl_mean=0.007, ttft_mean=0.02)
    (f,) = classify_pool(pool(held, slow), TH, CTX)
    assert f.replica == "fast" and "sit before fast's engine" in f.action


def test_small_spreads_are_not_imbalance() -> None:
    # more in flight on "a" at the same time per request (it gets more of the traffic)
    fs = classify_pool(pool(replica("a", inflight_mean=2.5, requests=250.0),
                            replica("b", inflight_mean=1.0)), TH, CTX)
    assert classes(fs) == ["healthy"]


@pytest.mark.parametrize(("routed", "policy", "action"), [
    (0.0, "round_robin", "set routing.policy: cache_aware (now round_robin)"),
    (0.0, "cache_aware", "raise routing.load_factor"),
    (0.5, "cache_aware", "give the replicas more KV cache"),
])
def test_hit_rate_far_below_the_sharing_allowed(routed: float, policy: str, action: str) -> None:
    reps = [replica("a", queries=100_000.0, hits=2_000.0), replica("b", queries=100_000.0,
                                                                     hits=2_000.0)]
    p = pool(*reps, share_n=50.0, share_prompt=100_000.0, share_best=55_000.0,
             share_chosen=routed * 100_000.0)
    (f,) = classify_pool(p, TH, Context(policy=policy))
    assert f.cls == "routing" and f.replica is None and f.action.startswith(action)


def test_a_good_hit_rate_or_little_sharing_is_fine() -> None:
    reps = [replica("a", queries=100_000.0, hits=45_000.0)]
    p = pool(*reps, share_n=50.0, share_prompt=100_000.0, share_best=55_000.0)
    assert classes(classify_pool(p, TH, CTX)) == ["healthy"]
    p = pool(replica("a", hits=0.0), share_n=50.0, share_prompt=100_000.0, share_best=10_000.0)
    assert classes(classify_pool(p, TH, CTX)) == ["healthy"]


def test_overflow_and_spill_shares() -> None:
    fs = classify_pool(pool(replica("a"), overflow=150.0, spilled=200.0), TH, CTX)
    assert classes(fs) == ["routing", "routing"]
    assert "routing.load_factor" in fs[0].action and "add replicas to pool p" in fs[1].action


def test_gateway_overhead_busy_or_starved() -> None:
    (busy,) = classify_gateway(GatewayStats(cpu_share=0.6, overhead_p99=0.012,
                                            overhead_n=500.0), TH, Context(cores=4))
    assert busy.cls == "gateway" and busy.action.startswith("add server.workers")
    (starved,) = classify_gateway(GatewayStats(cpu_share=0.1, overhead_p99=0.012,
                                               overhead_n=500.0), TH)
    assert "waits for a CPU" in starved.summary and "core of its own" in starved.action
    few = classify_gateway(GatewayStats(cpu_share=0.1, overhead_p99=0.012, overhead_n=16.0), TH)
    assert classes(few) == ["healthy"]
    assert "overhead p99 12 ms (not judged: 16 requests < 100)" in few[0].summary
    (judged,) = classify_gateway(GatewayStats(cpu_share=0.1, overhead_p99=0.004,
                                              overhead_n=500.0), TH)
    assert "overhead p99 4 ms (< 10 ms)" in judged.summary


def test_more_workers_are_advised_only_with_cores_to_spare() -> None:
    busy = GatewayStats(cpu_share=0.97)
    (spare,) = classify_gateway(busy, TH, Context(workers=1, cores=4))
    assert spare.action.startswith("add server.workers") and "4 cores" in spare.action
    (full,) = classify_gateway(busy, TH, Context(workers=2, cores=2))
    assert full.action.startswith("add gateway replicas") and "not add capacity" in full.action
    (unknown,) = classify_gateway(busy, TH)
    assert "if the pod has spare cores" in unknown.action
    assert all("docs/shared-state.md" in f.action for f in (spare, full, unknown))


def test_cpu_saturation() -> None:
    fs = classify_gateway(GatewayStats(cpu_share=0.97), TH)
    assert classes(fs) == ["gateway"] and fs[0].severity == "critical"


def test_redis_and_shared_state_degraded_now_or_earlier() -> None:
    fs = classify_gateway(GatewayStats(cpu_share=0.1, redis_up=0.0, redis_down_s=4.0,
                                       sync_degraded=1.0, sync_degraded_s=4.0), TH)
    assert [(f.cls, f.severity) for f in fs] == [("gateway", "warning")] * 2
    assert fs[0].evidence[0].metric == "kvgate_redis_up"
    assert fs[1].evidence[0].metric == "kvgate_sync_up"
    earlier = classify_gateway(GatewayStats(cpu_share=0.1, redis_up=1.0, redis_down_s=3.0), TH)
    assert [(f.cls, f.severity) for f in earlier] == [("gateway", "info")]
    no_redis = classify_gateway(GatewayStats(cpu_share=0.1), TH)
    assert classes(no_redis) == ["healthy"] and "Redis" not in no_redis[0].summary


def test_redis_down_since_start_is_critical_and_claims_no_last_known_state() -> None:
    (never,) = classify_gateway(GatewayStats(cpu_share=0.1, redis_up=0.0, redis_down_s=30.0,
                                             tenancy_loaded=0.0), TH)
    assert (never.cls, never.severity) == ("gateway", "critical")
    assert "last known" not in never.summary and "every request gets 503" in never.summary
    assert "KVGATE_REDIS_URL" in never.action
    (lost,) = classify_gateway(GatewayStats(cpu_share=0.1, redis_up=0.0, redis_down_s=30.0,
                                            tenancy_loaded=1.0), TH)
    assert lost.severity == "warning" and "last known" in lost.summary


# cause -> words its finding must say (what Redis does, the change that ends it)
REFUSALS = {
    "oom": ("out of memory (OOM", "raise Redis's maxmemory"),
    "wrongtype": ("(WRONGTYPE)", "delete the key the gateway's log names"),
    "noperm": ("(NOPERM)", "grant that ACL user"),
    "auth": ("refuses kvgate's credentials", "fix the user name and password in KVGATE_REDIS_URL"),
    "loading": ("loading its dataset", "wait"),
    "readonly": ("read-only replica (READONLY", "point KVGATE_REDIS_URL at the primary"),
    "misconf": ("(MISCONF", "fix Redis's persistence"),
    "other": ("the gateway's log names its reply", "read Redis's reply in the gateway's log"),
}


@pytest.mark.parametrize("cause", list(REFUSALS))
def test_a_redis_that_refuses_is_named_by_its_cause_not_as_dead(cause: str) -> None:
    """It said "the tenancy store does not answer ... restore Redis" for every cause: an
    operator looked for a dead server that was running."""
    said, fix = REFUSALS[cause]
    tenancy, sync = classify_gateway(GatewayStats(
        cpu_share=0.1, redis_up=0.0, redis_down_s=4.0, tenancy_loaded=1.0, redis_cause=cause,
        sync_degraded=1.0, sync_degraded_s=4.0, sync_cause=cause), TH)
    for f, metric in ((tenancy, "kvgate_redis_down_cause"), (sync, "kvgate_sync_down_cause")):
        assert said in f.summary and f.action.startswith(fix), (f.summary, f.action)
        assert "does not answer" not in f.summary and "restore Redis" not in f.action
        assert f.evidence[-1].metric == f'{metric}{{cause="{cause}"}}'
    assert tenancy.summary.startswith("Redis degraded: ") and "last known" in tenancy.summary
    assert sync.summary.startswith("shared routing state degraded")
    (never,) = classify_gateway(GatewayStats(cpu_share=0.1, redis_up=0.0, redis_down_s=4.0,
                                             tenancy_loaded=0.0, redis_cause=cause), TH)
    assert never.severity == "critical" and said in never.summary
    assert never.action.startswith(fix) and "every request gets 503" in never.summary
    (was,) = classify_gateway(GatewayStats(cpu_share=0.1, redis_up=1.0, redis_down_s=3.0,
                                           redis_cause=cause), TH)
    assert was.severity == "info" and said in was.summary


@pytest.mark.parametrize("cause", ["unreachable", "timeout", None])
def test_a_redis_that_does_not_answer_keeps_the_words_of_an_outage(cause: str | None) -> None:
    tenancy, sync = classify_gateway(GatewayStats(
        cpu_share=0.1, redis_up=0.0, redis_down_s=4.0, tenancy_loaded=1.0, redis_cause=cause,
        sync_degraded=1.0, sync_degraded_s=4.0, sync_cause=cause), TH)
    assert tenancy.summary.startswith("Redis degraded: the tenancy store does not answer")
    assert tenancy.action.startswith("restore Redis (KVGATE_REDIS_URL)")
    assert sync.action == "restore Redis; sharing resumes on its own"


def test_classify_orders_worst_first() -> None:
    kv = replica("kv", kv_p90=0.99, preemptions=10.0)
    q = replica("q", waiting_share=0.6, waiting_mean=1.5, running_when_waiting=4.0,
                ttft_mean=0.5, itl_mean=0.01)
    p = pool(kv, q, replica("ok"))
    w = Window(10, 10, 0, 10, 40, [kv, q], [p], GatewayStats(cpu_share=0.1), [], 0)
    fs = classify(w, TH, CTX)
    assert [(f.severity, f.cls) for f in fs][:2] == [("critical", "KV-bound"),
                                                     ("warning", "queue-bound")]
    assert all(f.severity == "ok" for f in fs[2:])


def test_thresholds_override_by_name_and_reject_unknown_names() -> None:
    th = Thresholds({"itl_high_s": 0.2})
    assert classes(classify_replica(replica(itl_mean=0.08), th, CTX)) == ["healthy"]
    with pytest.raises(ValueError, match="unknown doctor threshold 'itl_hihg_s'"):
        Thresholds({"itl_hihg_s": 0.2})


def test_findings_as_json_have_no_nan() -> None:
    (f,) = classify_replica(replica(requests=math.nan, waiting_share=math.nan), TH, CTX)
    d = f.as_dict()
    assert d["class"] == "healthy" and all(
        not (isinstance(e["value"], float) and math.isnan(e["value"])) for e in d["evidence"])


def test_too_few_samples_are_not_judged() -> None:
    # the first second of a load: one sample with a request waiting is no queue yet
    r = replica(samples=2, fresh=2, waiting_share=1.0, waiting_mean=3.0, ttft_mean=math.nan,
                itl_mean=math.nan, requests=0.0)
    (f,) = classify_replica(r, TH, CTX)
    assert f.cls == "healthy" and f.summary.startswith("not judged yet: 2 fresh samples")


def test_overflow_caused_by_an_imbalance_is_evidence_not_a_second_finding() -> None:
    hot = replica("hot", inflight_mean=12.0, running_mean=10.0, waiting_mean=2.0)
    (f,) = classify_pool(pool(hot, replica("a"), replica("b"), overflow=150.0), TH, CTX)
    assert f.summary.startswith("imbalance")
    assert f.evidence[-1].metric == 'kvgate_requests_total{route="overflow"}'
    assert f.evidence[-1].value == pytest.approx(0.3)


def test_waiting_between_steps_on_the_busiest_replica_is_not_an_imbalance() -> None:
    # the replica serving most requests shows a request or two waiting for the next step
    busy = replica("busy", waiting_share=0.6, waiting_mean=2.5, ttft_mean=0.012, itl_mean=0.008)
    fs = classify_pool(pool(busy, replica("a"), replica("b")), TH, CTX)
    assert classes(fs) == ["healthy"]
    queued = replica("queued", waiting_share=0.8, waiting_mean=6.0, ttft_mean=0.9, itl_mean=0.01)
    (f,) = classify_pool(pool(queued, replica("a"), replica("b")), TH, CTX)
    assert (f.cls, f.replica) == ("routing", "queued") and "mean waiting" in f.summary


def test_a_pool_is_not_judged_on_a_few_ticks() -> None:
    (f,) = classify_pool(pool(replica("a"), overflow=400.0, samples=2), TH, CTX)
    assert f.cls == "healthy" and "not judged yet" in f.summary


def test_a_stalled_replica_is_named_stalled() -> None:
    """Out of rotation because its engine made no progress (a hung engine: /health 200, its
    /metrics readable): the finding says so and what to do, not "health checks failing"."""
    hung = replica(healthy_share=0.2, healthy_last=0.0, stalls=1.0, stalled_last=True,
                   requests=0.0, generation_tokens=0.0)
    (f,) = classify_replica(hung, TH, CTX)
    assert (f.cls, f.severity) == ("down", "critical")
    assert f.summary.startswith("replica stalled:") and "restart" in f.action
    assert (f.evidence[0].metric, f.evidence[0].value) == ("kvgate_replica_stalls_total", 1.0)


def test_a_down_replica_is_named_down_not_a_metrics_problem() -> None:
    """A replica whose health checks fail also fails its scrapes: one finding, `down`."""
    dead = replica(healthy_share=0.1, healthy_last=0.0, fresh=0, stale_share=1.0,
                   scrape_errors=45.0, inflight_mean=0.0, requests=math.nan,
                   ttft_mean=math.nan, itl_mean=math.nan, waiting_share=math.nan)
    (f,) = classify_replica(dead, TH, CTX)
    assert (f.cls, f.severity) == ("down", "critical")
    assert "out of rotation, its health checks or requests failing" in f.summary
    assert "90% of the window" in f.summary
    assert (f.evidence[0].value, f.evidence[0].op, f.evidence[0].threshold) == (0.9, ">=", 0.5)
    assert "--disable-log-stats" not in f.action and "/health" in f.action
    back = replica(healthy_share=0.4, healthy_last=1.0)
    (f,) = classify_replica(back, TH, CTX)
    assert (f.cls, f.severity) == ("down", "warning") and "back now" in f.summary
    assert classes(classify_replica(replica(healthy_share=0.9, healthy_last=0.0), TH, CTX)) \
        == ["healthy"]  # a blip: one ejection just now
    assert classes(classify_replica(replica(healthy_share=0.0, healthy_last=0.0,
                                            draining=True), TH, CTX)) == ["healthy"]


def test_another_gateways_traffic_on_the_same_engines_is_not_this_ones_hit_gap() -> None:
    """Two gateways share the engines: this one's traffic could reuse 46% of its prompts, the
    other's long unique prompts (half the engines' tokens) reuse nothing. The engines' 22% is
    their mix; every hit counted as this gateway's, its traffic hit at most 44%: no gap."""
    reps = [replica("a", queries=800_000.0, hits=176_000.0),
            replica("b", queries=800_000.0, hits=176_000.0)]
    mixed = pool(*reps, share_n=150.0, share_prompt=100_000.0, share_best=46_000.0,
                 share_chosen=43_000.0, prompt_tokens=800_000.0)
    assert classes(classify_pool(mixed, TH, CTX)) == ["healthy"]
    # the same engines with a real gap in this gateway's own traffic is still named
    starved = pool(*[replica(r.id, queries=800_000.0, hits=40_000.0) for r in reps],
                   share_n=150.0, share_prompt=100_000.0, share_best=46_000.0,
                   share_chosen=43_000.0, prompt_tokens=800_000.0)
    (f,) = classify_pool(starved, TH, CTX)
    assert f.cls == "routing" and "at most 10% on this gateway's traffic (50%" in f.summary
    alone = pool(*reps, share_n=150.0, share_prompt=100_000.0, share_best=46_000.0,
                 share_chosen=43_000.0, prompt_tokens=1_600_000.0)  # one gateway: as before
    (f,) = classify_pool(alone, TH, CTX)
    assert f.summary.startswith("hit rate 22% where")


def test_time_per_request_is_not_judged_on_engines_another_gateway_also_feeds() -> None:
    """Little's law over this gateway's in flight and the engines' request counts mixes two
    gateways' traffic: the other one sending most of its requests to `a` makes `b` look slow."""
    a = replica("a", inflight_mean=4.0, requests=1000.0)  # 200 ours + 800 of the other gateway
    b = replica("b", inflight_mean=4.0, requests=200.0)
    assert classes(classify_pool(pool(a, b, requests=400.0), TH, CTX)) == ["healthy"]
    (f,) = classify_pool(pool(a, b, requests=1200.0), TH, CTX)  # all ours: b is slow
    assert (f.cls, f.replica) == ("routing", "b") and "time per request" in f.summary


@pytest.mark.parametrize(("replicas", "ctx", "action"), [
    ([replica("a", inflight_mean=4.0)], Context(flow_max_inflight=4),
     "raise flow.max_inflight (now 4)"),
    ([replica("a", inflight_mean=2.0)], Context(flow_max_inflight=4),
     "the engines have room"),
    ([replica("a", waiting_share=0.9, waiting_mean=8.0, ttft_mean=0.8, itl_mean=0.008)],
     Context(), "the engines are full too (a: their findings say which flag)"),
])
def test_requests_queued_in_flow_control_are_a_pool_queue(
        replicas: list[ReplicaStats], ctx: Context, action: str) -> None:
    p = pool(*replicas, requests=400.0, flow_queued=300.0, flow_depth_mean=12.0,
             flow_wait_mean=0.4)
    (f,) = [f for f in classify_pool(p, TH, ctx) if f.cls != "healthy"]
    assert (f.cls, f.replica) == ("queue-bound", None)
    assert f.summary.startswith("75% of requests waited in kvgate's flow-control queue, ~400 ms")
    assert f.action.startswith(action)


def test_a_pools_bound_in_the_policy_is_the_one_the_action_names() -> None:
    """The policy's pools.<p>.max_inflight overrides flow.max_inflight: a pool held at the
    policy's 4 while the configuration says 64 was told 'the engines have room ... raise
    flow.max_unanswered' (its own bound unnamed); one the policy raised to 64 over the
    configuration's 4 was told to raise flow.max_inflight, which bounds it no longer."""
    p = pool(replica("a", inflight_mean=4.0), requests=400.0, flow_queued=300.0,
             flow_depth_mean=12.0, flow_wait_mean=0.4)
    bounds = {"p": 4}
    (f,) = [f for f in classify_pool(p, TH, Context(flow_max_inflight=64,
                                                    pool_max_inflight=bounds.get))
            if f.cls != "healthy"]
    assert f.action.startswith("raise pools.p.max_inflight in the policy (now 4)"), f.action
    bounds["p"] = 64
    (f,) = [f for f in classify_pool(p, TH, Context(flow_max_inflight=4,
                                                    pool_max_inflight=bounds.get))
            if f.cls != "healthy"]
    assert f.action.startswith("the engines have room"), f.action


def test_flow_control_off_or_rarely_queueing_is_no_finding() -> None:
    assert classes(classify_pool(pool(replica("a")), TH, CTX)) == ["healthy"]  # NaN: off
    few = pool(replica("a"), requests=400.0, flow_queued=40.0, flow_depth_mean=0.1)
    assert classes(classify_pool(few, TH, CTX)) == ["healthy"]


def test_a_slower_replica_holding_more_in_flight_is_named_slow_not_hot_prefixes() -> None:
    """Round robin over an FP8 replica and one five times slower (AWQ): the slow one holds the
    requests. The cause is its engine, not hot prefixes (load_factor)."""
    fast = replica("fp8", inflight_mean=1.3, running_mean=1.0, ttft_mean=0.007, itl_mean=0.006)
    slow = replica("awq", inflight_mean=6.0, running_mean=5.9, ttft_mean=0.042, itl_mean=0.035)
    (f,) = classify_pool(pool(fast, slow), TH, Context(policy="round_robin"))
    assert (f.cls, f.replica) == ("routing", "awq")
    assert f.action.startswith("awq's engine is 6.0x slower than its peers'")
    assert "routing.policy: cache_aware" in f.action and "load_factor" not in f.action


def test_a_faster_replica_taking_more_is_not_an_imbalance() -> None:
    """Cache-aware routing sends most requests to the faster replica; it keeps up (no queue):
    the router weighing speed, not a fault."""
    fast = replica("fp8", inflight_mean=5.3, running_mean=2.6, ttft_mean=0.013, itl_mean=0.0066)
    slow = replica("awq", inflight_mean=2.0, running_mean=3.6, ttft_mean=0.072, itl_mean=0.032)
    assert classes(classify_pool(pool(fast, slow), TH, CTX)) == ["healthy"]
    queued = replica("fp8", inflight_mean=5.3, running_mean=2.6, ttft_mean=0.9, itl_mean=0.0066,
                     waiting_share=0.9, waiting_mean=3.0)
    (f,) = classify_pool(pool(queued, slow), TH, CTX)  # it does queue: named
    assert (f.cls, f.replica) == ("routing", "fp8")


def test_a_metrics_page_without_vllm_series_is_named_by_its_flag() -> None:
    quiet = replica(fresh=0, stale_share=1.0, scrape_errors=40.0, no_stats=True,
                    requests=math.nan, waiting_share=math.nan)
    (f,) = classify_replica(quiet, TH, CTX)
    assert f.cls == "gateway" and "without vllm:* series" in f.summary
    assert f.action.startswith("start its vLLM without --disable-log-stats")
    hung = replica(fresh=0, stale_share=1.0, scrape_errors=10.0, requests=math.nan,
                   waiting_share=math.nan)  # /metrics times out
    (f,) = classify_replica(hung, TH, CTX)
    assert f.summary.startswith("kvgate cannot read this replica's /metrics")
    assert "--disable-log-stats" not in f.action and "scrape timeout" in f.action


def test_a_replica_without_engine_numbers_is_not_said_to_hold_requests_before_its_engine() -> None:
    """--disable-log-stats: kvgate's in-flight count is known, the engine's is not (not 0)."""
    quiet = replica("quiet", inflight_mean=4.5, fresh=0, stale_share=1.0, no_stats=True,
                    running_mean=math.nan, waiting_mean=math.nan, waiting_share=math.nan)
    fs = classify_pool(pool(quiet, replica("a", inflight_mean=1.3),
                            replica("b", inflight_mean=1.0)), TH, CTX)
    assert classes(fs) == ["healthy"]


def test_a_pool_whose_requests_fail_is_not_healthy() -> None:
    """Half the requests failing on both replicas (both ejected in turn): the pool said
    'routing: nothing above thresholds (requests 969, 5xx 671)'."""
    out = [replica(rid, healthy_share=0.2, healthy_last=0.0) for rid in ("a", "b")]
    (f, *rest) = classify_pool(pool(*out, requests=969.0, errors=671.0), TH, CTX)
    assert (f.cls, f.severity, f.replica) == ("errors", "critical", None) and rest == []
    assert f.summary == "69% of pool p's requests failed (5xx), no replica in rotation"
    (f,) = classify_pool(pool(replica("a"), replica("b"), requests=500.0, errors=40.0), TH, CTX)
    assert (f.cls, f.severity) == ("errors", "warning") and "every replica in rotation" in f.summary
    assert classes(classify_pool(pool(replica("a"), requests=500.0, errors=10.0), TH, CTX)) \
        == ["healthy"]


def test_a_replica_failing_some_requests_in_rotation_is_named() -> None:
    """One request in five failing on a replica: never 3 in a row, so never ejected, and the
    retries answered them elsewhere (the pool's 5xx share stays low): nothing named it."""
    (f,) = [x for x in classify_replica(replica(attempts=200.0, failed=40.0), TH, CTX)
            if x.cls != "healthy"]
    assert (f.cls, f.severity, f.pool, f.replica) == ("errors", "warning", "p", "r1")
    assert f.summary.startswith("20% of the requests kvgate sent to this replica failed there")
    assert "40 of 200" in f.summary and "3 in a row" in f.action
    assert f.evidence[0].metric == "kvgate_replica_failures_total"
    assert f.evidence[0].threshold == TH.replica_failure_share
    (f,) = [x for x in classify_replica(replica(attempts=40.0, failed=30.0), TH, CTX)
            if x.cls == "errors"]
    assert f.severity == "critical"
    # the engine classes are still judged beside it
    both = classify_replica(replica(attempts=200.0, failed=40.0, itl_mean=0.2), TH, CTX)
    assert sorted(classes(both)) == ["decode-bound", "errors"]
    # ejected in turn by its failures (health checks pass): down, and why
    out = replica(attempts=200.0, failed=60.0, healthy_share=0.4, healthy_last=0.0)
    assert classes(classify_replica(out, TH, CTX)) == ["down", "errors"]


def test_the_only_replica_failing_its_requests_is_named_for_what_its_clients_see() -> None:
    """A pool's only replica is never ejected for vLLM's 500 to a request: its clients get
    every failure, and no failures in a row will take it out (the finding said both)."""
    (f,) = [x for x in classify_replica(replica(attempts=200.0, failed=200.0), TH, CTX,
                                        alone=True) if x.cls != "healthy"]
    assert (f.cls, f.severity) == ("errors", "critical")
    assert f.summary.endswith("no other can answer them, clients get them"), f.summary
    assert "add a replica to the pool" in f.action and "in a row" not in f.action, f.action


@pytest.mark.parametrize("kw", [
    dict(attempts=200.0, failed=9.0),  # under 5 %
    dict(attempts=19.0, failed=19.0),  # too few requests to judge
    dict(attempts=0.0, failed=0.0),
    dict(attempts=10.0, failed=10.0, healthy_share=0.1, healthy_last=0.0),  # down says it
])
def test_few_or_rare_failures_or_a_down_replica_are_not_a_failing_replica(
    kw: dict[str, Any],
) -> None:
    assert "errors" not in classes(classify_replica(replica(**kw), TH, CTX))


def test_a_pool_with_5xx_names_its_failing_replicas() -> None:
    bad = replica("b", attempts=300.0, failed=90.0)
    (f,) = [x for x in classify_pool(pool(replica("a"), bad, requests=500.0, errors=40.0), TH, CTX)
            if x.cls == "errors"]
    assert "every replica in rotation, failing: b" in f.summary
    assert f.action.startswith("see the replicas named with errors")


def test_a_pool_too_small_to_judge_is_not_said_to_have_nothing_above_thresholds() -> None:
    """27 requests, every one failed: under min_pool_requests no share is judged, and the
    finding read 'routing: nothing above thresholds (requests 27, 5xx 27, ...)'."""
    (f,) = classify_pool(pool(replica("a"), replica("b"), requests=27.0, errors=27.0), TH, CTX)
    assert (f.cls, f.severity) == ("healthy", "ok")
    assert "nothing above thresholds" not in f.summary
    assert f.summary.startswith("routing: 27 requests in the window, too few to judge")
    assert "judged from 50" in f.summary and "27 failed (5xx)" in f.summary


def test_a_hung_engine_in_rotation_is_down_not_queue_bound_nor_the_pools_imbalance() -> None:
    """Requests running and queued on an engine whose token counters stood still for 20 s,
    before kvgate's stall detection ejects it: it was queue-bound ('raise --max-num-seqs')
    and its pool's routing imbalance."""
    hung = replica("r1", frozen_s=20.0, frozen_running=4.0, inflight_mean=9.0,
                   waiting_share=1.0, waiting_mean=5.0, requests=0.0, generation_tokens=0.0,
                   ttft_mean=math.nan, itl_mean=math.nan)
    (f,) = classify_replica(hung, TH, CTX)
    assert (f.cls, f.severity) == ("down", "critical")
    assert f.summary.startswith("engine hung: 4 requests held (running or waiting) and no "
                                "token generated for 20 s"), f.summary
    assert "health.stall_after_s (60 s)" in f.summary
    (f,) = classify_replica(hung, TH, Context(stall_after_s=None))
    assert "stall detection is off" in f.summary and f.action.startswith("take it out")
    peers = [replica("r2", inflight_mean=1.0), replica("r3", inflight_mean=1.0)]
    pool = PoolStats("p", samples=40, requests=200.0, replicas=[hung, *peers])
    assert [x.cls for x in classify_pool(pool, TH, CTX, 10.0)] == ["healthy"]
    # counters that stood still for less than hung_s: not hung
    (f,) = classify_replica(replica(frozen_s=10.0, frozen_running=4.0), TH, CTX)
    assert f.cls == "healthy"


def test_requests_shed_by_flow_control_are_a_pool_finding_not_healthy() -> None:
    """Flow control with flow.max_queue 0 answered 1,839 of 1,975 requests 503: the pool was
    'routing: nothing above thresholds (requests 1,975, 5xx 0)' (its overload 503s are left
    out of the 5xx share)."""
    p = pool(replica("a", inflight_mean=2.0), requests=1975.0, flow_queued=0.0,
             flow_depth_mean=0.0, flow_shed=1839.0)
    (f,) = classify_pool(p, TH, Context(flow_max_inflight=2))
    assert (f.cls, f.severity, f.replica) == ("queue-bound", "critical", None)
    assert f.summary.startswith("93% of pool p's requests were shed by flow control (1839 of "
                                "1975, answered 503 or 429)"), f.summary
    assert f.action.startswith("raise flow.max_inflight (now 2)")
    assert (f.evidence[0].metric, f.evidence[0].threshold) == ("kvgate_flow_shed_total", 0.05)
    some = pool(replica("a"), requests=1000.0, flow_queued=0.0, flow_depth_mean=0.0,
                flow_shed=100.0)
    assert [(f.cls, f.severity) for f in classify_pool(some, TH, CTX)] == [
        ("queue-bound", "warning")]
    few = pool(replica("a"), requests=1000.0, flow_queued=0.0, flow_depth_mean=0.0,
               flow_shed=10.0)
    assert classes(classify_pool(few, TH, CTX)) == ["healthy"]


def test_a_slow_engine_a_load_aware_router_avoids_is_named() -> None:
    """cache_aware sent an A100-70B-AWQ replica 3 of 1,811 requests beside two faster ones
    (TTFT 863 ms vs 130 ms, inter-token 60 ms vs 11 ms): every row was healthy, the slow one
    'idle', though the pool ran on two replicas' capacity."""
    slow = replica("slow", requests=3.0, inflight_mean=0.04, running_mean=0.04, ttft_mean=0.863,
                   itl_mean=0.06, queries=4500.0, hits=0.0)
    peers = [replica(r, requests=900.0, inflight_mean=2.1, ttft_mean=0.13, itl_mean=0.011,
                     queries=1_350_000.0, hits=0.0) for r in ("a", "b")]
    (f,) = classify_pool(pool(slow, *peers, requests=1811.0), TH, CTX)
    assert (f.cls, f.severity, f.replica) == ("routing", "warning", "slow")
    assert "it started 3 of the pool's 1,803 requests" in f.summary, f.summary
    assert f.evidence[0].value == pytest.approx(6.6, abs=0.1)
    # sent little because its few prompts were the uncached ones: not slower per token
    cold = replica("cold", requests=3.0, inflight_mean=0.04, running_mean=0.04, ttft_mean=0.3,
                   itl_mean=0.011, queries=4500.0, hits=0.0)
    warm = [replica(r, requests=900.0, ttft_mean=0.05, itl_mean=0.011, queries=1_350_000.0,
                    hits=1_200_000.0) for r in ("a", "b")]
    assert classes(classify_pool(pool(cold, *warm, requests=1811.0), TH, CTX)) == ["healthy"]
    # a fair share of the requests: the imbalance rules judge it, not this one
    even = [replica(r, requests=600.0) for r in ("a", "b", "c")]
    assert classes(classify_pool(pool(*even, requests=1800.0), TH, CTX)) == ["healthy"]

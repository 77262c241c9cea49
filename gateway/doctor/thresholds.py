"""The doctor's one threshold table: every number a finding is judged by, with its unit, the
metric it reads and what it means. `docs/doctor.md` shows this table (a test keeps the two in
step); ``doctor.thresholds`` in the config overrides any entry by name.

Engine latencies (TTFT, inter-token, queue time) are the replicas' own histograms
(``vllm:*_seconds_sum / _count`` over the window), so they are in the engine's seconds: what a
GPU takes, independent of network or of the simulator's ``--time-scale``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DEFAULTS", "TABLE", "Threshold", "Thresholds", "markdown_table"]


@dataclass(frozen=True, slots=True)
class Threshold:
    name: str
    value: float
    unit: str
    metric: str
    meaning: str


TABLE: tuple[Threshold, ...] = (
    # -- traffic ------------------------------------------------------------------------------
    Threshold("min_requests", 5, "requests", "vllm:time_to_first_token_seconds_count",
              "fewer requests started on a replica in the window: its engine classes are not "
              "judged (reported healthy, idle)"),
    # -- queue-bound ------------------------------------------------------------------------
    Threshold("queue_waiting_share", 0.5, "share of samples", "vllm:num_requests_waiting",
              "queue-bound when requests wait in the engine in at least this share of the "
              "window's samples ..."),
    Threshold("queue_kv_max", 0.8, "fraction", "vllm:kv_cache_usage_perc",
              "... while KV usage (90th percentile of the samples) stays below this ..."),
    Threshold("queue_ttft_itl_ratio", 5, "ratio", "vllm:time_to_first_token_seconds",
              "... and the mean TTFT is at least this many mean inter-token latencies "
              "(requests wait for a seat, not just for the next step)"),
    # -- KV-bound ---------------------------------------------------------------------------
    Threshold("kv_high", 0.9, "fraction", "vllm:kv_cache_usage_perc",
              "KV-bound when KV usage (90th percentile of the samples) reaches this ..."),
    Threshold("kv_preemptions", 1, "preemptions", "vllm:num_preemptions_total",
              "... and the preemption counter rose by at least this much in the window"),
    # -- prefill-bound ----------------------------------------------------------------------
    Threshold("ttft_high_s", 1.0, "s", "vllm:time_to_first_token_seconds",
              "mean engine TTFT at or above this is high (prefill-bound with long uncached "
              "prompts and a normal inter-token latency)"),
    Threshold("long_prompt_tokens", 2000, "tokens", "vllm:prompt_tokens_total",
              "mean prompt tokens per request at or above this are long prompts; they also "
              "move a waiting queue from queue-bound to prefill-bound"),
    Threshold("low_hit_rate", 0.3, "fraction", "vllm:prefix_cache_hits_total",
              "prefix-cache hit rate (hits / queries) below this is low"),
    # -- decode-bound / ITL -----------------------------------------------------------------
    Threshold("itl_high_s", 0.05, "s", "vllm:inter_token_latency_seconds",
              "mean engine inter-token latency at or above this is high (decode-bound)"),
    Threshold("large_batch", 32, "requests", "vllm:num_requests_running",
              "a mean running batch of at least this is large (the decode-bound action is "
              "then more replicas; below it, prefill chunks in the decode steps)"),
    # -- hung engine -------------------------------------------------------------------------
    Threshold("hung_s", 15.0, "s", "vllm:generation_tokens_total",
              "a replica whose engine held requests running while its generation and prompt "
              "token counters stood still this long, up to the window's end, is hung (named "
              "before health.stall_after_s ejects it, or when stall detection is off); so is "
              "one where a request of kvgate's waited this long for its first event with "
              "nothing back from it (kvgate_replica_oldest_wait_seconds: the sign where it "
              "exports no counters)"),
    # -- routing ----------------------------------------------------------------------------
    Threshold("imbalance_ratio", 2.0, "ratio", "kvgate_inflight_requests",
              "imbalance when a replica's mean in flight (or engine waiting) is at least this "
              "many times the pool's median ..."),
    Threshold("imbalance_min", 2, "requests", "kvgate_inflight_requests",
              "... and at least this many requests above it"),
    Threshold("slow_min_s", 0.1, "s", "kvgate_inflight_requests / requests per second",
              "imbalance too when a replica's time per request (Little's law: mean in flight / "
              "throughput) is imbalance_ratio times the pool's median and this much longer "
              "(the router balances in-flight counts, so a slow replica shows here)"),
    Threshold("slow_engine_ratio", 1.5, "ratio", "vllm:inter_token_latency_seconds",
              "a replica sent less than its share of its pool's requests whose engine "
              "inter-token latency (over 100 tokens or more) is at least this many times its "
              "peers' median is a slow engine, routed around (a mean over many tokens: "
              "identical replicas differ by a few %; its TTFT per uncached prompt token is "
              "judged at imbalance_ratio, under half its share)"),
    Threshold("hit_potential_min", 0.3, "fraction", "kvgate router affinity index (sampled)",
              "the prefix sharing the traffic allows (the best replica's cached share, sampled at "
              "25-50 requests/s) must reach this before a low hit rate is routing's fault ..."),
    Threshold("hit_gap_ratio", 0.5, "ratio", "vllm:prefix_cache_hits_total",
              "... and the pool's engine hit rate is below this share of it"),
    Threshold("min_pool_requests", 50, "requests", "kvgate_requests_total",
              "fewer requests in a pool in the window: its error, overflow and spill-over "
              "shares are not judged (the pool's finding says how many it had and how many "
              "failed)"),
    Threshold("error_share", 0.05, "share of requests", 'kvgate_requests_total{status=~"5.."}',
              "requests of a pool that ended in a 5xx (critical from 50%)"),
    Threshold("refused_share", 0.05, "share of requests",
              'kvgate_requests_total{status=~"4.."}',
              "requests of a pool its replicas refused with a 4xx (a prompt past their "
              "--max-model-len, a bad parameter; critical from 50%): the clients see them fail"),
    Threshold("min_replica_attempts", 20, "requests", "kvgate_replica_attempts_total",
              "fewer requests sent to a replica in the window: its failure share is not "
              "judged"),
    Threshold("replica_failure_share", 0.05, "share of requests",
              "kvgate_replica_failures_total",
              "requests that failed on a replica, retried ones included (critical from 50%)"),
    Threshold("overflow_share", 0.2, "share of requests", 'kvgate_requests_total{route="overflow"}',
              "requests the bounded-load rule sent away from their best replica"),
    Threshold("spill_share", 0.2, "share of requests", "kvgate_spillovers_total",
              "requests spilled from a pool to its tier's spill pool"),
    Threshold("flow_queued_share", 0.2, "share of requests", "kvgate_flow_queued_total",
              "requests that waited in kvgate's flow-control queue (the pool was saturated by "
              "flow control's bounds): the queue is in the gateway, not in the engines"),
    Threshold("flow_shed_share", 0.05, "share of requests", "kvgate_flow_shed_total",
              "requests of a pool that flow control shed (503, or 429 past a tier's wait: its "
              "queue full or the wait too long; critical from 50%): the clients see them fail"),
    Threshold("limited_share", 0.05, "share of requests", "kvgate_ratelimit_rejections_total",
              "requests of a tenant (of at least min_pool_requests, answered or refused) that "
              "its own rate limits refused with a 429: named (info) as the tenant's limit, "
              "not a fault of the fleet"),
    # -- gateway ----------------------------------------------------------------------------
    Threshold("overhead_p99_s", 0.01, "s", 'kvgate_overhead_seconds{phase="pre_upstream"}',
              "kvgate's own time before the upstream request, 99th percentile (of at least "
              "100 requests; it includes waiting for the event loop)"),
    Threshold("cpu_busy", 0.85, "cores", "process CPU time / wall time",
              "kvgate's process near one core's saturation (one event loop per process)"),
    Threshold("scrape_fail_share", 0.5, "share of scrapes", "kvgate_scrape_errors_total",
              "failed scrapes of a replica's /metrics"),
    Threshold("scrape_stale_share", 0.5, "share of samples", "kvgate_replica_scrape_age_seconds",
              "samples whose last good scrape is older than routing.stale_after_s"),
    # -- cache return -----------------------------------------------------------------------
    Threshold("cache_pays_hit", 0.3, "fraction", "kvgate_tenant_tokens_total",
              "cached / prompt tokens at or above this: caching pays; below: little reuse"),
    Threshold("cache_min_prompt_tokens", 10000, "tokens", "kvgate_tenant_tokens_total",
              "fewer prompt tokens in the window: no cache verdict (not enough traffic)"),
)

DEFAULTS: dict[str, float] = {t.name: float(t.value) for t in TABLE}


class Thresholds:
    """The table's values with overrides applied: ``th.kv_high``; unknown names raise."""

    def __init__(self, overrides: Mapping[str, float] | None = None) -> None:
        values = dict(DEFAULTS)
        for name, value in (overrides or {}).items():
            if name not in DEFAULTS:
                raise ValueError(f"unknown doctor threshold {name!r} "
                                 f"(known: {', '.join(sorted(DEFAULTS))})")
            values[name] = _checked(name, float(value))
        self._values = values

    def __getattr__(self, name: str) -> float:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, float]:
        return dict(self._values)


_COUNTS = frozenset(t.name for t in TABLE if t.unit == "requests")


def _checked(name: str, value: float) -> float:
    """An override the rules can use: a finite number, not negative, and a request count
    (the least a share is judged on) at least 1 -- at 0 an idle pool's shares divided by its
    0 requests and the report failed."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"doctor threshold {name} must be a finite number >= 0 (got {value})")
    if name in _COUNTS and value < 1:
        raise ValueError(f"doctor threshold {name} counts requests: at least 1 (got {value:g})")
    return value


def markdown_table() -> str:
    """The table as docs/doctor.md shows it."""
    rows = ["| name | default | unit | metric | meaning |", "|---|---|---|---|---|"]
    for t in TABLE:
        value = f"{t.value:g}"
        rows.append(f"| `{t.name}` | {value} | {t.unit} | `{t.metric}` | {t.meaning} |")
    return "\n".join(rows)

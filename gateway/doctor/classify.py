"""The triage as pure functions: a window's numbers and the threshold table in, findings out.

The serving SOP, per replica: first **down** (kvgate ejected it for most of the window: its
failing scrapes are the same fault), then the engine classes (judged only when at least
``min_requests`` started in the window or the engine kept requests waiting):

1. **KV-bound** -- KV usage p90 >= ``kv_high`` and preemptions rose (or requests waited):
   lower ``--max-num-seqs``, ``--kv-cache-dtype fp8``, a shorter ``--max-model-len``, or a replica.
2. **decode-bound** -- mean inter-token latency >= ``itl_high_s``: more replicas (large
   batches) or a lower ``--max-num-batched-tokens`` (prefill chunks in the decode steps).
3. **prefill-bound** -- mean TTFT >= ``ttft_high_s`` with a normal inter-token latency, long
   prompts (>= ``long_prompt_tokens``) and a low hit rate (< ``low_hit_rate``).
4. **queue-bound** -- requests waiting in >= ``queue_waiting_share`` of the samples while KV
   p90 < ``queue_kv_max``, short prompts and a normal inter-token latency: raise
   ``--max-num-seqs`` from the running count observed while requests waited.

Per pool: **errors** (a 5xx share), **queue-bound** in flow control's queue (kvgate holds the
requests, the engines show no queue), **routing**: in-flight, waiting or time-per-request
imbalance between replicas (a replica whose engine is slower named as such, a faster one taking
more is fine), an engine hit rate far below the prefix sharing the traffic allows (against this
gateway's own traffic when other gateways feed the same engines), overflow or spill-over shares.
For the process (**gateway**): kvgate's overhead p99, CPU, a replica's scrape failures or stale
data, Redis (tenancy store) or the shared routing state degraded. Anything with no finding is
reported **healthy**, with the numbers that say so. Every evidence item names its metric and
threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import GatewayStats, PoolStats, ReplicaStats, Window

__all__ = [
    "CLASSES", "SEVERITIES", "Context", "Evidence", "Finding", "classify", "classify_gateway",
    "classify_pool", "classify_replica",
]

CLASSES = ("down", "errors", "KV-bound", "decode-bound", "prefill-bound", "queue-bound", "routing",
           "gateway", "healthy")
SEVERITIES = ("critical", "warning", "info", "ok")
MIN_SAMPLES = 5  # an engine class or a spread between replicas needs this many ticks
MIN_OVERHEAD_REQUESTS = 100  # kvgate's overhead p99 is judged from this many requests
# below this share of a pool's engine traffic, other gateways send the rest: the engines'
# counters are not this gateway's to compare with its own numbers one for one
SHARED_ENGINES = 0.8
# a replica out of rotation for this share of the window is down; out now, for this smaller one
DOWN_SHARE, DOWN_NOW_SHARE = 0.5, 0.2
WORKERS_DOC = "docs/shared-state.md, Worker processes"


@dataclass
class Evidence:
    metric: str
    what: str
    value: float | None
    op: str = ""  # how it compares to the threshold: ">=", "<", ...
    threshold: float | None = None
    threshold_name: str | None = None
    unit: str = ""
    note: str = ""  # instead of a threshold: why the value was not judged

    def text(self) -> str:
        value = _fmt(self.value, self.unit)
        if self.note:
            return f"{self.what} {value} ({self.note})"
        if self.threshold is None:
            return f"{self.what} {value}"
        return f"{self.what} {value} ({self.op} {_fmt(self.threshold, self.unit)})"


@dataclass
class Finding:
    cls: str
    severity: str
    pool: str | None
    replica: str | None
    summary: str
    action: str
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def where(self) -> str:
        if self.pool is None:
            return "gateway"
        return f"{self.pool}/{self.replica}" if self.replica else f"{self.pool}"

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["class"] = out.pop("cls")
        out["evidence"] = [
            {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in e.items()}
            for e in out["evidence"]]
        return out


@dataclass
class Context:
    """What the rules need besides the numbers."""

    policy: str = "cache_aware"
    load_factor: float = 2.0  # RouterConfig's default
    stale_after_s: float = 1.0
    scrape_interval_s: float = 0.25
    interval_s: float = 1.0  # the doctor's tick
    workers: int = 1  # server.workers
    cores: int | None = None  # cores this process may run on (its CPU affinity); None: unknown
    flow_max_inflight: int | None = None  # flow.max_inflight when flow control is on
    failure_threshold: int = 3  # health.failure_threshold: consecutive failures eject


def _ok(v: float) -> bool:
    return not math.isnan(v)


def _fmt(v: float | None, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if unit == "%":
        return f"{v:.0%}"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if unit == "/s":
        return f"{v:.2f}/s"
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:.2f}"


def _ev(metric: str, what: str, value: float, op: str = "", th: Thresholds | None = None,
        name: str | None = None, unit: str = "", note: str = "") -> Evidence:
    threshold = getattr(th, name) if th is not None and name else None
    return Evidence(metric, what, None if math.isnan(value) else value, op, threshold, name,
                    unit, note)


# -- per replica ---------------------------------------------------------------------------------
def _active(r: ReplicaStats, th: Thresholds) -> bool:
    started = r.requests if _ok(r.requests) else 0.0
    waited = _ok(r.waiting_share) and r.waiting_share >= th.queue_waiting_share
    return started >= th.min_requests or waited


def classify_replica(r: ReplicaStats, th: Thresholds, ctx: Context,
                     window_s: float = math.inf) -> list[Finding]:
    """Engine classes and scrape health of one replica (healthy when nothing fires) over a
    window of ``window_s`` seconds."""
    failing = _failing(r, th, ctx)
    down = _down(r)
    if down is not None:
        # its scrapes fail and it serves nothing: consequences, not findings; its requests
        # failing while it was in rotation are the cause (ejected after enough in a row)
        return [down] if failing is None else [down, failing]
    out: list[Finding] = []
    scrape = _scrape_finding(r, th, ctx)
    if scrape is not None:
        out.append(scrape)
    if failing is not None:
        out.append(failing)
    if r.fresh < MIN_SAMPLES or not _active(r, th):
        if not out:
            out.append(_healthy_replica(r, th, ctx, window_s, idle=True))
        return out
    hit = r.hit_rate
    prompt = r.mean_prompt
    itl_high = _ok(r.itl_mean) and r.itl_mean >= th.itl_high_s
    long_prompts = _ok(prompt) and prompt >= th.long_prompt_tokens
    waited = _ok(r.waiting_share) and r.waiting_share >= th.queue_waiting_share
    kv_full = _ok(r.kv_p90) and r.kv_p90 >= th.kv_high
    if kv_full and (r.preemptions >= th.kv_preemptions or waited):
        out.append(_kv_bound(r, th))
    if itl_high:
        out.append(_decode_bound(r, th))
    elif long_prompts and _ok(r.ttft_mean) and r.ttft_mean >= th.ttft_high_s and (
            not _ok(hit) or hit < th.low_hit_rate):
        out.append(_prefill_bound(r, th))
    elif waited and not long_prompts and _ok(r.kv_p90) and r.kv_p90 < th.queue_kv_max and (
            not (_ok(r.ttft_mean) and _ok(r.itl_mean))
            or r.ttft_mean >= th.queue_ttft_itl_ratio * r.itl_mean):
        out.append(_queue_bound(r, th))
    if not out:
        out.append(_healthy_replica(r, th, ctx, window_s, idle=False))
    return out


def _down(r: ReplicaStats) -> Finding | None:
    """A replica kvgate took out of rotation (failed health checks or requests: ejected) for
    most of the window, or that is out now after a while: its /metrics failing too is the same
    fault, not a second one."""
    if r.samples < MIN_SAMPLES or r.draining or not _ok(r.healthy_share):
        return None
    out_share = 1.0 - r.healthy_share
    now_out = r.healthy_last == 0.0
    if out_share < DOWN_SHARE and not (now_out and out_share >= DOWN_NOW_SHARE):
        return None
    ev = [_ev("kvgate_replica_healthy", "samples out of rotation (ejected)", out_share,
              ">=", unit="%"),
          _ev("kvgate_replica_healthy", "taking requests (last sample)", r.healthy_last),
          _ev("kvgate_scrape_errors_total", "failed scrapes in the window", r.scrape_errors),
          _ev("kvgate_inflight_requests", "mean in flight", r.inflight_mean)]
    ev[0].threshold = DOWN_SHARE if out_share >= DOWN_SHARE else DOWN_NOW_SHARE
    when = (f"out of rotation now and for {out_share:.0%} of the window" if now_out else
            f"out of rotation for {out_share:.0%} of the window, back now")
    return Finding(
        "down", "critical" if now_out else "warning", r.pool, r.id,
        f"replica down: kvgate took it out of rotation, its health checks or requests failing "
        f"({when}): kvgate sends it no requests until it answers again",
        "check the replica: its vLLM process (GET /health), its host and the network "
        "between; kvgate probes it and takes it back on its own", ev)


def _kv_bound(r: ReplicaStats, th: Thresholds) -> Finding:
    seats = max(1, math.floor((r.running_mean if _ok(r.running_mean) else 1) * 0.75))
    ev = [_ev("vllm:kv_cache_usage_perc", "KV usage p90", r.kv_p90, ">=", th, "kv_high", "%"),
          _ev("vllm:num_preemptions_total", "preemptions in the window", r.preemptions, ">=",
              th, "kv_preemptions"),
          _ev("vllm:num_requests_waiting", "samples with requests waiting", r.waiting_share,
              unit="%"),
          _ev("vllm:num_requests_running", "mean running", r.running_mean)]
    running = f"{r.running_mean:.0f}" if _ok(r.running_mean) else "?"
    if r.preemptions >= th.kv_preemptions:
        severity, summary = "critical", (
            f"KV cache full (p90 {r.kv_p90:.0%}), {r.preemptions:.0f} preemptions: requests "
            "are evicted and recomputed")
    else:
        severity, summary = "warning", (
            f"KV cache full (p90 {r.kv_p90:.0%}): requests wait for KV blocks "
            f"({r.waiting_share:.0%} of the time)")
    return Finding(
        "KV-bound", severity, r.pool, r.id, summary,
        f"lower --max-num-seqs (from ~{running} running to {seats}), or --kv-cache-dtype fp8, "
        "a shorter --max-model-len, or add a replica", ev)


def _decode_bound(r: ReplicaStats, th: Thresholds) -> Finding:
    ev = [_ev("vllm:inter_token_latency_seconds", "mean inter-token latency", r.itl_mean, ">=",
              th, "itl_high_s", "s"),
          _ev("vllm:num_requests_running", "mean running batch", r.running_mean, "vs",
              th, "large_batch"),
          _ev("vllm:prompt_tokens_total", "mean prompt tokens", r.mean_prompt),
          _ev("vllm:prefix_cache_hits_total", "prefix hit rate", r.hit_rate, unit="%")]
    batch = r.running_mean if _ok(r.running_mean) else 0.0
    uncached = r.mean_prompt * (1 - r.hit_rate) if _ok(r.hit_rate) else r.mean_prompt
    if batch >= th.large_batch:
        action = (f"add replicas (or lower --max-num-seqs): batches of ~{batch:.0f} "
                  f"sequences decode at {r.itl_mean * 1000:.0f} ms/token")
    elif _ok(uncached) and uncached >= 512:
        action = (f"lower --max-num-batched-tokens for interactive traffic: prefill chunks of "
                  f"~{uncached:.0f} uncached prompt tokens per request share the decode steps")
    else:
        action = ("add replicas or a faster model/GPU pair (fp8 weights, speculative decoding): "
                  "tokens are slow even in small batches with short prompts")
    return Finding(
        "decode-bound", "warning", r.pool, r.id,
        f"inter-token latency {r.itl_mean * 1000:.0f} ms with ~{batch:.0f} running", action, ev)


def _prefill_bound(r: ReplicaStats, th: Thresholds) -> Finding:
    hit = r.hit_rate if _ok(r.hit_rate) else 0.0
    ev = [_ev("vllm:time_to_first_token_seconds", "mean TTFT", r.ttft_mean, ">=", th,
              "ttft_high_s", "s"),
          _ev("vllm:inter_token_latency_seconds", "mean inter-token latency", r.itl_mean, "<",
              th, "itl_high_s", "s"),
          _ev("vllm:prompt_tokens_total", "mean prompt tokens", r.mean_prompt, ">=", th,
              "long_prompt_tokens"),
          _ev("vllm:prefix_cache_hits_total", "prefix hit rate", r.hit_rate, "<", th,
              "low_hit_rate", "%")]
    return Finding(
        "prefill-bound", "warning", r.pool, r.id,
        f"TTFT {r.ttft_mean:.2f} s on ~{r.mean_prompt:.0f}-token prompts, {hit:.0%} cached; "
        "decode is fine",
        "raise the prefix hit rate (prefix routing settings, KV cache capacity) or let each "
        "step prefill more (--max-num-batched-tokens); else add a replica", ev)


def _queue_bound(r: ReplicaStats, th: Thresholds) -> Finding:
    seats = r.running_when_waiting if _ok(r.running_when_waiting) else r.running_max
    seats = max(1.0, seats if _ok(seats) else 1.0)
    waiting = r.waiting_mean if _ok(r.waiting_mean) else 0.0
    kv = r.kv_p90 if _ok(r.kv_p90) and r.kv_p90 > 0 else 0.01
    by_kv = seats * th.queue_kv_max / kv  # seats the KV headroom allows at the same sizes
    target = int(max(seats + 1, min(seats + math.ceil(waiting), by_kv)))
    ev = [_ev("vllm:num_requests_waiting", "samples with requests waiting", r.waiting_share,
              ">=", th, "queue_waiting_share", "%"),
          _ev("vllm:kv_cache_usage_perc", "KV usage p90", r.kv_p90, "<", th, "queue_kv_max",
              "%"),
          _ev("vllm:num_requests_running", "running while requests waited", seats),
          _ev("vllm:time_to_first_token_seconds", "mean TTFT / mean inter-token latency",
              r.ttft_mean / r.itl_mean if _ok(r.ttft_mean) and _ok(r.itl_mean) and r.itl_mean
              else math.nan, ">=", th, "queue_ttft_itl_ratio"),
          _ev("vllm:num_requests_waiting", "mean waiting", waiting),
          _ev("vllm:time_to_first_token_seconds", "mean TTFT", r.ttft_mean, unit="s"),
          _ev("vllm:request_queue_time_seconds", "mean queue time", r.queue_mean, unit="s")]
    severity = "critical" if r.waiting_share >= 0.9 else "warning"
    return Finding(
        "queue-bound", severity, r.pool, r.id,
        f"requests wait in the engine {r.waiting_share:.0%} of the time (~{waiting:.0f} "
        f"waiting) with {seats:.0f} running and KV at {r.kv_p90:.0%}",
        f"raise --max-num-seqs from {seats:.0f} to {target} (the KV cache has room)", ev)


def _not_judged(n: int, what: str, ctx: Context, window_s: float) -> str:
    """Why nothing was judged: a history too young (it will be), or a window too short to hold
    MIN_SAMPLES ticks (it never will be: say which window would)."""
    least = MIN_SAMPLES * ctx.interval_s
    if n == 1:
        what = what.removesuffix("s")
    if window_s < least:
        return (f"not judged: a {_seconds(window_s)} window holds {n} {what} (< {MIN_SAMPLES}, "
                f"one per doctor.interval_s {_seconds(ctx.interval_s)}): ask for a window of "
                f"{_seconds(least)} or more")
    return f"not judged yet: {n} {what} in the window (< {MIN_SAMPLES})"


def _seconds(v: float) -> str:
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:g}s"


def _healthy_replica(r: ReplicaStats, th: Thresholds, ctx: Context, window_s: float,
                     idle: bool) -> Finding:
    if idle and r.fresh < MIN_SAMPLES:
        return Finding("healthy", "ok", r.pool, r.id,
                       _not_judged(r.fresh, "fresh samples", ctx, window_s),
                       "none", [_ev("kvgate_replica_scrape_age_seconds", "fresh samples",
                                    float(r.fresh))])
    if idle:
        started = f"{r.requests:.0f}" if _ok(r.requests) else "no"
        return Finding("healthy", "ok", r.pool, r.id,
                       f"idle: {started} requests started in the window (< {th.min_requests:.0f})",
                       "none", [_ev("vllm:time_to_first_token_seconds_count", "requests started",
                                    r.requests, "<", th, "min_requests")])
    ev = [_ev("vllm:num_requests_waiting", "samples with requests waiting", r.waiting_share, "<",
              th, "queue_waiting_share", "%"),
          _ev("vllm:kv_cache_usage_perc", "KV usage p90", r.kv_p90, "<", th, "kv_high", "%"),
          _ev("vllm:time_to_first_token_seconds", "mean TTFT", r.ttft_mean, unit="s"),
          _ev("vllm:inter_token_latency_seconds", "mean inter-token latency", r.itl_mean, "<",
              th, "itl_high_s", "s"),
          _ev("vllm:prefix_cache_hits_total", "prefix hit rate", r.hit_rate, unit="%")]
    parts = [e.text() for e in ev[:4]]
    return Finding("healthy", "ok", r.pool, r.id,
                   "nothing above thresholds: " + ", ".join(parts), "none", ev)


def _failing(r: ReplicaStats, th: Thresholds, ctx: Context) -> Finding | None:
    """A replica in rotation failing some of its requests: kvgate retries them elsewhere and
    ejects it only after ``health.failure_threshold`` failures in a row, so one failing a
    request in five stays in rotation and the pool's clients may see nothing but a slower
    answer; its failures are counted per attempt."""
    if r.attempts < th.min_replica_attempts or r.failed <= 0:
        return None
    share = min(1.0, r.failed / r.attempts)
    if share < th.replica_failure_share:
        return None
    return Finding(
        "errors", "critical" if share >= 0.5 else "warning", r.pool, r.id,
        f"{share:.0%} of the requests kvgate sent to this replica failed there "
        f"({r.failed:.0f} of {r.attempts:.0f}: 5xx, resets, stalls, cut streams); retries "
        "answer them elsewhere where they can, so clients may not see them",
        "read this replica's own log for its errors and kvgate's request log for the "
        f"reasons; it stays in rotation while its failures are not {ctx.failure_threshold} in a "
        "row (health.failure_threshold): restart or remove it if it keeps failing",
        [_ev("kvgate_replica_failures_total", "failed share of attempts", share, ">=", th,
             "replica_failure_share", "%"),
         _ev("kvgate_replica_attempts_total", "requests sent (retries included)", r.attempts,
             ">=", th, "min_replica_attempts"),
         _ev("kvgate_replica_failures_total", "failed", r.failed)])


def _scrape_finding(r: ReplicaStats, th: Thresholds, ctx: Context) -> Finding | None:
    if r.samples < MIN_SAMPLES or r.draining:
        return None
    # scrapes attempted while the replica was listed (one every routing.scrape_interval_ms)
    attempts = max(1.0, r.samples * ctx.interval_s / max(ctx.scrape_interval_s, 1e-3))
    fail_share = min(1.0, r.scrape_errors / attempts)
    stale = _ok(r.stale_share) and r.stale_share >= th.scrape_stale_share
    failing = fail_share >= th.scrape_fail_share
    if not (stale or failing):
        return None
    ev = [_ev("kvgate_scrape_errors_total", "failed scrapes (share of attempts)", fail_share,
              ">=", th, "scrape_fail_share", "%"),
          _ev("kvgate_replica_scrape_age_seconds",
              f"samples with a scrape older than {ctx.stale_after_s:g} s", r.stale_share, ">=",
              th, "scrape_stale_share", "%")]
    severity = "critical" if r.fresh == 0 else "warning"
    fallback = "routing falls back to its own accounting and the engine classes cannot be judged"
    if r.no_stats:
        return Finding(
            "gateway", severity, r.pool, r.id,
            f"this replica's /metrics answers without vllm:* series ({r.stale_share:.0%} of "
            f"samples without engine numbers): {fallback}",
            "start its vLLM without --disable-log-stats (the engine then exports its vllm:* "
            "metrics)", ev)
    return Finding(
        "gateway", severity, r.pool, r.id,
        f"kvgate cannot read this replica's /metrics ({r.scrape_errors:.0f} failed scrapes, "
        f"{r.stale_share:.0%} of samples stale): {fallback}",
        "check the replica's /metrics: that it answers within routing's scrape timeout "
        "(network, a proxy in between, auth) and with vLLM's metric names", ev)


# -- per pool -------------------------------------------------------------------------------------
def classify_pool(p: PoolStats, th: Thresholds, ctx: Context,
                  window_s: float = math.inf) -> list[Finding]:
    if p.samples < MIN_SAMPLES:
        return [Finding("healthy", "ok", p.name, None,
                        "routing: " + _not_judged(p.samples, "samples", ctx, window_s), "none",
                        [])]
    out: list[Finding] = []
    if _ok(p.flow_queued) and p.requests >= th.min_pool_requests \
            and p.flow_queued >= th.flow_queued_share * p.requests:
        out.append(_flow_queue(p, th, ctx))
    imbalance = _imbalance(p, th, ctx)
    out.extend(imbalance)
    hit = _hit_gap(p, th, ctx)
    if hit is not None:
        out.append(hit)
    if p.requests >= th.min_pool_requests and p.errors >= th.error_share * p.requests:
        out.append(_errors(p, th))
    if p.requests >= th.min_pool_requests:
        overflow = p.overflow / p.requests
        if overflow >= th.overflow_share and imbalance:
            # the hot replica's load sends requests away: a symptom, said with the cause
            imbalance[0].evidence.append(_ev(
                'kvgate_requests_total{route="overflow"}', "overflow share (a consequence)",
                overflow, ">=", th, "overflow_share", "%"))
        elif overflow >= th.overflow_share:
            out.append(Finding(
                "routing", "warning", p.name, None,
                f"{overflow:.0%} of requests overflowed: the bounded-load rule sent them away "
                "from the replica holding their prefix",
                f"add a replica to pool {p.name} or raise routing.load_factor (now "
                f"{ctx.load_factor:g})",
                [_ev('kvgate_requests_total{route="overflow"}', "overflow share", overflow, ">=",
                     th, "overflow_share", "%")]))
        spilled = p.spilled / p.requests
        if spilled >= th.spill_share:
            out.append(Finding(
                "routing", "warning", p.name, None,
                f"{spilled:.0%} of pool {p.name}'s requests spilled to another pool",
                f"add replicas to pool {p.name} (its tier's traffic does not fit)",
                [_ev("kvgate_spillovers_total", "spill-over share", spilled, ">=", th,
                     "spill_share", "%")]))
    if not out:
        out.append(_healthy_pool(p, th))
    return out


def _errors(p: PoolStats, th: Thresholds) -> Finding:
    """A pool whose requests end in 5xx: its replicas are down or failing (named on their
    own), or every one is out of rotation."""
    share = p.errors / p.requests
    down = [r.id for r in p.replicas if _down(r) is not None]
    listed = [r for r in p.replicas if r.samples >= MIN_SAMPLES and not r.draining]
    if listed and len(down) == len(listed):
        why, action = ("no replica in rotation", f"bring pool {p.name}'s replicas back (each is "
                       "named down: its health checks or requests fail), or add one")
    elif down:
        why, action = (f"{len(down)} of {len(listed)} replicas down",
                       "see the replicas named down; if the others fail too, read kvgate's "
                       "request log for the 5xx reasons (upstream errors, timeouts)")
    else:
        failing = [r.id for r in listed if r.attempts >= th.min_replica_attempts
                   and r.failed >= th.replica_failure_share * r.attempts > 0]
        why, action = ("every replica in rotation", "read kvgate's request log for the 5xx "
                       "reasons (upstream errors, timeouts, cut streams) and the replicas' logs")
        if failing:
            why += f", failing: {', '.join(failing)}"
            action = "see the replicas named with errors; " + action
    return Finding(
        "errors", "critical" if share >= 0.5 else "warning", p.name, None,
        f"{share:.0%} of pool {p.name}'s requests failed (5xx), {why}", action,
        [_ev('kvgate_requests_total{status=~"5.."}', "5xx share", share, ">=", th,
             "error_share", "%"),
         _ev("kvgate_requests_total", "requests", p.requests),
         _ev("kvgate_replica_healthy", "replicas down", float(len(down)))])


def _flow_queue(p: PoolStats, th: Thresholds, ctx: Context) -> Finding:
    """Requests wait in kvgate's flow-control queue: the engines show no queue of their own,
    so the knob is where the pool's bound is reached -- the engines (full: their findings
    say which flag) or flow control's saturation bounds (the engines have room)."""
    share = min(1.0, p.flow_queued / p.requests)
    live = [r for r in p.replicas if r.fresh >= MIN_SAMPLES and not r.draining]
    full = [r.id for r in live if _queueing(r, th) or (_ok(r.kv_p90) and r.kv_p90 >= th.kv_high)]
    inflight = max((r.inflight_mean for r in live if _ok(r.inflight_mean)), default=math.nan)
    waiting = max((r.waiting_share for r in live if _ok(r.waiting_share)), default=math.nan)
    kv = max((r.kv_p90 for r in live if _ok(r.kv_p90)), default=math.nan)
    if full:
        action = (f"the engines are full too ({', '.join(full)}: their findings say which "
                  f"flag): act on those, or add replicas to pool {p.name}")
    elif ctx.flow_max_inflight and _ok(inflight) and inflight >= 0.75 * ctx.flow_max_inflight:
        action = (f"raise flow.max_inflight (now {ctx.flow_max_inflight}): the replicas hold "
                  f"~{inflight:.0f} requests each and their engines have room")
    else:
        action = ("the engines have room (no queue of their own, KV below the knee): raise "
                  "the flow control bound the pool reaches (flow.max_unanswered, "
                  "flow.max_prefill_tokens, flow.max_waiting: docs/flow-control.md), or add "
                  "replicas")
    ev = [_ev("kvgate_flow_queued_total", "requests that waited in flow control's queue",
              share, ">=", th, "flow_queued_share", "%"),
          _ev("kvgate_flow_queue_depth", "mean queued", p.flow_depth_mean),
          _ev("kvgate_flow_queue_depth / queued per second", "mean wait in the queue",
              p.flow_wait_mean, unit="s"),
          _ev("kvgate_inflight_requests", "mean in flight, busiest replica", inflight),
          _ev("vllm:num_requests_waiting", "samples with requests waiting in an engine, most",
              waiting, unit="%"),
          _ev("vllm:kv_cache_usage_perc", "KV usage p90, fullest replica", kv, unit="%")]
    wait = f", ~{_fmt(p.flow_wait_mean, 's')} each" if _ok(p.flow_wait_mean) else ""
    return Finding(
        "queue-bound", "warning", p.name, None,
        f"{share:.0%} of requests waited in kvgate's flow-control queue{wait} (~"
        f"{p.flow_depth_mean:.1f} queued): pool {p.name} is saturated", action, ev)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _imbalance(p: PoolStats, th: Thresholds, ctx: Context) -> list[Finding]:
    """The first spread that fires: in flight, engine waiting, time per request."""
    # a replica without fresh engine numbers has its own finding (its /metrics); where its
    # requests wait cannot be told, so it is not compared
    live = [r for r in p.replicas if r.samples >= MIN_SAMPLES and not r.draining
            and _ok(r.healthy_share) and r.healthy_share >= 0.5 and r.fresh >= MIN_SAMPLES]
    if len(live) < 2:
        return []
    checks: tuple[tuple[str, str, str, float, str], ...] = (
        ("inflight_mean", "kvgate_inflight_requests", "mean in flight", th.imbalance_min, ""),
        ("time_per_request", "kvgate_inflight_requests / requests per second",
         "time per request", th.slow_min_s, "s"),
        ("waiting_mean", "vllm:num_requests_waiting", "mean waiting", th.imbalance_min, ""),
    )
    started = sum(r.requests for r in live if _ok(r.requests))
    # Little's law needs this gateway's in flight and its own requests per second; with other
    # gateways sending to the engines (their counts in `requests`), it is not judged
    shared = started > 0 and p.requests < SHARED_ENGINES * started
    for attr, metric, what, minimum, unit in checks:
        if attr == "time_per_request" and shared:
            continue
        values = [(getattr(r, attr), r) for r in live if _ok(getattr(r, attr))
                  and (attr != "time_per_request" or r.requests >= 4 * th.min_requests)]
        if attr == "waiting_mean" and values and not _queueing(
                max(values, key=lambda v: v[0])[1], th):
            continue  # the most waiting is requests between two steps, not a queue
        if len(values) < 2:
            continue
        values.sort(key=lambda x: x[0])
        hot_value, hot = values[-1]
        median = _median([v for v, _ in values[:-1]])
        floor = 0.5 if unit == "" else 1e-3
        if hot_value < th.imbalance_ratio * max(median, floor) or hot_value - median < minimum:
            continue
        engine = (hot.running_mean if _ok(hot.running_mean) else 0.0) + (
            hot.waiting_mean if _ok(hot.waiting_mean) else 0.0)
        # requests held before the engine (its host, network or frontend): at least half of
        # what this gateway has in flight there, and at least `imbalance_min` requests -- a
        # CPU-starved test host or the relay of a stream's last tokens makes a smaller gap
        outside = hot.inflight_mean > 0 and engine < 0.5 * hot.inflight_mean \
            and hot.inflight_mean - engine >= th.imbalance_min
        peers = [r for _, r in values[:-1]]
        itl = _speed(hot, peers, "itl_mean")
        if not outside and _ok(itl) and itl * th.imbalance_ratio <= 1.0 \
                and not _queueing(hot, th):
            # a replica decoding imbalance_ratio times faster than its peers finishes sooner
            # and takes more (the router weighs speed): nothing waits on it
            continue
        slower = max(itl, _speed(hot, peers, "ttft_mean"), key=lambda v: v if _ok(v) else 0.0)
        name = "slow_min_s" if unit else "imbalance_min"
        ev = [_ev(metric, f"{what} on {hot.id}", hot_value, ">=", th, "imbalance_ratio", unit),
              _ev(metric, f"{what}, median of the other replicas", median, unit=unit),
              _ev(metric, "difference", hot_value - median, ">=", th, name, unit),
              _ev("kvgate_inflight_requests", f"mean in flight on {hot.id}", hot.inflight_mean),
              _ev("vllm:num_requests_running", f"engine running + waiting on {hot.id}", engine),
              _ev("vllm:time_to_first_token_seconds", f"engine TTFT on {hot.id}",
                  hot.ttft_mean, unit="s")]
        ev[0].threshold = th.imbalance_ratio * max(median, floor)
        share = _ratio_or_nan(hot.requests, sum(r.requests for r in live if _ok(r.requests)))
        if outside:
            action = (f"requests sit before {hot.id}'s engine ({hot.inflight_mean:.1f} in flight, "
                      f"{engine:.1f} in the engine): check that replica's host, network or HTTP "
                      "frontend, or drain it")
        elif _ok(slower) and slower >= th.imbalance_ratio:
            ev.append(_ev("vllm:inter_token_latency_seconds",
                          f"engine inter-token latency on {hot.id} / its peers' median", itl))
            action = (f"{hot.id}'s engine is {slower:.1f}x slower than its peers' (inter-token "
                      f"latency {_fmt(hot.itl_mean, 's')}, TTFT {_fmt(hot.ttft_mean, 's')}): "
                      "check its GPU, model quantization and engine flags"
                      + (f", or set routing.policy: cache_aware, which weighs each replica's "
                         f"speed (now {ctx.policy})" if ctx.policy != "cache_aware" else ""))
        elif attr == "time_per_request":
            action = (f"{hot.id} is slower than its peers: check its GPU and engine flags "
                      "(the router already sends it less)")
        else:
            action = ("lower routing.load_factor so the bounded-load rule spreads hot prefixes "
                      "sooner, or add a replica")
        served = f", serving {share:.0%} of the pool's requests" if _ok(share) else ""
        return [Finding(
            "routing", "warning", p.name, hot.id,
            f"imbalance: {what} on {hot.id} {_short(hot_value, unit)} vs a median of "
            f"{_short(median, unit)} on the other replicas{served}", action, ev)]
    return []


def _speed(hot: ReplicaStats, peers: Sequence[ReplicaStats], attr: str) -> float:
    """The hot replica's engine latency (``itl_mean`` or ``ttft_mean``) over its peers'
    median: > 1 slower, < 1 faster; NaN when unknown."""
    theirs = [v for r in peers if _ok(v := getattr(r, attr))]
    mine = getattr(hot, attr)
    if not theirs or not _ok(mine):
        return math.nan
    return _ratio_or_nan(mine, _median(theirs))


def _short(v: float, unit: str) -> str:
    return f"{v * 1000:.0f} ms" if unit == "s" else f"{v:.1f}"


def _queueing(r: ReplicaStats, th: Thresholds) -> bool:
    """Requests wait for a seat there, not just for the next step (see queue-bound)."""
    if not (_ok(r.waiting_share) and r.waiting_share >= th.queue_waiting_share):
        return False
    if _ok(r.ttft_mean) and _ok(r.itl_mean) and r.itl_mean > 0:
        return r.ttft_mean >= th.queue_ttft_itl_ratio * r.itl_mean
    return True


def _ratio_or_nan(num: float, den: float) -> float:
    return num / den if _ok(num) and den > 0 else math.nan


def _own_share(p: PoolStats) -> float:
    """This gateway's share of the prompt tokens the pool's engines saw (its answers' usage /
    the engines' prefix-cache queries); NaN when unknown. Well below 1: other gateways (or
    clients) send to the same engines, whose counters then describe their traffic too."""
    queries = sum(r.queries for r in p.replicas)
    if p.prompt_tokens <= 0 or queries <= 0:
        return math.nan
    return min(1.0, p.prompt_tokens / queries)


def _hit_gap(p: PoolStats, th: Thresholds, ctx: Context) -> Finding | None:
    potential, routed, engine = p.potential_hit_rate, p.routed_hit_rate, p.engine_hit_rate
    if p.share_n < 8 or not (_ok(potential) and _ok(engine)):
        return None
    own = _own_share(p)
    shared = _ok(own) and own < SHARED_ENGINES
    if shared:
        # the potential is sampled from this gateway's traffic only: compare it with the best
        # hit rate its traffic can have had, every engine hit counted as its own
        engine = min(1.0, sum(r.hits for r in p.replicas) / p.prompt_tokens)
    if potential < th.hit_potential_min or engine >= th.hit_gap_ratio * potential:
        return None
    what = "engine hit rate (pool)" if not shared else \
        "engine hit rate of this gateway's traffic, at most"
    ev = [_ev("kvgate router affinity index (sampled)", "prefix sharing the traffic allows",
              potential, ">=", th, "hit_potential_min", "%"),
          _ev("vllm:prefix_cache_hits_total", what, engine, "<", th, "hit_gap_ratio", "%"),
          _ev("kvgate router affinity index (sampled)", "expected where the requests were sent",
              routed, unit="%"),
          _ev('kvgate_requests_total{route="overflow"}', "overflow share",
              p.overflow / p.requests if p.requests else math.nan, unit="%"),
          _ev("kvgate_tenant_tokens_total / vllm:prefix_cache_queries_total",
              "this gateway's share of the engines' prompt tokens", own, unit="%")]
    ev[1].threshold = th.hit_gap_ratio * potential  # the gap rule's bar, in hit-rate terms
    if routed < 0.7 * potential:
        if ctx.policy != "cache_aware":
            action = (f"set routing.policy: cache_aware (now {ctx.policy}): requests are sent "
                      "away from the replica holding their prefix")
        else:
            action = (f"raise routing.load_factor (now {ctx.load_factor:g}) or add a replica: "
                      "load pushes requests away from the replica holding their prefix")
        why = "requests are routed away from their prefix"
    else:
        action = ("give the replicas more KV cache for prefixes (--gpu-memory-utilization, "
                  "fp8 KV) or add a replica: they evict prefixes before they are reused")
        why = "the replicas evict prefixes before reuse"
    return Finding(
        "routing", "warning", p.name, None,
        (f"hit rate at most {engine:.0%} on this gateway's traffic ({own:.0%} of the engines' "
         "prompt tokens; other gateways send the rest)" if shared else f"hit rate {engine:.0%}")
        + f" where the traffic's prefix sharing allows {potential:.0%}: " + why, action, ev)


def _healthy_pool(p: PoolStats, th: Thresholds) -> Finding:
    ev = [_ev("kvgate_requests_total", "requests", p.requests),
          _ev("kvgate_requests_total", "5xx", p.errors),
          _ev("kvgate_request_duration_seconds", "latency p90", p.e2e_p90_client, unit="s"),
          _ev("vllm:prefix_cache_hits_total", "engine hit rate", p.engine_hit_rate, unit="%")]
    if p.ttft_n_client:
        ev.insert(3, _ev("kvgate_ttft_seconds", "TTFT p90 (streams)", p.ttft_p90_client,
                         unit="s"))
    return Finding("healthy", "ok", p.name, None,
                   "routing: nothing above thresholds (" + ", ".join(e.text() for e in ev) + ")",
                   "none", ev)


# -- the process ----------------------------------------------------------------------------------
def _more_capacity(ctx: Context) -> str:
    """Where more gateway capacity comes from. More workers help only with cores to spare: one
    gateway on 2 cores shared with its load generator and replicas ran 0.98x the requests/s
    with 2 workers as with 1, at ~2.6x the CPU per request
    (loadtest/results/bench_sync_live.md)."""
    if ctx.cores is None:
        return (f"add gateway replicas, or server.workers (with Redis) if the pod has spare "
                f"cores ({WORKERS_DOC})")
    if ctx.cores > ctx.workers:
        return (f"add server.workers (with Redis): this process may run on {ctx.cores} cores "
                f"and has {ctx.workers} worker(s); or add gateway replicas ({WORKERS_DOC})")
    return (f"add gateway replicas with cores of their own: {ctx.workers} worker(s) already "
            f"share the {ctx.cores} core(s) this process may run on, so more workers would "
            f"not add capacity ({WORKERS_DOC})")


def classify_gateway(g: GatewayStats, th: Thresholds, ctx: Context | None = None) -> list[Finding]:
    ctx = ctx or Context()
    out: list[Finding] = []
    judged = g.overhead_n >= MIN_OVERHEAD_REQUESTS
    if judged and _ok(g.overhead_p99) and g.overhead_p99 >= th.overhead_p99_s:
        starved = _ok(g.cpu_share) and g.cpu_share < 0.5
        out.append(Finding(
            "gateway", "warning", None, None,
            f"kvgate's own time before the upstream request: p99 {g.overhead_p99 * 1000:.1f} ms"
            + (f", while the process used only {g.cpu_share:.0%} of a core: it waits for a CPU"
               if starved else ""),
            "give kvgate's process a core of its own (other work on its node delays its event "
            "loop)" if starved else _more_capacity(ctx),
            [_ev('kvgate_overhead_seconds{phase="pre_upstream"}', "p99", g.overhead_p99, ">=",
                 th, "overhead_p99_s", "s"),
             _ev("process CPU time / wall time", "CPU", g.cpu_share, unit="%")]))
    if _ok(g.cpu_share) and g.cpu_share >= th.cpu_busy:
        out.append(Finding(
            "gateway", "critical" if g.cpu_share >= 0.95 else "warning", None, None,
            f"kvgate's process uses {g.cpu_share:.0%} of a core: its event loop is near "
            "saturation",
            _more_capacity(ctx),
            [_ev("process CPU time / wall time", "CPU", g.cpu_share, ">=", th, "cpu_busy", "%")]))
    if g.redis_up == 0.0 and g.tenancy_loaded == 0.0:
        out.append(Finding(
            "gateway", "critical", None, None,
            "Redis does not answer and has not since start: no tenant, API key or policy was "
            "ever loaded (policy version 0), so every request gets 503",
            "check KVGATE_REDIS_URL and that Redis runs (the gateway's log names the address "
            "and the error); kvgate loads its state on its own once Redis answers",
            [_ev("kvgate_redis_up", "Redis up (last sample)", g.redis_up),
             # nothing loaded means no policy in force: kvgate_policy_version reads 0
             _ev("kvgate_policy_version", "policy version (nothing loaded)", 0.0)]))
    elif g.redis_up == 0.0 or g.redis_down_s > 0:
        now_down = g.redis_up == 0.0
        out.append(Finding(
            "gateway", "warning" if now_down else "info", None, None,
            ("Redis degraded: the tenancy store does not answer; kvgate serves its last known "
             "tenants and policy, rate limits are per process" if now_down else
             f"Redis was degraded for {g.redis_down_s:.0f} s in the window (answers again)"),
            "restore Redis (KVGATE_REDIS_URL); /readyz shows the state" if now_down else "none",
            [_ev("kvgate_redis_up", "Redis up (last sample)", g.redis_up),
             _ev("kvgate_redis_up", "seconds down in the window", g.redis_down_s)]))
    if g.sync_degraded == 1.0 or g.sync_degraded_s > 0:
        now_down = g.sync_degraded == 1.0
        out.append(Finding(
            "gateway", "warning" if now_down else "info", None, None,
            ("shared routing state degraded: this gateway routes on its own state (other "
             "gateways' routes and load unseen)" if now_down else
             f"shared routing state was degraded for {g.sync_degraded_s:.0f} s in the window"),
            "restore Redis; sharing resumes on its own" if now_down else "none",
            [_ev("kvgate_sync_up", "degraded (last sample)", g.sync_degraded),
             _ev("kvgate_sync_up", "seconds degraded in the window", g.sync_degraded_s)]))
    if not out:
        metric = 'kvgate_overhead_seconds{phase="pre_upstream"}'
        overhead = (
            _ev(metric, "overhead p99", g.overhead_p99, "<", th, "overhead_p99_s", "s")
            if judged else
            _ev(metric, "overhead p99", g.overhead_p99, unit="s", note=(
                f"not judged: {g.overhead_n:.0f} requests < {MIN_OVERHEAD_REQUESTS}")))
        ev = [overhead,
              _ev("process CPU time / wall time", "CPU", g.cpu_share, "<", th, "cpu_busy", "%")]
        redis = ("" if not _ok(g.redis_up) else ", Redis up")
        sync = ("" if not _ok(g.sync_degraded) else ", shared routing state up")
        out.append(Finding("healthy", "ok", None, None,
                           "gateway: nothing above thresholds (" + ", ".join(
                               e.text() for e in ev) + redis + sync + ")", "none", ev))
    return out


# -- all -------------------------------------------------------------------------------------------
_ORDER = {s: i for i, s in enumerate(SEVERITIES)}
_CLASS_ORDER = {c: i for i, c in enumerate(CLASSES)}


def classify(w: Window, th: Thresholds, ctx: Context) -> list[Finding]:
    """Every finding of the window, worst first."""
    out: list[Finding] = []
    out.extend(classify_gateway(w.gateway, th, ctx))
    for pool in w.pools:
        out.extend(classify_pool(pool, th, ctx, w.requested_s))
        for r in pool.replicas:
            out.extend(classify_replica(r, th, ctx, w.requested_s))
    return sort_findings(out)


def sort_findings(findings: Sequence[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (
        _ORDER.get(f.severity, 9), _CLASS_ORDER.get(f.cls, 9), f.pool or "", f.replica or ""))

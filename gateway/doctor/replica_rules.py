"""The doctor's rules for one replica, as the serving SOP triages it: first **down** (kvgate
ejected it for most of the window: its failing scrapes are the same fault), then **errors**
(requests failing there while it stays in rotation) and its scrapes (**gateway**: failing or
stale /metrics), then the engine classes (judged only when at least ``min_requests`` started in
the window or the engine kept requests waiting):

1. **KV-bound** -- KV usage p90 >= ``kv_high`` and preemptions rose (or requests waited):
   lower ``--max-num-seqs``, ``--kv-cache-dtype fp8``, a shorter ``--max-model-len``, or a replica.
2. **decode-bound** -- mean inter-token latency >= ``itl_high_s``: more replicas (large
   batches) or a lower ``--max-num-batched-tokens`` (prefill chunks in the decode steps).
   Unless its pool's other replicas decode ``imbalance_ratio`` times faster at a batch as
   large: then its engine is slower (a slower GPU, another quantization, other flags), a
   *slow engine* (class routing, as the pool's slow-engine findings), and neither flag helps.
3. **prefill-bound** -- mean TTFT >= ``ttft_high_s`` with a normal inter-token latency, long
   prompts (>= ``long_prompt_tokens``) and a low hit rate (< ``low_hit_rate``).
4. **queue-bound** -- requests waiting in >= ``queue_waiting_share`` of the samples while KV
   p90 < ``queue_kv_max``, short prompts and a normal inter-token latency: raise
   ``--max-num-seqs`` from the running count observed while requests waited.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.doctor.down_causes import down_cause
from gateway.doctor.findings import (
    MIN_SAMPLES,
    Context,
    Evidence,
    Finding,
    cite,
    fmt_value,
    known,
    median_of,
    not_judged,
    ratio_or_nan,
)
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import ReplicaStats

__all__ = ["classify_replica", "replica_down", "replica_hung", "replica_waiting"]

# a replica out of rotation for this share of the window is down; out now, for this smaller one
DOWN_SHARE, DOWN_NOW_SHARE = 0.5, 0.2
FLAPS = 3  # out of rotation this many times in the window (after a while in it): it flaps


def _active(r: ReplicaStats, th: Thresholds) -> bool:
    started = r.requests if known(r.requests) else 0.0
    waited = known(r.waiting_share) and r.waiting_share >= th.queue_waiting_share
    return started >= th.min_requests or waited


def classify_replica(r: ReplicaStats, th: Thresholds, ctx: Context,
                     window_s: float = math.inf, alone: bool = False,
                     peers: Sequence[ReplicaStats] = ()) -> list[Finding]:
    """Engine classes and scrape health of one replica (healthy when nothing fires) over a
    window of ``window_s`` seconds; ``alone``: the only replica its pool lists; ``peers``:
    its pool's other replicas (a decode slower than theirs at the same batch is its engine's)."""
    failing = _failing(r, th, ctx, alone)
    down = replica_down(r)
    if down is not None:
        # its scrapes fail and it serves nothing: consequences, not findings; its requests
        # failing while it was in rotation are the cause (ejected after enough in a row)
        return [down] if failing is None else [down, failing]
    out: list[Finding] = []
    if replica_hung(r, th):
        out.append(_hung(r, th, ctx))
    elif replica_waiting(r, th):
        out.append(_waiting(r, th, ctx))
    scrape = _scrape_finding(r, th, ctx)
    if scrape is not None:
        out.append(scrape)
    if failing is not None:
        out.append(failing)
    if out and out[0].cls == "down":  # no engine class of an engine that makes no progress
        return out
    if r.fresh < MIN_SAMPLES or not _active(r, th):
        if not out:
            out.append(_healthy_replica(r, th, ctx, window_s, idle=True))
        return out
    hit = r.hit_rate
    prompt = r.mean_prompt
    itl_high = known(r.itl_mean) and r.itl_mean >= th.itl_high_s
    long_prompts = known(prompt) and prompt >= th.long_prompt_tokens
    waited = known(r.waiting_share) and r.waiting_share >= th.queue_waiting_share
    kv_full = known(r.kv_p90) and r.kv_p90 >= th.kv_high
    if kv_full and (r.preemptions >= th.kv_preemptions or waited):
        out.append(_kv_bound(r, th))
    if itl_high:
        slow = _slow_engine(r, th, peers)
        out.append(slow if slow is not None else _decode_bound(r, th))
    elif long_prompts and known(r.ttft_mean) and r.ttft_mean >= th.ttft_high_s and (
            not known(hit) or hit < th.low_hit_rate):
        out.append(_prefill_bound(r, th))
    elif waited and not long_prompts and known(r.kv_p90) and r.kv_p90 < th.queue_kv_max and (
            not (known(r.ttft_mean) and known(r.itl_mean))
            or r.ttft_mean >= th.queue_ttft_itl_ratio * r.itl_mean):
        out.append(_queue_bound(r, th))
    if not out:
        out.append(_healthy_replica(r, th, ctx, window_s, idle=False))
    return out


def replica_down(r: ReplicaStats) -> Finding | None:
    """A replica kvgate took out of rotation (failed health checks or requests: ejected) for
    most of the window, or that is out now after a while: its /metrics failing too is the same
    fault, not a second one."""
    if r.samples < MIN_SAMPLES or r.draining or not known(r.healthy_share):
        return None
    out_share = 1.0 - r.healthy_share
    now_out = r.healthy_last == 0.0
    flaps = r.outages >= FLAPS  # out a third of the time, back now: it was named healthy
    # out now, found stalled in the window: the cause is known at once (a replica without
    # engine counters had its failing-looking /metrics named instead until a fifth had passed)
    stalled_now = now_out and (r.stalled_last or r.stalls > 0)
    if out_share < DOWN_SHARE and not (now_out and out_share >= DOWN_NOW_SHARE) and not flaps \
            and not stalled_now:
        return None
    ev = [cite("kvgate_replica_healthy", "samples out of rotation (ejected)", out_share,
               ">=", unit="%"),
          cite("kvgate_replica_healthy", "taking requests (last sample)", r.healthy_last),
          cite("kvgate_scrape_errors_total", "failed scrapes in the window", r.scrape_errors),
          cite("kvgate_inflight_requests", "mean in flight", r.inflight_mean),
          cite("kvgate_replica_healthy", "times out of rotation in the window", r.outages)]
    ev[0].threshold = DOWN_SHARE if out_share >= DOWN_SHARE else DOWN_NOW_SHARE
    when = (f"out of rotation now and for {out_share:.0%} of the window" if now_out else
            f"out of rotation for {out_share:.0%} of the window, back now")
    if flaps:
        ev[-1].op, ev[-1].threshold = ">=", float(FLAPS)
        when += f"; it went out {r.outages:.0f} times: it flaps"
    if r.stalled_last or r.stalls > 0:
        return _stalled(r, ev, when, now_out)
    cause = down_cause(r.reason if now_out else "")
    action = cause.action
    if flaps:
        action = ("it flaps: check whether its vLLM process restarts (a crash loop: its log, "
                  "OOM kills, its pod's restarts) or its /health times out under load "
                  "(health.timeout_s); " + action)
    return Finding(
        "down", "critical" if now_out and not cause.deliberate else "warning", r.pool, r.id,
        f"replica {cause.label}: {cause.why} ({when}): kvgate sends it no requests until "
        f"{cause.until}", action, ev)


def _stalled(r: ReplicaStats, ev: list[Evidence], when: str, now_out: bool) -> Finding:
    """Down because its engine stopped making progress (`gateway.stall`): a hung engine, whose
    /health still answers 200. Without engine counters (--disable-log-stats) kvgate judged it on
    its own evidence, which the finding must say: there are no counters to look at."""
    ev.insert(0, cite("kvgate_replica_stalls_total", "times found stalled in the window",
                      r.stalls))
    ev.insert(1, cite("kvgate_replica_stalled", "stalled (last sample)",
                      1.0 if r.stalled_last else 0.0))
    hung = ("its vLLM engine is hung: restart the process; check the GPU (Xid errors in the "
            "kernel log, nvidia-smi) and, with several GPUs, the collective (NCCL) it waits on; ")
    if r.no_stats:
        ev.insert(2, cite("vllm:*", "its /metrics without engine counters (last scrape)", 1.0))
        return Finding(
            "down", "critical" if now_out else "warning", r.pool, r.id,
            f"replica stalled: it exports no engine counters (--disable-log-stats), so kvgate "
            f"judged it on its own evidence: streams waiting there for their first event and "
            f"nothing streamed or answered for health.stall_after_s, its /health still 200 "
            f"({when}): its requests are tried elsewhere",
            hung + "kvgate tries it again after its ejection's back-off; start vLLM without "
            "--disable-log-stats so a hang shows in its token counters", ev)
    return Finding(
        "down", "critical" if now_out else "warning", r.pool, r.id,
        f"replica stalled: requests there and its engine's token counters frozen for "
        f"health.stall_after_s, its /health still 200 ({when}): its requests are tried "
        "elsewhere",
        hung + "kvgate takes it back once its counters move", ev)


def replica_hung(r: ReplicaStats, th: Thresholds) -> bool:
    """Requests held by its engine (running or waiting) and no token produced for ``hung_s``
    up to the window's end, while kvgate still sends it requests: hung (vLLM's /health may
    well say 200)."""
    return r.frozen_s >= th.hung_s and r.frozen_s > 0 and replica_down(r) is None


def replica_waiting(r: ReplicaStats, th: Thresholds) -> bool:
    """A request of kvgate's waiting there for its first event for ``hung_s`` or more, and
    nothing back from the replica (no first event, answer, streamed event or engine token)
    for as long, up to the window's end, while it is still in rotation: hung, seen from
    kvgate's side -- the only sign before its ejection where it exports no engine counters
    (``--disable-log-stats``), and a sign of any other hang."""
    stuck = min(r.waited_s, r.quiet_s)
    return stuck >= th.hung_s and stuck > 0 and replica_down(r) is None


def _waiting(r: ReplicaStats, th: Thresholds, ctx: Context) -> Finding:
    stuck = min(r.waited_s, r.quiet_s)
    ev = [cite("kvgate_replica_oldest_wait_seconds", "oldest wait for a first event (s)",
               r.waited_s, ">=", th, "hung_s", "s"),
          cite("kvgate replica state (answers, streamed events, engine tokens)",
               "seconds nothing came back from it", r.quiet_s, ">=", th, "hung_s", "s"),
          cite("kvgate_inflight_requests", "mean in flight", r.inflight_mean)]
    blind = " (it exports no engine counters: --disable-log-stats)" if r.no_stats else ""
    if ctx.stall_after_s is None:
        then = ("stall detection is off (health.stall_after_s): kvgate keeps sending it "
                "requests, which wait there")
        act = "take it out of rotation (drain it), then restart its vLLM process; "
    else:
        then = (f"kvgate ejects it once nothing has come back for health.stall_after_s "
                f"({ctx.stall_after_s:g} s) or more; until then its requests wait there")
        act = "restart its vLLM process (kvgate tries its requests elsewhere once it is out); "
    return Finding(
        "down", "critical", r.pool, r.id,
        f"requests waiting for a first token on {r.id} for {r.waited_s:.0f} s, nothing "
        f"returned for {stuck:.0f} s{blind}, still in rotation ({then})",
        act + "first check its process (GET /health, its log: an engine error, a stuck "
        "collective) and the GPU (Xid errors in the kernel log, nvidia-smi); a single prefill "
        "or non-streamed answer longer than this on an otherwise idle replica looks the same: "
        "raise hung_s above it", ev)


def _hung(r: ReplicaStats, th: Thresholds, ctx: Context) -> Finding:
    ev = [cite("vllm:generation_tokens_total", "seconds without a token, requests held",
               r.frozen_s, ">=", th, "hung_s", "s"),
          cite("vllm:num_requests_running + vllm:num_requests_waiting",
               "requests held meanwhile", r.frozen_running),
          cite("kvgate_inflight_requests", "mean in flight", r.inflight_mean)]
    if ctx.stall_after_s is None:
        then = ("stall detection is off (health.stall_after_s): kvgate keeps sending it "
                "requests, which wait there")
        act = "take it out of rotation (drain it) and restart its vLLM process; "
    else:
        then = (f"kvgate ejects it once frozen for health.stall_after_s "
                f"({ctx.stall_after_s:g} s); until then its requests wait there")
        act = "restart its vLLM process; "
    return Finding(
        "down", "critical", r.pool, r.id,
        f"engine hung: {r.frozen_running:.0f} requests held (running or waiting) and no "
        f"token generated for "
        f"{r.frozen_s:.0f} s, still in rotation ({then})",
        act + "check the GPU (Xid errors in the kernel log, nvidia-smi) and, with several "
        "GPUs, the collective (NCCL) it waits on; a single prefill longer than this (a very "
        "long prompt) looks the same: raise hung_s above it", ev)


def _kv_bound(r: ReplicaStats, th: Thresholds) -> Finding:
    seats = max(1, math.floor((r.running_mean if known(r.running_mean) else 1) * 0.75))
    ev = [cite("vllm:kv_cache_usage_perc", "KV usage p90", r.kv_p90, ">=", th, "kv_high", "%"),
          cite("vllm:num_preemptions_total", "preemptions in the window", r.preemptions, ">=",
               th, "kv_preemptions"),
          cite("vllm:num_requests_waiting", "samples with requests waiting", r.waiting_share,
               unit="%"),
          cite("vllm:num_requests_running", "mean running", r.running_mean)]
    running = f"{r.running_mean:.0f}" if known(r.running_mean) else "?"
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
    ev = [cite("vllm:inter_token_latency_seconds", "mean inter-token latency", r.itl_mean, ">=",
               th, "itl_high_s", "s"),
          cite("vllm:num_requests_running", "mean running batch", r.running_mean, "vs",
               th, "large_batch"),
          cite("vllm:prompt_tokens_total", "mean prompt tokens", r.mean_prompt),
          cite("vllm:prefix_cache_hits_total", "prefix hit rate", r.hit_rate, unit="%")]
    batch = r.running_mean if known(r.running_mean) else 0.0
    uncached = r.mean_prompt * (1 - r.hit_rate) if known(r.hit_rate) else r.mean_prompt
    if batch >= th.large_batch:
        action = (f"add replicas (or lower --max-num-seqs): batches of ~{batch:.0f} "
                  f"sequences decode at {r.itl_mean * 1000:.0f} ms/token")
    elif known(uncached) and uncached >= 512:
        action = (f"lower --max-num-batched-tokens for interactive traffic: prefill chunks of "
                  f"~{uncached:.0f} uncached prompt tokens per request share the decode steps")
    else:
        action = ("add replicas or a faster model/GPU pair (fp8 weights, speculative decoding): "
                  "tokens are slow even in small batches with short prompts")
    return Finding(
        "decode-bound", "warning", r.pool, r.id,
        f"inter-token latency {r.itl_mean * 1000:.0f} ms with ~{batch:.0f} running", action, ev)


def _slow_engine(r: ReplicaStats, th: Thresholds,
                 peers: Sequence[ReplicaStats]) -> Finding | None:
    """A high inter-token latency that its pool's other replicas (those that started
    ``min_requests``) do not have at a batch as large: its engine is slower (it was
    "decode-bound: lower --max-num-batched-tokens", advice for a batch, not a GPU)."""
    judged = [x for x in peers if x.fresh >= MIN_SAMPLES and known(x.requests)
              and x.requests >= th.min_requests and known(x.itl_mean)]
    if not judged or not known(r.running_mean):
        return None
    itl_peers = median_of([x.itl_mean for x in judged])
    batches = [x.running_mean for x in judged if known(x.running_mean)]
    batch_peers = median_of(batches) if batches else math.nan
    slower = ratio_or_nan(r.itl_mean, itl_peers)
    if not (known(slower) and slower >= th.imbalance_ratio and known(batch_peers)
            and r.running_mean <= th.imbalance_ratio * max(batch_peers, 1.0)):
        return None
    ev = [cite("vllm:inter_token_latency_seconds", "mean inter-token latency", r.itl_mean,
               ">=", th, "itl_high_s", "s"),
          cite("vllm:inter_token_latency_seconds", "its peers' median inter-token latency",
               itl_peers, unit="s"),
          cite("vllm:inter_token_latency_seconds", "its / its peers'", slower, ">=", th,
               "imbalance_ratio"),
          cite("vllm:num_requests_running", "mean running batch", r.running_mean),
          cite("vllm:num_requests_running", "its peers' median running batch", batch_peers)]
    return Finding(
        "routing", "warning", r.pool, r.id,
        f"slow engine: it decodes {slower:.1f}x slower than its peers' at a batch as large "
        f"(inter-token latency {fmt_value(r.itl_mean, 's')} vs {fmt_value(itl_peers, 's')}, "
        f"~{r.running_mean:.0f} running vs ~{batch_peers:.0f}): its engine, not its load",
        "check its GPU, model quantization and engine flags against its peers' (a slower "
        "GPU decodes slower whatever --max-num-batched-tokens); routing.policy: cache_aware "
        "sends a slower replica less", ev)


def _prefill_bound(r: ReplicaStats, th: Thresholds) -> Finding:
    hit = r.hit_rate if known(r.hit_rate) else 0.0
    ev = [cite("vllm:time_to_first_token_seconds", "mean TTFT", r.ttft_mean, ">=", th,
               "ttft_high_s", "s"),
          cite("vllm:inter_token_latency_seconds", "mean inter-token latency", r.itl_mean, "<",
               th, "itl_high_s", "s"),
          cite("vllm:prompt_tokens_total", "mean prompt tokens", r.mean_prompt, ">=", th,
               "long_prompt_tokens"),
          cite("vllm:prefix_cache_hits_total", "prefix hit rate", r.hit_rate, "<", th,
               "low_hit_rate", "%")]
    return Finding(
        "prefill-bound", "warning", r.pool, r.id,
        f"TTFT {r.ttft_mean:.2f} s on ~{r.mean_prompt:.0f}-token prompts, {hit:.0%} cached; "
        "decode is fine",
        "raise the prefix hit rate (prefix routing settings, KV cache capacity) or let each "
        "step prefill more (--max-num-batched-tokens); else add a replica", ev)


def _queue_bound(r: ReplicaStats, th: Thresholds) -> Finding:
    seats = r.running_when_waiting if known(r.running_when_waiting) else r.running_max
    seats = max(1.0, seats if known(seats) else 1.0)
    waiting = r.waiting_mean if known(r.waiting_mean) else 0.0
    kv = r.kv_p90 if known(r.kv_p90) and r.kv_p90 > 0 else 0.01
    by_kv = seats * th.queue_kv_max / kv  # seats the KV headroom allows at the same sizes
    target = int(max(seats + 1, min(seats + math.ceil(waiting), by_kv)))
    ev = [cite("vllm:num_requests_waiting", "samples with requests waiting", r.waiting_share,
               ">=", th, "queue_waiting_share", "%"),
          cite("vllm:kv_cache_usage_perc", "KV usage p90", r.kv_p90, "<", th, "queue_kv_max",
               "%"),
          cite("vllm:num_requests_running", "running while requests waited", seats),
          cite("vllm:time_to_first_token_seconds", "mean TTFT / mean inter-token latency",
               r.ttft_mean / r.itl_mean if known(r.ttft_mean) and known(r.itl_mean) and r.itl_mean
               else math.nan, ">=", th, "queue_ttft_itl_ratio"),
          cite("vllm:num_requests_waiting", "mean waiting", waiting),
          cite("vllm:time_to_first_token_seconds", "mean TTFT", r.ttft_mean, unit="s"),
          cite("vllm:request_queue_time_seconds", "mean queue time", r.queue_mean, unit="s")]
    severity = "critical" if r.waiting_share >= 0.9 else "warning"
    return Finding(
        "queue-bound", severity, r.pool, r.id,
        f"requests wait in the engine {r.waiting_share:.0%} of the time (~{waiting:.0f} "
        f"waiting) with {seats:.0f} running and KV at {r.kv_p90:.0%}",
        f"raise --max-num-seqs from {seats:.0f} to {target} (the KV cache has room)", ev)


def _healthy_replica(r: ReplicaStats, th: Thresholds, ctx: Context, window_s: float,
                     idle: bool) -> Finding:
    """Nothing to name; a replica out of rotation now for too short a share of the window to
    be named down (just ejected: a frozen process, a blip) says so, not only "idle"."""
    found = _healthy_finding(r, th, ctx, window_s, idle)
    if r.healthy_last == 0.0 and not r.draining and known(r.healthy_share):
        why = f" ({r.reason})" if r.reason else ""
        found.summary += (f"; out of rotation now{why}, for {1.0 - r.healthy_share:.0%} of the "
                          f"window: named down from {DOWN_NOW_SHARE:.0%} if it stays out")
    return found


def _healthy_finding(r: ReplicaStats, th: Thresholds, ctx: Context, window_s: float,
                     idle: bool) -> Finding:
    if idle and r.fresh < MIN_SAMPLES:
        return Finding("healthy", "ok", r.pool, r.id,
                       not_judged(r.fresh, "fresh samples", ctx, window_s),
                       "none", [cite("kvgate_replica_scrape_age_seconds", "fresh samples",
                                     float(r.fresh))])
    if idle:
        started = f"{r.requests:.0f}" if known(r.requests) else "no"
        summary = f"idle: {started} requests started in the window (< {th.min_requests:.0f})"
        if r.failed > 0:  # too few to judge (_failing), but not to be read as nothing sent
            summary += (f"; kvgate sent it {r.attempts:.0f}, {r.failed:.0f} failed (a failure "
                        f"share is judged from {th.min_replica_attempts:.0f})")
        return Finding("healthy", "ok", r.pool, r.id, summary,
                       "none", [cite("vllm:time_to_first_token_seconds_count", "requests started",
                                     r.requests, "<", th, "min_requests")])
    ev = [cite("vllm:num_requests_waiting", "samples with requests waiting", r.waiting_share, "<",
               th, "queue_waiting_share", "%"),
          cite("vllm:kv_cache_usage_perc", "KV usage p90", r.kv_p90, "<", th, "kv_high", "%"),
          cite("vllm:time_to_first_token_seconds", "mean TTFT", r.ttft_mean, unit="s"),
          cite("vllm:inter_token_latency_seconds", "mean inter-token latency", r.itl_mean, "<",
               th, "itl_high_s", "s"),
          cite("vllm:prefix_cache_hits_total", "prefix hit rate", r.hit_rate, unit="%")]
    parts = [e.text() for e in ev[:4]]
    return Finding("healthy", "ok", r.pool, r.id,
                   "nothing above thresholds: " + ", ".join(parts), "none", ev)


def _failing(r: ReplicaStats, th: Thresholds, ctx: Context, alone: bool) -> Finding | None:
    """A replica in rotation failing some of its requests: kvgate retries them elsewhere and
    ejects it only after ``health.failure_threshold`` failures in a row or half of its last
    20 requests failed, so one failing a request in five stays in rotation and the pool's
    clients may see nothing but a slower answer; its failures are counted per attempt. A
    pool's only replica is never ejected for vLLM's 500 to a request (nothing else can tell
    whose fault it was): its clients get them all."""
    if r.attempts < th.min_replica_attempts or r.failed <= 0:
        return None
    share = min(1.0, r.failed / r.attempts)
    if share < th.replica_failure_share:
        return None
    why = (f"it stays in rotation while its failures are not {ctx.failure_threshold} in a row "
           "(health.failure_threshold): restart or remove it if it keeps failing")
    seen = "retries answer them elsewhere where they can, so clients may not see them"
    if alone:
        why = ("it is its pool's only replica, kept in rotation whatever it answers: restart "
               "it, or add a replica to the pool")
        seen = "it is its pool's only replica: no other can answer them, clients get them"
    return Finding(
        "errors", "critical" if share >= 0.5 else "warning", r.pool, r.id,
        f"{share:.0%} of the requests kvgate sent to this replica failed there "
        f"({r.failed:.0f} of {r.attempts:.0f}: 5xx, resets, stalls, cut streams); {seen}",
        "read this replica's own log for its errors and kvgate's request log for the "
        f"reasons; {why}",
        [cite("kvgate_replica_failures_total", "failed share of attempts", share, ">=", th,
              "replica_failure_share", "%"),
         cite("kvgate_replica_attempts_total", "requests sent (retries included)", r.attempts,
              ">=", th, "min_replica_attempts"),
         cite("kvgate_replica_failures_total", "failed", r.failed)])


def _scrape_finding(r: ReplicaStats, th: Thresholds, ctx: Context) -> Finding | None:
    if r.samples < MIN_SAMPLES or r.draining:
        return None
    # scrapes attempted while the replica was listed (one every routing.scrape_interval_ms)
    attempts = max(1.0, r.samples * ctx.interval_s / max(ctx.scrape_interval_s, 1e-3))
    fail_share = min(1.0, r.scrape_errors / attempts)
    stale = known(r.stale_share) and r.stale_share >= th.scrape_stale_share
    failing = fail_share >= th.scrape_fail_share
    if not (stale or failing):
        return None
    ev = [cite("kvgate_scrape_errors_total", "failed scrapes (share of attempts)", fail_share,
               ">=", th, "scrape_fail_share", "%"),
          cite("kvgate_replica_scrape_age_seconds",
               f"samples with a scrape older than {ctx.stale_after_s:g} s", r.stale_share, ">=",
               th, "scrape_stale_share", "%")]
    severity = "critical" if r.fresh == 0 else "warning"
    fallback = "routing falls back to its own accounting and the engine classes cannot be judged"
    if r.no_stats:
        summary = (f"this replica's /metrics answers without vllm:* series ({r.stale_share:.0%} "
                   f"of samples without engine numbers): {fallback}")
        action = ("start its vLLM without --disable-log-stats (the engine then exports its "
                  "vllm:* metrics)")
    else:
        summary = (f"kvgate cannot read this replica's /metrics ({r.scrape_errors:.0f} failed "
                   f"scrapes, {r.stale_share:.0%} of samples stale): {fallback}")
        action = ("check the replica's /metrics: that it answers within routing's scrape "
                  "timeout (network, a proxy in between, auth) and with vLLM's metric names")
    return Finding("gateway", severity, r.pool, r.id, summary, action, ev)

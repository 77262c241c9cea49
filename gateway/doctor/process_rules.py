"""The doctor's rules for the gateway process itself (**gateway**): kvgate's overhead p99, its
CPU, Redis (the tenancy store) or the shared routing state degraded (named by its cause when
Redis answers but refuses: `redis_causes`); **healthy** with the
numbers that say so when nothing fires.
"""

from __future__ import annotations

from gateway.doctor.findings import Context, Evidence, Finding, cite, known
from gateway.doctor.redis_causes import cause_evidence, refusal
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import GatewayStats

__all__ = ["classify_gateway"]

MIN_OVERHEAD_REQUESTS = 100  # kvgate's overhead p99 is judged from this many requests
WORKERS_DOC = "docs/shared-state.md, Worker processes"


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
    found = [_overhead(g, th, ctx), _cpu(g, th, ctx), _redis(g), _sync(g)]
    out = [f for f in found if f is not None]
    return out or [_healthy_gateway(g, th)]


def _overhead(g: GatewayStats, th: Thresholds, ctx: Context) -> Finding | None:
    judged = g.overhead_n >= MIN_OVERHEAD_REQUESTS
    if not (judged and known(g.overhead_p99) and g.overhead_p99 >= th.overhead_p99_s):
        return None
    starved = known(g.cpu_share) and g.cpu_share < 0.5
    return Finding(
        "gateway", "warning", None, None,
        f"kvgate's own time before the upstream request: p99 {g.overhead_p99 * 1000:.1f} ms"
        + (f", while the process used only {g.cpu_share:.0%} of a core: it waits for a CPU"
           if starved else ""),
        "give kvgate's process a core of its own (other work on its node delays its event "
        "loop)" if starved else _more_capacity(ctx),
        [cite('kvgate_overhead_seconds{phase="pre_upstream"}', "p99", g.overhead_p99, ">=",
              th, "overhead_p99_s", "s"),
         cite("process CPU time / wall time", "CPU", g.cpu_share, unit="%")])


def _cpu(g: GatewayStats, th: Thresholds, ctx: Context) -> Finding | None:
    if not (known(g.cpu_share) and g.cpu_share >= th.cpu_busy):
        return None
    return Finding(
        "gateway", "critical" if g.cpu_share >= 0.95 else "warning", None, None,
        f"kvgate's process uses {g.cpu_share:.0%} of a core: its event loop is near "
        "saturation",
        _more_capacity(ctx),
        [cite("process CPU time / wall time", "CPU", g.cpu_share, ">=", th, "cpu_busy", "%")])


def _redis(g: GatewayStats) -> Finding | None:
    refused = refusal(g.redis_cause)
    if g.redis_up == 0.0 and g.tenancy_loaded == 0.0:
        what, action = refused or (
            "Redis does not answer", "check KVGATE_REDIS_URL and that Redis runs (the "
            "gateway's log names the address and the error)")
        return Finding(
            "gateway", "critical", None, None,
            f"{what} and has not since start: no tenant, API key or policy was ever loaded "
            "(policy version 0), so every request gets 503",
            f"{action}; kvgate loads its state on its own once Redis answers",
            [cite("kvgate_redis_up", "Redis up (last sample)", g.redis_up),
             # nothing loaded means no policy in force: kvgate_policy_version reads 0
             cite("kvgate_policy_version", "policy version (nothing loaded)", 0.0),
             *cause_evidence("kvgate_redis_down_cause", g.redis_cause, True)])
    if not (g.redis_up == 0.0 or g.redis_down_s > 0):
        return None
    what, action = refused or (
        "the tenancy store does not answer", "restore Redis (KVGATE_REDIS_URL); /readyz shows "
        "the state")
    return _outage(
        g.redis_up == 0.0,
        f"Redis degraded: {what}; kvgate serves its last known tenants and policy, rate "
        "limits are per process",
        f"Redis was degraded for {g.redis_down_s:.0f} s in the window (answers again)"
        + (f": {what}" if refused else ""),
        action, "kvgate_redis_up",
        ("Redis up (last sample)", g.redis_up), ("seconds down in the window", g.redis_down_s),
        cause_evidence("kvgate_redis_down_cause", g.redis_cause, g.redis_up == 0.0))


def _sync(g: GatewayStats) -> Finding | None:
    if not (g.sync_degraded == 1.0 or g.sync_degraded_s > 0):
        return None
    refused = refusal(g.sync_cause)
    what, action = refused or ("", "restore Redis; sharing resumes on its own")
    return _outage(
        g.sync_degraded == 1.0,
        "shared routing state degraded: this gateway routes on its own state (other "
        "gateways' routes and load unseen)" + (f"; {what}" if refused else ""),
        f"shared routing state was degraded for {g.sync_degraded_s:.0f} s in the window"
        + (f": {what}" if refused else ""),
        action + ("; sharing resumes on its own" if refused else ""), "kvgate_sync_up",
        ("degraded (last sample)", g.sync_degraded),
        ("seconds degraded in the window", g.sync_degraded_s),
        cause_evidence("kvgate_sync_down_cause", g.sync_cause, g.sync_degraded == 1.0))


def _outage(now_down: bool, now: str, was: str, action: str, metric: str,
            last: tuple[str, float], seconds: tuple[str, float],
            cause: list[Evidence]) -> Finding:
    """A dependency down now (a warning, with what to do) or earlier in the window (info)."""
    return Finding(
        "gateway", "warning" if now_down else "info", None, None, now if now_down else was,
        action if now_down else "none", [cite(metric, *last), cite(metric, *seconds), *cause])


def _healthy_gateway(g: GatewayStats, th: Thresholds) -> Finding:
    metric = 'kvgate_overhead_seconds{phase="pre_upstream"}'
    overhead = (
        cite(metric, "overhead p99", g.overhead_p99, "<", th, "overhead_p99_s", "s")
        if g.overhead_n >= MIN_OVERHEAD_REQUESTS else
        cite(metric, "overhead p99", g.overhead_p99, unit="s", note=(
             f"not judged: {g.overhead_n:.0f} requests < {MIN_OVERHEAD_REQUESTS}")))
    ev = [overhead,
          cite("process CPU time / wall time", "CPU", g.cpu_share, "<", th, "cpu_busy", "%")]
    redis = ("" if not known(g.redis_up) else ", Redis up")
    sync = ("" if not known(g.sync_degraded) else ", shared routing state up")
    return Finding("healthy", "ok", None, None,
                   "gateway: nothing above thresholds (" + ", ".join(
                       e.text() for e in ev) + redis + sync + ")", "none", ev)

"""`kvgate doctor`: the serving SOP's triage, automated, and the cache's return per tenant.

| module | role |
|---|---|
| `thresholds.py` | the one threshold table (docs/doctor.md shows it); config overrides by name |
| `history.py` | the rolling history: a compact tick per ``doctor.interval_s``; the `Sampler` task |
| `flowq.py` | flow control's queue per pool, read each tick (when flow control is on) |
| `sharing.py` | prefix sharing the traffic allows, sampled at routing time (25-50 requests/s) |
| `window.py` | a window of ticks reduced to numbers per replica, pool, process and tenant |
| `classify.py` | the pure triage: every finding of a window, worst first |
| `findings.py` | what the rules produce (class, severity, evidence, one action) and share |
| `replica_rules.py` | per replica: down, errors, scrapes, KV-/decode-/prefill-/queue-bound |
| `pool_rules.py` | per pool: errors, flow control's queue, routing (imbalance, hit rate) |
| `down_causes.py` | why a replica is out now (kvgate's reason: asleep, frozen, ...), in words |
| `process_rules.py` | the gateway process: overhead, CPU, Redis, shared routing state |
| `cache.py` | cache return per tenant and per pool, with a verdict |
| `service.py` | `Doctor`: sampler + `report(window_s)` (`GET /admin/doctor`) |
| `render.py` | text tables (stdlib only), duration parsing |
| `readiness.py` | the gateway's /readyz degraded reasons as findings (read by the CLI) |
| `cli.py` | `kvgate doctor --url ... [--window 5m] [--json] [--cache]` |

Importing the package imports none of them (the CLI stays light).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from gateway.config import KvgateConfig
    from gateway.doctor.service import Doctor
    from gateway.metrics import GatewayMetrics
    from gateway.replicas import Replica
    from routing.router import Router

__all__ = ["build_doctor", "usable_cores"]


def usable_cores() -> int | None:
    """The cores this process may run on (its CPU affinity, else the machine's count). A CPU
    quota (a pod's limit) is not seen here."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def build_doctor(
    cfg: KvgateConfig, router: Router, metrics: GatewayMetrics,
    replicas: Callable[[], Iterable[Replica]], scrape_errors: Callable[[str], int], *,
    redis_up: Callable[[], bool | None], sync_degraded: Callable[[], bool | None],
    redis_cause: Callable[[], str | None], sync_cause: Callable[[], str | None],
    tenancy_loaded: Callable[[], bool], clock: Callable[[], float],
    flow: Callable[[], Mapping[str, tuple[float, float, float]]] | None = None,
    no_load_data: Callable[[str], bool] = lambda rid: False,
    pool_max_inflight: Callable[[str], int | None] = lambda pool: None,
) -> Doctor:
    """The doctor of a gateway app (its lifespan starts and stops it)."""
    from gateway.doctor.findings import Context
    from gateway.doctor.history import Sources
    from gateway.doctor.service import Doctor, DoctorSettings
    from gateway.doctor.sharing import PrefixSharing
    from gateway.worker_metrics import current

    dc, rc = cfg.doctor, cfg.routing
    src = Sources(replicas=replicas, metrics=metrics, router=router,
                  sharing=PrefixSharing(router), scrape_errors=scrape_errors,
                  redis_up=redis_up, sync_degraded=sync_degraded, redis_cause=redis_cause,
                  sync_cause=sync_cause,
                  tenancy_loaded=tenancy_loaded, flow=flow, no_load_data=no_load_data)
    ctx = Context(policy=rc.policy, load_factor=rc.load_factor, stale_after_s=rc.stale_after_s,
                  scrape_interval_s=rc.scrape_interval_ms / 1000.0, interval_s=dc.interval_s,
                  workers=cfg.server.workers, cores=usable_cores(),
                  flow_max_inflight=cfg.flow.max_inflight if cfg.flow.enabled else None,
                  pool_max_inflight=pool_max_inflight,
                  failure_threshold=cfg.health.failure_threshold,
                  stall_after_s=cfg.health.stall_after_s or None)
    settings = DoctorSettings(dc.interval_s, dc.history_s, dict(dc.thresholds))
    slot = current()
    return Doctor(src, settings, ctx, clock, workers=cfg.server.workers,
                  worker=slot.slot if slot is not None else None)

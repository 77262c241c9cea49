"""The doctor as the running gateway holds it: the sampler (owned by the app's lifespan) and
``report(window_s)``, which `GET /admin/doctor` answers with.

A report takes one more snapshot "now", reduces the history's window to numbers
(`window.summarise`), classifies them (`classify.classify`) and computes the cache return
(`cache.cache_return`). The reduction runs in a worker thread on a copy of the tick list, so a
15-minute window never holds the event loop for long.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway import __version__
from gateway.doctor.cache import cache_return
from gateway.doctor.classify import classify
from gateway.doctor.findings import Context
from gateway.doctor.history import History, Sampler, Sources, Tick
from gateway.doctor.render import iso
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import PoolStats, summarise

__all__ = ["Doctor", "DoctorSettings"]


@dataclass(frozen=True)
class DoctorSettings:
    interval_s: float = 1.0
    history_s: float = 900.0
    thresholds: Mapping[str, float] = field(default_factory=dict)


class Doctor:
    def __init__(
        self, src: Sources, settings: DoctorSettings, ctx: Context,
        clock: Callable[[], float] = time.monotonic, workers: int = 1,
        worker: int | None = None,
    ) -> None:
        self.settings = settings
        self.thresholds = Thresholds(settings.thresholds)
        self.ctx = ctx
        self.workers = workers
        self.worker = worker  # this process's worker slot (`server.workers` > 1), else None
        self.history = History(settings.interval_s, settings.history_s)
        self.sharing = src.sharing  # routing decisions feed it (sampled, 25-50/s)
        self.sampler = Sampler(src, self.history, clock)

    async def start(self) -> None:
        await self.sampler.start()

    async def stop(self) -> None:
        await self.sampler.stop()

    async def report(self, window_s: float) -> dict[str, Any]:
        """The findings and the cache return over the last ``window_s`` seconds."""
        if not window_s > 0:
            raise ValueError("window: must be positive")
        ticks = [*self.history.ticks, self.sampler.now()]
        # what the ticks do not keep (why a replica is out now, a string): read it live
        live = {r.id: (r.reason or "", r.max_model_len) for r in self.sampler.src.replicas()}
        return await asyncio.to_thread(self.build, ticks, window_s, live)

    def build(
        self, ticks: list[Tick], window_s: float,
        live: Mapping[str, tuple[str, int | None]] | None = None,
    ) -> dict[str, Any]:
        """The report; ``live``: per replica what the ticks do not keep, read at report time
        (why kvgate holds it out now, its context length)."""
        th, h = self.thresholds, self.history
        asked, window_s = window_s, min(window_s, h.history_s)
        w = summarise(ticks, window_s, self.ctx.stale_after_s)
        for r in w.replicas:
            reason, length = (live or {}).get(r.id, ("", None))
            r.reason, r.max_model_len = reason, math.nan if length is None else float(length)
        findings = classify(w, th, self.ctx)
        tenants, pools = cache_return(w, th)
        worst = findings[0].severity if findings else "ok"
        short = w.span_s + self.settings.interval_s < window_s
        return {
            "object": "doctor",
            "version": __version__,
            "generated_at": iso(w.end_wall),
            # with workers > 1 the report is this worker's only (its requests, routing, CPU
            # and history): `kvgate doctor` asks until it has every worker's
            "process": {"pid": os.getpid(), "workers": self.workers, "worker": self.worker},
            "window": {
                "requested_s": window_s, "covered_s": round(w.span_s, 3),
                "asked_s": asked, "max_s": h.history_s,
                "start": iso(w.start_wall), "end": iso(w.end_wall), "samples": w.ticks,
                "interval_s": self.settings.interval_s,
                "short": short,
            },
            "history": {
                "started_at": iso(h.started_wall), "max_s": h.history_s,
                "note": "kept in the gateway process: a restart starts a new history"
                        + ("; each worker process keeps its own" if self.workers > 1 else ""),
            },
            "worst": worst,
            "findings": [f.as_dict() for f in findings],
            "replicas": [_clean(asdict(r) | {"hit_rate": r.hit_rate, "mean_prompt": r.mean_prompt})
                         for r in w.replicas],
            "pools": [_clean({k: v for k, v in asdict(p).items()
                              if k not in ("replicas", "recent")} | {
                "engine_hit_rate": p.engine_hit_rate, "potential_hit_rate": p.potential_hit_rate,
                "routed_hit_rate": p.routed_hit_rate} | _recent(p)) for p in w.pools],
            "process_stats": _clean(asdict(w.gateway)),
            "cache": {
                "window_s": round(w.tenant_span_s, 3),
                "tenants": [r.as_dict() for r in tenants],
                "pools": [r.as_dict() for r in pools],
            },
            "thresholds": th.as_dict(),
            # what /readyz says: `kvgate doctor` reads it and fills this in (`readiness`)
            "readiness": None,
        }


def _recent(p: PoolStats) -> dict[str, float]:
    """The hit rates over the window's second half (`PoolStats.recent`)."""
    r = p.recent
    if r is None:
        return {}
    return {"recent_s": r.span_s, "recent_engine_hit_rate": r.engine_hit_rate,
            "recent_potential_hit_rate": r.potential_hit_rate}


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    """NaN (unknown) as null, for JSON."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}

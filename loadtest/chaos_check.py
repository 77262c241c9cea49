"""The invariants `loadtest.chaos` checks once the load stopped and the faults healed: what a
user relies on after a fleet went through faults. Each check is (name, passed, detail)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import httpx

from loadtest.chaos_load import Record, Tenant
from loadtest.chaos_procs import ADMIN, Child
from loadtest.soak_sample import _walk

__all__ = ["Check", "ended", "footprint", "gateway_state", "leases", "logs_clean", "resources",
           "revoked_refused", "settled_5xx", "timeline"]

Check = tuple[str, bool, str]
_AUTH = {"Authorization": f"Bearer {ADMIN}"}
_GAUGES = ("kvgate_inflight_requests", "kvgate_flow_queue_depth")


def ended(records: list[Record], revoked: set[str]) -> list[Check]:
    hung = [r for r in records if r.outcome == "hang"]
    cut = [r for r in records if r.outcome == "truncated"]
    other = [r for r in records if r.outcome.startswith("other:")]
    bad401 = [r for r in records if r.status == 401 and r.tenant not in revoked]
    return [
        ("every request ended (no hang)", not hung, f"{len(hung)} hung"),
        ("no truncated stream", not cut, f"{len(cut)} truncated: " +
         ", ".join(sorted({r.kind for r in cut}))),
        ("only SDK errors (APIError)", not other, "; ".join(
            f"{r.outcome} {r.message[:80]}" for r in other[:3])),
        ("no 401 for a valid key", not bad401, f"{len(bad401)}"),
    ]


def revoked_refused(records: list[Record], t0: float, tenants: list[Tenant],
                    grace_s: float = 3.0) -> Check:
    """A key revoked (answered 204) serves no request begun `grace_s` later, through either
    gateway (the other learns it within its poll interval, 0.5 s)."""
    at = {t.id: t.revoked_at for t in tenants if t.revoked_at}
    served = [r for r in records if r.tenant in at and r.status == 200
              and t0 + r.start > at[r.tenant] + grace_s]
    return ("a revoked key serves nothing", not served, f"{len(served)} served after "
            "its revocation: " + ", ".join(f"{t0 + r.start - at[r.tenant]:.1f}s"
                                           for r in served[:5]))


def _metric_sum(text: str, fam: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{fam}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def gateway_state(base: str) -> list[Check]:
    """In flight and queued 0 (gauges, admin view), ready and not degraded, peers seen."""
    out: list[Check] = []
    with httpx.Client(base_url=base, timeout=10) as c:
        text = c.get("/metrics").text
        gauges = {f: _metric_sum(text, f) for f in _GAUGES}
        replicas = c.get("/admin/replicas", headers=_AUTH).json()
        admin = {"in_flight": _walk(replicas, ("in_flight", "inflight")),
                 "queued": _walk(replicas, ("queued", "depth", "leases", "held"))}
        ready = c.get("/readyz")
        doc = ready.json()
    zero = {**gauges, **admin}
    out.append((f"{base} nothing in flight or queued", not any(zero.values()),
                ", ".join(f"{k}={v:g}" for k, v in zero.items() if v)))
    out.append((f"{base} ready, not degraded", ready.status_code == 200 and not
                doc.get("degraded"), f"{ready.status_code} {_short(doc)}"))
    sync = replicas.get("sync") or {}
    peers = sync.get("peers") or 0
    peers = peers if isinstance(peers, int) else len(peers)
    out.append((f"{base} sharing resumed (peers seen)", peers > 0 and not sync.get("degraded"),
                f"peers={peers} degraded={sync.get('degraded')}"))
    return out


def _short(doc: dict[str, Any]) -> str:
    return str({k: v for k, v in doc.items() if k in ("status", "degraded", "not_ready")})[:160]


def settled_5xx(records: list[Record]) -> Check:
    five = [r for r in records if r.status >= 500 or (r.outcome not in ("ok", "cancelled")
            and r.status not in (401, 429))]
    return ("no failure after the settle", not five,
            "; ".join(f"{r.outcome}({r.status}) {r.message[:100]}" for r in five[:3]))


def footprint(pid: int) -> tuple[float, int]:
    """RSS (MiB) and open descriptors of `pid`."""
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+)", f.read())
    return (int(m.group(1)) / 1024 if m else 0.0), len(os.listdir(f"/proc/{pid}/fd"))


def resources(name: str, before: tuple[float, int], after: tuple[float, int]) -> Check:
    # near: what a few hundred requests' caches and pools may keep, not what a leak grows to
    ok = after[0] <= before[0] * 1.5 + 40 and after[1] <= before[1] + 40
    return (f"{name} RSS and fds near pre-fault", ok,
            f"RSS {before[0]:.0f} -> {after[0]:.0f} MiB, fds {before[1]} -> {after[1]}")


def logs_clean(gateways: list[Child], secrets: list[str], records: list[Record]) -> list[Check]:
    text = "\n".join(Path(g.log).read_text(errors="replace") for g in gateways)
    tb = text.count("Traceback")
    first = text[text.find("Traceback"):][:600] if tb else ""
    leaked = [s[:6] + "..." for s in secrets if s and s in text]
    said = "\n".join(r.message for r in records)
    told = [s[:6] + "..." for s in secrets if s and s in said]
    return [("no traceback in gateway logs", not tb, f"{tb} {first!r}"[:700]),
            ("no secret in gateway logs", not leaked, ",".join(leaked)),
            ("no secret in client-visible errors", not told, ",".join(told))]


def leases(redis_url: str, ns: str = "kvgate") -> Check:
    """Tenants' concurrency leases not yet expired in Redis (`<ns>:rl:{t}:leases`, scored by
    expiry in Redis's clock) whose holder is alive (its heartbeat `<ns>:lease-holder:<id>`):
    0 once nothing runs. A dead holder's leases stop counting with its heartbeat (5 s) and
    are only shown (`holders.py`)."""
    import redis

    r = redis.Redis.from_url(redis_url, socket_timeout=5, decode_responses=True)
    live: dict[str, int] = {}
    orphans = 0
    try:
        sec, usec = r.time()
        now = sec + usec / 1e6
        for key in r.scan_iter(match=f"{ns}:rl:*:leases", count=1000):
            for lease in r.zrangebyscore(key, now, "+inf"):
                if r.exists(f"{ns}:lease-holder:{str(lease).split('.', 1)[0]}"):
                    live[key] = live.get(key, 0) + 1
                else:
                    orphans += 1
    finally:
        r.close()
    return ("no tenant concurrency lease held", not live,
            f"{str(live)[:160]}; of dead holders (not counted): {orphans}")


def timeline(records: list[Record], bucket_s: float = 5.0) -> str:
    """Errors other than 401/429 per `bucket_s` of the run: when they happened."""
    counts: dict[int, int] = {}
    for r in records:
        if r.outcome not in ("ok", "cancelled") and r.status not in (401, 429):
            b = int(r.start // bucket_s)
            counts[b] = counts.get(b, 0) + 1
    return " ".join(f"{b * bucket_s:.0f}s:{n}" for b, n in sorted(counts.items()))

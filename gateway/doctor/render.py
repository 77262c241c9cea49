"""The doctor's report as text a person reads in ten seconds (a table, worst first), and the
small parsing helpers the CLI and the admin route share. Stdlib only: `kvgate doctor` imports
this and nothing of the gateway."""

from __future__ import annotations

import math
import re
import time
from typing import Any

__all__ = ["format_duration", "iso", "parse_duration", "render_cache", "render_findings"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.ASCII)  # ASCII digits only
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
MAX_WINDOW_S = 24 * 3600.0


def parse_duration(text: str) -> float:
    """``"5m"`` -> 300.0; ``30s``, ``1h``, ``90`` (seconds), ``500ms``. ValueError otherwise."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"invalid window {text!r}: use e.g. 30s, 5m, 1h")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(f"invalid window {text!r}: must be > 0 and at most 24h")
    return seconds


def format_duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        if seconds >= 1:
            return f"{seconds:.0f}s"
        return f"{seconds:.1f}s" if seconds >= 0.1 else f"{seconds * 1000:.0f}ms"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s % 60 else f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def iso(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def _tokens(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if v >= 1e6:
        return f"{v / 1e6:.1f}M"
    if v >= 1e4:
        return f"{v / 1e3:.0f}k"
    return f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def _header(report: dict[str, Any], url: str) -> list[str]:
    w, h = report["window"], report["history"]
    line = f"kvgate doctor  {url}  window {format_duration(w['requested_s'])}"
    if w.get("asked_s", 0) > w["requested_s"]:
        line += f" (at most doctor.history_s, not {format_duration(w['asked_s'])})"
    if w.get("short"):
        line += (f" (the history covers {format_duration(w['covered_s'])}: it started at "
                 f"{h['started_at']}; {h['note']})")
    else:
        line += f" ({w['start']} .. {w['end']}; {h['note']})"
    line += _worker_line(report)
    return [line]


def _worker_line(report: dict[str, Any]) -> str:
    """With `server.workers` > 1, which worker a report is of: each answers for itself."""
    process = report.get("process", {})
    workers = process.get("workers", 1)
    if workers <= 1:
        return ""
    slot = process.get("worker")
    who = f"worker {slot} (pid {process.get('pid')})" if slot is not None \
        else f"worker pid {process.get('pid')}"
    return (f"\n{who} of {workers}: this worker's requests, routing, CPU and history only "
            "(each worker keeps its own)")


def render_findings(report: dict[str, Any], url: str = "") -> str:
    findings = report["findings"]
    counts: dict[str, int] = {}
    for f in findings:
        counts[f["severity"]] = counts.get(f["severity"], 0) + 1
    lines = _header(report, url)
    lines.append("worst: " + report["worst"] + "  (" + ", ".join(
        f"{n} {s}" for s, n in counts.items()) + ")")
    lines.append("")
    rows = [(f["severity"], f["class"], _where(f), f) for f in findings]
    w_class = max([len("CLASS"), *(len(r[1]) for r in rows)])
    w_where = max([len("WHERE"), *(len(r[2]) for r in rows)])
    lead = 10 + w_class + 2 + w_where + 2
    lines.append(f"{'SEVERITY':<10}{'CLASS':<{w_class + 2}}{'WHERE':<{w_where + 2}}FINDING")
    for sev, cls, where, f in rows:
        lines.append(f"{sev:<10}{cls:<{w_class + 2}}{where:<{w_where + 2}}{f['summary']}")
        if f["class"] == "healthy":
            continue
        # a number judged by a threshold, or what /readyz said in words (`readiness`)
        shown = [_evidence(e) for e in f["evidence"] if e.get("threshold") is not None] + [
            f"{e['metric']} {e['what']}: {e['note']}" for e in f["evidence"]
            if e.get("metric") == "/readyz" and e.get("note")]
        if shown:
            lines.append(" " * lead + "evidence: " + "; ".join(shown))
        lines.append(" " * lead + "action: " + f["action"])
    return "\n".join(lines)


def _where(f: dict[str, Any]) -> str:
    if f["pool"] is None:
        return "gateway"
    return f"{f['pool']}/{f['replica']}" if f["replica"] else f"{f['pool']} (pool)"


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "n/a"
    if unit == "%":
        return f"{v:.0%}"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    return f"{v:,.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.2f}"


def _evidence(e: dict[str, Any]) -> str:
    unit = e.get("unit", "")
    return (f"{e['what']} {_value(e['value'], unit)} ({e['op']} "
            f"{_value(e['threshold'], unit)}) [{e['metric']}]")


def render_cache(report: dict[str, Any], url: str = "") -> str:
    cache = report["cache"]
    lines = _header(report, url)
    lines.append(f"cache return over {format_duration(cache['window_s'] or 0)} "
                 "(GPU-s saved: cached tokens / the router's learned prefill rate)")
    lines.append("")
    head = ("TENANT", "POOL", "REQUESTS", "PROMPT TOK", "CACHED TOK", "HIT", "GPU-S SAVED",
            "KV SHARE", "VERDICT")
    rows = []
    for r in cache["tenants"]:
        rows.append((r["tenant"], r["pool"], f"{r['requests']:,.0f}", _tokens(r["prompt_tokens"]),
                     _tokens(r["cached_tokens"]), _pct(r["hit_rate"]),
                     "n/a" if r["gpu_seconds_saved"] is None else f"{r['gpu_seconds_saved']:.2f}",
                     _pct(r["kv_share"]), r["verdict"]))
    for r in cache["pools"]:
        rows.append(("(all, engine)", r["pool"], f"{r['requests']:,.0f}",
                     _tokens(r["prompt_tokens"]), _tokens(r["cached_tokens"]),
                     _pct(r["hit_rate"]),
                     "n/a" if r["gpu_seconds_saved"] is None else f"{r['gpu_seconds_saved']:.2f}",
                     _pct(r["kv_share"]), r["verdict"]))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        lines.append("(no traffic in the window)")
    details = [r for r in (*cache["tenants"], *cache["pools"]) if r.get("detail")]
    if details:
        lines.append("")
        for r in details:
            who = r["tenant"] if r["tenant"] is not None else "(all)"
            lines.append(f"{who} @ {r['pool']}: {r['verdict']} -- {r['detail']}")
    lines.append("KV share per tenant: not known (the engine does not say whose blocks it "
                 "holds); per pool: the replicas' mean KV usage")
    return "\n".join(lines)

"""What the doctor's rules produce and share: a finding (class, severity, where, one action)
with its evidence (each item names its metric and, when judged, its threshold), the context the
rules need besides the numbers, and the small helpers every rule module uses (`cite` an
evidence item, `known` for a number that is not NaN, `fmt_value` for display).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.doctor.thresholds import Thresholds

__all__ = [
    "CLASSES", "MIN_SAMPLES", "SEVERITIES", "Context", "Evidence", "Finding", "cite", "fmt_value",
    "known", "median_of", "not_judged", "ratio_or_nan",
]

CLASSES = ("down", "errors", "KV-bound", "decode-bound", "prefill-bound", "queue-bound", "routing",
           "gateway", "limits", "healthy")
SEVERITIES = ("critical", "warning", "info", "ok")
MIN_SAMPLES = 5  # an engine class or a spread between replicas needs this many ticks


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
        value = fmt_value(self.value, self.unit)
        if self.note:
            return f"{self.what} {value} ({self.note})"
        if self.threshold is None:
            return f"{self.what} {value}"
        return f"{self.what} {value} ({self.op} {fmt_value(self.threshold, self.unit)})"


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
    # a pool's own in-flight bound in the policy in force (pools.<p>.max_inflight, over
    # flow.max_inflight; None: not set), read when a rule runs: it changes at run time
    pool_max_inflight: Callable[[str], int | None] = lambda pool: None
    failure_threshold: int = 3  # health.failure_threshold: consecutive failures eject
    stall_after_s: float | None = 60.0  # health.stall_after_s: a frozen engine is ejected


def known(v: float) -> bool:
    return not math.isnan(v)


def fmt_value(v: float | None, unit: str) -> str:
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


def cite(metric: str, what: str, value: float, op: str = "", th: Thresholds | None = None,
         name: str | None = None, unit: str = "", note: str = "") -> Evidence:
    threshold = getattr(th, name) if th is not None and name else None
    return Evidence(metric, what, None if math.isnan(value) else value, op, threshold, name,
                    unit, note)


def median_of(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def ratio_or_nan(num: float, den: float) -> float:
    return num / den if known(num) and den > 0 else math.nan


def not_judged(n: int, what: str, ctx: Context, window_s: float) -> str:
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

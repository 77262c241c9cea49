"""The figures and the Markdown table of `loadtest.gray_failures`, from its runs' records."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from loadtest.gray_load import Record

__all__ = ["Run", "render"]

_BUCKET_S = 2.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


@dataclass
class Run:
    scenario: str
    variant: str
    faulty: str  # host:port
    pre_s: float
    fault_s: float
    records: list[Record] = field(default_factory=list)
    health: list[tuple[float, float]] = field(default_factory=list)  # (t, kvgate_replica_healthy)
    retries: dict[str, float] = field(default_factory=dict)
    inflight_after: float = 0.0
    tracebacks: int = 0
    doctor: list[str] | None = None

    @property
    def lift_s(self) -> float:
        return self.pre_s + self.fault_s

    def _on_faulty(self, r: Record) -> bool:
        return r.replica.endswith("/" + self.faulty)

    def success(self) -> str:
        ok = sum(r.status == 200 for r in self.records)
        return f"{100.0 * ok / max(len(self.records), 1):.2f} % of {len(self.records)}"

    def errors(self) -> str:
        c = Counter(f"{r.status} {r.error}" for r in self.records if r.status != 200)
        return ", ".join(f"{k}: {n}" for k, n in c.most_common()) or "none"

    def ttft(self) -> tuple[float | None, float | None]:
        """TTFT p50, p99 of the requests that started during the fault and succeeded."""
        vals = [r.ttft for r in self.records if r.ttft is not None and r.status == 200
                and self.pre_s <= r.start < self.lift_s]
        return _pct(vals, 0.5), _pct(vals, 0.99)

    def share(self, lo: float, hi: float) -> float | None:
        rs = [r for r in self.records if lo <= r.start < hi and r.replica]
        return None if not rs else sum(map(self._on_faulty, rs)) / len(rs)

    def buckets(self) -> str:
        end = max((r.start for r in self.records), default=0.0)
        out, t = [], 0.0
        while t <= end:
            s = self.share(t, t + _BUCKET_S)
            out.append("-" if s is None else f"{100 * s:.0f}")
            t += _BUCKET_S
        return " ".join(out)

    def ejected_after(self) -> float | None:
        """Seconds from the fault's start to kvgate's first health gauge 0 for it."""
        return next((t - self.pre_s for t, h in self.health if t >= self.pre_s and h == 0), None)

    def back_after(self) -> float | None:
        """Seconds from the lift to the gauge 1 again (None: never out, or never back)."""
        out = [t for t, h in self.health if h == 0]
        if not out:
            return None
        return next((t - self.lift_s for t, h in self.health if t > max(out[-1], self.lift_s)
                     and h == 1), None)

    def first_after_lift(self) -> float | None:
        return min((r.start - self.lift_s for r in self.records
                    if r.start >= self.lift_s and self._on_faulty(r)), default=None)

    def line(self) -> str:
        p50, p99 = self.ttft()
        return (f"ok {self.success()}, errors {self.errors()}, ttft {_ms(p50)}/{_ms(p99)} ms, "
                f"share per 2s [{self.buckets()}], eject {self.ejected_after()}, "
                f"back {self.back_after()}, inflight {self.inflight_after}")


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render(runs: list[Run], what: dict[str, str], command: str, pre_s: float,
           fault_s: float) -> str:
    lines = [
        "# Gray failures: one of four replicas wrong, not dead", "",
        f"`{command}`", "",
        f"Phases: {pre_s:g} s normal, {fault_s:g} s with the fault on replica 0, then lifted "
        "(`POST /sim/faults`). `kvgate`: all four replicas in the config (cache_aware); "
        "`baseline`: the faulty one left out; `least_load`: all four, `--policy least_load`. "
        "TTFT: requests started during the fault. Share: the faulty replica's share of the "
        "requests started in that phase (pre / fault / after), and per 2 s bucket. Eject: "
        "seconds from the fault to `kvgate_replica_healthy` 0; back: from the lift to 1.", "",
        "| scenario | run | success | errors | TTFT p50 / p99 ms | share pre / fault / after "
        "| eject s | back s | 1st req after lift s | retries | in flight after | tracebacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        p50, p99 = r.ttft()
        shares = " / ".join(_share(x) for x in (
            r.share(0, r.pre_s), r.share(r.pre_s, r.lift_s), r.share(r.lift_s, 1e9)))
        retries = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.retries.items()) if v) or "0"
        lines.append(
            f"| {r.scenario} | {r.variant} | {r.success()} | {r.errors()} | {_ms(p50)} / "
            f"{_ms(p99)} | {shares} | {_s(r.ejected_after())} | {_s(r.back_after())} | "
            f"{_s(r.first_after_lift())} | {retries} | {r.inflight_after:.0f} | "
            f"{r.tracebacks} |")
    lines += ["", "## The faulty replica's share per 2 s bucket, and the doctor", ""]
    for r in runs:
        if r.variant == "baseline":
            continue
        lines.append(f"- **{r.scenario}** ({what.get(r.scenario, '')}), {r.variant}, faulty "
                     f"replica {r.faulty}: share % per 2 s: `{r.buckets()}`")
        for finding in r.doctor or ["doctor: nothing but healthy"]:
            lines.append(f"  - doctor: {finding}")
    return "\n".join(lines) + "\n"

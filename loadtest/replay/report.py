"""What `kvgate replay` shows a person: the summary table, progress, failures, where JSON goes.

- The table's columns are the README's summary fields, with `failed` next to `requests`, and
  the ratios to the oracle's when it ran.
- Progress per policy goes to stderr: a bar on a terminal, a plain line every 10 % otherwise.
- Failed requests are counted per reason and reported on stderr; any failure makes the exit
  status non-zero, so a replay against a gateway that refuses every request cannot pass for a
  run with zeros in it.
- `--json` without a path writes a timestamped file in the working directory, `--json DIR` in
  DIR (it wrote into the source tree's `loadtest/results/` whatever the working directory:
  into site-packages for an installed kvgate).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

__all__ = [
    "COLUMNS", "Progress", "ReplayError", "default_json_path", "format_table", "report_failures",
]

COLUMNS = (
    "policy", "requests", "failed", "hit_rate", "pooled_reference_hit_rate", "ttft_p50_s",
    "ttft_p99_s", "e2e_p99_s", "max_over_mean_inflight", "load_bound.violations", "preemptions",
)
ORACLE_COLUMNS = ("hit_rate_vs_oracle", "ttft_p99_vs_oracle")  # when the oracle ran


class ReplayError(Exception):
    """A condition that stops the replay; its message is the one line to print."""


def _field(summary: dict[str, object], column: str) -> object:
    value: object = summary
    for part in column.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def format_table(summaries: Sequence[dict[str, object]]) -> str:
    columns = COLUMNS + tuple(c for c in ORACLE_COLUMNS if any(c in s for s in summaries))
    rows = [["n/a" if (v := _field(s, c)) is None else str(v) for c in columns]
            for s in summaries]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def report_failures(summaries: Sequence[dict[str, object]], out: IO[str] | None = None) -> int:
    """Print one line per policy with failed requests (by reason); 1 if any failed, else 0.

    `out`: stderr as it is at the call (a default bound at import wrote to a stream replaced
    since, e.g. by `contextlib.redirect_stderr`, or closed)."""
    out = out or sys.stderr
    status = 0
    for s in summaries:
        failed = s.get("failed") or 0
        if not failed:
            continue
        status = 1
        errors = s.get("errors") or {}
        reasons = "; ".join(f"{n} x {why}" for why, n in sorted(
            errors.items(), key=lambda kv: -int(kv[1]))) if isinstance(errors, dict) else ""
        hint = " (is --api-key set?)" if "HTTP 401" in reasons else ""
        print(f"kvgate replay: policy {s.get('policy')}: {failed} of {s.get('requests')} "
              f"requests failed{hint}: {reasons or 'no reason recorded'}", file=out)
    return status


def default_json_path(folder: Path, now: float | None = None) -> Path:
    """The timestamped file a bare `--json` (the working directory) or `--json DIR` writes."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return folder / f"replay-{stamp}.json"


class Progress:
    """Per-policy progress on stderr: a bar on a terminal, a plain line per 10 % otherwise."""

    BAR = 30

    def __init__(self, label: str, total: int, out: IO[str] | None = None) -> None:
        self.label, self.total = label, max(1, total)
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.done = 0
        self._shown = -1
        self._t0 = time.monotonic()

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.tty:
            filled = self.BAR * self.done // self.total
            if filled != self._shown or self.done == self.total:
                self._shown = filled
                bar = "#" * filled + "." * (self.BAR - filled)
                self.out.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
                self.out.flush()
        else:
            tenth = 10 * self.done // self.total
            if tenth != self._shown:
                self._shown = tenth
                self.out.write(f"{self.label}: {self.done}/{self.total} requests\n")
                self.out.flush()

    def note(self, text: str) -> None:
        """A line of its own (e.g. a phase without request-level progress)."""
        if self.tty and self._shown >= 0:
            self.out.write("\n")
        self.out.write(f"{self.label}: {text}\n")
        self.out.flush()

    def close(self) -> None:
        took = time.monotonic() - self._t0
        if self.tty and self._shown >= 0:
            self.out.write("\n")
        self.out.write(f"{self.label}: done in {took:.1f} s\n")
        self.out.flush()

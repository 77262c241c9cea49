"""Flow control benchmark: overload without collapse (issue 12), offline and live.

    python -m loadtest.bench_flow [--trace PATH] [--limit N] [--jobs N] [--live]
                                  [--out loadtest/results]

Offline (simulated time, the gateway's flow-control code in front of the same router): the
Mooncake conversation trace on 8 simulated replicas (h100-8b-fp8, 262,144 KV tokens each),
30 % premium / 70 % free conversations (4 tenants per tier, equal weights), at 1.5x, 2x and 3x
its arrival rate, flow control off, on, and on without the share cap; then the same with
tenant free-0 sending 5x its share (its extra requests added on top, so every other tenant's
traffic is identical); premium's floors (0.5x without flow control, premium alone at 2x, its
99th-percentile prompt alone on an idle replica); then the share cap's sweep and (``--sweep``)
the saturation thresholds', one setting changed at a time.
Per run: TTFT p50/p99 and goodput at a 2 s TTFT SLO per tier and tenant, preemptions, sheds,
the fair-share ratios (`loadtest.replay.fairshare`) and their Jain index. Writes ``flow.md``,
``flow.json`` and ``flow.png``.

Live (``--live``): two real gateways on the same simulated replicas, flow control on and off,
measured alternately: added latency when nothing is saturated (p50 at concurrency 1 and 8,
with the count of requests that queued, which should be 0) and kvgate's CPU per request, plus the
in-process cost of the fast path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from loadtest.flow_live import live_bench
from loadtest.flow_report import plot, report
from loadtest.flow_runs import offline, plan, premium_floor

RESULTS = Path(__file__).resolve().parent / "results"
# the 2-minute sample shipped in the repo; the whole hour (loadtest/data/README.md) with --trace
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_sample.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_flow", description=__doc__)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="a Mooncake-format trace (default: the 2-minute sample, "
                        "loadtest/data/mooncake_sample.jsonl; the whole hour, which the saved "
                        "results use: see loadtest/data/README.md)")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--jobs", type=int, default=1,
                   help="offline runs at a time (each is deterministic; default 1)")
    p.add_argument("--sweep", action="store_true",
                   help="also the saturation thresholds' sweep (8 runs more)")
    p.add_argument("--only", metavar="RUN,...",
                   help="re-run only these offline runs (names as in flow.md); the others are "
                        "kept from the saved flow.json")
    p.add_argument("--live", action="store_true", help="also the live on/off comparison")
    p.add_argument("--quick", action="store_true", help="a shorter live run")
    p.add_argument("--live-only", action="store_true",
                   help="only the live part (the offline runs from the saved flow.json)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "flow.json"
    before = orjson.loads(saved.read_bytes()) if saved.exists() else {}
    if args.live_only:
        runs, floor = before["offline"], before.get("floor")
    else:
        only = set(args.only.split(",")) if args.only else None
        fresh = offline(args.trace, args.limit, args.jobs, args.sweep, only)
        kept = before.get("offline", {}) if only else {}
        runs = {n: fresh.get(n) or kept[n] for n in plan(args.sweep) if n in fresh or n in kept}
        floor = premium_floor(args.trace, args.limit) if not only else before.get("floor")
    write(args.out, runs, floor, before.get("live"))  # kept if the live part fails
    if args.live or args.live_only:
        write(args.out, runs, floor, live_bench(args.quick))
    return 0


def write(out: Path, runs: dict[str, Any], floor: dict[str, float] | None,
          live: dict[str, Any] | None) -> None:
    (out / "flow.json").write_bytes(orjson.dumps(
        {"offline": runs, "floor": floor, "live": live}, option=orjson.OPT_INDENT_2))
    (out / "flow.md").write_text(report(runs, live, floor))
    plot(runs, out / "flow.png")
    print(f"written to {out}/flow.md, flow.json, flow.png", flush=True)


if __name__ == "__main__":
    sys.exit(main())

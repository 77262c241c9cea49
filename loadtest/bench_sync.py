"""Shared routing state between gateways: routing quality, the sharing's cost, workers.

    python -m loadtest.bench_sync [--offline] [--cost] [--workers] [--trace PATH] [--quick]
                                  [--jobs N]
    python -m loadtest.bench_sync --offline [--workload ITEM ...] [--seeds SEEDS] [...]

``--offline`` (routing quality, simulated time): N = 1, 2, 4, 8 gateways, requests spread at
random over them, sharing off and on at a sync delay D = 0, 10, 50 ms, on the Mooncake
conversation trace at 1x and 1.5x and the synthetic multi-tenant workload (8 replicas x
262,144 KV tokens); then (not with ``--quick``) every generated workload at 262,144 and
1,048,576 KV tokens with one gateway, four sharing nothing and four at D = 10 ms.
Ratios against one gateway in the same run.

``--offline`` with ``--workload``, ``--seeds``, ``--gateway-seeds``, ... (`bench_sync_seeds.py`):
N gateways against one over workload and gateway seeds, ratios to one gateway of the same
workload seed, target misses marked. The table "2026-12-04: N = 4, D = 10 ms with deferred
picks, today's code" of ``bench_sync_offline.md`` is

    python -m loadtest.bench_sync --offline --trace <the one-hour Mooncake trace> \\
        --gateway-seeds 0-2 -w mooncake@262144 -w mooncake-1.5x@262144 \\
        -w synthetic@262144:7-11:g0 -w bursts:14-21:g0 -w agent-loops -w hot-prefixes \\
        -w cold-one-offs -w rag-corpus -w skewed-tenants -w load-ramp -w heavy-tail

``--cost`` (live, one process, real redis-server; `loadtest/sync_cost.py`): two routers with
their `RouteSync`, 2,000 routed requests/s alternating between them (conversations of 8-32
blocks, each request in flight for 100 ms), sharing off / on / over pub/sub interleaved for a
few rounds. CPU per request with sharing on minus the same loop with sharing off, split into
the routing calls and the publishing + applying, Redis bytes per request (INFO net input and
output), apply lag p50 / p99. The same traffic over Redis pub/sub (PUBLISH + a subscriber
decoding and applying the same records) as the alternative the design rejected.

``--workers`` (live): one gateway with ``server.workers`` 1 then 2 (Redis on), 4 fast
simulated replicas, saturating non-streamed load: requests/s and gateway CPU per request.

Written to ``loadtest/results/bench_sync_offline.md`` (+ ``bench_sync_offline.png``) and
``bench_sync_live.md``, or to the folder ``--out DIR`` names (the committed results untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from loadtest import bench_sync_seeds
from loadtest.bench_overhead import Report
from loadtest.cmdline import shown_command
from loadtest.fleet import redis_server
from loadtest.replay.generators import WORKLOADS
from loadtest.replay.offline import FleetSpec, GatewaySpec, replay_offline
from loadtest.replay.summary import summarize
from loadtest.replay.trace import TraceError
from loadtest.replay.workload import ReplayRequest, load_mooncake, synthetic_multitenant
from routing.router import RouterConfig

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLE_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_sample.jsonl"


# -- offline: routing quality of N gateways -----------------------------------------------------
def _workloads(trace: Path, quick: bool) -> list[tuple[str, list[ReplayRequest], int]]:
    limit = 3000 if quick else None
    out = [("conversation trace 1x", load_mooncake(str(trace), limit=limit), 262_144)]
    if not quick:
        out.append(("conversation trace 1.5x",
                    load_mooncake(str(trace), rate_scale=1.5, limit=limit), 262_144))
    out.append(("synthetic multi-tenant", synthetic_multitenant(), 262_144))
    return out


def _one(reqs: list[ReplayRequest], kv: int, spec: GatewaySpec) -> dict[str, float]:
    fleet = FleetSpec(replicas=8, kv_tokens=kv)
    cfg = RouterConfig()
    res = replay_offline(reqs, fleet, cfg, spec)
    s = summarize(policy="cache_aware", outcomes=res.outcomes, replicas=res.replicas,
                  hit_rate=res.hit_rate, pooled_reference_hit_rate=0.0,
                  preemptions=res.preemptions, load_factor=cfg.load_factor,
                  load_slack=cfg.load_slack)
    return {k: float(s[k]) for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s")}  # type: ignore[arg-type]


def _job(job: tuple[list[ReplayRequest], int, GatewaySpec]) -> dict[str, float]:
    return _one(*job)  # a worker process's


_Cell = tuple[str, str, tuple[list[ReplayRequest], int, GatewaySpec]]  # workload, "N/label", job


def offline(rep: Report, trace: Path, quick: bool,
            jobs: int = 1) -> list[tuple[str, str, dict[str, float]]]:
    ns = (1, 4) if quick else (1, 2, 4, 8)
    delays = (10.0,) if quick else (0.0, 10.0, 50.0)
    cells: list[_Cell] = []
    for name, reqs, kv in _workloads(trace, quick):
        for n in ns:
            variants = [("none", GatewaySpec(n, share=False))] if n > 1 else [("-", GatewaySpec(1))]
            if n > 1:
                variants += [(f"D={d:g} ms", GatewaySpec(n, True, d / 1000)) for d in delays]
            cells += [(name, f"{n}/{label}", (reqs, kv, spec)) for label, spec in variants]
    return _table(rep, "Routing quality of N gateways (offline, cache_aware, 8 replicas)", cells,
                  jobs)


def generated(rep: Report, jobs: int = 1) -> list[tuple[str, str, dict[str, float]]]:
    """Every generated workload (`loadtest.replay.generators`) at both KV sizes: one gateway,
    four sharing nothing, four sharing at D = 10 ms (the issue's target cell)."""
    specs = [("1/-", GatewaySpec(1)), ("4/none", GatewaySpec(4, share=False)),
             ("4/D=10 ms", GatewaySpec(4, True, 0.010))]
    cells: list[_Cell] = [(f"{name}-{kv // 1024}k", key, (make(), kv, spec))
                          for name, make in sorted(WORKLOADS.items())
                          for kv in (262_144, 1_048_576) for key, spec in specs]
    return _table(rep, "Generated workloads: one gateway and four (offline, cache_aware, "
                  "8 replicas)", cells, jobs)


def _table(rep: Report, title: str, cells: list[_Cell],
           jobs: int) -> list[tuple[str, str, dict[str, float]]]:
    """Replay every cell (each workload's first: one gateway, the ratios' base), add the table."""
    rep.add(f"## {title}\n")
    rep.add("| workload | gateways | sharing | hit rate | x 1 gw | TTFT p50 s | x 1 gw | "
            "TTFT p99 s | x 1 gw |")
    rep.add("|---|---|---|---|---|---|---|---|---|")
    with ProcessPoolExecutor(jobs) as pool:
        results = list(pool.map(_job, [c[2] for c in cells]))
    rows = []
    base: dict[str, float] = {}
    for (name, key, _), r in zip(cells, results, strict=True):
        gws, label = key.split("/", 1)
        if gws == "1":
            base = r
        rows.append((name, key, r))
        rep.add(f"| {name} | {gws} | {label} | {r['hit_rate']:.4f} | "
                f"{r['hit_rate'] / max(base['hit_rate'], 1e-9):.3f} | "
                f"{r['ttft_p50_s']:.3f} | {r['ttft_p50_s'] / base['ttft_p50_s']:.3f} | "
                f"{r['ttft_p99_s']:.3f} | {r['ttft_p99_s'] / base['ttft_p99_s']:.3f} |")
    rep.add("")
    return rows


def plot(rows: list[tuple[str, str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r[0] for r in rows})
    cols = min(4, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names, strict=False):
        mine = [r for r in rows if r[0] == name]
        base = mine[0][2]["hit_rate"] or 1e-9
        ax.bar([r[1] for r in mine], [r[2]["hit_rate"] / base for r in mine])
        ax.axhline(0.97, color="red", linewidth=0.8)
        ax.set_title(name)
        ax.set_ylabel("hit rate / one gateway")
        ax.tick_params(axis="x", rotation=70, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- live: the cost of sharing ------------------------------------------------------------------
def cost(rep: Report, seconds: float, rounds: int = 3) -> None:
    import statistics

    from loadtest.sync_cost import HOLD_S, Measured, measure

    modes = ("off", "streams", "pubsub")
    runs: dict[str, list[Measured]] = {m: [] for m in modes}
    with redis_server() as url:
        for _ in range(rounds):  # interleaved: drift on a shared machine hits every mode alike
            for m in modes:
                runs[m].append(asyncio.run(measure(url, m, seconds)))

    def med(m: str, key: str) -> float:
        return float(statistics.median(getattr(x, key) for x in runs[m]))

    off = med("off", "cpu_us")
    off_route = med("off", "route_cpu_us")
    rep.add("## The cost of sharing (live, 2 routers in one process, real Redis)\n")
    rep.add(f"Offered load {med('off', 'rate'):.0f} routed requests/s alternating between two "
            f"routers, {rounds} interleaved rounds of {seconds:g} s per mode (medians); "
            "conversations of 8-32 blocks, each request in flight for "
            f"{HOLD_S * 1000:.0f} ms (`loadtest/sync_cost.py`). CPU is the process's; "
            "'routing' is the CPU of pick + record_route, the rest is publishing, reading and "
            "applying. Sharing = the mode's CPU minus sharing off's.\n")
    rep.add("| mode | CPU µs/request | sharing µs/request | of which routing | of which publish "
            "+ apply | Redis bytes in / out per request | batches/s | apply lag p50 / p99 ms |")
    rep.add("|---|---|---|---|---|---|---|---|")
    for m in modes:
        cpu, route = med(m, "cpu_us"), med(m, "route_cpu_us")
        share = "-" if m == "off" else f"{cpu - off:.1f}"
        of_route = "-" if m == "off" else f"{route - off_route:.1f}"
        of_rest = "-" if m == "off" else f"{(cpu - route) - (off - off_route):.1f}"
        rep.add(f"| {m} | {cpu:.1f} | {share} | {of_route} | {of_rest} | "
                f"{med(m, 'bytes_per_request'):.0f} / {med(m, 'bytes_out_per_request'):.0f} | "
                f"{med(m, 'batches_per_s'):.0f} | {med(m, 'lag_p50_ms'):.2f} / "
                f"{med(m, 'lag_p99_ms'):.2f} |")
    rep.add("")


# -- live: workers ------------------------------------------------------------------------------
def workers(rep: Report, n: int) -> None:
    from loadtest.sync_cost import workers_run

    with redis_server() as url:
        one = workers_run(url, 1, n)
        two = workers_run(url, 2, n)
    rep.add("## One gateway, server.workers 1 vs 2 (this 2-core machine, Redis on)\n")
    rep.add("4 simulated replicas at time scale 50 and the load generator share the cores with "
            "the gateway; non-streamed, concurrency 64, closed loop.\n")
    rep.add("| workers | requests | req/s | gateway CPU µs/request | errors |")
    rep.add("|---|---|---|---|---|")
    for w, r in ((1, one), (2, two)):
        rep.add(f"| {w} | {n} | {r[0]:.0f} | {r[1]:.0f} | {r[2]} |")
    rep.add(f"\nThroughput ratio 2 workers / 1: {two[0] / one[0]:.2f}\n")


def _check_trace(p: argparse.ArgumentParser, trace: Path) -> None:
    """A trace that cannot be read is a usage error before minutes of replays: a missing file
    left the conversation rows out without a word, a bad line was a traceback mid-run."""
    try:
        load_mooncake(str(trace))
    except (OSError, TraceError) as exc:
        p.error(f"--trace {trace}: {exc}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offline", action="store_true")
    p.add_argument("--cost", action="store_true")
    p.add_argument("--workers", action="store_true")
    p.add_argument("--trace", type=Path, default=SAMPLE_TRACE,
                   help="a Mooncake-format trace (default: the 2-minute sample in the repo)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="offline replays in parallel")
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="the folder the report and plot go to (default: loadtest/results/)")
    bench_sync_seeds.add_arguments(p)
    args = p.parse_args(argv)
    seeds = bench_sync_seeds.chosen(args)
    if seeds and not args.offline:
        p.error("--workload, --seeds, --gateway-seeds, --kv-tokens, --gateways, "
                "--sync-delay-ms and --limit go with --offline")
    out: Path = args.out
    every = not (args.offline or args.cost or args.workers)
    if every or args.offline:
        _check_trace(p, args.trace)
    rep = Report()
    rep.add("# Shared routing state: benchmark\n")
    rep.add(f"`{shown_command('loadtest.bench_sync', argv)}`\n")
    if seeds:
        bench_sync_seeds.seeds_table(rep, args)
    elif every or args.offline:
        rows = offline(rep, args.trace, args.quick, args.jobs)
        if not args.quick:  # a few minutes more: the four generated workloads, two sizes
            rows += generated(rep, args.jobs)
        out.mkdir(parents=True, exist_ok=True)
        plot(rows, out / "bench_sync_offline.png")
    if every or args.cost:
        cost(rep, 5.0 if args.quick else 20.0)
    if every or args.workers:
        workers(rep, 3000 if args.quick else 12000)
    out.mkdir(parents=True, exist_ok=True)
    parts = [n for n, on in (("seeds" if seeds else "offline", args.offline),
                             ("live", args.cost or args.workers)) if on or every]
    path = out / f"bench_sync_{'_'.join(parts)}.md"
    path.write_text("\n".join(rep.lines) + "\n")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

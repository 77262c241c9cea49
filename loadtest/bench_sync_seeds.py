"""N gateways against one over workload seeds and gateway seeds (``bench_sync --offline``).

    python -m loadtest.bench_sync --offline [--workload ITEM ...] [--seeds SEEDS]
        [--gateway-seeds SEEDS] [--kv-tokens KV[,KV]] [--gateways N] [--sync-delay-ms D]
        [--limit N] [--trace PATH] [--jobs N] [--out DIR]

Each cell is `run_offline(requests, FleetSpec(kv_tokens=KV), "cache_aware", 0.0,
gateways=GatewaySpec(N, True, D, gateway_seed))` (`loadtest.replay.cli`) against the same
requests with `GatewaySpec()` (one gateway), reported as ratios hit / TTFT p50 / TTFT p99 and
marked where they miss issue 9's target (hit >= 0.97x, p50 and p99 <= 1.05x); then the means
over each workload's runs. Simulated time: the figures do not depend on the machine.

An ITEM is ``NAME[@KV[,KV]][:SEEDS][:gGATEWAY_SEEDS]`` (``bursts@262144:14-21:g0-2``); what
it leaves out comes from ``--kv-tokens`` (default 262144,1048576), ``--seeds`` (default: the
workload's own seed) and ``--gateway-seeds`` (default 0). SEEDS is a list of numbers and
ranges: ``14-21``, ``0,2,5-6``.
NAME is a generated workload (`loadtest.replay.generators.SEEDED`), ``synthetic``
(`synthetic_multitenant` with ``SyntheticSpec(seed=s)``; 7 is ``--synthetic``'s) or
``mooncake`` / ``mooncake-1.5x`` (``--trace`` at 1x / 1.5x speed; no workload seed). Without
``--workload``: every generated workload. The table of loadtest/results/bench_sync_offline.md,
"2026-12-04: N = 4, D = 10 ms with deferred picks, today's code" is::

    python -m loadtest.bench_sync --offline --trace <the one-hour Mooncake trace> \\
        --gateway-seeds 0-2 -w mooncake@262144 -w mooncake-1.5x@262144 \\
        -w synthetic@262144:7-11:g0 -w bursts:14-21:g0 -w agent-loops -w hot-prefixes \\
        -w cold-one-offs -w rag-corpus -w skewed-tenants -w load-ramp -w heavy-tail

Written to ``bench_sync_seeds.md`` in ``--out`` (default loadtest/results/).
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loadtest.bench_overhead import Report
from loadtest.replay.cli import run_offline
from loadtest.replay.generators import DEFAULT_SEEDS, SEEDED
from loadtest.replay.offline import FleetSpec, GatewaySpec
from loadtest.replay.workload import (
    ReplayRequest,
    SyntheticSpec,
    load_mooncake,
    synthetic_multitenant,
)

__all__ = ["Item", "Row", "add_arguments", "chosen", "item", "requests", "seed_list",
           "seeds_table"]

KV_SIZES = (262_144, 1_048_576)
HIT_MIN, P50_MAX, P99_MAX = 0.97, 1.05, 1.05  # issue 9's target at N = 4, D = 10 ms
SYNTHETIC_SEED = SyntheticSpec().seed


def seed_list(text: str) -> tuple[int, ...]:
    """``"14-21"`` -> 14, 15, ..., 21; ``"0,2,5-6"`` -> 0, 2, 5, 6."""
    out: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"not a seed list: {text!r} (e.g. 14-21 or 0,2,5-6)")
        out += range(int(lo), int(hi) + 1) if dash else [int(lo)]
    return tuple(out)


def _kv_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of KV sizes: {text!r}") from None


@dataclass(frozen=True, slots=True)
class Item:
    """One workload of the table; None: the command's ``--kv-tokens`` / ``--seeds`` / ..."""

    name: str
    kv: tuple[int, ...] | None = None
    seeds: tuple[int, ...] | None = None
    gateway_seeds: tuple[int, ...] | None = None


def _rate(name: str) -> float | None:
    """A Mooncake item's rate scale (``mooncake`` 1.0, ``mooncake-1.5x`` 1.5), else None."""
    if name == "mooncake":
        return 1.0
    if name.startswith("mooncake-") and name.endswith("x"):
        try:
            return float(name[len("mooncake-"):-1])
        except ValueError:
            return None
    return None


def item(text: str) -> Item:
    """``NAME[@KV[,KV]][:SEEDS][:gGATEWAY_SEEDS]``, e.g. ``bursts@262144:14-21:g0-2``."""
    head, *parts = text.split(":")
    name, _, kv = head.partition("@")
    if name not in SEEDED and name != "synthetic" and _rate(name) is None:
        known = ", ".join([*SEEDED, "synthetic", "mooncake", "mooncake-1.5x"])
        raise argparse.ArgumentTypeError(f"no workload {name!r} (known: {known})")
    seeds = [seed_list(x) for x in parts if not x.startswith("g")]
    gseeds = [seed_list(x[1:]) for x in parts if x.startswith("g")]
    if len(seeds) > 1 or len(gseeds) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one list of seeds and one of gateway seeds")
    if seeds and _rate(name) is not None:
        raise argparse.ArgumentTypeError(f"{name}: the trace has no workload seed")
    return Item(name, _kv_list(kv) if kv else None, seeds[0] if seeds else None,
                gseeds[0] if gseeds else None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--offline over seeds (loadtest/bench_sync_seeds.py)")
    g.add_argument("--workload", "-w", type=item, action="append", metavar="ITEM",
                   help="NAME[@KV[,KV]][:SEEDS][:gGATEWAY_SEEDS], repeatable")
    g.add_argument("--seeds", type=seed_list, help="workload seeds, e.g. 14-21")
    g.add_argument("--gateway-seeds", type=seed_list, help="gateway seeds, e.g. 0-2 (default 0)")
    g.add_argument("--kv-tokens", type=_kv_list, help="KV tokens per replica, e.g. 262144,1048576")
    g.add_argument("--gateways", type=int, help="gateways against one (default 4)")
    g.add_argument("--sync-delay-ms", type=float, help="records this much late (default 10)")
    g.add_argument("--limit", type=int, help="each workload's first N requests")


def chosen(args: argparse.Namespace) -> bool:
    """Whether the command asks for the table over seeds."""
    return any(getattr(args, k) is not None for k in
               ("workload", "seeds", "gateway_seeds", "kv_tokens", "gateways", "sync_delay_ms",
                "limit"))


def requests(name: str, seed: int | None, trace: Path | None,
             limit: int | None = None) -> list[ReplayRequest]:
    rate = _rate(name)
    if rate is not None:
        assert trace is not None
        return load_mooncake(str(trace), rate_scale=rate, limit=limit)
    assert seed is not None
    if name == "synthetic":
        reqs = synthetic_multitenant(SyntheticSpec(seed=seed))
    else:
        reqs = SEEDED[name](seed)
    return reqs[:limit] if limit is not None else reqs


# workload, workload seed, KV tokens, gateways, gateway seed, sync delay s, trace, limit
_Job = tuple[str, int | None, int, int, int, float, Path | None, int | None]


def _run(job: _Job) -> dict[str, float]:
    name, seed, kv, n, gseed, delay, trace, limit = job
    spec = GatewaySpec(n, True, delay, gseed) if n > 1 else GatewaySpec()
    out = run_offline(requests(name, seed, trace, limit), FleetSpec(kv_tokens=kv),
                      "cache_aware", 0.0, gateways=spec)
    return {k: float(out[k]) for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s")}  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Row:
    label: str  # the workload, with its KV size when it runs at several
    seed: int | None
    gateway_seed: int
    ratios: tuple[float, float, float]  # hit, TTFT p50, TTFT p99 x one gateway
    one: dict[str, float]  # one gateway's figures on the same requests

    @property
    def misses(self) -> list[str]:
        hit, p50, p99 = self.ratios
        return [k for k, bad in (("hit", hit < HIT_MIN), ("p50", p50 > P50_MAX),
                                 ("p99", p99 > P99_MAX)) if bad]


def _label(name: str, kv: int, sizes: int) -> str:
    rate = _rate(name)
    base = (f"Mooncake {name[len('mooncake-'):] if rate != 1.0 else '1x'}" if rate is not None
            else "synthetic (`--synthetic`)" if name == "synthetic" else name)
    return f"{base} {kv // 1024}k" if sizes > 1 else base


def seeds_table(rep: Report, args: argparse.Namespace) -> list[Row]:
    """Replay every cell and its one-gateway base once, add the table and the means."""
    items = args.workload or [Item(name) for name in SEEDED]
    n = 4 if args.gateways is None else args.gateways
    delay_ms = 10.0 if args.sync_delay_ms is None else args.sync_delay_ms
    cells: list[tuple[str, _Job, _Job]] = []  # label, N gateways, one gateway
    for it in items:
        sizes = it.kv or args.kv_tokens or KV_SIZES
        trace = args.trace if _rate(it.name) is not None else None
        if trace is not None and not trace.exists():  # before an hour of other replays
            raise SystemExit(f"bench_sync: {it.name} needs --trace (a Mooncake-format trace)")
        if _rate(it.name) is not None:
            seeds: tuple[int | None, ...] = (None,)
        else:
            default = SYNTHETIC_SEED if it.name == "synthetic" else DEFAULT_SEEDS[it.name]
            seeds = it.seeds or args.seeds or (default,)
        for kv in sizes:
            for seed in seeds:
                one: _Job = (it.name, seed, kv, 1, 0, 0.0, trace, args.limit)
                cells += [(_label(it.name, kv, len(sizes)),
                           (it.name, seed, kv, n, g, delay_ms / 1000,
                            trace, args.limit), one)
                          for g in it.gateway_seeds or args.gateway_seeds or (0,)]
    jobs = list(dict.fromkeys(j for _, many, one in cells for j in (one, many)))
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            got = dict(zip(jobs, pool.map(_run, jobs), strict=True))
    else:
        got = {j: _run(j) for j in jobs}
    rows = [Row(label, many[1], many[4],
                (got[many]["hit_rate"] / max(got[one]["hit_rate"], 1e-9),
                 got[many]["ttft_p50_s"] / got[one]["ttft_p50_s"],
                 got[many]["ttft_p99_s"] / got[one]["ttft_p99_s"]), got[one])
            for label, many, one in cells]
    _markdown(rep, rows, n, delay_ms)
    return rows


def _markdown(rep: Report, rows: list[Row], n: int, delay_ms: float) -> None:
    rep.add(f"## N = {n}, D = {delay_ms:g} ms against one gateway "
            "over workload and gateway seeds\n")
    rep.add("Ratios x one gateway on the same requests; bold: past the target (hit < "
            f"{HIT_MIN}x, p50 or p99 > {P50_MAX}x).\n")
    rep.add("| workload | workload seed | gateway seed | hit | p50 | p99 | "
            "1 gw hit / p50 / p99 s | target |")
    rep.add("|---|---|---|---|---|---|---|---|")
    for r in rows:
        shown = [f"**{x:.3f}**" if k in r.misses else f"{x:.3f}"
                 for k, x in zip(("hit", "p50", "p99"), r.ratios, strict=True)]
        base = (f"{r.one['hit_rate']:.4f} / {r.one['ttft_p50_s']:.3f} / "
                f"{r.one['ttft_p99_s']:.3f}")
        target = f"miss: {', '.join(r.misses)}" if r.misses else "met"
        rep.add(f"| {r.label} | {'-' if r.seed is None else r.seed} | {r.gateway_seed} | "
                f"{' | '.join(shown)} | {base} | {target} |")
    rep.add("\nMeans over the runs of each workload (worst run in brackets):\n")
    rep.add("| workload | runs | hit mean (min) | p50 mean (worst) | p99 mean (worst) |")
    rep.add("|---|---|---|---|---|")
    for label in dict.fromkeys(r.label for r in rows):
        mine = [r.ratios for r in rows if r.label == label]
        hit, p50, p99 = ([x[i] for x in mine] for i in range(3))
        rep.add(f"| {label} | {len(mine)} | {statistics.mean(hit):.3f} ({min(hit):.3f}) | "
                f"{statistics.mean(p50):.3f} ({max(p50):.3f}) | "
                f"{statistics.mean(p99):.3f} ({max(p99):.3f}) |")
    rep.add("")

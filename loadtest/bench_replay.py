"""Routing quality benchmark: every policy and yardstick on the same workloads, offline.

    python -m loadtest.bench_replay [--trace PATH] [--limit N] [--only NAME ...] [--jobs 2]
                                    [--seeds N]
    python -m loadtest.bench_replay --render loadtest/results/routing.json   # report only
    python -m loadtest.bench_replay --render loadtest/results/routing.json --refresh-reference \
                                    [--trace PATH]   # each row's pooled reference again
    python -m loadtest.bench_replay --policies cache_aware --merge loadtest/results/routing.json
                                    # re-run one policy, the other rows from an earlier run

Workloads (8 simulated replicas sized like an 8B model on one H100): the Mooncake conversation
trace at its own arrival rate and at 1.5x, the synthetic multi-tenant workload (`kvgate replay
--synthetic`), and the generated shapes the trace lacks (`loadtest.replay.generators`: hot
shared prefixes, agent loops, cold one-offs, bursts; and `loadtest.replay.shapes` and `trees`,
which routing was not tuned on: a large RAG corpus, a skewed tenant mix, a load ramp,
heavy-tailed prompt lengths, long documents read by many, prefixes shared at several depths;
and `loadtest.replay.mixes`: one prompt salted per tenant, decode-heavy beside prefill-heavy),
each at 262,144 and 1,048,576 KV tokens per replica. The synthetic workload is drawn
with 5 seeds and the generated ones with 3, and every figure of theirs is the mean over
the seeds (the synthetic workload has 576 requests: its
TTFT p99 is its 6th-slowest request, decided by two or three cold starts); the report also
gives each policy's median and range of p99 over the seeds. Policies: the registry's, the
peers' published rules re-implemented (`routing.policies.YARDSTICKS`) and the oracle
(`loadtest.replay.oracle`), against which every row is compared. Then cache_aware under other
load factors, and several gateways sharing state (N = 4, records 10 ms late) against one.
Writes `routing.md`, `routing.json` and `routing.png` (one row of plots per workload) to
``--out``.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import orjson

from loadtest.replay.cli import run_offline
from loadtest.replay.generators import DEFAULT_SEEDS, SEEDED
from loadtest.replay.offline import FleetSpec, GatewaySpec
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.summary import against_oracle, percentile
from loadtest.replay.workload import (
    ReplayRequest,
    SyntheticSpec,
    load_mooncake,
    synthetic_multitenant,
)
from routing.policies import REGISTRY, YARDSTICKS

POLICIES = (*REGISTRY, *YARDSTICKS, "oracle")
KV_SIZES = (262_144, 1_048_576)
LOAD_FACTORS = (1.25, 2.0, 4.0)
SYNTHETIC_SEEDS, GENERATED_SEEDS = 5, 3  # workload seeds: the spec's default, then +1, +2, ...
# averaged over a workload's seeds (the rest of a row is its first seed's)
MEAN_OF = ("requests", "hit_rate", "pooled_reference_hit_rate", "hit_rate_vs_reference",
           "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "max_over_mean_inflight",
           "preemptions")
# the 2-minute sample shipped in the repo; the whole hour (loadtest/data/README.md) with --trace
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_sample.jsonl"
Row = dict[str, object]
Task = tuple["Scenario", str, Path, int | None, float | None, int]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    kv_tokens: int
    source: str  # "mooncake", "synthetic" or a generator's name
    rate_scale: float = 1.0
    seed: int | None = None  # the workload's seed (generated ones); None: the trace


def scenarios(seeds: int | None = None) -> list[Scenario]:
    """Every workload; the synthetic and generated ones once per seed (``seeds`` of each, or
    `SYNTHETIC_SEEDS` and `GENERATED_SEEDS`), all seeds of one under the same name."""
    first = SyntheticSpec().seed
    out = [
        Scenario("mooncake-1x", 262_144, "mooncake"),
        Scenario("mooncake-1.5x", 262_144, "mooncake", 1.5),
        *(Scenario("synthetic", 262_144, "synthetic", seed=first + k)
          for k in range(seeds or SYNTHETIC_SEEDS)),
    ]
    for name, first in DEFAULT_SEEDS.items():
        out += [Scenario(f"{name}-{kv // 1024}k", kv, name, seed=first + k)
                for kv in KV_SIZES for k in range(seeds or GENERATED_SEEDS)]
    return out


def requests(s: Scenario, trace: Path, limit: int | None) -> list[ReplayRequest]:
    if s.source == "mooncake":
        return load_mooncake(trace, rate_scale=s.rate_scale, limit=limit)
    assert s.seed is not None
    if s.source == "synthetic":
        reqs = synthetic_multitenant(SyntheticSpec(seed=s.seed))
    else:
        reqs = SEEDED[s.source](s.seed)
    if s.rate_scale != 1.0:
        reqs = [replace(r, arrival_s=r.arrival_s / s.rate_scale) for r in reqs]
    return reqs[:limit] if limit else reqs


def _one(task: Task) -> Row:
    """One replay (a worker process): scenario, policy, load factor, gateways."""
    s, policy, trace, limit, load_factor, gateways = task
    reqs = requests(s, trace, limit)
    fleet = FleetSpec(kv_tokens=s.kv_tokens)
    ref = pooled_reference_hit_rate(reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
    t0 = time.perf_counter()
    spec = GatewaySpec(gateways, True, 0.010) if gateways > 1 else None
    row = run_offline(reqs, fleet, policy, ref, load_factor=load_factor, gateways=spec)
    row.update(scenario=s.name, kv_tokens=s.kv_tokens, seed=s.seed,
               wall_s=round(time.perf_counter() - t0, 1))
    print(f"{s.name:>18} {s.seed or '':>3} {policy:>16} c={load_factor or '-'} gw={gateways}  "
          f"hit {row['hit_rate']}  p50 {row['ttft_p50_s']}  p99 {row['ttft_p99_s']}  "
          f"({row['wall_s']} s)", flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, object]:
    chosen = [s for s in scenarios(args.seeds) if not args.only or s.name in args.only]
    policies = args.policies or POLICIES
    tasks: list[Task] = [(s, p, args.trace, args.limit, None, 1) for s in chosen for p in policies]
    moon = next((s for s in chosen if s.name == "mooncake-1x"), None)
    shared = [s for s in chosen if s.name in ("mooncake-1x", "mooncake-1.5x", "synthetic")]
    if "cache_aware" in policies:  # its load factors, and several gateways
        if moon is not None:
            tasks += [(moon, "cache_aware", args.trace, args.limit, c, 1) for c in LOAD_FACTORS]
        tasks += [(s, "cache_aware", args.trace, args.limit, None, 4) for s in shared]
    # the slowest first, so the pool ends together
    tasks.sort(key=lambda t: (t[0].source != "mooncake", t[0].source != "agent-loops"))
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(_one, tasks))
    # one row per (workload, policy, load factor, gateways): the mean over the workload's seeds
    seeds: dict[tuple[str, str, float | None, int], list[Row]] = {}
    for task, row in zip(tasks, rows, strict=True):
        seeds.setdefault((task[0].name, task[1], task[4], task[5]), []).append(row)
    by_scenario: dict[str, list[Row]] = {}
    sweep, gateways = [], []
    for (name, _, load_factor, n), group in seeds.items():
        row = mean_row(group)
        if load_factor is not None:
            sweep.append(row)
        elif n > 1:
            gateways.append(row)
        else:
            by_scenario.setdefault(name, []).append(row)
    doc: dict[str, object] = {
        "scenarios": {name: by_scenario[name] for name in dict.fromkeys(s.name for s in chosen)},
        "load_factor_sweep": sweep, "gateways": gateways}
    if args.merge:
        doc = merged(orjson.loads(args.merge.read_bytes()), doc, set(policies))
    scenarios_ = doc["scenarios"]
    assert isinstance(scenarios_, dict)
    for group in scenarios_.values():
        group.sort(key=lambda r: POLICIES.index(str(r["policy"])))
        against_oracle(group)
    return doc


def merged(old: dict[str, object], new: dict[str, object], rerun: set[str]) -> dict[str, object]:
    """An earlier run's report with the rows of the ``rerun`` policies replaced by ``new``'s
    on the workloads ``new`` ran (the load-factor sweep's and several gateways' rows too, those
    of the workloads ``new`` ran, when cache_aware was re-run; the others kept). Only for the
    same trace and seeds: the rows are compared with each other as they stand."""
    out_scenarios: dict[str, list[Row]] = {}
    old_s, new_s = old["scenarios"], new["scenarios"]
    assert isinstance(old_s, dict) and isinstance(new_s, dict)
    for name in dict.fromkeys([*old_s, *new_s]):
        if name not in new_s:
            out_scenarios[name] = list(old_s[name])
            continue
        kept = [r for r in old_s.get(name, []) if r["policy"] not in rerun]
        out_scenarios[name] = kept + list(new_s[name])
    out = {**old, "scenarios": out_scenarios}
    if "cache_aware" in rerun:
        order = list(out_scenarios)
        for key in ("load_factor_sweep", "gateways"):
            old_rows, new_rows = old.get(key, []), new[key]
            assert isinstance(old_rows, list) and isinstance(new_rows, list)
            kept = [r for r in old_rows if r["scenario"] not in new_s]
            rows = kept + new_rows  # in the workloads' order, each one's rows as they came
            out[key] = sorted(rows, key=lambda r: order.index(r["scenario"])
                              if r["scenario"] in order else len(order))
    return out


def mean_row(rows: list[Row]) -> Row:
    """One policy's replays of the seeds of one workload as one row: `MEAN_OF` averaged, each
    seed's value kept under ``per_seed``, the rest as in the first seed's row."""
    out = dict(rows[0])
    out["seeds"] = [r["seed"] for r in rows]
    out["wall_s"] = round(sum(float(str(r["wall_s"])) for r in rows), 1)
    per_seed: dict[str, list[float]] = {}
    for key in MEAN_OF:
        per_seed[key] = [float(str(r[key])) for r in rows]
        out[key] = round(sum(per_seed[key]) / len(rows), 4)
    out["per_seed"] = per_seed
    return out


def _f(value: object, digits: int = 4) -> str:
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def markdown(doc: dict[str, object]) -> str:
    fleet = FleetSpec()
    lines = [
        "# Routing quality (offline replay)",
        "",
        f"{fleet.replicas} replicas, profile `{fleet.profile}`, KV tokens per replica as named; "
        "hit rate from the engines' prefix-cache counters (each request once, at its first "
        "admission, as vLLM counts); *pooled* = one LRU holding the "
        "whole fleet's KV memory on the same request order; *oracle* = the yardstick that "
        "reads the engines' true caches and queues (least true TTFT, same load bound). "
        "Peers' rules re-implemented from their documentation (`sglang_style`, `llmd_style`). "
        "Times are simulated seconds. `python -m loadtest.bench_replay`.",
        "",
    ]
    scenarios_ = doc["scenarios"]
    assert isinstance(scenarios_, dict)
    for name, rows in scenarios_.items():
        seeds = rows[0].get("seeds") or [None]
        several = len(seeds) > 1
        lines += [f"## {name}", ""]
        if several:
            lines += [f"Means over {len(seeds)} workload seeds "
                      f"({', '.join(str(x) for x in seeds)}); the last column: each policy's "
                      "TTFT p99 median over the seeds [lowest, highest].", ""]
        extra = (" | p99 median [range] s", "|---") if several else ("", "")
        lines += [
            "| policy | hit rate | vs pooled | vs oracle | TTFT p50 s | TTFT p99 s "
            f"| p99 vs oracle | e2e p99 s | max/mean in-flight | preemptions{extra[0]} |",
            f"|---|---|---|---|---|---|---|---|---|---{extra[1]}|",
        ]
        for r in rows:
            spread = f" | {_spread(r)}" if several else ""
            lines.append(
                f"| {r['policy']} | {_f(r['hit_rate'])} | {_f(r['hit_rate_vs_reference'])} "
                f"| {_f(r.get('hit_rate_vs_oracle'))} | {_f(r['ttft_p50_s'])} "
                f"| {_f(r['ttft_p99_s'])} | {_f(r.get('ttft_p99_vs_oracle'))} "
                f"| {_f(r['e2e_p99_s'])} | {_f(r['max_over_mean_inflight'])} "
                f"| {_f(r['preemptions'])}{spread} |"
            )
        lines.append("")
    sweep = doc["load_factor_sweep"]
    assert isinstance(sweep, list)
    if sweep:
        lines += [
            "## cache_aware: bounded-load factor c (mooncake-1x, slack as configured)",
            "",
            "| c | hit rate | vs pooled | TTFT p50 s | TTFT p99 s | max/mean in-flight "
            "| bound violations |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sweep:
            bound = r["load_bound"]
            assert isinstance(bound, dict)
            lines.append(
                f"| {bound['factor']} | {r['hit_rate']} | {r['hit_rate_vs_reference']} "
                f"| {r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['max_over_mean_inflight']} "
                f"| {bound['violations']} |"
            )
        lines.append("")
    lines += _gateways_markdown(doc)
    lines += _targets_markdown(doc)
    return "\n".join(lines)


def _spread(row: Row) -> str:
    per_seed = row["per_seed"]
    assert isinstance(per_seed, dict)
    p99 = per_seed["ttft_p99_s"]
    return f"{_f(percentile(p99, 50))} [{_f(min(p99))}, {_f(max(p99))}]"


def targets(rows: list[Row], me: str = "cache_aware") -> dict[str, object]:
    """Issue 11's targets on one workload: ``me`` against the oracle (hit >= 0.95x, TTFT p99
    <= 1.1x) and against every other deployable policy or peer rule (best hit, p50, p99)."""
    mine = next(r for r in rows if r["policy"] == me)
    others = [r for r in rows if r["policy"] not in (me, "oracle")]

    def best(key: str, higher: bool) -> tuple[bool, str]:
        if not others:
            return True, ""
        sign = 1.0 if higher else -1.0
        top = max(others, key=lambda r: sign * float(str(r[key])))
        ok = sign * float(str(mine[key])) >= sign * float(str(top[key]))
        return ok, f"{top['policy']} {_f(top[key])}"

    hit, p50, p99 = best("hit_rate", True), best("ttft_p50_s", False), best("ttft_p99_s", False)
    vs_hit, vs_p99 = mine.get("hit_rate_vs_oracle"), mine.get("ttft_p99_vs_oracle")
    return {
        "hit_vs_oracle": vs_hit,
        "hit_vs_oracle_ok": vs_hit is not None and float(str(vs_hit)) >= 0.95,
        "p99_vs_oracle": vs_p99,
        "p99_vs_oracle_ok": vs_p99 is not None and float(str(vs_p99)) <= 1.1,
        "best_hit": hit[0], "best_other_hit": hit[1], "best_p50": p50[0],
        "best_other_p50": p50[1], "best_p99": p99[0], "best_other_p99": p99[1],
    }


def _targets_markdown(doc: dict[str, object]) -> list[str]:
    scenarios_ = doc["scenarios"]
    assert isinstance(scenarios_, dict)
    yes = {True: "yes", False: "**no**"}
    lines = [
        "## Targets (issue 11): cache_aware vs the oracle and the best other policy",
        "",
        "Best other = the best of every deployable policy and peer rule but cache_aware "
        "(the oracle excluded).",
        "",
        "| workload | hit / oracle (>= 0.95) | p99 / oracle (<= 1.1) | best hit | best other hit "
        "| best p50 | best other p50 | best p99 | best other p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in scenarios_.items():
        if not any(r["policy"] == "cache_aware" for r in rows):
            continue
        t = targets(rows)
        lines.append(
            f"| {name} | {_f(t['hit_vs_oracle'])} {yes[bool(t['hit_vs_oracle_ok'])]} "
            f"| {_f(t['p99_vs_oracle'])} {yes[bool(t['p99_vs_oracle_ok'])]} "
            f"| {yes[bool(t['best_hit'])]} | {t['best_other_hit']} "
            f"| {yes[bool(t['best_p50'])]} | {t['best_other_p50']} "
            f"| {yes[bool(t['best_p99'])]} | {t['best_other_p99']} |")
    return [*lines, ""]


def _gateways_markdown(doc: dict[str, object]) -> list[str]:
    rows, scenarios_ = doc["gateways"], doc["scenarios"]
    assert isinstance(rows, list) and isinstance(scenarios_, dict)
    if not rows:
        return []
    lines = [
        "## Several gateways (cache_aware, 4 gateways sharing state, records 10 ms late)",
        "",
        "| workload | gateways | hit rate | TTFT p50 s | TTFT p99 s | hit / one | p50 / one "
        "| p99 / one |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one = next(x for x in scenarios_[r["scenario"]] if x["policy"] == "cache_aware")
        lines.append(f"| {r['scenario']} | 1 | {one['hit_rate']} | {one['ttft_p50_s']} "
                     f"| {one['ttft_p99_s']} | | | |")
        ratios = [float(str(r[k])) / max(1e-9, float(str(one[k])))
                  for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s")]
        lines.append(f"| | 4 | {r['hit_rate']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | "
                     + " | ".join(f"{x:.3f}" for x in ratios) + " |")
    return [*lines, ""]


def plot(doc: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios_ = doc["scenarios"]
    assert isinstance(scenarios_, dict)
    metrics = [("hit_rate_vs_reference", "hit rate / pooled"), ("ttft_p50_s", "TTFT p50 (s)"),
               ("ttft_p99_s", "TTFT p99 (s)"), ("e2e_p99_s", "e2e p99 (s)")]
    fig, axes = plt.subplots(len(scenarios_), len(metrics),
                             figsize=(16, 2.6 * len(scenarios_)), squeeze=False)
    for i, (name, rows) in enumerate(scenarios_.items()):
        names = [str(r["policy"]) for r in rows]
        for j, (metric, title) in enumerate(metrics):
            ax = axes[i][j]
            values = [float(str(r[metric])) for r in rows]
            colors = ["tab:red" if n == "cache_aware" else "tab:gray" if n == "oracle"
                      else "tab:blue" for n in names]
            ax.barh(names, values, color=colors)
            for k, v in enumerate(values):
                ax.text(v, k, f" {v:.3g}", va="center", fontsize=6)
            ax.set_xlim(0, max(values) * 1.25 or 1.0)
            ax.set_title(f"{name}: {title}", fontsize=9)
            ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def refresh_reference(doc: dict[str, object], trace: Path, limit: int | None) -> None:
    """Each row's pooled reference computed again (the replays' own figures kept): for a
    fix of the reference alone, which needs no replay. Rows are matched to their workload by
    name and seeds; a row whose reference changed gets ``hit_rate_vs_reference`` as its seeds'
    hit / reference averaged, as `mean_row` does (from the rounded hit rates kept)."""
    known = {(s.name, s.seed): s for s in scenarios()}
    refs: dict[tuple[str, int | None], float] = {}

    def ref(name: str, seed: int | None) -> float:
        if (name, seed) not in refs:
            s = known.get((name, seed)) or Scenario(name, 0, "?")
            assert s.source != "?", f"{name} seed {seed}: not a workload of this benchmark"
            reqs = requests(s, trace, limit)
            fleet = FleetSpec(kv_tokens=s.kv_tokens)
            refs[(name, seed)] = pooled_reference_hit_rate(
                reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
        return refs[(name, seed)]

    scenarios_ = doc["scenarios"]
    sweep, gateways = doc.get("load_factor_sweep", []), doc.get("gateways", [])
    assert isinstance(scenarios_, dict) and isinstance(sweep, list) and isinstance(gateways, list)
    for row in [*(r for rows in scenarios_.values() for r in rows), *sweep, *gateways]:
        seeds = row.get("seeds") or [row.get("seed")]
        per = row.get("per_seed") or {"hit_rate": [row["hit_rate"]]}
        values = [ref(str(row["scenario"]), seed) for seed in seeds]
        if [round(v, 4) for v in values] == per.get("pooled_reference_hit_rate",
                                                    [row["pooled_reference_hit_rate"]]):
            continue  # the same reference: the row as it was (its ratios from unrounded hits)
        ratios = [h / v if v else 0.0 for h, v in zip(per["hit_rate"], values, strict=True)]
        row["pooled_reference_hit_rate"] = round(sum(values) / len(values), 4)
        row["hit_rate_vs_reference"] = round(sum(ratios) / len(ratios), 4)
        if "per_seed" in row:
            per["pooled_reference_hit_rate"] = [round(v, 4) for v in values]
            per["hit_rate_vs_reference"] = [round(x, 4) for x in ratios]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_replay",
                                description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="a Mooncake-format trace (default: the 2-minute sample, "
                        "loadtest/data/mooncake_sample.jsonl; the whole hour: see "
                        "loadtest/data/README.md)")
    p.add_argument("--limit", type=int, help="replay only the first N requests of each")
    p.add_argument("--only", nargs="*", help="these workloads only (names as in the report)")
    p.add_argument("--jobs", type=int, default=2, help="replays in parallel")
    p.add_argument("--seeds", type=int, help="seeds per synthetic or generated workload "
                   f"(default {SYNTHETIC_SEEDS} synthetic, {GENERATED_SEEDS} generated)")
    p.add_argument("--policies", nargs="*", choices=POLICIES, metavar="POLICY",
                   help="these policies only (default: every one)")
    p.add_argument("--merge", type=Path, metavar="JSON", help="take the other policies' rows "
                   "from this earlier routing.json (the same trace and seeds)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="no replays: write the report and plot again from a routing.json")
    p.add_argument("--refresh-reference", action="store_true",
                   help="with --render: compute each row's pooled reference again first")
    args = p.parse_args()
    doc = orjson.loads(args.render.read_bytes()) if args.render else run(args)
    if args.refresh_reference:
        if not args.render:
            p.error("--refresh-reference goes with --render JSON")
        refresh_reference(doc, args.trace, args.limit)
    by_scenario = doc["scenarios"]
    assert isinstance(by_scenario, dict)
    doc["targets"] = {name: targets(rows) for name, rows in by_scenario.items()
                      if any(r["policy"] == "cache_aware" for r in rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (args.out / "routing.md").write_text(markdown(doc))
    plot(doc, args.out / "routing.png")
    print(f"wrote {args.out}/routing.md, routing.json, routing.png")


if __name__ == "__main__":
    main()

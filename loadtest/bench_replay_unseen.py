"""Routing quality on the unseen shapes (`loadtest.replay.unseen`): every policy, offline.

    python -m loadtest.bench_replay_unseen [--only NAME ...] [--seeds N] [--jobs 1]
                                           [--gateway-seeds K] [--merge JSON]
    python -m loadtest.bench_replay_unseen --render loadtest/results/routing_unseen.json

The same replays, columns and targets as `loadtest.bench_replay` (8 replicas, 262,144 and
1,048,576 KV tokens, every policy, the peers' rules and the oracle), on shapes kept out of its
matrix so that its report and merges stay as they are; and, when cache_aware runs, cache_aware
through 4 gateways sharing state with records 10 ms late against one gateway (issue 9's
target), each workload seed spread over the gateways ``--gateway-seeds`` ways (a single
spread's tail moves by a few per cent). Writes `routing_unseen.md`, `.json` and `.png` to
``--out``.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import orjson

from loadtest.bench_replay import (
    KV_SIZES,
    POLICIES,
    Row,
    markdown,
    mean_row,
    merged,
    plot,
    targets,
)
from loadtest.replay.cli import run_offline
from loadtest.replay.offline import FleetSpec, GatewaySpec
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.summary import against_oracle
from loadtest.replay.unseen import UNSEEN_SEEDED, UNSEEN_SEEDS

GATEWAYS, SYNC_DELAY_S = 4, 0.010  # issue 9's target: N = 4, records 10 ms late
# scenario, workload, KV tokens, seed, policy, gateways, gateway seed
Task = tuple[str, str, int, int, str, int, int]


def tasks(only: list[str] | None, seeds: int, policies: tuple[str, ...],
          gateway_seeds: int = 0) -> list[Task]:
    """Every (row, seed, policy) replay; with ``gateway_seeds`` and cache_aware, also its
    replays through `GATEWAYS` gateways, each seed spread over them that many ways."""
    out: list[Task] = []
    for name, first in UNSEEN_SEEDS.items():
        for kv in KV_SIZES:
            scenario = f"{name}-{kv // 1024}k"
            if only and scenario not in only and name not in only:
                continue
            out += [(scenario, name, kv, first + k, p, 1, 0)
                    for k in range(seeds) for p in policies]
            if "cache_aware" in policies:
                out += [(scenario, name, kv, first + k, "cache_aware", GATEWAYS, g)
                        for k in range(seeds) for g in range(gateway_seeds)]
    return out


def _one(task: Task) -> Row:
    scenario, name, kv, seed, policy, gateways, gateway_seed = task
    reqs = UNSEEN_SEEDED[name](seed)
    fleet = FleetSpec(kv_tokens=kv)
    ref = pooled_reference_hit_rate(reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
    spec = (GatewaySpec(gateways, True, SYNC_DELAY_S, gateway_seed) if gateways > 1
            else None)
    t0 = time.perf_counter()
    row = run_offline(reqs, fleet, policy, ref, gateways=spec)
    row.update(scenario=scenario, kv_tokens=kv, seed=seed,
               wall_s=round(time.perf_counter() - t0, 1))
    print(f"{scenario:>22} {seed:>3} {policy:>16} gw={gateways}/{gateway_seed}  "
          f"hit {row['hit_rate']}  p50 {row['ttft_p50_s']}  p99 {row['ttft_p99_s']}  "
          f"({row['wall_s']} s)", flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, object]:
    policies = tuple(args.policies or POLICIES)
    todo = tasks(args.only, args.seeds, policies, args.gateway_seeds)
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(_one, todo))
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for task, row in zip(todo, rows, strict=True):
        groups.setdefault((task[0], task[4], task[5]), []).append(row)
    by_scenario: dict[str, list[Row]] = {}
    gateways: list[Row] = []
    for (scenario, _, n), group in groups.items():
        row = mean_row(group)
        if n > 1:
            row["gateway_seeds"] = sorted({int(str(r["gateway_seed"])) for r in group})
            gateways.append(row)
        else:
            by_scenario.setdefault(scenario, []).append(row)
    doc: dict[str, object] = {"scenarios": by_scenario, "load_factor_sweep": [],
                              "gateways": gateways}
    if args.merge:
        doc = merged(orjson.loads(args.merge.read_bytes()), doc, set(policies))
    scenarios_ = doc["scenarios"]
    assert isinstance(scenarios_, dict)
    for group in scenarios_.values():
        group.sort(key=lambda r: POLICIES.index(str(r["policy"])))
        against_oracle(group)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_replay_unseen",
                                description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="these workloads or rows only (e.g. long-pauses, "
                   "long-pauses-256k)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per workload (default 2)")
    p.add_argument("--jobs", type=int, default=1, help="replays in parallel")
    p.add_argument("--policies", nargs="*", choices=POLICIES, metavar="POLICY")
    p.add_argument("--gateway-seeds", type=int, default=2,
                   help=f"cache_aware through {GATEWAYS} gateways, each workload seed spread "
                        "this many ways (default 2; 0: no several-gateways rows)")
    p.add_argument("--merge", type=Path, metavar="JSON", help="the other policies' rows (and "
                   "the other workloads') from this earlier routing_unseen.json")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--render", type=Path, metavar="JSON", help="no replays: the report again")
    args = p.parse_args()
    doc = orjson.loads(args.render.read_bytes()) if args.render else run(args)
    scenarios_ = doc["scenarios"]
    assert isinstance(scenarios_, dict)
    doc["targets"] = {name: targets(rows) for name, rows in scenarios_.items()
                      if any(r["policy"] == "cache_aware" for r in rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_unseen.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    text = markdown(doc).replace("# Routing quality (offline replay)",
                                 "# Routing quality on unseen shapes (offline replay)", 1)
    text = text.replace("`python -m loadtest.bench_replay`",
                        "`python -m loadtest.bench_replay_unseen`", 1)
    (args.out / "routing_unseen.md").write_text(text)
    plot(doc, args.out / "routing_unseen.png")
    print(f"wrote {args.out}/routing_unseen.md, .json, .png")


if __name__ == "__main__":
    main()

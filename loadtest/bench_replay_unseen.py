"""Routing quality on the unseen shapes (`loadtest.replay.unseen`): every policy, offline.

    python -m loadtest.bench_replay_unseen [--only NAME ...] [--seeds N] [--jobs 1]
    python -m loadtest.bench_replay_unseen --render loadtest/results/routing_unseen.json

The same replays, columns and targets as `loadtest.bench_replay` (8 replicas, 262,144 and
1,048,576 KV tokens, every policy, the peers' rules and the oracle), on shapes kept out of its
matrix so that its report and merges stay as they are. Writes `routing_unseen.md`, `.json` and
`.png` to ``--out``.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import orjson

from loadtest.bench_replay import KV_SIZES, POLICIES, Row, markdown, mean_row, plot, targets
from loadtest.replay.cli import run_offline
from loadtest.replay.offline import FleetSpec
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.summary import against_oracle
from loadtest.replay.unseen import UNSEEN_SEEDED, UNSEEN_SEEDS

Task = tuple[str, str, int, int, str]  # scenario, workload, KV tokens, seed, policy


def tasks(only: list[str] | None, seeds: int, policies: tuple[str, ...]) -> list[Task]:
    out: list[Task] = []
    for name, first in UNSEEN_SEEDS.items():
        for kv in KV_SIZES:
            scenario = f"{name}-{kv // 1024}k"
            if only and scenario not in only and name not in only:
                continue
            out += [(scenario, name, kv, first + k, p) for k in range(seeds) for p in policies]
    return out


def _one(task: Task) -> Row:
    scenario, name, kv, seed, policy = task
    reqs = UNSEEN_SEEDED[name](seed)
    fleet = FleetSpec(kv_tokens=kv)
    ref = pooled_reference_hit_rate(reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
    t0 = time.perf_counter()
    row = run_offline(reqs, fleet, policy, ref)
    row.update(scenario=scenario, kv_tokens=kv, seed=seed,
               wall_s=round(time.perf_counter() - t0, 1))
    print(f"{scenario:>22} {seed:>3} {policy:>16}  hit {row['hit_rate']}  "
          f"p50 {row['ttft_p50_s']}  p99 {row['ttft_p99_s']}  ({row['wall_s']} s)", flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, object]:
    todo = tasks(args.only, args.seeds, tuple(args.policies or POLICIES))
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(_one, todo))
    groups: dict[tuple[str, str], list[Row]] = {}
    for task, row in zip(todo, rows, strict=True):
        groups.setdefault((task[0], task[4]), []).append(row)
    by_scenario: dict[str, list[Row]] = {}
    for (scenario, _), group in groups.items():
        by_scenario.setdefault(scenario, []).append(mean_row(group))
    for group in by_scenario.values():
        group.sort(key=lambda r: POLICIES.index(str(r["policy"])))
        against_oracle(group)
    return {"scenarios": by_scenario, "load_factor_sweep": [], "gateways": []}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_replay_unseen",
                                description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="these workloads or rows only (e.g. long-pauses, "
                   "long-pauses-256k)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per workload (default 2)")
    p.add_argument("--jobs", type=int, default=1, help="replays in parallel")
    p.add_argument("--policies", nargs="*", choices=POLICIES, metavar="POLICY")
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

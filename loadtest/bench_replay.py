"""Routing quality benchmark: every policy on the same workloads, offline, side by side.

    python -m loadtest.bench_replay [--trace PATH] [--limit N] [--out loadtest/results]

Scenarios: the Mooncake conversation trace at its own arrival rate and at 1.5x, and the
synthetic multi-tenant workload; 8 simulated replicas sized like an 8B model on one H100
(262,144 KV tokens each). Writes `routing.md`, `routing.json` and `routing.png`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import orjson

from loadtest.replay.cli import run_offline
from loadtest.replay.offline import FleetSpec
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.workload import (
    ReplayRequest,
    SyntheticSpec,
    load_mooncake,
    synthetic_multitenant,
)
from routing.policies import REGISTRY

MULTI_TENANT = SyntheticSpec(conversations_per_tenant=48, rate_per_s=80.0)
LOAD_FACTORS = (1.25, 1.5, 2.0)
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/data/mooncake_conversation_trace.jsonl"
)


def scenarios(trace: Path, limit: int | None) -> dict[str, list[ReplayRequest]]:
    return {
        "mooncake-1x": load_mooncake(trace, rate_scale=1.0, limit=limit),
        "mooncake-1.5x": load_mooncake(trace, rate_scale=1.5, limit=limit),
        # 8 tenants x 48 conversations x 6 turns at 80 req/s: moderate load on 8 replicas
        "multi-tenant": synthetic_multitenant(MULTI_TENANT),
    }


def run(trace: Path, limit: int | None, fleet: FleetSpec) -> dict[str, list[dict[str, object]]]:
    results: dict[str, list[dict[str, object]]] = {}
    for name, reqs in scenarios(trace, limit).items():
        ref = pooled_reference_hit_rate(reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
        rows = []
        for policy in REGISTRY:
            t0 = time.perf_counter()
            row = run_offline(reqs, fleet, policy, ref)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(
                f"{name:>14} {policy:>16}  hit/ref {row['hit_rate_vs_reference']}  "
                f"ttft p50 {row['ttft_p50_s']}  p99 {row['ttft_p99_s']}  "
                f"max/mean {row['max_over_mean_inflight']}  ({row['wall_s']} s)",
                flush=True,
            )
        results[name] = rows
    return results


def load_factor_sweep(reqs: list[ReplayRequest], fleet: FleetSpec) -> list[dict[str, object]]:
    """cache_aware under several bounded-load factors: the hit rate / hot-spot trade-off."""
    ref = pooled_reference_hit_rate(reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
    rows = []
    for c in LOAD_FACTORS:
        row = run_offline(reqs, fleet, "cache_aware", ref, load_factor=c)
        row["load_factor"] = c
        rows.append(row)
        print(
            f"  load_factor {c}: hit/ref {row['hit_rate_vs_reference']}  "
            f"ttft p99 {row['ttft_p99_s']}  max/mean {row['max_over_mean_inflight']}",
            flush=True,
        )
    return rows


def sweep_markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "## cache_aware: bounded-load factor c (Mooncake 1x)",
        "",
        "| c | hit rate vs reference | TTFT p50 s | TTFT p99 s | max/mean in-flight "
        "| bound violations |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = r["load_bound"]
        violations = bound["violations"] if isinstance(bound, dict) else "?"
        lines.append(
            f"| {r['load_factor']} | {r['hit_rate_vs_reference']} | {r['ttft_p50_s']} "
            f"| {r['ttft_p99_s']} | {r['max_over_mean_inflight']} | {violations} |"
        )
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, list[dict[str, object]]], fleet: FleetSpec) -> str:
    lines = [
        "# Routing quality (offline replay)",
        "",
        f"{fleet.replicas} replicas x {fleet.kv_tokens:,} KV tokens, profile `{fleet.profile}`; "
        "hit rate from the engines' prefix-cache counters; reference = one LRU holding the "
        "whole fleet's KV memory on the same request order. Times are simulated seconds.",
        "",
    ]
    for name, rows in results.items():
        best_ll = next(r for r in rows if r["policy"] == "least_load")
        lines += [
            f"## {name}",
            "",
            "| policy | hit rate | vs reference | TTFT p50 s | TTFT p99 s | e2e p99 s "
            "| p50 gain vs least_load | max/mean in-flight | bound violations "
            "| preemptions |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            gain = float(str(best_ll["ttft_p50_s"])) / max(1e-9, float(str(r["ttft_p50_s"])))
            bound = r["load_bound"]
            violations = bound["violations"] if isinstance(bound, dict) else "?"
            lines.append(
                f"| {r['policy']} | {r['hit_rate']} | {r['hit_rate_vs_reference']} "
                f"| {r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['e2e_p99_s']} | {gain:.2f}x "
                f"| {r['max_over_mean_inflight']} | {violations} | {r['preemptions']} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, object]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(results)
    policies = [str(r["policy"]) for r in results[names[0]]]
    width = 0.8 / len(policies)
    for k, (metric, title) in enumerate(
        [
            ("hit_rate_vs_reference", "hit rate / pooled reference"),
            ("ttft_p50_s", "TTFT p50 (s)"),
            ("ttft_p99_s", "TTFT p99 (s)"),
        ]
    ):
        ax = axes[k]
        for j, policy in enumerate(policies):
            vals = [
                float(str(next(r for r in results[n] if r["policy"] == policy)[metric]))
                for n in names
            ]
            ax.bar([i + j * width for i in range(len(names))], vals, width, label=policy)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--limit", type=int)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    fleet = FleetSpec()
    results = run(args.trace, args.limit, fleet)
    sweep = load_factor_sweep(load_mooncake(args.trace, limit=args.limit), fleet)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"scenarios": results, "load_factor_sweep": sweep}
    (args.out / "routing.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (args.out / "routing.md").write_text(markdown(results, fleet) + "\n" + sweep_markdown(sweep))
    plot(results, args.out / "routing.png")
    print(f"wrote {args.out}/routing.md, routing.json, routing.png")


if __name__ == "__main__":
    main()

"""bench_replay's target check (issue 11): cache_aware against the oracle and the best other."""

from __future__ import annotations

import pytest

from loadtest.bench_replay import (
    GENERATED_SEEDS,
    SYNTHETIC_SEEDS,
    mean_row,
    merged,
    scenarios,
    targets,
)


def _row(policy: str, hit: float, p50: float, p99: float) -> dict[str, object]:
    return {"policy": policy, "hit_rate": hit, "ttft_p50_s": p50, "ttft_p99_s": p99}


@pytest.mark.parametrize(
    ("mine", "other", "expect"),
    [
        # cache_aware best everywhere, within the oracle's bounds
        ((0.50, 0.10, 1.00), (0.40, 0.20, 2.00),
         {"hit_vs_oracle_ok": True, "p99_vs_oracle_ok": True, "best_hit": True,
          "best_p50": True, "best_p99": True}),
        # a peer keeps more hits at a worse tail; cache_aware's p99 is 1.2x the oracle's
        ((0.45, 0.10, 1.20), (0.55, 0.30, 3.00),
         {"hit_vs_oracle_ok": False, "p99_vs_oracle_ok": False, "best_hit": False,
          "best_p50": True, "best_p99": True}),
        # equal counts as best
        ((0.50, 0.20, 1.00), (0.50, 0.20, 1.00),
         {"best_hit": True, "best_p50": True, "best_p99": True}),
    ],
)
def test_targets(mine: tuple[float, float, float], other: tuple[float, float, float],
                 expect: dict[str, bool]) -> None:
    me = _row("cache_aware", *mine)
    oracle = _row("oracle", 0.50, 0.10, 1.00)
    me["hit_rate_vs_oracle"] = round(mine[0] / 0.50, 4)
    me["ttft_p99_vs_oracle"] = round(mine[2] / 1.00, 4)
    got = targets([me, _row("llmd_style", *other), oracle])
    assert {k: got[k] for k in expect} == expect
    assert got["best_other_hit"].startswith("llmd_style")  # type: ignore[attr-defined]


def test_a_workload_drawn_with_several_seeds_is_one_row_of_means() -> None:
    rows: list[dict[str, object]] = [
        {**_row("cache_aware", hit, 0.02, p99), "seed": seed, "wall_s": 0.5, "requests": 576,
         "pooled_reference_hit_rate": 0.9, "hit_rate_vs_reference": hit / 0.9,
         "e2e_p50_s": 1.0, "e2e_p99_s": 2.0, "max_over_mean_inflight": 4.0, "preemptions": k}
        for k, (seed, hit, p99) in enumerate([(7, 0.90, 0.196), (8, 0.92, 0.134),
                                              (9, 0.91, 0.196)])]
    got = mean_row(rows)
    assert got["seeds"] == [7, 8, 9]
    assert got["hit_rate"] == pytest.approx(0.91)
    assert got["ttft_p99_s"] == pytest.approx(0.1753, abs=1e-4)
    assert got["preemptions"] == 1.0
    assert got["wall_s"] == 1.5
    assert got["per_seed"]["ttft_p99_s"] == [0.196, 0.134, 0.196]  # type: ignore[index]


def test_the_synthetic_and_generated_workloads_come_in_several_seeds() -> None:
    names = [s.name for s in scenarios()]
    assert names.count("mooncake-1x") == 1
    assert names.count("synthetic") == SYNTHETIC_SEEDS
    assert names.count("bursts-256k") == GENERATED_SEEDS
    seeds = [s.seed for s in scenarios(seeds=2) if s.name == "hot-prefixes-1024k"]
    assert len(set(seeds)) == 2


def test_merged_replaces_only_the_rerun_policies_rows() -> None:
    rows = {"a": [_row("cache_aware", 0.1, 1, 2), _row("oracle", 0.2, 1, 2)],
            "b": [_row("cache_aware", 0.3, 1, 2)]}
    old: dict[str, object] = {"scenarios": rows, "load_factor_sweep": [{"scenario": "a"}],
                              "gateways": [{"scenario": "a"}], "targets": {}}
    new: dict[str, object] = {"scenarios": {"a": [_row("cache_aware", 0.5, 1, 2)]},
           "load_factor_sweep": [{"scenario": "a", "new": 1}],
           "gateways": [{"scenario": "a", "new": 1}]}
    out = merged(old, new, {"cache_aware"})
    assert out["scenarios"] == {"a": [_row("oracle", 0.2, 1, 2), _row("cache_aware", 0.5, 1, 2)],
                                "b": [_row("cache_aware", 0.3, 1, 2)]}  # b not re-run
    assert out["load_factor_sweep"] == out["gateways"] == [{"scenario": "a", "new": 1}]
    only_oracle = merged(old, {"scenarios": {"a": [_row("oracle", 0.4, 1, 2)]},
                               "load_factor_sweep": [], "gateways": []}, {"oracle"})
    assert only_oracle["gateways"] == [{"scenario": "a"}]
    assert only_oracle["scenarios"]["a"] == [_row("cache_aware", 0.1, 1, 2),  # type: ignore[index]
                                             _row("oracle", 0.4, 1, 2)]

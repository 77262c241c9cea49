"""bench_replay's target check (issue 11): cache_aware against the oracle and the best other."""

from __future__ import annotations

import pytest

from loadtest.bench_replay import targets


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

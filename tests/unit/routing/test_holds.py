"""`HoldOdds`: the lower ranks' picks a contested pick is blind to, and whether a hold pays."""

from __future__ import annotations

import pytest

from routing.holds import RATE_WINDOWS, HoldOdds

WINDOW = 0.01


@pytest.mark.parametrize(("routes", "own", "holds", "rank", "expected"), [
    ([], 0, 0, 2, 0.0),
    ([("a", 8, 0.995)], 0, 0, 2, 8 / RATE_WINDOWS),  # a lower rank's, per window
    ([("d", 8, 0.995)], 0, 0, 2, 0.0),  # a higher rank's: not waited for
    ([("a", 8, 1.0 - RATE_WINDOWS * WINDOW)], 0, 0, 2, 0.0),  # past the rate's windows
    ([("a", 4, 0.97), ("b", 4, 0.999)], 0, 0, 2, 8 / RATE_WINDOWS),
    ([("a", 1, 0.995)], 3, 0, 2, 6.0),  # a burst: each lower rank makes as many as it did
    ([], 1, 2, 3, 9.0),  # ... its holds included
])
def test_unseen_picks(
    routes: list[tuple[str, int, float]], own: int, holds: int, rank: int, expected: float,
) -> None:
    odds = HoldOdds("c", WINDOW)
    for member, n, at in routes:
        odds.peer_routed(member, n, at)
    for _ in range(holds):
        odds.held(0.995)
    assert odds.unseen(1.0, rank, own) == pytest.approx(expected)


def test_a_hold_counts_within_one_window_only() -> None:
    odds = HoldOdds("c", WINDOW)
    odds.held(1.0)
    assert odds.unseen(1.0 + WINDOW / 2, 1, 0) == 1.0
    assert odds.unseen(1.0 + WINDOW, 1, 0) == 0.0


@pytest.mark.parametrize(("near", "collision_s", "hold_s", "worth"), [
    (8, 0.128, 0.03, True),  # 2 unseen x 128 ms / 8 = 32 ms > 30 ms
    (8, 0.128, 0.033, False),
    (2, 0.04, 0.03, True),  # few candidates: a likelier collision
    (8, 0.04, 0.03, False),  # short requests: a collision costs little
])
def test_a_hold_pays_when_the_collisions_it_may_spare_cost_more(
    near: int, collision_s: float, hold_s: float, worth: bool,
) -> None:
    odds = HoldOdds("c", WINDOW)
    odds.peer_routed("a", 2 * RATE_WINDOWS, 0.995)  # 2 lower-rank picks a window
    assert odds.worth(1.0, 1, 0, near, collision_s, hold_s) is worth

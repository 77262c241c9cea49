"""`ErrorStreaks`: a replica's acquitted 500s in a row are charged once they reach the
threshold while another replica of its pool served; its own success ends the streak."""

from __future__ import annotations

from gateway.error_streaks import ErrorStreaks
from gateway.replicas import HealthRules, Replica

RULES = HealthRules(failure_threshold=3)


def _pool() -> tuple[Replica, Replica]:
    return Replica("p", "http://10.0.0.1:8000", RULES), Replica("p", "http://10.0.0.2:8000", RULES)


def test_a_streak_while_another_serves_is_charged_whole() -> None:
    failing, good = _pool()
    streaks = ErrorStreaks(3)
    streaks.acquitted(failing, 0.0)
    streaks.served(good)
    streaks.acquitted(failing, 0.0)
    assert failing.failures == 0  # not yet: two in a row
    streaks.acquitted(failing, 0.0)
    assert failing.failures == 3 and failing.state == "ejected"


def test_nothing_served_nothing_charged() -> None:
    failing, other = _pool()
    streaks = ErrorStreaks(3)
    for _ in range(10):
        streaks.acquitted(failing, 0.0)
        streaks.acquitted(other, 0.0)
    assert failing.failures == other.failures == 0


def test_its_own_success_ends_the_streak() -> None:
    failing, good = _pool()
    streaks = ErrorStreaks(3)
    streaks.served(good)
    for _ in range(2):
        streaks.acquitted(failing, 0.0)
    streaks.served(failing)
    for _ in range(2):
        streaks.acquitted(failing, 0.0)
    assert failing.failures == 0


def test_another_pools_success_does_not_count() -> None:
    failing, _ = _pool()
    elsewhere = Replica("q", "http://10.0.0.3:8000", RULES)
    streaks = ErrorStreaks(3)
    streaks.acquitted(failing, 0.0)
    streaks.served(elsewhere)
    for _ in range(4):
        streaks.acquitted(failing, 0.0)
    assert failing.failures == 0

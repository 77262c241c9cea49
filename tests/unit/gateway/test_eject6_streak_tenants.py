"""`ErrorStreaks` with authentication on: one tenant's requests failing alike on two replicas
(a poisoned prompt) never charge a streak; two tenants' do, as a replica failing everything
fails everyone."""

from __future__ import annotations

from gateway.error_streaks import ErrorStreaks
from gateway.replicas import HealthRules, Replica

RULES = HealthRules(failure_threshold=3)


def _pool() -> tuple[Replica, Replica]:
    return Replica("p", "http://10.0.0.1:8000", RULES), Replica("p", "http://10.0.0.2:8000", RULES)


def test_one_tenants_streak_is_never_charged() -> None:
    failing, good = _pool()
    streaks = ErrorStreaks(3)
    for _ in range(10):
        streaks.acquitted(failing, 0.0, "hostile")
        streaks.served(good)
    assert failing.failures == 0 and failing.state != "ejected"


def test_two_tenants_streak_is_charged_whole() -> None:
    failing, good = _pool()
    streaks = ErrorStreaks(3)
    streaks.acquitted(failing, 0.0, "a")
    streaks.served(good)
    streaks.acquitted(failing, 0.0, "a")
    streaks.acquitted(failing, 0.0, "b")
    assert failing.failures == 3 and failing.state == "ejected"

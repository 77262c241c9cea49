"""`StreamBudget`: the routes stream's MAXLEN from its entries' sizes and the memory budget."""

from __future__ import annotations

import pytest

from gateway.fleet.budget import MIN_ENTRIES, OVERHEAD, PER_ENTRY, StreamBudget

MIB = 1 << 20


def _entry(n: int) -> dict[bytes, bytes]:
    """An entry whose fields hold ``n`` bytes in all."""
    return {b"h": b"x" * (n - 1)}


@pytest.mark.parametrize(("maxlen", "budget", "size", "expected"), [
    (20_000, 64 * MIB, 50, 20_000),  # heartbeats: the entry cap binds
    (20_000, 64 * MIB, 13_000, int(64 * MIB / (OVERHEAD * 13_000 + PER_ENTRY))),  # 2k req/s
    (20_000, 1 * MIB, 100_000, MIN_ENTRIES),  # never fewer than a few intervals' backlog
    (150, 64 * MIB, 13_000, 150),  # a small stream_maxlen still binds
])
def test_trim_to(maxlen: int, budget: int, size: int, expected: int) -> None:
    assert StreamBudget(maxlen, budget).trim_to(_entry(size)) == expected


def test_the_cap_is_what_the_latest_entries_fill() -> None:
    """Sizes that swing between batches: the cap is the count of the latest entries that fill
    the budget, whatever the last few were; a lasting change moves it as the stream's
    content changes."""
    budget = StreamBudget(20_000, 4 * MIB)
    sizes = (10_000, 20_000) * 200
    cap = [budget.trim_to(_entry(n)) for n in sizes][-1]
    cost = [OVERHEAD * n + PER_ENTRY for n in sizes]
    fits = max(k for k in range(len(cost) + 1) if sum(cost[len(cost) - k:]) <= 4 * MIB)
    assert cap == fits > MIN_ENTRIES
    small = [budget.trim_to(_entry(100)) for _ in range(20_000)]  # the load has gone
    assert small == sorted(small) and small[-1] == 20_000


def test_a_gateway_that_just_started_takes_unseen_entries_to_be_like_its_own() -> None:
    budget = StreamBudget(20_000, 64 * MIB)
    assert budget.trim_to(_entry(13_000)) == int(64 * MIB / (OVERHEAD * 13_000 + PER_ENTRY))


def test_its_memory_stays_bounded() -> None:
    budget = StreamBudget(150, 64 * MIB)
    for _ in range(10_000):
        budget.trim_to(_entry(100))
    assert len(budget._total) <= 2 * 150

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


def test_a_burst_counts_at_once_and_its_end_slowly() -> None:
    budget = StreamBudget(20_000, 64 * MIB)
    assert budget.trim_to(_entry(100)) == 20_000
    big = budget.trim_to(_entry(20_000))  # the first large entry: trimmed for it at once
    assert big == int(64 * MIB / (OVERHEAD * 20_000 + PER_ENTRY))
    after = [budget.trim_to(_entry(100)) for _ in range(200)]
    assert after[0] < 2 * big  # one small entry does not undo the burst's cap
    assert after == sorted(after) and after[-1] == 20_000  # it rises back as they stay small

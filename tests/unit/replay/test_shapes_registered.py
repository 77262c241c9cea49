"""Every generated shape of `kvgate replay --workload` the tree and mix modules add is
registered, the same for the same seed, another for another, in arrival order, its prompt
lengths whole blocks."""
from __future__ import annotations

import pytest

from loadtest.replay.generators import DEFAULT_SEEDS, SEEDED, WORKLOADS


@pytest.mark.parametrize("name", ["long-context", "prefix-tree", "salted-tenants", "decode-mix"])
def test_registered_seeded_and_in_arrival_order(name: str) -> None:
    reqs = WORKLOADS[name]()
    assert reqs == WORKLOADS[name]() == SEEDED[name](DEFAULT_SEEDS[name])
    assert SEEDED[name](DEFAULT_SEEDS[name] + 1) != reqs
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0.0
    assert all(r.prompt_tokens == len(r.block_ids) * r.block_tokens for r in reqs)
    assert all(r.output_tokens >= 1 for r in reqs)

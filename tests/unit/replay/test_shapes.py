"""The unseen workload shapes (`loadtest.replay.shapes`): seeded, and the shape each claims."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from loadtest.replay.draws import BLOCK
from loadtest.replay.generators import DEFAULT_SEEDS, SEEDED, WORKLOADS
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.shapes import (
    HeavyTailSpec,
    RagSpec,
    RampSpec,
    SkewSpec,
    heavy_tail,
    load_ramp,
    rag_corpus,
    rag_drawn,
    ramp_rate,
    skewed_tenants,
)
from loadtest.replay.workload import ReplayRequest

NEW = ("rag-corpus", "skewed-tenants", "load-ramp", "heavy-tail")
REPLICA, FLEET = 262_144, 8 * 1_048_576  # one replica's KV (the smaller size), the larger fleet's


@pytest.mark.parametrize("name", NEW)
def test_registered_seeded_and_well_formed(name: str) -> None:
    make: Callable[[], list[ReplayRequest]] = WORKLOADS[name]
    reqs = make()
    assert reqs == make() == SEEDED[name](DEFAULT_SEEDS[name])  # deterministic for a seed
    assert SEEDED[name](DEFAULT_SEEDS[name] + 1) != reqs
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert all(r.prompt_tokens == len(r.block_ids) * r.block_tokens for r in reqs)
    assert all(r.output_tokens >= 1 for r in reqs)


def test_rag_documents_are_zipf_reused_and_their_working_set_spans_replica_and_fleet() -> None:
    s = RagSpec()
    reqs, chosen, docs = rag_drawn(s)
    sizes = [len(d) for d in docs]
    assert reqs == rag_corpus(s)
    assert len({r.block_ids[0] for r in reqs}) == s.system_prompts
    assert all(2048 <= n * BLOCK <= 20480 + BLOCK for n in sizes)  # medium documents
    uses = Counter(chosen)
    ranked = [n for _, n in uses.most_common()]
    assert s.documents >= 2000 and len(uses) > 500  # a large set, hundreds of them asked
    assert ranked[0] > 4 * ranked[9] and ranked[9] > 2 * ranked[99] > 0  # Zipf-skewed reuse
    assert uses.most_common(1)[0][0] == 0  # the first document is the most popular
    # each question is short: the prompt past system prompt and document
    for r, d in zip(reqs, chosen, strict=True):
        document = r.block_ids.index(docs[d][0]) + sizes[d]
        assert 1 <= len(r.block_ids) - document <= 1 + (s.question_tokens[1] + BLOCK) // BLOCK
    # the documents asked about again add up to more than one replica's cache, less than the
    # fleet's; one replica's worth of cache keeps far fewer hits than the fleet's
    reused = sum(sizes[d] * BLOCK for d, n in uses.items() if n >= 2)
    assert REPLICA < reused < FLEET
    one, fleet = (pooled_reference_hit_rate(reqs, kv) for kv in (REPLICA, FLEET))
    assert one < 0.75 * fleet


def test_skewed_tenants_top_share_and_salted_prompts() -> None:
    s = SkewSpec()
    reqs = skewed_tenants(s)
    share = Counter(r.tenant for r in reqs)
    assert 0.70 <= share["tenant-0"] / len(reqs) <= 0.80
    assert len(share) == 1 + s.small_tenants
    assert max(n for t, n in share.items() if t != "tenant-0") < 0.03 * len(reqs)
    # a tenant's prompts all start with its own system prompt and share no block with another
    # tenant's (the replay salts each tenant's hashes too: `ReplayRequest.tenant`)
    owner: dict[int, str] = {}
    for r in reqs:
        for b in r.block_ids:
            assert owner.setdefault(b, r.tenant) == r.tenant
    assert all(len({r.block_ids[0] for r in reqs if r.tenant == t}) == 1 for t in share)
    # conversations come back: most requests extend an earlier request's whole prompt
    seen = {r.block_ids for r in reqs}
    continued = sum(1 for r in reqs if any(r.block_ids[:k] in seen
                                           for k in range(len(r.block_ids) - 1, 0, -1)))
    assert continued > 0.4 * len(reqs)


def test_load_ramp_rises_to_its_peak_and_back() -> None:
    s = RampSpec()
    assert ramp_rate(s, 0.0) == ramp_rate(s, s.duration_s) == s.low_rate_per_s
    assert ramp_rate(s, s.duration_s / 2) == s.peak_rate_per_s
    assert ramp_rate(s, -1.0) == ramp_rate(s, s.duration_s + 1.0) == 0.0
    reqs = load_ramp(s)
    tenth = s.duration_s / 10

    def rate(start: float) -> float:
        return sum(1 for r in reqs if start <= r.arrival_s < start + tenth) / tenth

    first, middle, last = rate(0.0), rate(s.duration_s / 2 - tenth / 2), rate(s.duration_s - tenth)
    expect_edge = (ramp_rate(s, 0.0) + ramp_rate(s, tenth)) / 2  # the mean over that tenth
    assert first == pytest.approx(expect_edge, rel=0.35)
    assert last == pytest.approx(expect_edge, rel=0.35)
    assert middle == pytest.approx(0.95 * s.peak_rate_per_s, rel=0.15)
    assert middle > 3 * max(first, last)
    expected = s.duration_s * (s.low_rate_per_s + s.peak_rate_per_s) / 2
    assert len(reqs) == pytest.approx(expected, rel=0.05)


def test_heavy_tail_rare_long_prompts_share_nothing() -> None:
    s = HeavyTailSpec()
    reqs = heavy_tail(s)
    long_ = [r for r in reqs if r.prompt_tokens >= s.long_tokens[0]]
    short = [r for r in reqs if r.prompt_tokens < s.long_tokens[0]]
    assert 0.5 * s.long_probability < len(long_) / len(reqs) < 2 * s.long_probability
    assert all(r.prompt_tokens <= s.long_tokens[1] + BLOCK for r in long_)
    assert all(r.prompt_tokens <= s.system_tokens[1] + s.short_tokens[1] + 2 * BLOCK
               for r in short)
    others = Counter(b for r in reqs for b in r.block_ids)
    assert all(others[b] == 1 for r in long_ for b in r.block_ids)  # no block shared
    assert sum(1 for r in short if others[r.block_ids[0]] > 1) > 0.4 * len(short)
    long_tokens = sum(r.prompt_tokens for r in long_)
    assert long_tokens > 0.1 * sum(r.prompt_tokens for r in reqs)  # rare, yet heavy

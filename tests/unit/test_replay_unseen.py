"""The unseen shapes (`loadtest.replay.unseen`): seeded, registered for `kvgate replay
--workload`, and each of the shape its docstring promises."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from loadtest.replay.cli import _parser
from loadtest.replay.draws import BLOCK
from loadtest.replay.generators import WORKLOADS
from loadtest.replay.unseen import (
    UNSEEN,
    UNSEEN_SEEDED,
    UNSEEN_SEEDS,
    DominantSpec,
    DriftSpec,
    HugeDocSpec,
    PauseSpec,
    dominant_tenant,
    drift_doc,
    huge_documents,
    long_pauses_drawn,
    popularity_drift_drawn,
)

REPLICA = 262_144  # one replica's KV tokens at the smaller size


@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_seeded_in_arrival_order_and_whole_blocks(name: str) -> None:
    reqs = UNSEEN[name]()
    assert reqs == UNSEEN[name]() == UNSEEN_SEEDED[name](UNSEEN_SEEDS[name])
    assert UNSEEN_SEEDED[name](UNSEEN_SEEDS[name] + 1) != reqs
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0.0
    assert all(r.prompt_tokens == len(r.block_ids) * r.block_tokens for r in reqs)
    assert all(r.output_tokens >= 1 and r.prompt_tokens < 131_072 - 512 for r in reqs)


@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_replay_cli_offers_them_and_the_main_matrix_does_not(name: str) -> None:
    assert _parser().parse_args(["--workload", name, "--offline"]).workload == name
    assert name not in WORKLOADS  # loadtest.bench_replay's rows and merges stay as they were


def test_popularity_drift_turns_the_hot_documents_cold() -> None:
    s = DriftSpec()
    reqs, docs = popularity_drift_drawn(s)
    assert len(reqs) == len(docs) and s.duration_s * s.rate_per_s * 0.9 < len(reqs)
    # each epoch a document falls `shift` ranks; the coldest `shift` come to the top
    assert drift_doc(s, 0, s.epoch_s) == drift_doc(s, s.documents - s.shift, 0.0)
    assert all(drift_doc(s, r + s.shift, s.epoch_s) == drift_doc(s, r, 0.0) for r in range(9))
    per_epoch = [Counter(d for r, d in zip(reqs, docs, strict=True)
                         if e * s.epoch_s <= r.arrival_s < (e + 1) * s.epoch_s)
                 for e in range(int(s.duration_s // s.epoch_s))]
    tops = [c.most_common(1)[0][0] for c in per_epoch]
    assert len(set(tops)) == len(tops)  # every epoch has another hottest document
    for before, after in pairwise(per_epoch):
        hot = [d for d, _ in before.most_common(s.shift)]
        # the last epoch's top documents: a third of their requests or fewer in this one
        assert sum(after[d] for d in hot) < 0.35 * sum(before[d] for d in hot)
        # and this epoch's hottest was next to unread in the last (a herd on a cold prefix)
        newest = after.most_common(1)[0][0]
        assert before[newest] <= 2 < after[newest] // 10
    # every document is read by a question on top of it: prompts share the document's blocks
    assert all(r.prompt_tokens >= s.document_tokens[0] for r in reqs)


def test_long_pauses_outlast_the_caches_and_continue_their_conversation() -> None:
    s = PauseSpec()
    reqs, pauses = long_pauses_drawn(s)
    long_ = [p for p in pauses if p is not None and p >= s.long_pause_s[0]]
    short = [p for p in pauses if p is not None and p <= s.short_pause_s[1]]
    assert len(long_) > 50 and len(short) > 3 * len(long_) // 2
    background = sum(r.prompt_tokens for r, p in zip(reqs, pauses, strict=True) if p is None)
    # the churn alone turns the fleet's KV over faster than the mean long pause at 262,144
    # KV tokens per replica and slower at 1,048,576: the two sizes straddle the pauses
    churn_per_s, pause = background / s.duration_s, sum(s.long_pause_s) / 2
    assert 8 * REPLICA / churn_per_s < pause < 8 * 4 * REPLICA / churn_per_s
    # a returning turn's prompt starts with an earlier request's whole prompt (its history)
    seen = {r.block_ids for r in reqs}
    for r, p in zip(reqs, pauses, strict=True):
        if p is not None:
            assert any(r.block_ids[:n] in seen for n in range(1, len(r.block_ids)))


def test_huge_documents_fill_a_replica_and_are_read_many_times() -> None:
    s = HugeDocSpec()
    reqs = huge_documents(s)
    long_ = [r for r in reqs if r.prompt_tokens >= s.document_tokens[0]]
    assert len(long_) / len(reqs) == pytest.approx(s.document_probability, abs=0.04)
    firsts = Counter(r.block_ids[0] for r in long_)
    assert len(firsts) == s.documents and min(firsts.values()) > 20  # each read by many
    biggest = max(r.prompt_tokens for r in long_)
    assert biggest > 0.35 * REPLICA  # two copies do not fit on one replica
    chat = [r for r in reqs if r.prompt_tokens < s.document_tokens[0]]
    assert max(r.prompt_tokens for r in chat) <= s.system_tokens[1] + s.chat_tokens[1] + BLOCK


def test_dominant_tenant_sends_four_fifths_and_small_tenants_converse() -> None:
    s = DominantSpec()
    reqs = dominant_tenant(s)
    tenants = Counter(r.tenant for r in reqs)
    assert tenants["tenant-0"] / len(reqs) == pytest.approx(s.top_share, abs=0.03)
    assert len(tenants) == 1 + s.small_tenants
    top = [r for r in reqs if r.tenant == "tenant-0"]
    system = top[0].block_ids[: s.top_system_tokens[0] // BLOCK]
    assert all(r.block_ids[: len(system)] == system for r in top)
    # a small tenant's later request often extends one of its earlier prompts
    small = [r for r in reqs if r.tenant != "tenant-0"]
    earlier: set[tuple[str, tuple[int, ...]]] = set()
    continued = 0
    for r in small:
        continued += any((r.tenant, r.block_ids[:n]) in earlier
                         for n in range(len(r.block_ids) - 1, 0, -1))
        earlier.add((r.tenant, r.block_ids))
    assert continued > 0.4 * len(small)

"""The shapes of `loadtest.replay.pressure_shapes` (long answers, giant sessions, a salted
tenant's surge): each of the shape its docstring promises. Seeding, arrival order and the
replay CLI's offer are `tests/unit/test_replay_unseen.py`'s (every `UNSEEN` entry)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from loadtest.replay.draws import BLOCK
from loadtest.replay.pressure_shapes import (
    GiantSpec,
    LongAnswerSpec,
    SurgeSpec,
    giant_sessions_drawn,
    long_answers,
    surge_rate,
    tenant_surge_drawn,
)

REPLICA = 262_144  # one replica's KV tokens at the smaller size


def test_long_answers_decode_more_than_they_prefill_anew_and_carry_their_answers() -> None:
    s = LongAnswerSpec()
    reqs = long_answers(s)
    long_ = [r for r in reqs if r.output_tokens >= s.long_output_tokens[0]]
    assert len(long_) / len(reqs) == pytest.approx(s.long_probability, abs=0.04)
    # a next turn's prompt is an earlier prompt, its whole answer and a short new turn
    prompts = {r.block_ids: r for r in reqs}
    carried = 0
    for r in reqs:
        for n in range(len(r.block_ids) - 1, 0, -1):
            earlier = prompts.get(r.block_ids[:n])
            if earlier is not None and earlier is not r:
                answer_blocks = -(-earlier.output_tokens // BLOCK)
                new = len(r.block_ids) - n - answer_blocks
                assert 1 <= new <= -(-s.turn_tokens[1] // BLOCK)
                # it comes once the answer is generated, and read
                assert r.arrival_s - earlier.arrival_s >= (
                    earlier.output_tokens / s.decode_tokens_per_s + s.think_s[0])
                carried += 1
                break
    assert carried > 0.5 * len(reqs)
    # answers of a thousand tokens and more on average: the KV memory fills from decode
    assert sum(r.output_tokens for r in reqs) / len(reqs) > 1000


def test_giant_sessions_fill_much_of_a_replica_and_are_read_a_few_times() -> None:
    s = GiantSpec()
    reqs, giant = giant_sessions_drawn(s)
    calls = [r for r, g in zip(reqs, giant, strict=True) if g]
    chat = [r for r, g in zip(reqs, giant, strict=True) if not g]
    assert all(0.37 * REPLICA < r.prompt_tokens <= s.max_context_tokens for r in calls)
    assert all(r.prompt_tokens + r.output_tokens < 131_072 for r in calls)
    sessions = Counter(r.block_ids[0] for r in calls)
    assert 8 <= len(sessions) <= 25 and max(sessions.values()) <= s.calls[1]
    assert len(calls) / len(sessions) >= s.calls[0]
    # a call extends its session's previous call: the context is the shared prefix
    by_session: dict[int, list[tuple[int, ...]]] = {}
    for r in calls:
        by_session.setdefault(r.block_ids[0], []).append(r.block_ids)
    for prompts in by_session.values():
        assert all(b[: len(a)] == a for a, b in pairwise(prompts))
    # many short chats around them, an eighth of a giant context or less each
    assert len(chat) > 20 * len(calls)
    assert max(r.prompt_tokens for r in chat) < s.context_tokens[0] / 8


def test_tenant_surge_is_one_cold_salted_tenant_at_five_times_the_top_rate() -> None:
    s = SurgeSpec()
    reqs, surge = tenant_surge_drawn(s)
    name = f"tenant-{s.surge_tenant}"
    assert all(r.tenant == name for r, f in zip(reqs, surge, strict=True) if f)
    # one text for every tenant: the same system prompt's block ids (the salt tells them apart)
    head = s.system_tokens[0] // BLOCK
    assert len({r.block_ids[:head] for r in reqs}) == 1
    assert len({r.tenant for r in reqs}) > 0.8 * s.tenants
    start, end = s.surge_start_s, s.surge_start_s + s.surge_ramp_s + s.surge_hold_s
    before = Counter(r.tenant for r in reqs if r.arrival_s < start)
    during = Counter(r.tenant for r in reqs if start + s.surge_ramp_s <= r.arrival_s < end)
    assert before[name] < 0.01 * before.total()  # a tail tenant: one request in 100 before
    top = during.most_common(2)
    assert top[0][0] == name
    assert top[0][1] / during["tenant-0"] == pytest.approx(s.surge_factor, rel=0.35)
    assert surge_rate(s, start - 1.0) == surge_rate(s, end + s.surge_ramp_s) == 0.0
    assert sum(surge) == pytest.approx(s.surge_hold_s * surge_rate(s, end - 1.0), rel=0.2)

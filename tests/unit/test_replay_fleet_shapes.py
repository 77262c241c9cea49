"""The tool-agent, fleet-mix and flash-crowd shapes (`loadtest.replay.fleet_shapes`): each of
the shape its docstring promises (seeding and registration: `test_replay_unseen.py`, which
runs over every `UNSEEN` name)."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtest.replay.fleet_shapes import (
    KINDS,
    CrowdSpec,
    FleetMixSpec,
    ToolAgentSpec,
    crowd_rate,
    flash_crowd_drawn,
    fleet_mix_drawn,
    tool_agent,
)
from loadtest.replay.unseen import UNSEEN
from loadtest.replay.workload import ReplayRequest


def reused_share(reqs: list[ReplayRequest]) -> float:
    """The share of prompt blocks an earlier prompt had at the same position after the same
    prefix (what an unbounded cache would hit)."""
    seen: set[tuple[int, ...]] = set()
    reused = total = 0
    for r in reqs:
        reused += next((k for k in range(len(r.block_ids), 0, -1)
                        if r.block_ids[:k] in seen), 0)
        seen.update(r.block_ids[:k] for k in range(1, len(r.block_ids) + 1))
        total += len(r.block_ids)
    return reused / total


def test_registered_as_unseen_shapes() -> None:
    assert {"tool-agent", "fleet-mix", "flash-crowd"} <= set(UNSEEN)


def test_tool_agent_has_the_published_trace_s_proportions_and_bursty_sessions() -> None:
    s = ToolAgentSpec()
    reqs = tool_agent(s)
    # the Mooncake tool&agent trace: mean input ~8.6k tokens, mean output ~180
    assert 7_000 < sum(r.prompt_tokens for r in reqs) / len(reqs) < 11_000
    assert 120 < sum(r.output_tokens for r in reqs) / len(reqs) < 250
    assert 0.6 < reused_share(reqs) < 0.85  # the paper: ~59 % reusable with its cache
    # a few long preambles start nearly every request: the top one most of all
    firsts = Counter(r.block_ids[0] for r in reqs)
    top = firsts.most_common(s.preambles)
    assert sum(n for _, n in top) == len(reqs) and top[0][1] > 0.2 * len(reqs)
    # a call extends an earlier call's prompt (its session's), within seconds of it
    by_prompt = {r.block_ids: r.arrival_s for r in reqs}
    chained = [r for r in reqs if any(
        r.block_ids[:k] in by_prompt and 0 < r.arrival_s - by_prompt[r.block_ids[:k]] < 10
        for k in range(len(r.block_ids) - 1, 0, -1))]
    assert len(chained) > 0.45 * len(reqs)
    # fan-out: several sessions start at once on the same preamble and task (a first call's
    # prompt sent by two or more sub-agents within 50 ms)
    same = Counter(r.block_ids for r in reqs)
    fanned = [ids for ids, n in same.items() if n >= 2]
    assert len(fanned) > 10


def test_fleet_mix_serves_every_kind_and_drifts_from_chat_to_agents() -> None:
    s = FleetMixSpec()
    reqs, kinds = fleet_mix_drawn(s)
    assert len(reqs) == pytest.approx(s.duration_s * s.rate_per_s, rel=0.1)
    first = Counter(k for r, k in zip(reqs, kinds, strict=True) if r.arrival_s < 60)
    last = Counter(k for r, k in zip(reqs, kinds, strict=True) if r.arrival_s > 240)
    assert set(first) == set(last) == set(KINDS)
    share = {k: (first[k] / sum(first.values()), last[k] / sum(last.values())) for k in KINDS}
    assert share["chat"][0] > 0.35 > 0.25 > share["chat"][1]
    assert share["agent"][0] < 0.15 < 0.3 < share["agent"][1]
    # conversations and agents continue: their later prompts extend earlier ones
    earlier: set[tuple[int, ...]] = set()
    continued = Counter[str]()
    for r, k in zip(reqs, kinds, strict=True):
        continued[k] += any(r.block_ids[:n] in earlier for n in range(len(r.block_ids) - 1,
                                                                      len(r.block_ids) // 2, -1))
        earlier.add(r.block_ids)
    assert continued["chat"] > 0.4 * kinds.count("chat")
    assert continued["agent"] > 0.5 * kinds.count("agent")
    assert continued["one-off"] == 0


def test_flash_crowd_swings_over_the_day_and_herds_on_one_new_prefix() -> None:
    s = CrowdSpec()
    reqs, crowd = flash_crowd_drawn(s)
    times = [r.arrival_s for r in reqs]
    trough = sum(t < 30 for t in times)
    peak = sum(s.duration_s / 2 - 15 <= t < s.duration_s / 2 + 15 for t in times)
    assert peak > 2.5 * trough
    ours = [r for r, c in zip(reqs, crowd, strict=True) if c]
    prefix = ours[0].block_ids[: s.crowd_prefix_tokens[0] // 64]
    assert all(r.block_ids[: len(prefix)] == prefix for r in ours)
    others = [r for r, c in zip(reqs, crowd, strict=True) if not c]
    assert not any(r.block_ids[: len(prefix)] == prefix for r in others)  # nobody sent it before
    end = s.crowd_start_s + 3 * s.crowd_ramp_s + s.crowd_hold_s
    assert all(s.crowd_start_s <= r.arrival_s <= end for r in ours)
    assert crowd_rate(s, s.crowd_start_s - 1) == 0.0 == crowd_rate(s, end + 1)
    # while held, the crowd is close to half of all arrivals
    held = [c for r, c in zip(reqs, crowd, strict=True)
            if s.crowd_start_s + s.crowd_ramp_s <= r.arrival_s
            < s.crowd_start_s + s.crowd_ramp_s + s.crowd_hold_s]
    assert 0.35 < sum(held) / len(held) < 0.65

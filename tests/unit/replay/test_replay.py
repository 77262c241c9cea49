"""The replay tool's pieces: workloads, block hashing, the pooled reference, the summary, and
offline replay end to end (deterministic, and affinity beats round robin on reuse)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main as kvgate
from loadtest.replay.blocks import unit_hashes
from loadtest.replay.cli import run_offline
from loadtest.replay.offline import FleetSpec, GatewaySpec, replay_offline
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.summary import Outcome, inflight_balance, percentile
from loadtest.replay.text import render_prompt
from loadtest.replay.workload import (
    ReplayRequest,
    SyntheticSpec,
    load_mooncake,
    synthetic_multitenant,
)
from routing.router import RouterConfig
from routing.tokens import CHARS_PER_TOKEN


def _req(ids: tuple[int, ...], tokens: int, t: float = 0.0, tenant: str = "a") -> ReplayRequest:
    return ReplayRequest(t, tokens, 8, ids, block_tokens=64, tenant=tenant)


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        ((1, 2, 3), (1, 2, 3), 12),  # 3 blocks x 64 tokens / 16-token units
        ((1, 2, 3), (1, 2, 9), 8),
        ((1, 2, 3), (7, 2, 3), 0),  # a different first block changes every later hash
    ],
)
def test_unit_hashes_share_exactly_the_shared_prefix(
    a: tuple[int, ...], b: tuple[int, ...], shared: int
) -> None:
    ha, hb = unit_hashes(a, 64, 16, 12, 1), unit_hashes(b, 64, 16, 12, 1)
    common = next((i for i, (x, y) in enumerate(zip(ha, hb, strict=True)) if x != y), 12)
    assert common == shared


def test_unit_hashes_differ_everywhere_under_another_seed() -> None:
    assert not set(unit_hashes((1, 2), 64, 16, 8, 1)) & set(unit_hashes((1, 2), 64, 16, 8, 2))


@pytest.mark.parametrize(
    ("requests", "capacity", "expected"),
    [
        ([_req((1, 2), 128), _req((1, 2), 128)], 10_000, 0.5),  # second one all cached
        ([_req((1, 2), 128), _req((1, 3), 128)], 10_000, 0.25),  # shares block 1 only
        ([_req((1, 2), 128), _req((3, 4), 128), _req((1, 2), 128)], 128, 0.0),  # evicted
        ([_req((1, 2), 120), _req((1, 2), 120)], 10_000, 112 / 240),  # only full units hit
    ],
)
def test_pooled_reference(requests: list[ReplayRequest], capacity: int, expected: float) -> None:
    assert pooled_reference_hit_rate(requests, capacity) == pytest.approx(expected)


def test_tenants_never_share_the_reference_cache() -> None:
    reqs = [_req((1, 2), 128, tenant="a"), _req((1, 2), 128, tenant="b")]
    assert pooled_reference_hit_rate(reqs, 10_000) == 0.0


def test_render_prompt_follows_the_token_rule_and_sharing() -> None:
    a = render_prompt((1, 2, 3), 64, 150)
    b = render_prompt((1, 2, 4), 64, 150)
    assert len(a) == 150 * CHARS_PER_TOKEN
    assert a[: 128 * CHARS_PER_TOKEN] == b[: 128 * CHARS_PER_TOKEN]
    assert a[128 * CHARS_PER_TOKEN :] != b[128 * CHARS_PER_TOKEN :]


def test_inflight_balance_counts_assignments_over_the_bound() -> None:
    # four requests at once, all on r0, with two replicas: the 2nd..4th exceed 1.25 x mean + 1
    outs = [Outcome("r0", 0.0, 0.1, 1.0, True, i) for i in range(4)]
    worst, violations = inflight_balance(outs, ["r0", "r1"], 1.25, 1.0)
    assert worst == 2.0 and violations == 2
    spread = [Outcome(f"r{i % 2}", 0.0, 0.1, 1.0, True, i) for i in range(4)]
    worst, violations = inflight_balance(spread, ["r0", "r1"], 1.25, 1.0)
    assert worst == pytest.approx(4 / 3) and violations == 0


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_load_mooncake_scales_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}]
    first = {"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [2]}
    path.write_text("\n".join(json.dumps(r) for r in [first, *rows]) + "\n")
    (_, req) = load_mooncake(path, rate_scale=1.5)  # arrivals count from the first request
    assert req.arrival_s == pytest.approx(2.0)
    assert (req.prompt_tokens, req.output_tokens, req.block_ids) == (600, 5, (0, 1))


SMALL = SyntheticSpec(tenants=2, conversations_per_tenant=4, turns=3, rate_per_s=6.0)


def test_offline_replay_is_deterministic_and_affinity_pays() -> None:
    reqs = synthetic_multitenant(SMALL)
    fleet = FleetSpec(replicas=4, kv_tokens=65_536)
    first = run_offline(reqs, fleet, "cache_aware", 0.5)
    assert run_offline(reqs, fleet, "cache_aware", 0.5) == first
    rr = run_offline(reqs, fleet, "round_robin", 0.5)
    assert float(str(first["hit_rate"])) > float(str(rr["hit_rate"]))
    bound = first["load_bound"]
    assert isinstance(bound, dict) and bound["violations"] == 0


def test_replay_cli_writes_one_summary_per_policy(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    code = kvgate(["replay", "--synthetic", "--offline", "--replicas", "2", "--limit", "30",
                   "--policy", "all", "--json", str(out)])
    assert code == 0
    summaries = json.loads(out.read_text())
    # offline, "all" is the registry's policies and the yardsticks: peers' rules, the oracle
    assert {s["policy"] for s in summaries} == {
        "round_robin", "least_load", "consistent_hash", "cache_aware", "sglang_style",
        "llmd_style", "oracle"}
    for s in summaries:
        for key in ("requests", "hit_rate", "pooled_reference_hit_rate", "ttft_p50_s",
                    "ttft_p99_s", "e2e_p99_s", "max_over_mean_inflight", "preemptions",
                    "hit_rate_vs_oracle", "ttft_p99_vs_oracle"):
            assert key in s
        assert s["requests"] == 30
    oracle = next(s for s in summaries if s["policy"] == "oracle")
    assert oracle["hit_rate_vs_oracle"] == oracle["ttft_p99_vs_oracle"] == 1.0



def test_replay_cli_spreads_requests_by_the_gateway_seed(tmp_path: Path) -> None:
    """--gateway-seed picks which of the N routers takes which request: another seed is
    another run (and is reported), the same seed the same run."""
    def run(seed: int) -> dict[str, object]:
        out = tmp_path / f"g{seed}.json"
        code = kvgate(["replay", "--synthetic", "--offline", "--limit", "200", "--gateways",
                       "4", "--no-share", "--gateway-seed", str(seed), "--json", str(out)])
        assert code == 0
        summary: dict[str, object] = json.loads(out.read_text())[0]
        return summary

    first, again, other = run(0), run(0), run(1)
    assert first["gateway_seed"] == 0 and other["gateway_seed"] == 1
    assert first == again
    assert {k: v for k, v in first.items() if k != "gateway_seed"} != {
        k: v for k, v in other.items() if k != "gateway_seed"}

def test_replay_cli_holds_picks_unless_told_not_to(tmp_path: Path) -> None:
    """`kvgate replay --offline --gateways N` holds contested picks by default and says so in
    its summary; `--no-defer` picks at arrival (with turns): another run on bursts."""
    def run(*extra: str) -> dict[str, object]:
        out = tmp_path / f"h{len(extra)}.json"
        assert kvgate(["replay", "--workload", "bursts", "--offline", "--limit", "300",
                       "--gateways", "4", "--sync-delay-ms", "10", *extra,
                       "--json", str(out)]) == 0
        summary: dict[str, object] = json.loads(out.read_text())[0]
        return summary

    held, at_once = run(), run("--no-defer")
    assert held["held_picks"] is True and at_once["held_picks"] is False
    assert held["ttft_p99_s"] != at_once["ttft_p99_s"]


def test_held_picks_count_their_ttft_from_the_arrival() -> None:
    """Four gateways, bursts of cold requests at one instant: the higher-ranked gateways hold
    their picks (`Router.defer_s`), routing them later, but every request's TTFT counts from
    its arrival; without holding (``defer=False``) the run differs."""
    reqs = [_req((1000 * i + 1, 1000 * i + 2), 1024, t=0.5 * (i // 12), tenant=str(i % 3))
            for i in range(48)]
    fleet, cfg = FleetSpec(replicas=8, kv_tokens=65_536), RouterConfig()
    held = replay_offline(reqs, fleet, cfg, GatewaySpec(4, True, 0.01, 0))
    at_once = replay_offline(reqs, fleet, cfg, GatewaySpec(4, True, 0.01, 0, defer=False))
    for res in (held, at_once):
        assert sorted((o.seq, o.start_s) for o in res.outcomes) == [
            (i, r.arrival_s) for i, r in enumerate(reqs)]
        assert all(o.ok and o.first_token_s is not None for o in res.outcomes)
    assert sorted(held.outcomes, key=_seq) != sorted(at_once.outcomes, key=_seq)


def _seq(o: Outcome) -> int:
    return o.seq


def test_a_yardstick_is_offline_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["replay", "--synthetic", "--target", "http://127.0.0.1:9", "--policy",
                   "oracle"]) == 2
    assert "offline only" in capsys.readouterr().err


def test_generated_workloads_are_seeded_and_have_their_shape() -> None:
    from loadtest.replay.generators import DEFAULT_SEEDS, SEEDED, WORKLOADS

    for name, make in WORKLOADS.items():
        reqs = make()
        assert reqs == make() == SEEDED[name](DEFAULT_SEEDS[name]), name  # seeded
        assert SEEDED[name](DEFAULT_SEEDS[name] + 1) != reqs, name
        assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs), name
        assert all(r.prompt_tokens == len(r.block_ids) * r.block_tokens for r in reqs), name
    hot = pooled_reference_hit_rate(WORKLOADS["hot-prefixes"](), 8 * 262_144)
    cold = pooled_reference_hit_rate(WORKLOADS["cold-one-offs"](), 8 * 262_144)
    assert hot > 0.5 > 0.1 > cold  # shared prefixes vs one-offs
    burst = WORKLOADS["bursts"]()
    same_instant = len(burst) - len({r.arrival_s for r in burst})
    assert same_instant > len(burst) / 2  # most requests share their arrival instant


def test_replay_cli_rejects_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvgate(["replay", "--synthetic", "--offline", "--policy", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err

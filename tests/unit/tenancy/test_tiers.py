"""Tier resolution and spill-over: a table of load situations and where requests go."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.policy_doc import parse_policy
from gateway.tenancy.tiers import ReplicaLoad, resolve_tier

POLICY = parse_policy(
    {
        "pools": {
            "fp8": {
                "served_model": "m-fp8",
                "replicas": ["http://a:1", "http://a:2"],
                "priority": True,
            },
            "awq": {"served_model": "m-awq", "replicas": ["http://b:1"]},
        },
        "models": {"m": {"premium": "fp8", "free": "awq"}, "only-free": {"free": "awq"}},
        "tiers": {
            "premium": {
                "priority": 1,
                "spill_to": "awq",
                "spill_when": {"waiting": 4, "kv_usage": 0.9},
            },
            "free": {
                "priority": 10,
                "borrow_from": "fp8",
                "spill_when": {"waiting": 2, "kv_usage": 0.9},
                "borrow_below": {"waiting": 0, "kv_usage": 0.3},
            },
        },
    }
)

IDLE = ReplicaLoad(waiting=0, kv_usage=0.1)
BUSY = ReplicaLoad(waiting=1, kv_usage=0.5)  # neither idle nor saturated
FULL = ReplicaLoad(waiting=9, kv_usage=0.5)
KV_FULL = ReplicaLoad(waiting=0, kv_usage=0.95)
DOWN = ReplicaLoad(waiting=0, kv_usage=0.0, healthy=False)
UNKNOWN = ReplicaLoad()

L = dict[str, Sequence[ReplicaLoad]]
CASES: list[tuple[str, str, L, str, str, int | None]] = [
    # (case, tier, loads, pool, reason, priority)
    ("premium home", "premium", {"fp8": [IDLE, BUSY], "awq": [IDLE]}, "fp8", "tier", 1),
    ("premium one replica free", "premium", {"fp8": [FULL, BUSY], "awq": [IDLE]}, "fp8", "tier", 1),
    (
        "premium all saturated",
        "premium",
        {"fp8": [FULL, KV_FULL], "awq": [BUSY]},
        "awq",
        "spill",
        None,
    ),
    (
        "premium saturated+down",
        "premium",
        {"fp8": [FULL, DOWN], "awq": [IDLE]},
        "awq",
        "spill",
        None,
    ),
    ("premium no replicas", "premium", {"awq": [IDLE]}, "awq", "spill", None),
    ("premium target full too", "premium", {"fp8": [FULL, FULL], "awq": [FULL]}, "fp8", "tier", 1),
    (
        "premium unknown load",
        "premium",
        {"fp8": [UNKNOWN, UNKNOWN], "awq": [IDLE]},
        "fp8",
        "tier",
        1,
    ),
    ("free home", "free", {"fp8": [IDLE, IDLE], "awq": [BUSY]}, "awq", "tier", None),
    ("free borrows idle premium", "free", {"fp8": [IDLE, IDLE], "awq": [FULL]}, "fp8", "spill", 10),
    (
        "free never takes busy premium",
        "free",
        {"fp8": [IDLE, BUSY], "awq": [FULL]},
        "awq",
        "tier",
        None,
    ),
    (
        "free no borrow on unknown",
        "free",
        {"fp8": [IDLE, UNKNOWN], "awq": [FULL]},
        "awq",
        "tier",
        None,
    ),
    ("free premium down", "free", {"fp8": [DOWN, DOWN], "awq": [FULL]}, "awq", "tier", None),
]


@pytest.mark.parametrize(
    ("case", "tier", "loads", "pool", "reason", "priority"), CASES, ids=[c[0] for c in CASES]
)
def test_resolution(
    case: str, tier: str, loads: L, pool: str, reason: str, priority: int | None
) -> None:
    route = resolve_tier(POLICY, "m", tier, loads)
    assert route is not None
    assert (route.pool, route.reason, route.priority) == (pool, reason, priority)
    assert route.served_model == POLICY.pools[pool].served_model
    assert route.home_pool == POLICY.pool_for("m", tier)


def test_model_not_offered_to_a_tier_resolves_to_none() -> None:
    assert resolve_tier(POLICY, "only-free", "premium", {}) is None
    assert resolve_tier(POLICY, "unknown-model", "free", {}) is None


def test_resolution_is_deterministic() -> None:
    loads: L = {"fp8": [FULL, KV_FULL], "awq": [BUSY]}
    assert {resolve_tier(POLICY, "m", "premium", loads) for _ in range(5)} == {
        resolve_tier(POLICY, "m", "premium", loads)
    }


SHORT = ReplicaLoad(waiting=0, kv_usage=0.1, max_model_len=2048)
SHORT_FULL = ReplicaLoad(waiting=9, kv_usage=0.5, max_model_len=2048)
LONG = ReplicaLoad(waiting=0, kv_usage=0.1, max_model_len=16384)
LONG_BUSY = ReplicaLoad(waiting=1, kv_usage=0.5, max_model_len=16384)
LONG_FULL = ReplicaLoad(waiting=9, kv_usage=0.5, max_model_len=16384)
NEED = 5000  # a prompt and the output it asks for, past 2048
CONTEXT_CASES: list[tuple[str, str, L, int, str, str]] = [
    # (case, tier, loads, need, pool, reason)
    ("fits home", "premium", {"fp8": [SHORT], "awq": [LONG]}, 1000, "fp8", "tier"),
    ("too long for home", "premium", {"fp8": [SHORT, SHORT], "awq": [LONG]}, NEED, "awq", "spill"),
    ("one home replica takes it", "premium", {"fp8": [SHORT, LONG], "awq": [LONG]}, NEED, "fp8",
     "tier"),
    ("spill pool full", "premium", {"fp8": [SHORT], "awq": [LONG_FULL]}, NEED, "awq", "spill"),
    ("spill pool's context unknown", "premium", {"fp8": [SHORT], "awq": [IDLE]}, NEED, "awq",
     "spill"),
    ("home's context unknown", "premium", {"fp8": [IDLE], "awq": [LONG]}, NEED, "fp8", "tier"),
    ("no pool takes it", "premium", {"fp8": [SHORT], "awq": [SHORT]}, NEED, "fp8", "tier"),
    ("no spill to a short pool", "premium", {"fp8": [LONG_FULL], "awq": [SHORT]}, NEED, "fp8",
     "tier"),
    ("borrows a busy pool that takes it", "free", {"awq": [SHORT], "fp8": [LONG_BUSY]}, NEED,
     "fp8", "spill"),
    ("no borrow of a short pool", "free", {"awq": [LONG_FULL], "fp8": [SHORT]}, NEED, "awq",
     "tier"),
    ("borrow for load when it fits", "free", {"awq": [SHORT_FULL], "fp8": [SHORT]}, 1000, "fp8",
     "spill"),
]


@pytest.mark.parametrize(
    ("case", "tier", "loads", "need", "pool", "reason"), CONTEXT_CASES,
    ids=[c[0] for c in CONTEXT_CASES],
)
def test_a_request_goes_to_a_pool_of_its_tier_that_takes_it(
    case: str, tier: str, loads: L, need: int, pool: str, reason: str
) -> None:
    route = resolve_tier(POLICY, "m", tier, loads, need)
    assert route is not None
    assert (route.pool, route.reason) == (pool, reason)
    assert route.home_pool == POLICY.pool_for("m", tier)

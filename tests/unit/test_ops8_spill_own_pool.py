"""A model served only by a tier's `spill_to` pool can be added to the policy.

With the shipped example (premium -> fp8, `spill_to: awq`), adding a public model that only
the awq pool serves (`{"default": "awq"}`) was refused as a "spill cycle" of premium: the
operator could add no awq-only model while premium spilled to awq. Such a model has nowhere to
spill for premium, and the run time keeps it home; a `spill_to` that is the tier's own pool for
every model it serves is still refused (it would never spill: a mistake)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.policy_doc import PolicyValidationError, parse_policy
from gateway.tenancy.tiers import ReplicaLoad, resolve_tier

EXAMPLE: dict[str, Any] = {
    "pools": {
        "fp8": {"served_model": "llama-70b-fp8", "replicas": ["http://127.0.0.1:9001"]},
        "awq": {"served_model": "llama-70b-awq", "replicas": ["http://127.0.0.1:9002"]},
    },
    "models": {"llama-70b": {"default": "fp8", "premium": "fp8", "free": "awq"}},
    "tiers": {
        "premium": {"limits": {"rpm": 600}, "priority": 0, "spill_to": "awq"},
        "free": {"limits": {"rpm": 60}, "priority": 10},
    },
}


def _with_model(name: str, per_tier: dict[str, str]) -> dict[str, Any]:
    doc = copy.deepcopy(EXAMPLE)
    doc["models"][name] = per_tier
    return doc


def test_a_model_only_the_spill_pool_serves_is_accepted_and_stays_home() -> None:
    policy = parse_policy(_with_model("embed", {"default": "awq"}))
    busy = ReplicaLoad(waiting=50, kv_usage=0.99)
    loads = {"fp8": [busy], "awq": [busy]}
    route = resolve_tier(policy, "embed", "premium", loads)
    assert route is not None
    assert (route.pool, route.reason) == ("awq", "tier")
    # the tier still spills its other models
    spilled = resolve_tier(policy, "llama-70b", "premium", {"fp8": [busy], "awq": [ReplicaLoad(
        waiting=0, kv_usage=0.1)]})
    assert spilled is not None and (spilled.pool, spilled.reason) == ("awq", "spill")


def test_a_spill_to_that_is_the_tiers_own_pool_for_every_model_is_still_refused() -> None:
    doc = copy.deepcopy(EXAMPLE)
    doc["models"]["llama-70b"]["premium"] = "awq"
    with pytest.raises(PolicyValidationError) as info:
        parse_policy(doc)
    assert info.value.field == "tiers.premium.spill_to"
    assert "own pool" in str(info.value)

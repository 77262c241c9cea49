"""The policy document's validation: every error names the offending field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gateway.policy_doc import Limits, PolicyDoc, PolicyValidationError, parse_policy

BASE: dict[str, Any] = {
    "pools": {
        "fp8": {"served_model": "llama-70b-fp8", "replicas": ["http://127.0.0.1:9001"]},
        "awq": {"served_model": "llama-70b-awq", "replicas": ["http://127.0.0.1:9002"]},
    },
    "models": {"llama-70b": {"premium": "fp8", "free": "awq"}},
    "tiers": {
        "premium": {"limits": {"rpm": 600}, "spill_to": "awq"},
        "free": {"limits": {"rpm": 60}, "priority": 10, "borrow_from": "fp8"},
    },
}


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[part]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


_DELETE = object()

INVALID = [
    ("unknown pool", _with("models.llama-70b.premium", "fp9"), "models.llama-70b.premium"),
    ("unknown tier", _with("models.llama-70b.gold", "fp8"), "models.llama-70b.gold"),
    ("spill to unknown pool", _with("tiers.premium.spill_to", "nope"), "tiers.premium.spill_to"),
    ("borrow unknown pool", _with("tiers.free.borrow_from", "nope"), "tiers.free.borrow_from"),
    ("spill to own pool", _with("tiers.premium.spill_to", "fp8"), "tiers.premium.spill_to"),
    ("spill cycle", _with("tiers.free.spill_to", "fp8"), "tiers.free.spill_to"),
    ("no tiers", _with("tiers", {}), "tiers"),
    ("model maps nothing", _with("models.llama-70b", {}), "models.llama-70b"),
    ("zero rpm", _with("tiers.free.limits", {"rpm": 0}), "tiers.free.limits.rpm"),
    ("unknown field", _with("tiers.free.colour", "red"), "tiers.free.colour"),
    ("bad replica url", _with("pools.fp8.replicas", ["ftp://x"]), "pools.fp8"),
    (
        "kv threshold > 1",
        _with("tiers.premium.spill_when", {"waiting": 1, "kv_usage": 2}),
        "tiers.premium.spill_when.kv_usage",
    ),
]


@pytest.mark.parametrize(("case", "doc", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_documents_name_the_field(case: str, doc: dict[str, Any], field: str) -> None:
    with pytest.raises(PolicyValidationError) as info:
        parse_policy(doc)
    assert info.value.field == field, str(info.value)


def test_the_canonical_document_is_valid_and_resolves_pools() -> None:
    doc = parse_policy(BASE)
    assert doc.pool_for("llama-70b", "premium") == "fp8"
    assert doc.pool_for("llama-70b", "free") == "awq"
    assert doc.pool_for("llama-70b", "other") is None
    assert doc.tiers["premium"].spill_when.waiting == 8  # documented default


def test_a_threshold_naming_one_level_keeps_the_others_default() -> None:
    # (before: "waiting: Field required", though the docs give each level's default)
    doc = parse_policy(_with("tiers.premium.spill_when", {"kv_usage": 0.9}))
    assert doc.tiers["premium"].spill_when.model_dump() == {"waiting": 8, "kv_usage": 0.9}
    doc = parse_policy(_with("tiers.free.borrow_below", {"waiting": 2}))
    assert doc.tiers["free"].borrow_below.model_dump() == {"waiting": 2, "kv_usage": 0.5}
    with pytest.raises(PolicyValidationError):  # what is given is still checked
        parse_policy(_with("tiers.premium.spill_when", {"kv_usage": 2}))


def test_limits_overlay_keeps_tier_defaults_for_unset_fields() -> None:
    tier = Limits(rpm=60, tpm=1000, max_concurrency=4)
    assert tier.overlay(Limits(rpm=5)) == Limits(rpm=5, tpm=1000, max_concurrency=4)
    assert tier.overlay(Limits()) == tier


def test_a_replica_in_two_pools_is_refused_on_input_but_a_stored_one_still_loads() -> None:
    doc = _with("pools.awq.replicas", ["http://127.0.0.1:9001/"])  # fp8's replica
    with pytest.raises(PolicyValidationError) as exc:
        parse_policy(doc)
    assert exc.value.field == "pools.awq.replicas"
    # a store written before the rule: gateways must still start on it
    assert PolicyDoc.model_validate(doc).pools["awq"].replicas == ["http://127.0.0.1:9001/"]


def test_a_replica_listed_twice_in_one_pool_is_refused() -> None:
    # two Replica objects of one id (host:port): the router and the scrapes key by it
    doc = _with("pools.awq.replicas", ["http://127.0.0.1:9100", "http://user:pw@127.0.0.1:9100/"])
    with pytest.raises(PolicyValidationError) as exc:
        parse_policy(doc)
    assert exc.value.field == "pools.awq.replicas" and "listed twice" in exc.value.message
    assert "pw" not in str(exc.value)

"""`keep_unknown`: a rewrite keeps the fields of the stored record this kvgate does not know,
at any depth, and never takes a known field from the stored record."""

from __future__ import annotations

import json

from gateway.policy_doc import Limits, PolicyDoc, parse_policy
from gateway.tenancy.models import Tenant
from gateway.tenancy.store import tenant_to_json
from gateway.tenancy.unknown import keep_unknown


def test_unknown_fields_of_a_tenant_are_kept_at_any_depth() -> None:
    stored = json.dumps({"id": "a", "tier": "free", "limits": {"rpm": 5, "burst": 9},
                         "salt_group": "g", "region": "eu"})
    new = tenant_to_json(Tenant(id="a", tier="gold", limits=Limits(tpm=10)))
    out = json.loads(keep_unknown(stored, new, Tenant))
    # known fields are the new record's (rpm and salt_group were dropped by the write)
    assert out == {"id": "a", "tier": "gold", "limits": {"tpm": 10, "burst": 9},
                   "region": "eu"}


def test_a_known_field_the_new_record_leaves_out_is_not_brought_back() -> None:
    stored = json.dumps({"id": "a", "tier": "free", "limits": {"rpm": 5}})
    out = json.loads(keep_unknown(stored, tenant_to_json(Tenant(id="a", tier="free")), Tenant))
    assert out == {"id": "a", "tier": "free"}


def test_unknown_fields_inside_a_policy_maps_entries_are_kept() -> None:
    doc = {"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
           "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}}
    stored = json.loads(json.dumps(doc))
    stored["pools"]["p"]["warm"] = True
    stored["pools"]["gone"] = {"served_model": "x", "warm": False}  # removed by the write
    stored["tiers"]["free"]["flow"] = {"band": 1, "future": 2}
    stored["later"] = [1, 2]
    new = parse_policy({**doc, "tiers": {"free": {"flow": {"band": 2}}}})
    out = json.loads(keep_unknown(json.dumps(stored), new.model_dump_json(exclude_unset=True),
                                  PolicyDoc))
    assert out["pools"] == {"p": {"served_model": "m", "replicas": ["http://x:1"],
                                  "warm": True}}
    assert out["tiers"]["free"]["flow"] == {"band": 2, "future": 2}
    assert out["later"] == [1, 2]


def test_a_stored_value_that_is_not_an_object_is_ignored() -> None:
    new = tenant_to_json(Tenant(id="a", tier="free"))
    assert keep_unknown("{not json", new, Tenant) == new
    assert keep_unknown("[1]", new, Tenant) == new

"""The code's configuration schema against its reference, field by field, in the direction
test_config_docs.py does not check: every field the code takes is named in
docs/configuration.md's row for its section (routing's cost-model settings, which that row
leaves to it, in routing/README.md), the policy sections' fields included (a pool's, a tier's
and its limits', flow and spill settings, fairness's, a seeded tenant's), and a default the
row states for a policy field is the code's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.config import load_config
from gateway.config.sections import TenantBootstrap
from gateway.policy_doc import Fairness, Limits, LoadThreshold, PoolConfig, TierConfig, TierFlow
from tests.unit.gateway.test_config_docs import POOLS, SECTIONS, _documented, _row, _stated

ROOT = Path(__file__).resolve().parents[3]
ROUTING_README = (ROOT / "routing" / "README.md").read_text()
# section row -> the models whose fields it must name
POLICY_MODELS: dict[str, tuple[type[BaseModel], ...]] = {
    "pools": (PoolConfig,),
    "tiers": (TierConfig, Limits, TierFlow, LoadThreshold),
    "fairness": (Fairness,),
    "tenants": (TenantBootstrap,),
}


def _names(section: str) -> set[str]:
    """Every backticked name in the row's defaults cell, inside parentheses too (a tier's
    `limits` (`rpm`, `tpm`, ...) names its sub-fields there)."""
    cell = _row(section)
    return set(cell.split("`")[1::2])


@pytest.mark.parametrize("section", SECTIONS)
def test_every_field_of_a_section_is_in_the_reference(section: str) -> None:
    fields = load_config(None, overrides=POOLS, environ={}).model_dump(mode="json")[section]
    unnamed = sorted(set(fields) - _names(section))
    if section == "routing":  # "the cost model's finer settings": routing/README.md
        unnamed = [name for name in unnamed if f"`{name}`" not in ROUTING_README]
    assert unnamed == [], f"{section} fields docs/configuration.md does not name"


@pytest.mark.parametrize("section", sorted(POLICY_MODELS))
def test_every_policy_field_is_in_the_reference(section: str) -> None:
    named = _names(section)
    fields = {name for model in POLICY_MODELS[section] for name in model.model_fields}
    assert sorted(fields - named) == []


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    return {name: info.get_default(call_default_factory=True)
            for name, info in model.model_fields.items() if not info.is_required()}


@pytest.mark.parametrize("section", sorted(POLICY_MODELS))
def test_a_stated_policy_default_is_the_codes(section: str) -> None:
    defaults: dict[str, Any] = {}
    for model in POLICY_MODELS[section]:
        for name, value in _defaults(model).items():
            defaults.setdefault(name, value.model_dump() if isinstance(value, BaseModel)
                                else value)
    differ = {}
    for name, text in _documented(_row(section)).items():
        if name not in defaults:
            continue
        if isinstance(defaults[name], dict):  # sub-fields: (`waiting` 8, `kv_usage` 0.95)
            for sub, number in re.findall(r"`(\w+)` (\d+(?:\.\d+)?)", text or ""):
                if float(number) != defaults[name].get(sub):
                    differ[f"{name}.{sub}"] = (number, defaults[name].get(sub))
            continue
        stated, value = _stated(text or "")
        if stated and value != defaults[name]:
            differ[name] = (text, defaults[name])
    assert differ == {}


def test_the_check_sees_a_field_missing_from_a_row() -> None:
    class Extra(PoolConfig):
        warm_up_s: float = 0.0

    assert "warm_up_s" not in _names("pools")
    assert "warm_up_s" in set(Extra.model_fields) - _names("pools")

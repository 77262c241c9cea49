"""A field that is not one, with no field close to its name (`urls` for a pool's replicas,
`endpoints`, a key from another product's config): the error said "unknown field" and no
more, where a near miss says `did you mean replicas?`; the user had to find the fields in
examples/kvgate.yaml. It now names the fields that go there (never a secret's)."""

from __future__ import annotations

import pytest

from gateway.config import load_config
from gateway.errors import ConfigError
from gateway.policy_doc import PolicyValidationError, parse_policy

POOL = {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}


def _line(overrides: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={}, overrides={"pools": {"a": POOL}, **overrides})
    return info.value.message.splitlines()[1].strip()


def test_a_pool_field_far_from_any_names_the_pools_fields() -> None:
    line = _line({"pools": {"a": {"served_model": "m", "urls": ["http://127.0.0.1:9"]}}})
    assert line == ("pools.a.urls: unknown field (known here: served_model, replicas, "
                    "discovery, api_key_env, priority, max_inflight)")


def test_a_section_far_from_any_names_the_sections_but_no_secret() -> None:
    line = _line({"listen": {"port": 1}})
    assert line.startswith("listen: unknown field (known here: pools, models, tiers, ")
    assert "redis_url" not in line and "admin_token" not in line and "salt_secret" not in line


def test_a_near_miss_still_names_the_one_meant() -> None:
    assert _line({"tiers": {"free": {"limits": {"rmp": 1}}}}) == (
        "tiers.free.limits.rmp: unknown field (did you mean rpm?)")


def test_the_admin_apis_policy_names_only_policy_sections() -> None:
    with pytest.raises(PolicyValidationError) as info:
        parse_policy({"pools": {"a": POOL}, "models": {"m": {"default": "a"}}, "colour": 1})
    assert "(known here: pools, models, tiers, fairness)" in str(info.value)

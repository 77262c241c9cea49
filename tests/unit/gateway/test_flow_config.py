"""Flow control's configuration and policy: defaults shared with the core and documented in
the example file, the policy's bands/weights/waits and their validation, the replay's tiers."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import yaml

from gateway.config import FlowSection, load_config
from gateway.errors import ConfigError
from gateway.policy_doc import PolicyDoc, PolicyValidationError, parse_policy
from loadtest.replay.generators import AgentSpec, agent_loops
from loadtest.replay.tiers import assign, conversation_keys, noisy, parse_mix
from loadtest.replay.workload import ReplayRequest
from routing.flow import DEFAULT_MAX_WAIT_S, DEFAULT_MIN_SHARE, FlowConfig

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kvgate.yaml"
POOLS = {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}


def test_config_defaults_are_the_cores_and_the_example_documents_them() -> None:
    section = FlowSection()
    assert section.flow_config() == FlowConfig()
    example = yaml.safe_load(EXAMPLE.read_text())["flow"]
    assert example == section.model_dump()
    fairness = yaml.safe_load(EXAMPLE.read_text())["fairness"]
    assert fairness["default_min_share"] == DEFAULT_MIN_SHARE


def test_env_overrides_reach_the_flow_section() -> None:
    cfg = load_config(None, overrides=POOLS, environ={"KVGATE_FLOW__MAX_QUEUE": "7",
                                                      "KVGATE_FLOW__ENABLED": "false"})
    assert cfg.flow.max_queue == 7 and not cfg.flow.enabled
    assert cfg.flow.flow_config().max_queue == 7


def test_flow_class_from_tiers_and_tenant_weights() -> None:
    doc = parse_policy({
        "tiers": {"default": {}, "premium": {"priority": 0, "flow": {"max_wait_s": 5}},
                  "free": {"priority": 10, "flow": {"band": 3, "weight": 2}}},
        "fairness": {"tenants": {"acme": 4}, "min_share": {"3": 0.2}},
    })
    assert doc.flow_class("premium", "x") == (0, 1.0, 5.0)
    assert doc.flow_class("free", "x") == (3, 2.0, DEFAULT_MAX_WAIT_S)
    assert doc.flow_class("free", "acme") == (3, 4.0, DEFAULT_MAX_WAIT_S)
    assert doc.flow_class("unknown", "x") == (0, 1.0, DEFAULT_MAX_WAIT_S)
    assert doc.fairness.min_share == {3: 0.2}
    # the config carries the policy's fairness into the seeded policy document
    cfg = load_config(None, overrides={**POOLS, "fairness": {"tenants": {"acme": 2}}},
                      environ={})
    assert cfg.policy_doc().fairness.tenants == {"acme": 2}


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"fairness": {"min_share": {"1": 0.6, "2": 0.5}}}, "fairness"),
        ({"fairness": {"min_share": {"1": 1.0}}}, "fairness.min_share.1"),
        ({"fairness": {"tenants": {"a": 0}}}, "fairness.tenants.a"),
        ({"fairness": {"tenants": {"a": 1e-300}}}, "fairness.tenants.a"),
        ({"fairness": {"tenants": {"a": 5e-4}}}, "fairness.tenants.a"),  # (floor 1e-3)
        ({"tiers": {"default": {"flow": {"weight": 5e-4}}}}, "tiers.default.flow.weight"),
        ({"tiers": {"default": {"flow": {"weight": -1}}}}, "tiers.default.flow.weight"),
        ({"tiers": {"default": {"flow": {"max_wait_s": 0}}}}, "tiers.default.flow.max_wait_s"),
    ],
)
def test_invalid_flow_policy_names_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(PolicyValidationError) as exc:
        parse_policy(doc)
    assert exc.value.field.startswith(field), exc.value


@pytest.mark.parametrize(
    ("flow", "field"),
    [
        ({"kv_knee": 1.5}, "flow.kv_knee"),
        ({"max_unanswered": 0}, "flow.max_unanswered"),
        ({"max_queue": -1}, "flow.max_queue"),
        ({"tick_ms": 0}, "flow.tick_ms"),
        ({"max_waitng": 3}, "flow.max_waitng"),  # a typo is not ignored
    ],
)
def test_invalid_flow_config_names_the_field(flow: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides={**POOLS, "flow": flow}, environ={})
    assert field in str(exc.value)


def test_old_policy_documents_stay_valid() -> None:
    doc = PolicyDoc.model_validate({"tiers": {"default": {}, "free": {"priority": 1}}})
    assert doc.flow_class("free", "t") == (1, 1.0, DEFAULT_MAX_WAIT_S)


def _r(i: int, t: float = 0.0) -> ReplayRequest:
    return ReplayRequest(t, 100, 10, (0, 1000 + i, 2000 + i))


def test_replay_tiers_follow_the_mix_and_keep_conversations_together() -> None:
    reqs = [_r(i % 500, float(i)) for i in range(4000)]  # 500 conversations, 8 turns each
    out = assign(reqs, parse_mix("premium:0.3,free:0.7"), 4)
    share = sum(1 for r in out if r.tier == "premium") / len(out)
    assert 0.25 < share < 0.35
    by_conv: dict[int, set[str]] = {}
    for r in out:
        by_conv.setdefault(r.block_ids[1], set()).add(r.tenant)
    assert all(len(t) == 1 for t in by_conv.values())
    assert {r.tenant for r in out} <= {f"{t}-{k}" for t in ("premium", "free") for k in range(4)}


def test_replay_tenants_follow_agent_sessions_past_a_long_shared_prompt() -> None:
    """Agent loops share a tool prompt of many blocks: its second block told no session from
    another, and nearly every request went to one tenant."""
    reqs = agent_loops(AgentSpec(sessions=40))
    out = assign(reqs, parse_mix("premium:0.3,free:0.7"), 4)
    by_tenant = Counter(r.tenant for r in out)
    assert len(by_tenant) >= 6 and max(by_tenant.values()) < 0.4 * len(out)
    keys = conversation_keys(reqs)
    assert len(set(keys)) == 40  # one per session
    tenant_of: dict[str, set[str]] = {}
    for key, r in zip(keys, out, strict=True):
        tenant_of.setdefault(key, set()).add(r.tenant)
    assert all(len(t) == 1 for t in tenant_of.values())
    # a prompt no other chain continues differently is a conversation of its own
    assert conversation_keys([_r(0), ReplayRequest(0.0, 10, 1, (7, 8))])[1] == "#1"


def test_noisy_tenant_adds_its_extra_requests_on_top() -> None:
    base = assign([_r(i, float(i)) for i in range(400)], parse_mix("a:1"), 4)
    loud = noisy(base, "a-0", 5.0)
    mine = sum(1 for r in base if r.tenant == "a-0")
    assert len(loud) == len(base) + 4 * mine
    assert sum(1 for r in loud if r.tenant == "a-0") == 5 * mine
    others = sorted((r.arrival_s, r.block_ids) for r in loud if r.tenant != "a-0")
    assert others == sorted((r.arrival_s, r.block_ids) for r in base if r.tenant != "a-0")
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(loud))

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from routing.config import RouterConfig
from routing.policies import REGISTRY
from routing.router import NoCandidate, Router
from routing.types import ReplicaView

from .helpers import feats, views

POLICIES = sorted(REGISTRY)
SYSTEM = "You are a helpful assistant. " * 80  # ~9 blocks every request shares


def test_registry_names_the_four_policies() -> None:
    assert POLICIES == ["cache_aware", "consistent_hash", "least_load", "round_robin"]
    assert RouterConfig().policy == "cache_aware"


def test_unknown_policy_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="nope"):
        Router(RouterConfig(policy="nope"))


@pytest.mark.parametrize("policy", POLICIES)
def test_no_healthy_replica_raises(policy: str) -> None:
    r = Router(RouterConfig(policy=policy))
    with pytest.raises(NoCandidate):
        r.pick(feats("x"), views(3, healthy=False), 0.0)
    with pytest.raises(NoCandidate):
        r.pick(feats("x"), [], 0.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_never_picks_unhealthy_and_fallbacks_cover_the_rest(policy: str) -> None:
    r = Router(RouterConfig(policy=policy))
    vs = [*views(3), ReplicaView(id="sick", pool="p", healthy=False)]
    for i in range(10):
        d = r.pick(feats(f"prompt {i} " * 100), vs, float(i))
        assert d.replica != "sick"
        assert sorted((d.replica, *d.fallbacks)) == ["r0", "r1", "r2"]


@pytest.mark.parametrize("policy", POLICIES)
def test_view_order_does_not_matter(policy: str) -> None:
    a, b = Router(RouterConfig(policy=policy)), Router(RouterConfig(policy=policy))
    vs = views(5, inflight=2)
    for i in range(20):
        f = feats(SYSTEM + f"user {i} " * 60)
        da, db = a.pick(f, vs, 0.0), b.pick(f, list(reversed(vs)), 0.0)
        assert (da.replica, da.fallbacks, da.reason) == (db.replica, db.fallbacks, db.reason)
        a.record_route(da.replica, f, 0.0)
        b.record_route(db.replica, f, 0.0)


def test_round_robin_cycles_in_id_order() -> None:
    r = Router(RouterConfig(policy="round_robin"))
    vs = list(reversed(views(3)))
    picks = [r.pick(feats("x"), vs, 0.0) for _ in range(4)]
    assert [d.replica for d in picks] == ["r0", "r1", "r2", "r0"]
    assert {d.reason for d in picks} == {"round-robin"}


@pytest.mark.parametrize(
    ("loads", "prefill", "expected"),
    [
        ([3, 1, 2], [0, 0, 0], "r1"),
        ([1, 1, 2], [500, 100, 0], "r1"),  # equal requests: fewer prompt tokens waiting wins
        ([0, 5, 5], [0, 0, 0], "r0"),
    ],
)
def test_least_load(loads: list[int], prefill: list[int], expected: str) -> None:
    r = Router(RouterConfig(policy="least_load"))
    vs = [
        ReplicaView(id=f"r{i}", pool="p", inflight=n, inflight_prefill_tokens=t)
        for i, (n, t) in enumerate(zip(loads, prefill, strict=True))
    ]
    d = r.pick(feats("x"), vs, 0.0)
    assert (d.replica, d.reason) == (expected, "least-load")


def test_least_load_ties_spread_by_prompt_hash() -> None:
    r = Router(RouterConfig(policy="least_load"))
    chosen = Counter(r.pick(feats(f"p{i}"), views(4), 0.0).replica for i in range(200))
    assert len(chosen) == 4


def _warm(router: Router, prompts: list[str], vs: list[ReplicaView]) -> list[str]:
    """Route prompts one by one, counting each as in flight; returns the picks."""
    load = {v.id: v.inflight for v in vs}
    picks = []
    for p in prompts:
        cur = [replace(v, inflight=load[v.id]) for v in vs]
        d = router.pick(feats(p), cur, 0.0)
        router.record_route(d.replica, feats(p), 0.0)
        load[d.replica] += 1
        picks.append(d.replica)
    return picks


def test_consistent_hash_is_sticky_and_overflows_to_a_stable_next() -> None:
    r = Router(RouterConfig(policy="consistent_hash", load_factor=1.25, load_slack=1.0))
    f = feats("hot prefix " * 100)
    idle = views(4, inflight=1)
    home = r.pick(f, idle, 0.0)
    assert home.reason == "hash"
    assert r.pick(f, idle, 1.0).replica == home.replica
    busy = [replace(v, inflight=9 if v.id == home.replica else 1) for v in idle]
    over = [r.pick(f, busy, 2.0) for _ in range(3)]
    assert {d.reason for d in over} == {"overflow"}
    assert len({d.replica for d in over}) == 1
    assert over[0].replica == home.fallbacks[0]  # the next replica on the ring


@pytest.mark.parametrize("policy", ["consistent_hash", "cache_aware"])
def test_shared_system_prompt_does_not_pin_everything(policy: str) -> None:
    r = Router(RouterConfig(policy=policy))
    prompts = [SYSTEM + f"conversation {i} " * 80 for i in range(64)]
    picks = Counter(_warm(r, prompts, views(8)))
    assert len(picks) == 8
    cfg = r.config
    assert max(picks.values()) <= cfg.load_factor * 64 / 8 + cfg.load_slack


def test_cache_aware_conversation_returns_to_its_replica() -> None:
    r = Router()
    vs = views(4)
    first = [SYSTEM + f"conversation {i} " * 80 for i in range(8)]
    homes = _warm(r, first, vs)
    # later turns, with every replica equally loaded: each goes home
    for prompt, home in zip(first, homes, strict=True):
        d = r.pick(feats(prompt + " follow-up question" * 20), views(4, inflight=2), 5.0)
        assert (d.replica, d.reason) == (home, "prefix-hit")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prompt_past_a_replicas_context_goes_to_one_that_takes_it(policy: str) -> None:
    """Replicas of one pool differing in ``max_model_len``: a prompt past one's context is
    not sent there while another takes it (or may: not known); when none does, all stay
    candidates (the client gets the engine's own answer, not a 503)."""
    r = Router(RouterConfig(policy=policy))
    vs = [ReplicaView(id=f"r{i}", pool="p", max_model_len=n)
          for i, n in enumerate((2048, None, 4096, 1024))]
    prompts = [feats(f"{i} " + "word " * 2000) for i in range(20)]  # ~2,500 tokens each
    assert {r.pick(f, vs, float(i)).replica for i, f in enumerate(prompts)} == {"r1", "r2"}
    # the output it asks for counts: 1,000 tokens and 1,500 asked need 2,500 of context
    asked = [replace(feats(f"{i} " + "word " * 800), output_tokens=1500) for i in range(20)]
    assert {r.pick(f, vs, float(i)).replica for i, f in enumerate(asked)} == {"r1", "r2"}
    too_short = [vs[0], vs[3]]
    assert r.pick(prompts[0], too_short, 30.0).replica in {"r0", "r3"}
    assert r.pick(feats("hi"), too_short, 31.0).replica in {"r0", "r3"}

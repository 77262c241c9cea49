"""The peers' published rules, re-implemented as yardsticks (offline comparison only)."""

from __future__ import annotations

import pytest

from routing.config import RouterConfig
from routing.policies import REGISTRY, YARDSTICKS
from routing.router import Router
from routing.types import ReplicaView

from .helpers import feats

DOC = "a long shared document " * 400


def _router(policy: str) -> Router:
    return Router(RouterConfig(), policy=YARDSTICKS[policy])


def test_yardsticks_are_not_servable() -> None:
    assert not set(YARDSTICKS) & set(REGISTRY)
    with pytest.raises(ValueError, match="unknown policy"):
        Router(RouterConfig(policy="sglang_style"))


@pytest.mark.parametrize(
    ("inflight", "expected", "reason"),
    [
        # balanced: the longest match over half the prompt wins, whatever the load
        ({"r0": 0, "r1": 30}, "r1", "prefix-hit"),
        # imbalanced (max - min > 64 and max > 1.5 x min): the least loaded
        ({"r0": 0, "r1": 70}, "r0", "imbalanced"),
    ],
)
def test_sglang_style_balance_then_cache(
    inflight: dict[str, int], expected: str, reason: str
) -> None:
    r = _router("sglang_style")
    r.record_route("r1", feats(DOC), 0.0)
    vs = [ReplicaView(id=k, pool="p", inflight=n) for k, n in inflight.items()]
    d = r.pick(feats(DOC + " question"), vs, 1.0)
    assert (d.replica, d.reason) == (expected, reason)


def test_sglang_style_sends_a_miss_to_the_smallest_cache() -> None:
    r = _router("sglang_style")
    r.record_route("r0", feats("x" * 20_000), 0.0)
    r.record_route("r1", feats("y" * 4_000), 0.0)
    vs = [ReplicaView(id="r0", pool="p"), ReplicaView(id="r1", pool="p"),
          ReplicaView(id="r2", pool="p")]
    d = r.pick(feats("something new " * 100), vs, 1.0)
    assert (d.replica, d.reason) == ("r2", "smallest-cache")


def test_llmd_style_weighs_prefix_queue_and_kv() -> None:
    r = _router("llmd_style")
    r.record_route("r1", feats(DOC), 0.0)
    fresh = {"scrape_age_s": 0.1}
    # the holder wins on prefix (3 x 1.0) against a shorter queue elsewhere (2 x 1.0)...
    vs = [ReplicaView(id="r0", pool="p", waiting=0, kv_usage=0.1, **fresh),  # type: ignore[arg-type]
          ReplicaView(id="r1", pool="p", waiting=5, kv_usage=0.1, **fresh)]  # type: ignore[arg-type]
    d = r.pick(feats(DOC), vs, 1.0, explain=True)
    assert d.replica == "r1"
    assert {c.replica: c.terms["prefix"] for c in d.ranked}["r1"] == pytest.approx(1.0)
    # ...but not against a shorter queue and an emptier cache together (2 + 2 > 3)
    vs = [ReplicaView(id="r0", pool="p", waiting=0, kv_usage=0.0, **fresh),  # type: ignore[arg-type]
          ReplicaView(id="r1", pool="p", waiting=5, kv_usage=1.0, **fresh)]  # type: ignore[arg-type]
    assert r.pick(feats(DOC), vs, 1.0).replica == "r0"

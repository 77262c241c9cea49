"""Policy registry: the ONE place a routing policy is named (``RouterConfig.policy``).

`REGISTRY` holds the policies a gateway may serve with. `YARDSTICKS` holds re-implementations
of peer routers' published rules, run by the offline replay for comparison only (the replay's
oracle, which needs the engines' true state, lives in ``loadtest.replay.oracle``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from routing.policies.base import PickContext, Policy, RouterState
from routing.policies.cache_aware import CacheAware
from routing.policies.consistent_hash import ConsistentHash
from routing.policies.least_load import LeastLoad
from routing.policies.llmd_style import LlmdStyle
from routing.policies.round_robin import RoundRobin
from routing.policies.sglang_style import SGLangStyle

__all__ = [
    "REGISTRY", "YARDSTICKS", "PickContext", "Policy", "PolicyFactory", "RouterState",
    "build_policy",
]

PolicyFactory = Callable[[RouterState], Policy]

REGISTRY: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        RoundRobin.name: RoundRobin,
        LeastLoad.name: LeastLoad,
        ConsistentHash.name: ConsistentHash,
        CacheAware.name: CacheAware,
    }
)

YARDSTICKS: Mapping[str, PolicyFactory] = MappingProxyType(
    {SGLangStyle.name: SGLangStyle, LlmdStyle.name: LlmdStyle}
)


def build_policy(name: str, state: RouterState) -> Policy:
    factory = REGISTRY.get(name)
    if factory is None:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"routing.policy: unknown policy {name!r} (known: {known})")
    return factory(state)

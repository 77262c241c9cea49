"""Policy registry: the ONE place a routing policy is named (``RouterConfig.policy``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from routing.policies.base import PickContext, Policy, RouterState
from routing.policies.cache_aware import CacheAware
from routing.policies.consistent_hash import ConsistentHash
from routing.policies.least_load import LeastLoad
from routing.policies.round_robin import RoundRobin

__all__ = ["REGISTRY", "PickContext", "Policy", "RouterState", "build_policy"]

REGISTRY: Mapping[str, Callable[[RouterState], Policy]] = MappingProxyType(
    {
        RoundRobin.name: RoundRobin,
        LeastLoad.name: LeastLoad,
        ConsistentHash.name: ConsistentHash,
        CacheAware.name: CacheAware,
    }
)


def build_policy(name: str, state: RouterState) -> Policy:
    factory = REGISTRY.get(name)
    if factory is None:
        known = ", ".join(sorted(REGISTRY))
        raise ValueError(f"routing.policy: unknown policy {name!r} (known: {known})")
    return factory(state)

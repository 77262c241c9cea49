"""Tier resolution with spill-over: a pure function (no I/O, no clock, deterministic).

public model + tenant tier + per-pool load signals -> (pool, served model, priority, reason).
A tier uses its own pool; it spills to `spill_to` only when every replica of its own pool is
saturated (or unhealthy) and the target still has an unsaturated healthy replica; it borrows
`borrow_from` only when its own pool is saturated and the borrowed pool is idle (every healthy
replica at or below `borrow_below`). Unknown signals (None) count as neither saturated nor
idle, so missing scrapes never move traffic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.policy_doc import LoadThreshold, PolicyDoc, TierConfig

__all__ = ["LoadSignal", "ReplicaLoad", "TierRoute", "resolve_tier"]


class LoadSignal(Protocol):
    """What tier resolution reads of a replica (routing's `ReplicaView` satisfies it)."""

    @property
    def healthy(self) -> bool: ...
    @property
    def waiting(self) -> float | None: ...
    @property
    def kv_usage(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    waiting: float | None = None
    kv_usage: float | None = None
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class TierRoute:
    pool: str
    served_model: str | None  # None: the pool learns it from its replicas
    priority: int | None  # set only for pools running --scheduling-policy priority
    reason: Literal["tier", "spill"]
    home_pool: str  # the tier's own pool (== pool unless spilled)


def _saturated(r: LoadSignal, level: LoadThreshold) -> bool:
    if not r.healthy:
        return True
    return (r.waiting is not None and r.waiting >= level.waiting) or (
        r.kv_usage is not None and r.kv_usage >= level.kv_usage
    )


def _idle(r: LoadSignal, level: LoadThreshold) -> bool:
    return (
        r.waiting is not None
        and r.kv_usage is not None
        and r.waiting <= level.waiting
        and r.kv_usage < level.kv_usage
    )


def _all_saturated(replicas: Sequence[LoadSignal], level: LoadThreshold) -> bool:
    """Every replica saturated; an empty pool counts as saturated."""
    return all(_saturated(r, level) for r in replicas)


def _pool_idle(replicas: Sequence[LoadSignal], level: LoadThreshold) -> bool:
    healthy = [r for r in replicas if r.healthy]
    return bool(healthy) and all(_idle(r, level) for r in healthy)


def _spill_target(
    tier: TierConfig, home: str, loads: Mapping[str, Sequence[LoadSignal]]
) -> str | None:
    if not _all_saturated(loads.get(home, ()), tier.spill_when):
        return None
    spill, borrow = tier.spill_to, tier.borrow_from
    if spill not in (None, home) and not _all_saturated(loads.get(spill, ()), tier.spill_when):
        return spill
    if borrow not in (None, home) and _pool_idle(loads.get(borrow, ()), tier.borrow_below):
        return borrow
    return None


def resolve_tier(
    policy: PolicyDoc,
    model: str,
    tier: str,
    loads: Mapping[str, Sequence[LoadSignal]],
) -> TierRoute | None:
    """Where a request for public `model` from a `tier` tenant goes; None if not offered."""
    home = policy.pool_for(model, tier)
    if home is None:
        return None
    tier_cfg = policy.tiers.get(tier, TierConfig())
    target = _spill_target(tier_cfg, home, loads)
    pool = target or home
    pool_cfg = policy.pools[pool]
    return TierRoute(
        pool=pool,
        served_model=pool_cfg.served_model,
        priority=tier_cfg.priority if pool_cfg.priority else None,
        reason="spill" if target else "tier",
        home_pool=home,
    )

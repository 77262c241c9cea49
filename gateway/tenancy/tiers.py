"""Tier resolution with spill-over: a pure function (no I/O, no clock, deterministic).

public model + tenant tier + per-pool load signals -> (pool, served model, priority, reason).
A tier uses its own pool; it spills to `spill_to` only when every replica of its own pool is
saturated (or unhealthy) and the target still has an unsaturated healthy replica; it borrows
`borrow_from` only when its own pool is saturated and the borrowed pool is idle (every healthy
replica at or below `borrow_below`). Unknown signals (None) count as neither saturated nor
idle, so missing scrapes never move traffic.

A request too long for its home pool (`need`: its prompt and the output it asks for, past the
``max_model_len`` of every replica there) goes to the tier's `spill_to` pool if that takes it,
else its `borrow_from` pool if that does, whatever their load (vLLM would refuse it at home);
it stays home when neither does. Spill-over and borrowing for load never go to a pool too
short for the request. An unknown context length (None) counts as long enough.
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
    @property
    def max_model_len(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    waiting: float | None = None
    kv_usage: float | None = None
    healthy: bool = True
    max_model_len: int | None = None


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


def _takes(replicas: Sequence[LoadSignal], need: int) -> bool:
    """Some replica's context takes ``need`` tokens (or is not known); an empty pool's not."""
    return any(r.max_model_len is None or r.max_model_len >= need for r in replicas)


def _spill_target(
    tier: TierConfig, home: str, loads: Mapping[str, Sequence[LoadSignal]], need: int
) -> str | None:
    def takes(pool: str | None) -> bool:  # another pool, long enough for this request
        return pool not in (None, home) and _takes(loads.get(str(pool), ()), need)

    spill, borrow = tier.spill_to, tier.borrow_from
    own = loads.get(home, ())
    if own and not _takes(own, need):  # too long for home: a pool that takes it, if any
        return next((p for p in (spill, borrow) if takes(p)), None)
    if not _all_saturated(own, tier.spill_when):
        return None
    if takes(spill) and not _all_saturated(loads.get(str(spill), ()), tier.spill_when):
        return spill
    if takes(borrow) and _pool_idle(loads.get(str(borrow), ()), tier.borrow_below):
        return borrow
    return None


def resolve_tier(
    policy: PolicyDoc,
    model: str,
    tier: str,
    loads: Mapping[str, Sequence[LoadSignal]],
    need: int = 0,
) -> TierRoute | None:
    """Where a request for public `model` from a `tier` tenant goes; None if not offered.
    ``need``: the context the request takes (its prompt and the output it asks for)."""
    home = policy.pool_for(model, tier)
    if home is None:
        return None
    tier_cfg = policy.tiers.get(tier, TierConfig())
    target = _spill_target(tier_cfg, home, loads, need)
    pool = target or home
    pool_cfg = policy.pools[pool]
    return TierRoute(
        pool=pool,
        served_model=pool_cfg.served_model,
        priority=tier_cfg.priority if pool_cfg.priority else None,
        reason="spill" if target else "tier",
        home_pool=home,
    )

"""Tier resolution with spill-over: a pure function (no I/O, no clock, deterministic).

public model + tenant tier + per-pool load signals -> (pool, served model, priority, reason).
A tier uses its own pool; it spills to `spill_to` only when every replica of its own pool is
saturated (or unhealthy) and the target still has an unsaturated healthy replica; it borrows
`borrow_from` only when its own pool is saturated and the borrowed pool is idle (every healthy
replica at or below `borrow_below`). Unknown signals (None) count as neither saturated nor
idle, so missing scrapes never move traffic.

Scrapes are stale (one every ``routing.scrape_interval_ms``): in a burst every request
between two of them saw the same levels, and a home pool scraped idle took all of it, though
kvgate had just sent it more than it runs. So the home pool, and a pool to borrow, are read
at their live load (``live``, from `live_load`): the scrape reconciled with the requests
kvgate has in flight there (with shared routing state, the whole fleet's), the ones past
what a replica was seen running counted as waiting, and its KV usage with their prompts in.
A burst spills once home is full by that count, and a pool kvgate has just filled is not
idle. The spill pool's room is read at its scrape: how many requests a replica runs at once
is known only once some wait there, and counting the rest of kvgate's requests as waiting
would call an idle spill pool full after a few requests a replica. A replica never scraped
stays unknown.

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
from routing.flow.saturation import projected_kv
from routing.peers import ReplicaLoad as PeerLoad
from routing.types import ReplicaView

__all__ = ["LoadSignal", "ReplicaLoad", "TierRoute", "live_load", "resolve_tier"]


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


def live_load(view: ReplicaView, peer: PeerLoad | None = None) -> ReplicaLoad:
    """``view``'s load now, as tier resolution reads it (``peer``: the other gateways' there,
    with shared routing state). Waiting: its requests now less the ones it runs, and at least
    its scraped waiting ones. Its requests now: kvgate's in flight there (sent, not ended), or
    the scraped waiting and running ones when more (other clients', or kvgate's since ended);
    the ones it runs: the scraped running ones, and at least one while nothing waited there
    (its batch size is not known: a replica with room runs more, so this errs towards
    spilling). KV: the scraped usage plus the prompts of kvgate's requests not answered yet
    (flow control's `projected_kv`). Unknown (None) while it was never scraped."""
    inflight, tokens = view.inflight, view.inflight_prefill_tokens
    if peer is not None:
        inflight, tokens = inflight + peer.inflight, tokens + peer.prefill_tokens
    waiting, running = view.waiting, view.running or 0.0
    if waiting is not None:
        runs = running if waiting > 0 else max(running, 1.0)
        waiting = max(waiting, max(waiting + running, float(inflight)) - runs)
    return ReplicaLoad(waiting=waiting, kv_usage=projected_kv(view, tokens),
                       healthy=view.healthy, max_model_len=view.max_model_len)


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
    tier: TierConfig, home: str, loads: Mapping[str, Sequence[LoadSignal]], need: int,
    live: Mapping[str, Sequence[LoadSignal]],
) -> str | None:
    def takes(pool: str | None) -> bool:  # another pool, long enough for this request
        return pool not in (None, home) and _takes(loads.get(str(pool), ()), need)

    spill, borrow = tier.spill_to, tier.borrow_from
    own = loads.get(home, ())
    if own and not _takes(own, need):  # too long for home: a pool that takes it, if any
        return next((p for p in (spill, borrow) if takes(p)), None)
    if not _all_saturated(live.get(home, ()), tier.spill_when):
        return None
    if takes(spill) and not _all_saturated(loads.get(str(spill), ()), tier.spill_when):
        return spill
    if takes(borrow) and _pool_idle(live.get(str(borrow), ()), tier.borrow_below):
        return borrow
    return None


def resolve_tier(
    policy: PolicyDoc,
    model: str,
    tier: str,
    loads: Mapping[str, Sequence[LoadSignal]],
    need: int = 0,
    live: Mapping[str, Sequence[LoadSignal]] | None = None,
) -> TierRoute | None:
    """Where a request for public `model` from a `tier` tenant goes; None if not offered.
    ``need``: the context the request takes (its prompt and the output it asks for);
    ``loads``: the pools' replicas at their scrape; ``live``: at their live load (`live_load`;
    None: ``loads``), read for the home pool and a pool to borrow."""
    home = policy.pool_for(model, tier)
    if home is None:
        return None
    tier_cfg = policy.tiers.get(tier, TierConfig())
    target = _spill_target(tier_cfg, home, loads, need, loads if live is None else live)
    pool = target or home
    pool_cfg = policy.pools[pool]
    return TierRoute(
        pool=pool,
        served_model=pool_cfg.served_model,
        priority=tier_cfg.priority if pool_cfg.priority else None,
        reason="spill" if target else "tier",
        home_pool=home,
    )

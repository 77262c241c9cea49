"""Is a pool saturated? A pure rule over the replicas' views and other gateways' load.

A replica *has room* when one more request would not queue inside vLLM beyond the configured
bound (`Saturation`): its unanswered prompt tokens and requests (the prefill queue kvgate itself
sent it, exact), vLLM's scraped waiting queue, KV usage at the knee (the scraped usage plus the
unanswered prompts), and an
optional in-flight cap. Other gateways' in-flight work on the replica (`routing.peers`) is
added first, so the rule is fleet-wide. A pool is *saturated* when it has healthy replicas and
none of them has room; a pool without a healthy replica is not saturated (holding requests
for it would not help: the proxy answers 503 at once).

Scraped values are used as they are (at most one scrape interval old); ``None`` (no scrape)
never makes a replica full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from routing.flow.config import Saturation
from routing.peers import ReplicaLoad
from routing.types import ReplicaView

__all__ = [
    "full_reason", "never_spare", "pool_saturated", "projected_kv", "replica_reasons", "with_room",
    "with_spare",
]

_NO_PEERS: Mapping[str, ReplicaLoad] = {}


def full_reason(
    view: ReplicaView, peer: ReplicaLoad | None, rule: Saturation
) -> str | None:
    """Why ``view``'s replica cannot take a request now ("prefill", "unanswered", "inflight",
    "waiting", "kv"), or None when it has room."""
    prefill = view.inflight_prefill_tokens
    inflight = view.inflight
    unanswered = view.inflight_prefill
    if peer is not None:
        prefill += peer.prefill_tokens
        inflight += peer.inflight
        unanswered += peer.prefill
    if prefill >= rule.max_prefill_tokens:
        return "prefill"
    if rule.max_unanswered is not None and unanswered >= rule.max_unanswered:
        return "unanswered"
    if rule.max_inflight is not None and inflight >= rule.max_inflight:
        return "inflight"
    waiting = view.waiting
    if waiting is not None and waiting > rule.max_waiting:
        return "waiting"
    # KV at the knee is full even with nothing waiting: what is admitted now grows into the
    # cache as it decodes and, past the knee, vLLM preempts (the benchmark: docs/flow-control.md)
    kv = projected_kv(view, prefill)
    if kv is not None and kv >= rule.kv_knee:
        return "kv"
    return None


def projected_kv(view: ReplicaView, prefill_tokens: int) -> float | None:
    """KV usage once the unanswered prompts are in: the scraped usage plus their tokens over
    the capacity (vLLM admits a prompt with its first chunk's blocks; the rest grows into the
    cache and, past the knee, preempts). None: never scraped."""
    kv = view.kv_usage
    if kv is None:
        return None
    cap = view.cache_capacity_tokens
    return kv + prefill_tokens / cap if cap else kv


def with_room(
    views: Sequence[ReplicaView], rule: Saturation,
    peers: Mapping[str, ReplicaLoad] = _NO_PEERS, tokens: int = 0,
) -> list[ReplicaView]:
    """``views`` narrowed to where a request of ``tokens`` prompt tokens goes without queueing
    beyond the bound: the others are marked unhealthy for the router. Among the replicas with
    room, the ones whose KV stays under the knee with the prompt in; when none does, the one
    with the most KV headroom (fewest preemptions). Unchanged when no replica has room."""
    room: list[tuple[ReplicaView, float | None]] = []
    for v in views:
        if not v.healthy:
            continue
        peer = peers.get(v.id)
        if full_reason(v, peer, rule) is None:
            prefill = v.inflight_prefill_tokens + (peer.prefill_tokens if peer else 0)
            kv = projected_kv(v, prefill + tokens)
            room.append((v, kv))
    if not room:
        return list(views)
    fit = {v.id for v, kv in room if kv is None or kv < rule.kv_knee}
    if not fit:
        fit = {min(room, key=_kv_of)[0].id}
    return [v if v.id in fit or not v.healthy else replace(v, healthy=False) for v in views]


def with_spare(
    views: Sequence[ReplicaView], rule: Saturation,
    peers: Mapping[str, ReplicaLoad] = _NO_PEERS, tokens: float = 0.0,
) -> list[ReplicaView] | None:
    """``views`` narrowed to the replicas a request of ``tokens`` tokens leaves within
    ``rule`` (the others marked unhealthy), None when there is none: room under ``rule`` now,
    KV under its knee with the tokens in (what the request holds once decoded), and the
    unanswered prompt tokens within its prefill bound with them in, or none unanswered before
    (a prompt longer than the bound goes only where nothing waits to prefill ahead of it)."""
    fit = set()
    for v in views:
        if not v.healthy:
            continue
        peer = peers.get(v.id)
        if full_reason(v, peer, rule) is not None:
            continue
        prefill = v.inflight_prefill_tokens + (peer.prefill_tokens if peer else 0)
        kv = projected_kv(v, prefill + int(tokens))
        if ((kv is None or kv < rule.kv_knee)
                and (prefill == 0 or prefill + tokens <= rule.max_prefill_tokens)):
            fit.add(v.id)
    if not fit:
        return None
    return [v if v.id in fit or not v.healthy else replace(v, healthy=False) for v in views]


def never_spare(
    views: Sequence[ReplicaView], rule: Saturation,
    peers: Mapping[str, ReplicaLoad] = _NO_PEERS, tokens: float = 0.0,
) -> list[ReplicaView] | None:
    """For a request of ``tokens`` tokens that no healthy replica could take within
    ``rule``'s KV knee even empty (its tokens alone at or past the knee of every one whose
    capacity is known): the replicas with room under ``rule`` and nothing in flight, fleet-wide
    (the others marked unhealthy), the nearest to spare room it can ever find; None when the
    request fits somewhere once room frees, or no replica is so free now. `with_spare` held
    such a request for spare room no replica could give, until its longest wait shed it. (A
    replica with some work was tried first: in the replay it preempted that work, 27 against
    18 preemptions; an idle one, 17.)"""
    caps = [v.cache_capacity_tokens for v in views if v.healthy]
    if not caps or any(not cap or tokens / cap < rule.kv_knee for cap in caps):
        return None
    fit = set()
    for v in views:
        peer = peers.get(v.id)
        inflight = v.inflight + (peer.inflight if peer else 0)
        if v.healthy and inflight == 0 and full_reason(v, peer, rule) is None:
            fit.add(v.id)
    if not fit:
        return None
    return [v if v.id in fit or not v.healthy else replace(v, healthy=False) for v in views]


def _kv_of(item: tuple[ReplicaView, float | None]) -> float:
    return item[1] if item[1] is not None else 0.0


def pool_saturated(
    views: Sequence[ReplicaView], rule: Saturation,
    peers: Mapping[str, ReplicaLoad] = _NO_PEERS,
) -> bool:
    """True when the pool has a healthy replica and no healthy replica has room."""
    healthy = False
    get = peers.get
    for v in views:
        if not v.healthy:
            continue
        healthy = True
        if full_reason(v, get(v.id), rule) is None:
            return False
    return healthy


def replica_reasons(
    views: Sequence[ReplicaView], rule: Saturation,
    peers: Mapping[str, ReplicaLoad] = _NO_PEERS,
) -> dict[str, str]:
    """Replica id -> why it is full, "room", or "unhealthy" (for explain)."""
    out: dict[str, str] = {}
    for v in views:
        if not v.healthy:
            out[v.id] = "unhealthy"
        else:
            out[v.id] = full_reason(v, peers.get(v.id), rule) or "room"
    return out

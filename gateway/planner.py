"""Where one request goes before the router picks a replica: tier pool, spill-over, features.

`Planner.plan` reads the principal's policy snapshot (so a request never mixes two policy
versions), resolves the tier's pool with `resolve_tier` over the pools' live loads
(`live_load`: the scraped levels reconciled with the requests kvgate -- with shared routing
state, the fleet -- has in flight there; built lazily from the `ReplicaView`s, only for the pools
it looks at, the views reused for the pick), and computes the
request's features with the tenant's salt in the prefix key, so affinity never crosses
tenants. The features come first: their prompt estimate and asked output are the context the
request needs, and a request too long for every replica of the tier's home pool goes to its
spill or borrowed pool that takes it. It also drops vLLM's operator-only body fields unless
the tier allows them (`operator_fields`). The proxy and the admin API's route explain share it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import replace

from gateway.body import ParsedBody, drop_operator_fields
from gateway.errors import BadRequest, ModelNotFound, NoReplicaAvailable, shown_name
from gateway.policy_doc import PolicyDoc
from gateway.pool import Pool, Pools
from gateway.replicas import Replica
from gateway.tenancy.edge import TenantGate
from gateway.tenancy.keys import hide_keys
from gateway.tenancy.resolver import Principal
from gateway.tenancy.tiers import LoadSignal, ReplicaLoad, live_load, resolve_tier
from gateway.vllm_routes import chat_view
from routing.config import RouterConfig
from routing.features import extract_features
from routing.peers import ReplicaLoad as PeerLoad
from routing.router import Router
from routing.types import ReplicaView, RequestFeatures

__all__ = ["PREFIX_KINDS", "Plan", "Planner"]

# kinds whose prompt prefix is cached by vLLM (embeddings are not generated, so not routed on it)
# (Anthropic's messages too: `chat_view`; count_tokens goes where its messages would, so an
# agent's count then send warms nothing twice)
PREFIX_KINDS = frozenset({"chat", "completions", "responses", "messages", "count_tokens"})
_ANTHROPIC_KINDS = frozenset({"messages", "count_tokens"})


class Plan:
    """Where a request goes before the router picks a replica (shared with route explain)."""

    __slots__ = ("among", "features", "home", "pool", "priority", "served", "spilled", "views")

    def __init__(
        self, pool: Pool, served: str, priority: int | None, home: str, spilled: bool,
        features: RequestFeatures, views: list[ReplicaView],
        among: list[Replica] | None = None,
    ) -> None:
        self.pool, self.served, self.priority, self.home = pool, served, priority, home
        self.spilled, self.features, self.views = spilled, features, views
        # the replicas it may use when not all of the pool's (a LoRA adapter's): a 503 counts
        # those (it said "1 available" of a replica without the adapter)
        self.among = among


class _Views(Mapping[str, list[ReplicaView]]):
    """Pool name -> live replica views, built only for the pools tier resolution looks at."""

    __slots__ = ("_cache", "_now", "_pools")

    def __init__(self, pools: Pools, now: float) -> None:
        self._pools, self._now = pools, now
        self._cache: dict[str, list[ReplicaView]] = {}

    def __getitem__(self, name: str) -> list[ReplicaView]:
        views = self._cache.get(name)
        if views is None:
            pool = self._pools.by_name[name]  # KeyError: Mapping.get answers the default
            views = self._cache[name] = [r.view(self._now) for r in pool.replicas]
        return views

    def __iter__(self) -> Iterator[str]:
        return iter(self._pools.by_name)

    def __len__(self) -> int:
        return len(self._pools.by_name)


class _Live(Mapping[str, Sequence[LoadSignal]]):
    """Pool name -> its replicas' live loads (`live_load`) over `_Views`, built lazily."""

    __slots__ = ("_cache", "_peers", "_views")

    def __init__(self, views: _Views, peers: Mapping[str, PeerLoad]) -> None:
        self._views, self._peers = views, peers
        self._cache: dict[str, list[ReplicaLoad]] = {}

    def __getitem__(self, name: str) -> list[ReplicaLoad]:
        loads = self._cache.get(name)
        if loads is None:
            get = self._peers.get
            loads = self._cache[name] = [live_load(v, get(v.id)) for v in self._views[name]]
        return loads

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


class _Avoid(Mapping[str, Sequence[LoadSignal]]):
    """Loads where the ``avoid`` pools look saturated (an unhealthy replica each)."""

    __slots__ = ("_avoid", "_views")

    def __init__(
        self, views: Mapping[str, Sequence[LoadSignal]], avoid: Collection[str],
    ) -> None:
        self._views, self._avoid = views, avoid

    def __getitem__(self, name: str) -> Sequence[LoadSignal]:
        if name in self._avoid:
            return _FULL
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)


_FULL = (ReplicaLoad(healthy=False),)
_NO_PEERS: Mapping[str, PeerLoad] = {}


class Planner:
    def __init__(
        self, pools: Pools, config: RouterConfig, gate: TenantGate, router: Router | None = None,
    ) -> None:
        """``router``: whose `peers` are the other gateways' load (shared routing state)."""
        self.pools = pools
        self._config = config
        self.gate = gate
        self._router = router

    def _live(self, views: _Views, now: float) -> _Live:
        peers = self._router.peers if self._router is not None else None
        return _Live(views, peers.totals(now) if peers is not None else _NO_PEERS)

    def doc(self, principal: Principal) -> PolicyDoc:
        """The policy ``principal`` was resolved under (the pools' when it carries none)."""
        snap = principal.policy
        return snap.doc if snap is not None else self.pools.doc

    def pool_for(
        self, principal: Principal, model: str, now: float, need: int = 0,
    ) -> str | None:
        """The pool `plan` sends a request for ``model`` that takes ``need`` tokens of context
        (`RequestFeatures.context_tokens`) to now, on ``principal``'s policy (None: none
        running here). Flow control moves a queued request whose pool a policy change
        changed (`FlowGate.policy_changed`)."""
        views = _Views(self.pools, now)
        route = resolve_tier(self.doc(principal), model, principal.tier, views, need,
                             self._live(views, now))
        if route is None:
            pool = self.pools.public.get(model)
            return pool.name if pool is not None else None
        return route.pool if route.pool in self.pools.by_name else None

    def context_len(self, principal: Principal, model: str) -> int | None:
        """The longest context (``max_model_len``) among the pools a request for `model`
        may go to on `principal`'s tier (its own, the tier's spill-over and borrowed ones),
        before tier resolution picks one; None while one of them has not said it."""
        doc = self.doc(principal)
        home = doc.pool_for(model, principal.tier)
        if home is None:  # no `models` entry: the pool serving that name
            pool = self.pools.public.get(model)
            return pool.max_model_len if pool is not None else None
        tier = doc.tiers.get(principal.tier)
        names = {home} if tier is None else {home, tier.spill_to, tier.borrow_from} - {None}
        lengths = [p.max_model_len if (p := self.pools.by_name.get(str(n))) else None
                   for n in names]
        return None if None in lengths else max(n for n in lengths if n is not None)

    def plan(
        self, principal: Principal, parsed: ParsedBody, kind: str, now: float,
        avoid: Collection[str] = (),
    ) -> Plan:
        """The pool (tier, spill-over) and features for one request, from one policy snapshot.
        ``avoid``: pools tier resolution treats as saturated (flow control tries the tier's
        spill-over before queueing)."""
        doc = self.doc(principal)
        features = self._features(kind, parsed, principal, None)
        views = _Views(self.pools, now)
        live: Mapping[str, Sequence[LoadSignal]] = self._live(views, now)
        loads: Mapping[str, Sequence[LoadSignal]] = views
        if avoid:
            loads, live = _Avoid(views, avoid), _Avoid(live, avoid)
        # a pool too short for the context it takes is skipped
        route = resolve_tier(doc, parsed.model, principal.tier, loads, features.context_tokens,
                             live)
        if route is None:  # no `models` entry: public names are the pools' served names
            pool = self.pools.public.get(parsed.model)
            if pool is None:
                unknown = [p for p in self.pools.by_name.values() if not p.served_model]
                if unknown:  # a pool whose served name is not known yet may serve it
                    learning = [f"pool {p.name}: no replica has answered yet; {p.condition(now)}"
                                for p in unknown]
                    raise NoReplicaAvailable(  # (Retry-After: the soonest back among them)
                        f"No ready replica for the model `{shown_name(parsed.model)}` "
                        f"(not ready: {'; '.join(learning)}).",
                        retry_after=min(p.retry_after(now) for p in unknown))
                raise self.not_found(principal, parsed.model)
            served, priority, home, spilled = pool.served_model, None, pool.name, False
        else:
            found = self.pools.by_name.get(route.pool)
            if found is None:
                later = self._in_force(principal)
                if later is not None:  # its pool was removed since it came in: plan anew
                    return self.plan(later, parsed, kind, now, avoid)
                raise NoReplicaAvailable(
                    f"The pool for `{shown_name(parsed.model)}` is not running here.")
            pool, priority, home = found, route.priority, route.home_pool
            served, spilled = route.served_model or pool.served_model, route.reason == "spill"
        if served is None:
            raise NoReplicaAvailable(f"The model `{shown_name(parsed.model)}` is not available "
                                     f"yet (pool {pool.name}: no replica has answered yet; "
                                     f"{pool.condition(now)}).",
                                     retry_after=pool.retry_after(now))
        tier_cfg = doc.tiers.get(principal.tier)
        if tier_cfg is None or not tier_cfg.operator_fields:
            drop_operator_fields(parsed.data)  # before the body rewrite, which copies the rest
        if priority:
            features = replace(features, priority=priority)
        served, pool_views, among = self._adapter(principal, parsed.model, served, pool, home,
                                                  spilled, views[pool.name], now)
        return Plan(pool, served, priority, home, spilled, features, pool_views, among)

    def _adapter(
        self, principal: Principal, model: str, served: str, pool: Pool, home: str,
        spilled: bool, views: list[ReplicaView], now: float,
    ) -> tuple[str, list[ReplicaView], list[Replica] | None]:
        """(the model name sent, the views of the replicas it may go to, those replicas when
        not all of the pool's): a LoRA adapter goes under its own name to the replicas
        listing it (`Pool.adapter_holders`); one loaded on none of the pool's is never sent
        as the base model (which would answer under its name): the 404 vLLM gives for it,
        or, spilled from its own pool, that pool's 503."""
        if model == served:  # its pool's base model (even where another pool's replicas
            return served, views, None  # list an adapter of that name)
        holders = pool.adapter_holders(model) if model in pool.lora_names else None
        if holders is not None:
            return (model, [v for v in views if v.id in holders],
                    [r for r in pool.replicas if r.id in holders])
        if not any(model in p.lora_names for p in self.pools.by_name.values()):
            return served, views, None
        if spilled:  # (its own pool's replicas are down or busy: wait for them)
            own = self.pools.by_name.get(home, pool)
            raise NoReplicaAvailable(
                f"No ready replica has the LoRA adapter `{shown_name(model)}` loaded "
                f"(pool {own.name}: {own.condition(now)}).", retry_after=own.retry_after(now))
        raise self.not_found(principal, model)

    def _in_force(self, principal: Principal) -> Principal | None:
        """``principal`` on the policy in force, when it was resolved under an older one
        (None: it was not). A request is identified before its body is read and admitted;
        a policy change meanwhile that removed its pool (its model moved to another) made
        it a 503 "not running here", a slow upload's whole body wasted: it goes where the
        policy in force sends its model, as a request queued in flow control does."""
        snap, current = principal.policy, self.gate.policy
        if snap is None or current is None or current.version == snap.version:
            return None
        return replace(principal, policy=current)

    def offered(self, principal: Principal) -> list[str]:
        """The public model names `principal`'s tier can use, sorted (`GET /v1/models`, and
        the list a 404 names)."""
        doc = self.doc(principal)
        tier = principal.tier
        mine = {m for m in doc.models if doc.pool_for(m, tier) is not None}
        return sorted(mine | set(self.pools.public))

    def default_model(self, principal: Principal) -> str:
        """The model of a request that names none (vLLM serves its own model then): the one
        public name `principal`'s tier can use; with several, a 400 listing them; with none
        known yet (the quick form before a replica answered), the 503 to retry."""
        # (vLLM serves its base model then, never a LoRA adapter; a name that is also a
        # pool's base model stays offered: it was dropped, and a key with two pools' models
        # went to the other one unasked)
        adapters = {n for p in self.pools.by_name.values() for n in p.lora_names} - {
            p.served_model for p in self.pools.by_name.values()}
        offered = [m for m in self.offered(principal) if m not in adapters]
        if len(offered) == 1:
            return offered[0]
        if offered:
            shown = ", ".join(offered[:ModelNotFound.SHOWN])
            raise BadRequest(f"`model` is required: this key can use {len(offered)} models "
                             f"({shown}; GET /v1/models lists them).", param="model")
        raise NoReplicaAvailable("No ready replica: no model is known yet to serve a request "
                                 "that names none.")

    def not_found(self, principal: Principal, model: str) -> ModelNotFound:
        """The 404 for a `model` `principal` cannot use: missing, a served name, or offered
        to other tiers only."""
        doc = self.doc(principal)
        # a key sent as the model (key and model swapped) is not echoed: an SDK's exception
        # text holds the answer's message, and applications log exceptions
        return ModelNotFound(
            hide_keys(model), self.offered(principal),
            served=any(p.served_model == model for p in doc.pools.values()),
            other_tier=principal.tier if model in doc.models else None)

    def prefix_features(
        self, parsed: ParsedBody, principal: Principal, priority: int = 0, kind: str = "chat",
    ) -> RequestFeatures:
        """The salted prefix features of a chat/completions/responses body, or an Anthropic
        Messages one read as chat (`chat_view`) (pure: safe in a worker thread)."""
        data = chat_view(parsed.data, kind) if kind in _ANTHROPIC_KINDS else parsed.data
        features = extract_features(
            data, model=parsed.model, salt=self.gate.salt(principal) or "",
            config=self._config, tenant=principal.tenant_id, tier=principal.tier,
            priority=priority,
        )
        # the body's parse decides (a "stream": "false" string is a whole answer, as vLLM
        # reads it; the features' truth test took it for a stream)
        return features if features.stream == parsed.stream else replace(
            features, stream=parsed.stream)

    def _features(
        self, kind: str, parsed: ParsedBody, principal: Principal, priority: int | None
    ) -> RequestFeatures:
        if kind in PREFIX_KINDS:
            early = parsed.prefix  # computed off the loop with the parse (a large body)
            if early is None:
                return self.prefix_features(parsed, principal, priority or 0, kind)
            return early if early.priority == (priority or 0) else replace(
                early, priority=priority or 0)
        return RequestFeatures(
            model=parsed.model, block_hashes=(), prompt_tokens=parsed.prompt_tokens,
            tenant=principal.tenant_id, tier=principal.tier, stream=parsed.stream,
            priority=priority or 0,
        )

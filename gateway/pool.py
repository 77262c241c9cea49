"""Pools at run time: replicas, their transport, the served model name and the public names.

`Pools` is built inside the app's lifespan (the transports need a running event loop) from
the policy document in force, and follows new policy versions with `apply`: pools that appear
are created, pools that disappear stop taking requests, replica lists and served names of
existing pools are updated in place (a replica that stays keeps its counters and health).
A pool with `discovery` gets its replicas from it instead (`set_discovered`), never from the
document. A replica that leaves its pool *drains*: it takes no new request, its in-flight
requests finish, and `reap` hands it back once idle so the app can forget it.

A replica (host:port) belongs to one pool, as `policy_doc.check_replicas_distinct` checks the
documents: its scrapes, health and routing state are keyed by host:port. Discovery cannot be
checked on input, so a discovered address another pool has already is refused there (logged,
and named in /readyz while the pool has no replica), and taken once that pool lets it go: two
pools naming one replica had one scraped and the other's load frozen at start, two in-flight
counts for one engine, with no error anywhere.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.config import KvgateConfig
from gateway.errors import NoReplicaAvailable
from gateway.policy_doc import DEFAULT_TIER, PolicyDoc, PoolConfig
from gateway.replicas import HealthRules, Replica, RetryBudget, replica_id
from gateway.transport import Transport, TransportFactory, default_transport

__all__ = ["Pool", "PoolChanges", "Pools"]

log = logging.getLogger(__name__)

_MAX_RETRY_AFTER_S = 60


class Pool:
    __slots__ = ("adapters", "budget", "by_id", "headers", "lora_names", "max_model_len", "name",
                 "refused", "replicas", "served_model", "transport", "wanted")

    def __init__(
        self, name: str, served_model: str | None, replicas: list[Replica],
        transport: Transport, api_key: str | None, budget: RetryBudget,
    ) -> None:
        self.name = name
        self.served_model = served_model
        # the context length its replicas' /v1/models card gives (`HealthMonitor`), if known
        self.max_model_len: int | None = None
        # replica id -> the LoRA adapters its /v1/models lists (`HealthMonitor`): a request
        # naming one goes to those replicas only, under the adapter's name
        self.adapters: dict[str, frozenset[str]] = {}
        self.lora_names: set[str] = set()  # every adapter name any of them ever listed
        self.replicas = replicas
        self.by_id = {r.id: r for r in replicas}
        # the URLs its list or its discovery names, and those of them it does not have
        # because another pool has that replica (replica id -> that pool)
        self.wanted = [r.url for r in replicas]
        self.refused: dict[str, str] = {}
        self.transport = transport
        self.budget = budget
        # sent with every upstream request: vLLM's --api-key, never the client's credentials
        self.headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def adapter_holders(self, model: str) -> frozenset[str] | None:
        """The ids of its replicas serving LoRA adapter `model`, None when none does (then
        `model` is no adapter of this pool)."""
        held = frozenset(r.id for r in self.replicas if model in self.adapters.get(r.id, ()))
        return held or None

    def unloaded(self, replica_id: str, model: str) -> bool:
        """Whether `model`, which a replica answered it does not serve, was one of its LoRA
        adapters (unloaded there since its cards were read): then forgotten there."""
        held = self.adapters.get(replica_id, frozenset())
        if model not in held:
            return False
        self.adapters[replica_id] = held - {model}
        return True

    def condition(self, now: float, among: Sequence[Replica] | None = None) -> str:
        """Its replicas' states counted (`among`: those of them a request may use), for a
        client's 503: ``2 replicas: 1 cannot connect, 1 backing off after busy 503s`` (no
        address: `Replica.condition`)."""
        replicas = self.replicas if among is None else among
        if not replicas:
            return "the pool has no replicas"
        counts = Counter(r.condition(now) for r in replicas)
        n = len(replicas)
        if n == 1:
            return f"1 replica: {next(iter(counts))}"
        return f"{n} replicas: " + ", ".join(f"{k} {why}" for why, k in counts.most_common())

    def retry_after(self, now: float, among: Sequence[Replica] | None = None) -> int:
        """Whole seconds until the soonest of its replicas (`among`: of those a request may
        use) may be tried again, for the Retry-After of a 503 none could take: at least 1, at
        most a minute (the OpenAI SDKs wait out a longer one with their own back-off)."""
        replicas = self.replicas if among is None else among
        soonest = min((r.back_in(now) for r in replicas), default=0.0)
        return min(max(math.ceil(soonest), 1), _MAX_RETRY_AFTER_S)

    def none_healthy(
        self, model: str, now: float, among: Sequence[Replica] | None = None,
    ) -> NoReplicaAvailable:
        """The 503 of a request for `model` none of its replicas (`among`: of those it may
        use, the data plane's subset) can take now: why (counted, no address) and when to
        try again. The same answer whether the pick found none or the request's own tries
        just found them gone (the first request after an outage)."""
        return NoReplicaAvailable(f"No healthy replica for the model `{model}` "
                                  f"({self.condition(now, among)}).",
                                  retry_after=self.retry_after(now, among))

    def takes_requests(self, now: float) -> bool:
        """Whether some replica may be sent a request now (busy back-offs aside)."""
        return any(r.available(now) for r in self.replicas)

    def set_replicas(self, replicas: list[Replica]) -> None:
        # new list objects: a request iterating the old ones is not disturbed
        self.replicas = replicas
        self.by_id = {r.id: r for r in replicas}
        # a replica that left takes its adapters along (`Pools.refresh_public` then)
        self.adapters = {rid: a for rid, a in self.adapters.items() if rid in self.by_id}
        self.context_learned()

    def context_learned(self) -> None:
        """Its context: the longest its replicas said (`HealthMonitor`); a replica that left
        takes its length along (kept while none of them said theirs yet)."""
        self.max_model_len = max((r.max_model_len for r in self.replicas if r.max_model_len),
                                 default=self.max_model_len)


@dataclass
class PoolChanges:
    """What `Pools.apply` changed (the app updates the scraper and the router with it)."""

    added: list[Replica] = field(default_factory=list)
    removed: list[Replica] = field(default_factory=list)
    retired: list[Pool] = field(default_factory=list)  # pools the new document removed

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


class Pools:
    """All pools of one gateway and the public-name → pool map (default tier)."""

    def __init__(
        self, cfg: KvgateConfig, doc: PolicyDoc | None = None,
        transport: TransportFactory = default_transport,
    ) -> None:
        self._cfg = cfg
        self._transport = transport
        h = cfg.health
        self._health = HealthRules(
            h.failure_threshold, h.eject_base_s, h.eject_max_s, h.slow_threshold,
            h.busy_backoff_s, h.busy_backoff_max_s, stall_after_s=h.stall_after_s,
        )
        self.doc: PolicyDoc = doc if doc is not None else cfg
        self.by_name: dict[str, Pool] = {}
        # removed by a policy change: closed once drained (`close_retired`) or at shutdown
        self.retired: list[Pool] = []
        self.draining: list[Replica] = []  # left their pool, requests still in flight
        for name, pc in self.doc.pools.items():
            self._new_pool(name, pc, PoolChanges())
        self._settle(PoolChanges(), {})
        self.public: dict[str, Pool] = {}
        # model name (public or served) -> when this gateway first knew it, unix seconds: the
        # `created` of its /v1/models card
        self.seen: dict[str, int] = {}
        self.refresh_public()

    def _new_pool(self, name: str, pc: PoolConfig, changes: PoolChanges) -> None:
        up = self._cfg.upstream
        transport = self._transport(up.max_connections, up.connect_timeout_s)
        api_key = os.environ.get(pc.api_key_env) if pc.api_key_env else None
        budget = RetryBudget(up.retry_budget_ratio, up.retry_budget_min)
        pool = Pool(name, pc.served_model, [], transport, api_key, budget)
        self.by_name[name] = pool  # (before its replicas: `_relist` looks at every pool)
        self._relist(pool, [u.rstrip("/") for u in pc.replicas], changes)

    def apply(self, doc: PolicyDoc) -> PoolChanges:
        """Follow a new policy document (must run on the event loop: new transports)."""
        changes, before = PoolChanges(), self._refusals()
        for name in [n for n in self.by_name if n not in doc.pools]:
            pool = self.by_name.pop(name)
            changes.removed.extend(self._drain(pool.replicas))
            self.retired.append(pool)
            changes.retired.append(pool)
        for name, pc in doc.pools.items():
            found = self.by_name.get(name)
            if found is None:
                self._new_pool(name, pc, changes)
                continue
            pool = found
            if pc.served_model is not None:
                if pc.served_model != pool.served_model:  # another model's: learned again
                    pool.max_model_len = None
                    for r in pool.replicas:
                        r.max_model_len = None
                pool.served_model = pc.served_model
            if not pc.discovery:  # a discovered pool's replicas come from discovery only
                self._relist(pool, [u.rstrip("/") for u in pc.replicas], changes)
        self._settle(changes, before)
        self.doc = doc
        self.refresh_public()
        return changes

    def set_discovered(self, name: str, urls: frozenset[str]) -> PoolChanges:
        """Discovery published the complete replica set of pool `name` (unknown pool: no-op)."""
        changes = PoolChanges()
        pool = self.by_name.get(name)
        if pool is not None:
            before = self._refusals()
            self._relist(pool, sorted(u.rstrip("/") for u in urls), changes)
            self._settle(changes, before)
            # its adapters leave with a replica: listed until then, a request for one of
            # them was vLLM's 404 ("does not exist") from the gateway that listed it
            self.refresh_public()
        return changes

    def _relist(self, pool: Pool, wanted: list[str], changes: PoolChanges) -> None:
        pool.wanted = wanted
        owners = {r.id: p.name for p in self.by_name.values() if p is not pool
                  for r in p.replicas}
        pool.refused = {rid: owners[rid] for u in wanted if (rid := replica_id(u)) in owners}
        kept = [u for u in wanted if replica_id(u) not in pool.refused]
        if kept == [r.url for r in pool.replicas]:
            return
        current = {r.url: r for r in pool.replicas}
        fresh = [current.get(u) or self._revive(pool.name, u) for u in kept]
        changes.added.extend(r for r in fresh if r.url not in current)
        changes.removed.extend(self._drain(r for u, r in current.items() if u not in kept))
        pool.set_replicas(fresh)

    def _refusals(self) -> dict[str, set[str]]:
        return {p.name: set(p.refused) for p in self.by_name.values()}

    def _settle(self, changes: PoolChanges, before: dict[str, set[str]]) -> None:
        """Pools refused a replica another pool had: they take it once it has left that
        pool (discovery publishes a set only when it changes: nothing else would). A
        refusal still there, and not there ``before`` the change, is logged (a replica a
        policy version moves from one pool to another was refused on the way)."""
        for pool in self.by_name.values():
            if pool.refused:
                self._relist(pool, pool.wanted, changes)
        for pool in self.by_name.values():
            for rid in pool.refused.keys() - before.get(pool.name, set()):
                log.error("replica not added: it is a replica of another pool already (a "
                          "replica belongs to one pool)", extra={
                              "pool": pool.name, "replica": rid, "owner": pool.refused[rid]})

    def _revive(self, pool: str, url: str) -> Replica:
        """A replica that comes back while still draining keeps its counters (its requests
        in flight), not its health: it starts fresh (`Replica.rejoin`)."""
        for r in self.draining:
            if r.pool == pool and r.url == url:
                self.draining.remove(r)
                r.rejoin()
                return r
        return Replica(pool, url, self._health)

    def _drain(self, replicas: Iterable[Replica]) -> list[Replica]:
        out = list(replicas)
        for r in out:
            r.draining = True
        self.draining.extend(out)
        return out

    def pool_of(self, replica: Replica) -> Pool | None:
        """The pool a replica (draining ones too) belongs or belonged to: its transport and
        headers (a pool a policy removed, while it lingers)."""
        for pool in [*self.by_name.values(), *self.retired]:
            if pool.name == replica.pool:
                return pool
        return None

    def reap(self) -> list[Replica]:
        """Draining replicas whose last in-flight request finished (no longer tracked)."""
        done = [r for r in self.draining if r.inflight == 0]
        if done:
            self.draining = [r for r in self.draining if r.inflight > 0]
        return done

    def refresh_public(self) -> None:
        """Recompute public names (after a pool learned its served model name)."""
        now = int(time.time())
        for name in [*self.doc.models, *(p.served_model for p in self.by_name.values())]:
            if name:
                self.seen.setdefault(name, now)
        if self.doc.models:
            self.public = {}
            for model in self.doc.models:
                name = self.doc.pool_for(model, DEFAULT_TIER)
                if name is not None and name in self.by_name:
                    self.public[model] = self.by_name[name]
        else:  # a pool's LoRA adapters are public names too (its base model's first)
            self.public = {name: p for p in self.by_name.values() if p.served_model
                           for rid in p.by_id for name in p.adapters.get(rid, ())}
            self.public.update(
                {p.served_model: p for p in self.by_name.values() if p.served_model})
            for name in self.public:
                self.seen.setdefault(name, now)

    def serving(self, model: str, doc: PolicyDoc, tier: str) -> Pool | None:
        """The pool that serves public name `model` to `tier` under `doc`, if any."""
        if doc.models:
            name = doc.pool_for(model, tier)
            return self.by_name.get(name) if name is not None else None
        return self.public.get(model)

    def replicas(self) -> Iterator[Replica]:
        for pool in self.by_name.values():
            yield from pool.replicas

    def described(self) -> Iterator[Replica]:
        """The replicas the metrics describe: every pool's, then the draining ones."""
        yield from self.replicas()
        yield from self.draining

    def not_ready(self, now: float, *, operator: bool = True) -> dict[str, str]:
        """The pools that cannot serve now, and why: no replica answered yet (its served
        model is not known) or none is usable; for an operator (/readyz) with why its
        replicas were last found down (``127.0.0.1:8001: cannot connect``, ``r.svc:8000:
        cannot resolve host r.svc``), else (an API client's /v1/models) their states
        counted, naming no address (`Pool.condition`)."""
        return {
            p.name: _not_ready(p, now, operator) for p in self.by_name.values()
            if not (p.served_model and any(r.available(now) for r in p.replicas))
        }

    async def close_retired(self, pool: Pool) -> None:
        """A removed pool nothing uses any more: its transport closed, the pool forgotten."""
        self.retired = [p for p in self.retired if p is not pool]
        await pool.transport.close()

    async def close(self) -> None:
        for pool in [*self.by_name.values(), *self.retired]:
            await pool.transport.close()


def _not_ready(pool: Pool, now: float, operator: bool) -> str:
    # a pool with no replica at all (discovery found none yet, or none is left) said "no
    # healthy replica" or "no replica answered", as if some were there and down
    if not pool.replicas:
        if pool.refused:
            owned = "; ".join(f"{rid}: a replica of pool {owner}"
                              for rid, owner in sorted(pool.refused.items()))
            return f"no replica listed or discovered of its own ({owned})"
        return "no replica listed or discovered"
    why = _why(pool) if operator else f" ({pool.condition(now)})"
    if not pool.served_model:
        return "served model not known yet (no replica answered)" + why
    return "no healthy replica" + why


def _why(pool: Pool) -> str:
    """`` (replica: reason; ...)`` for the replicas of `pool` with a known down reason."""
    known = [f"{r.id}: {r.reason}" for r in pool.replicas if r.reason]
    return f" ({'; '.join(known)})" if known else ""

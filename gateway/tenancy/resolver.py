"""The hot-path view of tenancy: API key -> `Principal`, and the current policy, from memory.

A background task keeps the cache in step with the store: change notifications (Redis pub/sub
or in-process callbacks) trigger a reload at once, and a periodic generation check is the
safety net for lost messages. If the store is unreachable the last known state keeps serving
for at most `max_staleness_s` (then requests get 503), `health()` says degraded, and the task
recovers by itself when the store returns.

Given a `reseed` callable (the gateway's bootstrap from configuration), every check also looks
for the store's bootstrap marker: a store that lost it was wiped (FLUSHALL, a Redis restart
without persistence). A process that holds a state it loaded (not older than `max_staleness_s`;
confirmed by the store just before when the store was wiped in place, its server running on:
`_missed_writes`, `_in_touch_s`; one cut off waits for such a one) writes it back first
(`TenantStore.restore`: one gateway of several does, the others reload it), then the store is
re-seeded (idempotent) before anything is loaded from it; the wipe is logged and counted
(`health().store_resets`), and degraded for `WIPE_NOTICE_S` unless it was restored.
A record the store holds but this process cannot read is
left out of the load (its tenant, key or policy; the last readable policy stays in force, or
the configuration's if none was ever read: `policy_source`), logged once, counted
(`health().records_skipped`) and reported as degraded, while every other tenant keeps working.
A salt group's unreadable epoch keeps the last one this process read for it; with none, the
group's tenants are refused (503) rather than given a salt from a guessed epoch: epoch 0 would
be the group's own first salt (no other tenant's, as the subject names the group) but would
undo a rotation made to leave that cache. A tenant whose tier the policy in force does not
define is never admitted (403): its limits would be unknown, and limits are never silently off.
A store that still holds its marker but lost its policy (the key deleted by hand, or evicted
by a Redis running an `allkeys-*` eviction policy) had every request refused (403: no tier is
defined) while `/readyz` said all was well: the policy in force is written back (compare-and-set
against none, so one gateway writes it), logged, and read again (`_policy_lost`). The same
for its tenants or its key records (a hash lost): a load finding none while the state in
force has some writes those back that the journal does not name as changed since (an
operator deleting the last tenant is journaled, and stays deleted), only while the hash is
still missing, then reads the store again (`_records_lost`).
A worker of several (`server.workers`) keeps what it loaded in a file its siblings read
(`last_state`, one file each): one started again while the store does not answer starts from
the latest, degraded and as stale as it is, instead of refusing every request until the store
is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.errors import (
    AuthError,
    BackendUnavailable,
    NotFound,
    PermissionDenied,
    StoreUnreachable,
    shown_name,
)
from gateway.tenancy.keys import hash_key
from gateway.tenancy.models import Change, PolicySnapshot
from gateway.tenancy.principal import (
    CONFLICTING_KEYS,
    INVALID_KEY,
    Principal,
    TenancyHealth,
    parse_bearer,
)
from gateway.tenancy.redis_conn import cause_label, refusal_code
from gateway.tenancy.resolver_base import WHOLE_RELOAD_S, WIPE_NOTICE_S, PolicyCallback
from gateway.tenancy.resolver_repair import ResolverRepair

__all__ = [
    "CONFLICTING_KEYS", "INVALID_KEY", "WHOLE_RELOAD_S", "WIPE_NOTICE_S", "Principal",
    "TenancyHealth", "TenantResolver",
    "parse_bearer",
]

log = logging.getLogger(__name__)


class TenantResolver(ResolverRepair):
    # -- lifecycle ---------------------------------------------------------------------------
    def reseed_with(self, reseed: Callable[[], Awaitable[object]]) -> None:
        """Watch the store's bootstrap marker and re-seed a wiped store with `reseed()`."""
        self._reseed = reseed

    def seed_later(self, seed: Callable[[], Awaitable[object]]) -> None:
        """The seeding from configuration failed at start (the store away or refusing): run
        `seed()` at the first check that finds the store answering and taking writes. With
        the store's bootstrap marker there nothing else seeded it: tenants added to the
        configuration meanwhile waited for a restart. `seed` is idempotent (`bootstrap`:
        what the store holds, admin changes included, stays)."""
        self._seed_due = seed

    async def _seed_postponed(self) -> None:
        """Run the postponed seeding; a failure leaves it due at a later check (never the
        load's: the store answers reads)."""
        seed, self._seed_due = self._seed_due, None
        if seed is None:
            return
        try:
            await seed()
        except BackendUnavailable as exc:
            self._seed_due = seed
            log.debug("tenancy seeding still postponed: %s", exc)
        else:
            log.info("tenancy store seeded from configuration (postponed at start)")

    async def start(self) -> None:
        """Load once (a failure leaves us degraded, not crashed) and start syncing."""
        self._unsubscribe = self._store.subscribe(self._on_change)
        if not await self.refresh() and not self._loaded:
            self._start_from_last_state()
        self._task = asyncio.create_task(self._sync_loop(), name="tenancy-sync")

    async def close(self) -> None:
        # the flag, not only the cancel, ends the sync loop: redis-py can swallow a cancel that
        # lands inside a command (it surfaces as a Redis error, which `refresh` survives)
        self._closing = True
        self._dirty.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _on_change(self, change: Change) -> None:
        self._dirty.set()

    async def _sync_loop(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout=self._poll)
            self._dirty.clear()
            await self.refresh()

    async def refresh(self) -> bool:
        """Bring the cache up to date with the store now. False when the store is unreachable."""
        async with self._refreshing:
            return await self._refresh()

    async def _refresh(self) -> bool:
        # wall clock, before anything is read: the state read holds every change made by then
        # (the stamp of the workers' files, `last_state`)
        read_at = time.time()
        # ... and the monotonic one: at a wipe, the state is judged confirmed as of the start
        # of its reading (a process paused between sending a read and taking its answer --
        # SIGSTOP, a stalled node -- took a state older than its answer's arrival for one
        # just confirmed, and wrote it back over a wipe); the staleness served counts from
        # the end, as before (a slow load must not make a state too stale to serve)
        started = self._clock()
        whole_before = self._whole_at
        try:
            mark, wiped = self._mark, False
            if self._reseed is not None:
                mark = await self._store.seed_mark()
                if mark is not None:  # (restored by another gateway: a later wipe waits anew)
                    self._wipe_wait = None
                else:
                    mark = await self._reseeded()
                    if mark is None:  # cut off when it was wiped: a gateway in touch restores
                        self._answers = True
                        return False
                # another marker than the one our state came from: wiped and re-seeded (by
                # another gateway, perhaps), whatever the generation counter says now
                wiped = mark != self._mark
                if self._seed_due is not None and self._store.refusing_writes is None:
                    await self._seed_postponed()
                if wiped and self._mark is not None and mark != self._wipe_seen:
                    self._wipe_seen = mark
                    self._wiped(mark)
            generation = await self._store.generation()
            recent = self._clock() - self._whole_at < WHOLE_RELOAD_S
            # (a store refusing writes is read each time: a load is what tells it has room)
            if (wiped or generation != self._state.generation or not self._loaded or not recent
                    or self._store.refusing_writes is not None):
                snap = None
                if not wiped and self._loaded and recent:  # only what changed since
                    snap = await self._store.changes_since(self._state.generation)
                if snap is None:
                    snap = await self._store.snapshot()
                    self._whole_at = self._clock()
                if snap.generation == 0 and self._state.generation > 0:
                    self._degraded_reason = "store is empty (reset?); serving last known state"
                    self._answers = True
                    return False
                if snap.policy is None and self._state.policy is not None and not any(
                        s.kind == "policy" for s in snap.skipped):
                    snap = await self._policy_lost(snap)
                if not wiped and (lost := self._lost_kinds(snap)):
                    snap = await self._records_lost(snap, lost, whole_before)
                if not wiped and self._applied is not None and (
                        snap.generation < self._applied.generation):
                    self._say_went_back(self._applied, snap)
                applied = self._apply(snap)
                self._mark = mark
                if self.last_state is not None:
                    await self.last_state.keep(applied, mark, read_at)
        except BackendUnavailable as exc:
            cause = exc.cause if isinstance(exc, StoreUnreachable) else None
            self._down_cause = "unreachable" if cause is None else cause_label(cause)
            if cause is not None:
                cause = await self._store.explain(cause)
                if self._store.reach is not None:  # the store's one voice in the log
                    self._store.reach.failed(cause)
                    cause = self._store.reach.cause or cause  # with its TLS hint, if any
            # /readyz's: what is wrong, a refusal (credentials, an ACL, a full Redis) told
            # apart from the network; it read "store unreachable" for a wrong password
            self._degraded_reason = (
                "store unreachable" if cause is None else
                f"store unreachable: {cause}" if refusal_code(cause) is None else
                f"store refuses kvgate's commands: {cause}")
            self._answers = False
            return False
        except Exception as exc:  # e.g. records this version cannot read (a rolling upgrade)
            if self._degraded_reason is None:
                log.error("tenancy store data unreadable (%s); serving last known keys and "
                          "policy", type(exc).__name__)
            self._degraded_reason = "store data unreadable"
            self._answers = True
            return False
        if self._degraded_reason == "store data unreadable":
            log.info("tenancy store data readable again")
        if self._store.reach is not None:
            self._store.reach.answered()
        self._fresh_at, self._confirmed_at = self._clock(), started
        self._degraded_reason = None
        self._answers = True
        if self.last_state is not None:
            self.last_state.confirmed(read_at)
        return True

    # -- hot path ----------------------------------------------------------------------------
    def _check_usable(self) -> None:
        trouble = None if self._answers else _TROUBLE.get(self._down_cause)
        if not self._loaded:
            raise BackendUnavailable(
                f"{self._store.label} has not answered yet, so no API key or policy is loaded; "
                "retry shortly" if trouble is None else
                f"{self._store.label} {trouble}, so no API key or policy is loaded; the "
                "gateway's log has the details")
        if self._max_stale is not None and self._clock() - self._fresh_at > self._max_stale:
            raise BackendUnavailable(
                "tenancy state is too stale to serve; retry shortly" if trouble is None else
                f"tenancy state is too stale to serve: {self._store.label} {trouble}; the "
                "gateway's log has the details")

    def authenticate(self, token: str | None) -> Principal:
        """The caller of an API key (the token after ``Bearer``). No I/O; raises `AuthError`."""
        if not token:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        if token == CONFLICTING_KEYS:
            raise AuthError("the request presents more than one API key (Authorization, "
                            "api-key, x-api-key headers that disagree): send one")
        self._check_usable()
        principal = self._state.by_key.get(hash_key(token))
        if principal is None:
            raise AuthError(INVALID_KEY)
        return _admissible(principal)

    def current(self, tenant_id: str, key_hash: str | None) -> Principal:
        """The caller of a request admitted earlier, as the state in force now has it: by the
        hash of its key (None: by its tenant, the `--no-auth` mode). `AuthError` when the key
        was revoked or its tenant deleted since. No I/O."""
        state = self._state
        found = (state.by_key.get(key_hash) if key_hash is not None
                 else state.by_tenant.get(tenant_id))
        if found is None:
            raise AuthError(INVALID_KEY)
        return _admissible(found)

    def principal_for(self, tenant_id: str) -> Principal:
        """A tenant's principal without a key (the `--no-auth` single-tenant mode)."""
        self._check_usable()
        principal = self._state.by_tenant.get(tenant_id)
        if principal is None:
            raise NotFound(f"tenant {shown_name(tenant_id)!r} not found")
        return _admissible(principal)

    def has_keys(self, tenant_id: str) -> bool:
        """Whether an API key of the tenant is in force (it is an authenticated tenant)."""
        return tenant_id in self._state.keyed

    def owner(self, tenant_id: str) -> str:
        """What a tenant's Responses API ids are kept under: its incarnation's
        ``<id>#<incarnation>`` (`Principal.limits_key`), so a tenant deleted and created
        again under its id does not reach its predecessor's; ``<id>#gone`` for a tenant not
        known now (deleted meanwhile: its responses are nobody's)."""
        principal = self._state.by_tenant.get(tenant_id)
        return principal.limits_key if principal is not None else f"{tenant_id}#gone"

    @property
    def policy(self) -> PolicySnapshot | None:
        """The current policy snapshot; take it once per request and keep it."""
        return self._state.policy

    @property
    def policy_source(self) -> str | None:
        """Where the policy in force came from: ``store`` (the stored one), ``last readable``
        (the stored one is unreadable: the last one read stays), ``configuration`` (unreadable
        since this process started: the configuration's), None (no policy)."""
        return self._policy_source if self._state.policy is not None else None

    def on_policy(self, callback: PolicyCallback) -> Callable[[], None]:
        """Call `callback(snapshot)` whenever a new policy version is applied."""
        self._policy_callbacks.append(callback)
        return lambda: self._policy_callbacks.remove(callback)

    def health(self) -> TenancyHealth:
        """`degraded` also for `WIPE_NOTICE_S` after a wipe that was not restored: the store
        answers again, but every key made through the admin API is gone and their clients
        get 401s -- /readyz (and the doctor) must say so, not only a log line and a counter.
        A restored one is `store_wiped` (and counted) without being degraded."""
        state = self._state
        reasons = self._degraded_reasons()
        # every reason that holds, most pressing first: it named only the first (an evicting
        # Redis hid gateways with other salt secrets until it was fixed, then a restart)
        reason = "; ".join(reasons) if reasons else None
        wiped = self._clock() - self._wiped_at < WIPE_NOTICE_S
        return TenancyHealth(
            loaded=self._loaded,
            degraded=reason is not None,
            reason=reason,
            generation=state.generation,
            policy_version=state.policy.version if state.policy else 0,
            staleness_s=max(0.0, self._clock() - self._fresh_at),
            store_resets=self._resets,
            store_wiped=wiped,
            store_answers=self._answers,
            store_cause=None if self._answers else self._down_cause,
            records_skipped=dict(self._skipped_total),
        )


    def _degraded_reasons(self) -> list[str]:
        """Why the tenancy state is degraded, each reason that holds now."""
        found = [self._degraded_reason] if self._degraded_reason is not None else []
        since = self._clock() - self._wiped_at
        if since < WIPE_NOTICE_S and not self._wipe_restored and "wiped" not in (
                self._degraded_reason or ""):  # not twice while it re-seeds
            found.append(f"the store was wiped {since:.0f} s ago: API keys and tenants made "
                         "through the admin API are gone (re-issue them)")
        if self._store.refusing_writes is not None:
            found.append(f"store refuses writes: {self._store.refusing_writes} (its keys and "
                         "policy are served; admin writes fail, limits are per-process)")
        if self._store.evicting is not None:
            found.append(self._store.evicting)
        if self._went_back is not None and (
                self._clock() - self._went_back[0] < WIPE_NOTICE_S):
            found.append(self._went_back[1])
        if self._skipped:
            names = [s.label for s in self._skipped.values()]
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5
                                            else "")
            found.append(f"{len(names)} unreadable record(s) in the store skipped: {shown} "
                         "(fix or delete them)")
        if self.also_degraded is not None and (other := self.also_degraded()) is not None:
            found.append(other)
        return found


# What a client is told of a store that answers with a refusal (`cause_label`'s labels: a
# fixed set, so no address, password or key name reaches a client); a store not reached is
# one that "has not answered". It said "has not answered yet; retry shortly" to every client
# of a Redis refusing kvgate's password: retrying cures none of these but `loading`.
_TROUBLE = {
    "timeout": "does not answer in time",
    "auth": "refuses kvgate's credentials (KVGATE_REDIS_URL)",
    "noperm": "refuses kvgate's commands (its ACL user lacks a permission kvgate needs)",
    "oom": "refuses kvgate's commands: it is out of memory",
    "wrongtype": "holds a key of another type where kvgate keeps its state",
    "loading": "is loading its data set",
    "readonly": "is a read-only replica (KVGATE_REDIS_URL must name the primary)",
    "misconf": "refuses kvgate's commands: it cannot save its data to disk",
    "other": "refuses kvgate's commands",
}


def _admissible(principal: Principal) -> Principal:
    if principal.refused is not None:
        raise BackendUnavailable(principal.refused)
    if not principal.tier_known:
        raise PermissionDenied(
            f"this tenant's tier {principal.tier!r} is not defined in the policy in force; "
            "ask the operator", param="tier")
    return principal

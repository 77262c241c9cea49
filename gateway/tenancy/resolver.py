"""The hot-path view of tenancy: API key -> `Principal`, and the current policy, from memory.

A background task keeps the cache in step with the store: change notifications (Redis pub/sub
or in-process callbacks) trigger a reload at once, and a periodic generation check is the
safety net for lost messages. If the store is unreachable the last known state keeps serving
for at most `max_staleness_s` (then requests get 503), `health()` says degraded, and the task
recovers by itself when the store returns.

Given a `reseed` callable (the gateway's bootstrap from configuration), every check also looks
for the store's bootstrap marker: a store that lost it was wiped (FLUSHALL, a Redis restart
without persistence). A process that holds a state it loaded (not older than `max_staleness_s`)
writes it back first (`TenantStore.restore`: one gateway of several does, the others reload
it), then the store is re-seeded (idempotent) before anything is loaded from it; the wipe is
logged and counted (`health().store_resets`), and degraded for `WIPE_NOTICE_S` unless it was
restored. A record the store holds but this process cannot read is
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
from dataclasses import dataclass, field, replace

from gateway.errors import (
    AuthError,
    BackendUnavailable,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    StoreUnreachable,
    shown_name,
)
from gateway.policy_doc import DEFAULT_TIER, Limits
from gateway.tenancy.keys import hash_key
from gateway.tenancy.last_state import LastState
from gateway.tenancy.models import (
    Change,
    PolicySnapshot,
    SkippedRecord,
    StoreSnapshot,
    Tenant,
)
from gateway.tenancy.redis_conn import cause_label, refusal_code
from gateway.tenancy.salts import SaltDeriver
from gateway.tenancy.store import TenantStore, restored_from
from gateway.tenancy.went_back import went_back

__all__ = [
    "CONFLICTING_KEYS", "INVALID_KEY", "Principal", "TenancyHealth", "TenantResolver",
    "parse_bearer",
]

log = logging.getLogger(__name__)

WIPE_NOTICE_S = 600.0  # how long health() reports a wipe (store_wiped; degraded if not restored)
# A reload reads only what changed (`TenantStore.changes_since`) unless the last whole read is
# older than this, and the store is read whole at least this often even when the generation
# did not change: a record changed behind the store's back without bumping the generation (by
# hand, in redis-cli: a key record deleted to revoke it) is still read within this long.
WHOLE_RELOAD_S = 30.0
PolicyCallback = Callable[[PolicySnapshot], None]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant, its effective limits and its cache salt (never printed)."""

    tenant_id: str
    tier: str
    limits: Limits  # tier defaults with the tenant's overrides applied
    salt_group: str | None
    cache_salt: str = field(repr=False)
    # The policy this principal was built from: use it for the whole request, so one request
    # never mixes two policy versions.
    policy: PolicySnapshot | None = field(default=None, repr=False, compare=False)
    tier_known: bool = True  # False: the policy does not define `tier` (never admitted)
    refused: str | None = None  # why this tenant cannot be served now (503), e.g. no salt
    incarnation: str | None = None  # its tenant's (`Tenant.incarnation`)

    @property
    def limits_key(self) -> str:
        """What its rate limits are kept under (`Tenant.limits_key`)."""
        return self.tenant_id if self.incarnation is None else (
            f"{self.tenant_id}#{self.incarnation}")


@dataclass(frozen=True, slots=True)
class TenancyHealth:
    loaded: bool
    degraded: bool
    reason: str | None
    generation: int
    policy_version: int
    staleness_s: float  # since the store last confirmed our state
    store_resets: int = 0  # wiped stores noticed (restored or re-seeded) since start
    store_wiped: bool = False  # a wipe noticed within the last `WIPE_NOTICE_S`, restored or not
    # whether the store answered the last load (False until its first answer): reachability
    # only -- a wiped store or an unreadable record answers
    store_answers: bool = False
    # why not, as one of `redis_conn.CAUSE_LABELS` (None while it answers)
    store_cause: str | None = None
    records_skipped: dict[str, int] = field(default_factory=dict)  # kind -> count since start


@dataclass(frozen=True, slots=True)
class _State:
    generation: int = 0
    by_key: dict[str, Principal] = field(default_factory=dict)
    by_tenant: dict[str, Principal] = field(default_factory=dict)
    policy: PolicySnapshot | None = None
    group_epochs: dict[str, int] = field(default_factory=dict)
    keyed: frozenset[str] = frozenset()  # the tenants with an API key


# what a readable record of a kind is, where a log line can say it in a few words
_RULES = {"salt_group": "; a salt group's epoch is a decimal integer from 0 to 2**63 - 1 "
                        "without leading zeros, and rotating its salt writes a fresh one"}

# where the policy in force came from (`TenantResolver.policy_source`)
FROM_STORE, LAST_READABLE, CONFIGURED = "store", "last readable", "configuration"


# the key of a request that presented several different ones (`gateway.apikey`); no issued key
# equals it (kvgate's keys are base64url), and a client sending it gets the same 401
CONFLICTING_KEYS = "\x00conflicting"
# a key no tenant holds (never created, revoked, its tenant deleted): what the client can do
INVALID_KEY = ("invalid or revoked API key: send a key an operator created for your tenant "
               "(`kvgate admin keys create`)")


def parse_bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class TenantResolver:
    def __init__(
        self,
        store: TenantStore,
        salts: SaltDeriver,
        *,
        poll_interval_s: float = 0.5,
        max_staleness_s: float | None = 300.0,
        clock: Callable[[], float] = time.monotonic,
        reseed: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._store = store
        self._reseed = reseed
        # the seeding from configuration postponed at start (`seed_later`), until it is done
        self._seed_due: Callable[[], Awaitable[object]] | None = None
        self._resets = 0
        self._wiped_at = float("-inf")  # when a wipe was last noticed (this clock)
        self._mark: str | None = None  # the store's bootstrap marker our state was read under
        self._wipe_seen: str | None = None  # the marker of the last wipe reported
        self._wipe_restored = False  # the last wipe noticed was restored (by any gateway)
        self._restored: str | None = None  # the marker of the last restore made here
        self._applied: StoreSnapshot | None = None  # the state in force, as applied
        self._went_back: tuple[float, str] | None = None  # (when, what) `went_back.went_back`
        self._salts = salts
        self._poll = poll_interval_s
        self._max_stale = max_staleness_s
        self._clock = clock
        self._state = _State()
        self._loaded = False
        self._fresh_at = clock()
        self._whole_at = float("-inf")  # when the store was last read whole (this clock)
        self._degraded_reason: str | None = "not loaded yet"
        # another reason to report degraded, the store answering (`secret_check`)
        self.also_degraded: Callable[[], str | None] | None = None
        self._answers = False
        self._down_cause = "unreachable"  # `store_cause` of the last failed load
        self._skipped: dict[str, SkippedRecord] = {}  # fingerprint -> record, of the last load
        self._skipped_total: dict[str, int] = {}  # kind -> records skipped since start
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._unsubscribe: Callable[[], None] | None = None
        self._policy_callbacks: list[PolicyCallback] = []
        # the configuration's policy: in force while the stored one is unreadable and no
        # readable one was ever loaded (`Tenancy.start` sets it)
        self.configured_policy: PolicySnapshot | None = None
        # a worker of several (`server.workers`): where the workers keep the state they last
        # loaded, for one started again while the store does not answer (`gateway.workers`)
        self.last_state: LastState | None = None
        self._policy_source: str | None = None
        # one refresh at a time: the sync loop's and an admin write's (`read_your_writes`)
        # must not apply their snapshots out of order. This, not a generation compare, keeps
        # an older read from landing over a newer one: a later read is made after the earlier
        # one landed, and Redis answers it with the newer state. A lower generation is no
        # proof of an older state (the counter deleted by hand and counted again, a restore
        # from a backup): refusing it would keep revoked keys working.
        self._refreshing = asyncio.Lock()

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
        whole_before = self._whole_at
        try:
            mark, wiped = self._mark, False
            if self._reseed is not None:
                mark = await self._store.seed_mark()
                if mark is None:
                    mark = await self._reseeded()
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
        self._fresh_at = self._clock()
        self._degraded_reason = None
        self._answers = True
        if self.last_state is not None:
            self.last_state.confirmed(read_at)
        return True

    def _start_from_last_state(self) -> None:
        """The store did not answer our first load: start from the state the other workers
        of this gateway last loaded, as stale as it is, like they serve it (degraded)."""
        saved = self.last_state.load() if self.last_state is not None else None
        if saved is None:
            return
        self._apply(saved.snapshot)
        self._mark = saved.mark
        self._fresh_at = self._clock() - saved.age_s
        log.warning("tenancy store not answering: serving the state the other workers last "
                    "loaded (%.0f s old) until it does", saved.age_s,
                    extra={"generation": saved.snapshot.generation})

    async def _reseeded(self) -> str | None:
        """The store lost its bootstrap marker: write back the state this process loaded, if
        it has one recent enough, then seed it from configuration (idempotent: what was
        restored stays) before reading it. Returns the new marker; a wipe of the store our
        state came from is logged and counted (`_wiped`, here or by the gateway that finds
        another gateway's marker)."""
        assert self._reseed is not None
        last, age = self._applied, self._clock() - self._fresh_at
        if last is not None:  # loaded: the wipe of a store it read
            self._degraded_reason = "store was wiped; restoring or re-seeding it"
            if self._max_stale is not None and age > self._max_stale:
                # a gateway cut off from the store for that long may hold revoked keys
                log.error("tenancy store was wiped; this gateway's last state is %.0f s old, "
                          "past max_staleness_s (%.0f s): not restored, re-seeding from "
                          "configuration", age, self._max_stale)
            elif await self._store.restore(last):
                self._restored = await self._store.seed_mark()
        await self._reseed()
        self._seed_due = None  # (what was postponed at start is done too)
        return await self._store.seed_mark()

    async def _policy_lost(self, snap: StoreSnapshot) -> StoreSnapshot:
        """The store answers, its marker is there, but its policy is gone (deleted, evicted):
        write back the one in force (only if the store still has none: another gateway may
        have done it first) and read the store again; the one in force stays if that fails."""
        lost = self._state.policy
        assert lost is not None
        log.error("tenancy store lost its policy (deleted, or evicted: run Redis with "
                  "maxmemory-policy noeviction); writing back the one in force (version %d)",
                  lost.version)
        with contextlib.suppress(PreconditionFailed):  # another gateway wrote one back first
            await self._store.put_policy(lost.doc, if_version=0)
        again = await self._store.snapshot()
        self._whole_at = self._clock()
        return again if again.policy is not None else replace(snap, policy=lost)

    def _lost_kinds(self, snap: StoreSnapshot) -> list[str]:
        """What `snap` has none of, or says the store lost (`StoreSnapshot.lost`: its hash
        made again since, by a gateway's start or an admin write, holds only what they
        wrote), while the state in force had some (none unreadable): its tenants, its key
        records, or both."""
        had = self._applied
        if had is None:
            return []
        return [kind for kind, now, before in (("tenant", snap.tenants, had.tenants),
                                               ("key", snap.keys, had.keys))
                if before and (not now or kind in snap.lost)
                and not any(s.kind == kind for s in snap.skipped)]

    async def _records_lost(
        self, snap: StoreSnapshot, kinds: list[str], whole_before: float
    ) -> StoreSnapshot:
        """The store answers, its marker is there, but it holds no tenant or no key record
        while the state in force has some: the last one deleted by an operator (journaled:
        nothing to do), or the hash lost (deleted by hand, evicted; perhaps made again since
        with a few records). Write back the records in force the journal does not name as
        changed since (`TenantStore.restore_lost`: only while the hash is still lost, so one
        gateway does) and read the store again. Not from a state last read whole more than
        `max_staleness_s` before (`whole_before`: a gateway cut off meanwhile, or started from
        its siblings' file), as a wiped store is not restored from one: a record removed by
        hand (a key revoked in redis-cli) is journaled nowhere, and such a gateway may still
        hold it; another gateway writes back, or none."""
        had = self._applied
        assert had is not None
        names = {"tenant": "tenants", "key": "API key records"}
        age = self._clock() - whole_before
        if self._max_stale is not None and age > self._max_stale:
            log.error("tenancy store lost its %s while its bootstrap marker stayed; this "
                      "gateway's state was last read whole %.0f s ago, past max_staleness_s "
                      "(%.0f s: a record removed by hand since may be in it): not written "
                      "back from it", " and ".join(names[k] for k in kinds), age,
                      self._max_stale)
            kinds = []
        for kind in kinds:
            written = await self._store.restore_lost(kind, had)
            if written is None:
                log.error("tenancy store lost its %s while its bootstrap marker stayed, and "
                          "its journal cannot tell which were deleted since generation %d: "
                          "not written back (re-create them, or restore a backup)",
                          names[kind], had.generation)
            elif written:
                log.error("tenancy store lost its %s (deleted, or evicted: run Redis with "
                          "maxmemory-policy noeviction); wrote back %d of the state in force "
                          "(generation %d)", names[kind], written, had.generation,
                          extra={"kind": kind, "written": written})
        again = await self._store.snapshot()
        self._whole_at = self._clock()
        return again

    def _wiped(self, mark: str | None) -> None:
        self._resets += 1
        self._wiped_at = self._clock()
        restored = restored_from(mark)
        self._wipe_restored = restored is not None
        extra = {"store_resets": self._resets}
        last = self._applied
        if mark == self._restored and last is not None:
            log.error("tenancy store was wiped; restored %d tenants and %d keys from this "
                      "gateway's last state (generation %d, loaded %.0f s ago); rate-limit "
                      "budgets start again", len(last.tenants), len(last.keys),
                      last.generation, self._clock() - self._fresh_at, extra=extra)
        elif restored is not None:
            log.error("tenancy store was wiped; another gateway restored its last state "
                      "(generation %d): reloading it", restored, extra=extra)
        else:
            log.error(
                "tenancy store was wiped (its bootstrap marker changed): policy and configured "
                "tenants re-seeded from configuration; API keys, tenants made through the "
                "admin API and rate-limit budgets were lost", extra=extra)

    def _say_went_back(self, last: StoreSnapshot, snap: StoreSnapshot) -> None:
        """The store's generation is behind the state in force, under the same marker: Redis
        came back from an older snapshot. Said once, counted as a reset, and in /readyz for
        `WIPE_NOTICE_S` (it was reloaded without a word: `went_back`)."""
        self._resets += 1
        story = went_back(last, snap)
        self._went_back = (self._clock(), story)
        log.error("%s", story, extra={"store_resets": self._resets})

    def _apply(self, snap: StoreSnapshot) -> StoreSnapshot:
        """Put ``snap`` in force; returns it as applied (an unreadable policy or epoch
        replaced by the last one read)."""
        old_policy = self._state.policy
        self._note_skipped(snap.skipped)
        source = FROM_STORE if snap.policy is not None else None
        if snap.policy is None and any(s.kind == "policy" for s in snap.skipped):
            if old_policy is not None:  # the last readable policy stays in force
                kept = self._policy_source
                source = LAST_READABLE if kept in (FROM_STORE, None) else kept
                snap = replace(snap, policy=old_policy)
            elif self.configured_policy is not None:
                source = CONFIGURED
                snap = replace(snap, policy=self.configured_policy)
        self._policy_source = source
        snap = replace(snap, group_epochs=self._epochs(snap))
        # one principal per tenant, shared by its keys: a reload after each admin write costs
        # a dict entry per key, not a salt and a limits overlay (~65 µs) per key
        by_tenant = self._principals(snap)
        by_key = {key_hash: principal for key_hash, record in snap.keys.items()
                  if (principal := by_tenant.get(record.tenant_id)) is not None}
        keyed = frozenset(record.tenant_id for record in snap.keys.values())
        self._state = _State(snap.generation, by_key, by_tenant, snap.policy, snap.group_epochs,
                             keyed)
        self._applied = snap
        self._loaded = True
        if snap.policy is not None and (old_policy is None or old_policy != snap.policy):
            for callback in list(self._policy_callbacks):
                try:
                    callback(snap.policy)
                except Exception:
                    log.exception("policy change callback failed")
        return snap

    def _principals(self, snap: StoreSnapshot) -> dict[str, Principal]:
        """Each tenant's principal; the one in force kept for a tenant whose record, policy
        and salt-group epoch are those it was made from. Made anew for all, a reload after
        each admin write held every gateway's event loop (requests included) ~85 ms with
        1,000 tenants on a loaded 2-core machine."""
        last, had = self._applied, self._state.by_tenant
        if last is None or last.policy != snap.policy:
            return {tid: self._principal(t, snap) for tid, t in snap.tenants.items()}
        out: dict[str, Principal] = {}
        for tid, tenant in snap.tenants.items():
            kept = had.get(tid)
            group = tenant.salt_group
            if kept is not None and kept.refused is None and (
                    (before := last.tenants.get(tid)) is tenant or before == tenant) and (
                    group is None or last.group_epochs.get(group) == snap.group_epochs.get(group)):
                out[tid] = kept
            else:
                out[tid] = self._principal(tenant, snap)
        return out

    def _epochs(self, snap: StoreSnapshot) -> dict[str, int]:
        """The snapshot's salt-group epochs, an unreadable one replaced by the last one read."""
        epochs = dict(snap.group_epochs)
        for record in snap.skipped:
            last = self._state.group_epochs.get(record.name)
            if record.kind == "salt_group" and last is not None:
                epochs[record.name] = last
        return epochs

    def _note_skipped(self, skipped: tuple[SkippedRecord, ...]) -> None:
        """Log and count each unreadable record once (a reload after every change meets it
        again); one made readable and broken again counts again."""
        now = {s.fingerprint: s for s in skipped}
        for fingerprint, record in now.items():
            if fingerprint not in self._skipped:
                self._skipped_total[record.kind] = self._skipped_total.get(record.kind, 0) + 1
                log.error("tenancy store: the record of %s is unreadable and was skipped; "
                          "every other record is in force (fix or delete it)%s", record.label,
                          _RULES.get(record.kind, ""), extra={"kind": record.kind})
        if self._skipped and not now:
            log.info("tenancy store: no unreadable record left")
        self._skipped = now

    def _principal(self, tenant: Tenant, snap: StoreSnapshot) -> Principal:
        tier = snap.policy.doc.tiers.get(tenant.tier) if snap.policy else None
        base = tier.limits if tier is not None else Limits()
        # 'default' needs no entry in `tiers` (no limits unless one is set) -- if there is a
        # policy at all; any other tier must be defined there
        known = snap.policy is not None and (tier is not None or tenant.tier == DEFAULT_TIER)
        group = tenant.salt_group
        if group is not None and group not in snap.group_epochs and any(
                s.kind == "salt_group" and s.name == group for s in snap.skipped):
            return Principal(
                tenant_id=tenant.id, tier=tenant.tier, limits=base.overlay(tenant.limits),
                salt_group=group, cache_salt="", policy=snap.policy, tier_known=known,
                refused=f"this tenant's cache salt is unavailable: the stored epoch of its "
                        f"salt group {group!r} is unreadable; ask the operator to rotate its "
                        f"salt (kvgate admin rotate-salt {tenant.id})")
        return Principal(
            tenant_id=tenant.id,
            tier=tenant.tier,
            limits=base.overlay(tenant.limits),
            salt_group=tenant.salt_group,
            cache_salt=self._salts.for_tenant(tenant, snap.group_epochs),
            policy=snap.policy,
            tier_known=known,
            incarnation=tenant.incarnation,
        )

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
        reason = self._degraded_reason
        since = self._clock() - self._wiped_at
        wiped = since < WIPE_NOTICE_S
        if reason is None and wiped and not self._wipe_restored:
            reason = (f"the store was wiped {since:.0f} s ago: API keys and tenants made "
                      "through the admin API are gone (re-issue them)")
        if reason is None and self._store.refusing_writes is not None:
            reason = (f"store refuses writes: {self._store.refusing_writes} (its keys and "
                      "policy are served; admin writes fail, limits are per-process)")
        if reason is None and self._went_back is not None and (
                self._clock() - self._went_back[0] < WIPE_NOTICE_S):
            reason = self._went_back[1]
        if reason is None and self._skipped:
            names = [s.label for s in self._skipped.values()]
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5
                                            else "")
            reason = (f"{len(names)} unreadable record(s) in the store skipped: {shown} "
                      "(fix or delete them)")
        if reason is None and self.also_degraded is not None:
            reason = self.also_degraded()
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

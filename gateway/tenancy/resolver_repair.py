"""How a `TenantResolver` repairs what the store lost: a wiped store restored from the state in
force or re-seeded, a lost policy or records hash written back, a store gone back to an older
snapshot said, and a worker started from its siblings' last state while the store is away."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from gateway.errors import PreconditionFailed, StoreUnreachable
from gateway.tenancy.models import StoreSnapshot
from gateway.tenancy.resolver_apply import ResolverApply
from gateway.tenancy.resolver_base import IN_TOUCH_SLACK_S
from gateway.tenancy.store import restored_from
from gateway.tenancy.went_back import went_back

__all__ = ["ResolverRepair"]

# the resolver's log lines keep the logger name operators and tests filter on
log = logging.getLogger("gateway.tenancy.resolver")


class ResolverRepair(ResolverApply):
    """Notice and repair a wiped or damaged store (`_reseeded`, `_policy_lost`, ...)."""

    def _start_from_last_state(self) -> None:
        """The store did not answer our first load: start from the state the other workers
        of this gateway last loaded, as stale as it is, like they serve it (degraded)."""
        saved = self.last_state.load() if self.last_state is not None else None
        if saved is None:
            return
        self._apply(saved.snapshot)
        self._mark = saved.mark
        self._fresh_at = self._confirmed_at = self._clock() - saved.age_s
        log.warning("tenancy store not answering: serving the state the other workers last "
                    "loaded (%.0f s old) until it does", saved.age_s,
                    extra={"generation": saved.snapshot.generation})

    def _in_touch_s(self) -> float:
        """How recently a state must have been confirmed by the store for this process to
        write it back over a wipe: two checks and a second's slack (a loaded machine), and
        never longer than `max_staleness_s`."""
        bound = 2 * self._poll + IN_TOUCH_SLACK_S
        return bound if self._max_stale is None else min(bound, self._max_stale)

    async def _missed_writes(self, age_s: float) -> bool:
        """Could the wiped store have taken writes this process missed, its state last
        confirmed `age_s` ago? Yes when its server has run since about then (`up_for_s`): it
        was wiped in place (FLUSHALL, an eviction, by hand) after serving the other gateways
        while this one was cut off -- a key revoked meanwhile is in our state. No when the
        server started since (a Redis restarted without persistence: every gateway lost it
        at once, and what it held when it stopped is what we last read, up to `_in_touch_s`);
        nor when the server does not say (INFO refused by an ACL): restored, as before.
        An uptime that cannot be read (a timeout) fails the check, tried again, for at most
        `_in_touch_s`: then read as the server not saying (one that never answers INFO would
        otherwise keep the store wiped for good). (Cut off first and restarted later, with a
        key revoked between: not told apart.)"""
        try:
            up = await self._store.up_for_s()
        except StoreUnreachable:
            now = self._clock()
            if self._uptime_wait is None:
                self._uptime_wait = now
            if now - self._uptime_wait < self._in_touch_s():
                raise
            up = None
        self._uptime_wait = None
        return up is not None and up > age_s - self._in_touch_s()

    async def _reseeded(self) -> str | None:
        """The store lost its bootstrap marker: write back the state this process loaded if it is
        younger than `max_staleness_s` and, when the store was wiped in place
        (`_missed_writes`), the store confirmed it just before (this process was in touch
        with the store when it was wiped), then seed it from configuration (idempotent: what
        was restored stays) before reading it. Returns the new marker, or None while a
        process cut off from the store waits for one in touch to restore it (`_in_touch_s`,
        then it re-seeds): a key revoked or a tenant deleted while it was cut off is in its
        state, and nothing in a wiped store says so. A wipe of the store our state came from
        is logged and counted (`_wiped`, here or by the gateway that finds another gateway's
        marker)."""
        assert self._reseed is not None
        last, now = self._applied, self._clock()
        age = now - self._confirmed_at
        if last is not None:  # loaded: the wipe of a store it read
            self._degraded_reason = "store was wiped; restoring or re-seeding it"
            if age > self._in_touch_s() and await self._missed_writes(age):
                if self._wipe_wait is None:
                    self._wipe_wait = now
                    log.error("tenancy store was wiped; this gateway's last state is %.1f s "
                              "old (it was cut off from the store: keys revoked or tenants "
                              "deleted meanwhile may be in it): not restored from it; waiting "
                              "%.1f s for a gateway in touch with the store to restore it, "
                              "else re-seeding from configuration", age, self._in_touch_s())
                if now - self._wipe_wait < self._in_touch_s():
                    self._degraded_reason = ("store was wiped; waiting for a gateway in "
                                             "touch with it to restore it")
                    return None
            elif self._max_stale is not None and age > self._max_stale:
                log.error("tenancy store was wiped; this gateway's last state is %.0f s old, "
                          "past max_staleness_s (%.0f s): not restored, re-seeding from "
                          "configuration", age, self._max_stale)
            elif await self._store.restore(last):
                self._restored = await self._store.seed_mark()
        self._wipe_wait = None
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


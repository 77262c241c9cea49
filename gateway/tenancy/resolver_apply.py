"""How a `TenantResolver` puts a snapshot of the store in force: the policy (the last readable
one kept over an unreadable one), the salt-group epochs, one principal per tenant, and the
unreadable records logged and counted once."""

from __future__ import annotations

import logging
from dataclasses import replace

from gateway.policy_doc import DEFAULT_TIER, Limits
from gateway.tenancy.models import SkippedRecord, StoreSnapshot, Tenant
from gateway.tenancy.principal import Principal
from gateway.tenancy.resolver_base import (
    CONFIGURED,
    FROM_STORE,
    LAST_READABLE,
    ResolverBase,
    _State,
)

__all__ = ["ResolverApply"]

# the resolver's log lines keep the logger name operators and tests filter on
log = logging.getLogger("gateway.tenancy.resolver")

# what a readable record of a kind is, where a log line can say it in a few words
_RULES = {"salt_group": "; a salt group's epoch is a decimal integer from 0 to 2**63 - 1 "
                        "without leading zeros, and rotating its salt writes a fresh one"}


class ResolverApply(ResolverBase):
    """Put a store snapshot in force (`_apply`)."""

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
        by_key, counts = self._key_index(snap, by_tenant)
        self._state = _State(snap.generation, by_key, by_tenant, snap.policy, snap.group_epochs,
                             frozenset(counts), counts)
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

    def _key_index(self, snap: StoreSnapshot, by_tenant: dict[str, Principal],
                   ) -> tuple[dict[str, Principal], dict[str, int]]:
        """Each key's principal and each tenant's count of key records: the ones in force
        updated where the keys changed, when `snap`'s keys update the snapshot in force and
        every tenant kept has the principal in force; else made anew (a Python step per key:
        ~1 us each). A tenant deleted, or created, is such an update when no key record of
        it is left over (its deletion journals each of its keys): a deletion rebuilt the
        index whole, a step for every key of every tenant."""
        last, had = self._applied, self._state
        if last is None or snap.keys_from is None or snap.keys_from is not last.keys:
            return self._whole_index(snap, by_tenant)
        new = by_tenant.keys() - had.by_tenant.keys()
        if any(had.key_counts.get(t) for t in new) or any(
                p is not had.by_tenant[t] for t, p in by_tenant.items() if t not in new):
            return self._whole_index(snap, by_tenant)  # (keys of a tenant to map again)
        by_key, counts = dict(had.by_key), dict(had.key_counts)
        for key_hash in snap.keys_changed:
            if (gone := last.keys.get(key_hash)) is not None:
                counts[gone.tenant_id] -= 1
                if not counts[gone.tenant_id]:
                    del counts[gone.tenant_id]
            by_key.pop(key_hash, None)
            if (added := snap.keys.get(key_hash)) is not None:
                counts[added.tenant_id] = counts.get(added.tenant_id, 0) + 1
                if (principal := by_tenant.get(added.tenant_id)) is not None:
                    by_key[key_hash] = principal
        if any(counts.get(t) for t in had.by_tenant.keys() - by_tenant.keys()):
            return self._whole_index(snap, by_tenant)  # a deleted tenant's unjournaled keys
        return by_key, counts

    @staticmethod
    def _whole_index(snap: StoreSnapshot, by_tenant: dict[str, Principal],
                     ) -> tuple[dict[str, Principal], dict[str, int]]:
        counts: dict[str, int] = {}
        for record in snap.keys.values():
            counts[record.tenant_id] = counts.get(record.tenant_id, 0) + 1
        return {key_hash: principal for key_hash, record in snap.keys.items()
                if (principal := by_tenant.get(record.tenant_id)) is not None}, counts

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


"""The single-process store: plain dicts, callbacks instead of pub/sub."""

from __future__ import annotations

import secrets
from collections import deque

from gateway.errors import Conflict, StaleCheck
from gateway.policy_doc import PolicyDoc
from gateway.tenancy.models import (
    AuditEntry,
    Change,
    KeyRecord,
    PolicySnapshot,
    SaltRotation,
    StoreSnapshot,
    Tenant,
)
from gateway.tenancy.store import (
    DEFAULT_AUDIT_CAP,
    TenantStore,
    apply_tenant_changes,
    check_policy_version,
    key_taken,
    tenant_missing,
    with_epoch,
)

__all__ = ["InMemoryStore"]


class InMemoryStore(TenantStore):
    def __init__(self, *, audit_cap: int = DEFAULT_AUDIT_CAP) -> None:
        super().__init__()
        self._tenants: dict[str, Tenant] = {}
        self._keys: dict[str, KeyRecord] = {}  # key_hash -> record
        self._policy: PolicySnapshot | None = None
        self._group_epochs: dict[str, int] = {}
        self._audit: deque[AuditEntry] = deque(maxlen=audit_cap)
        self._generation = 0
        self._mark: str | None = None  # process memory cannot be wiped behind our back
        self._tenants_at = 0  # the generation of the last write of a tenant record
        # the keys of the last snapshot and the hashes changed since: the next snapshot says
        # so, and the resolver updates its key index there (`StoreSnapshot.keys_from`)
        # tenant -> key id -> key_hash, every key of `_keys` once: a creation, revocation,
        # listing or tenant deletion reads its tenant's keys here, not a scan of every key
        self._of_tenant: dict[str, dict[str, str]] = {}
        self._handed: dict[str, KeyRecord] | None = None
        self._keys_changed: set[str] = set()

    def _changed(self, kind: str, ident: str | None) -> None:
        self._generation += 1
        if kind == "tenant":
            self._tenants_at = self._generation
        self._notify(Change(kind, ident))

    def _check_policy(self, version: int | None) -> None:
        """The policy a tenant's tier was checked against is still in force (as the Redis
        store's scripts check: here nothing awaits between a check and its write, but the
        rule is the same)."""
        current = self._policy.version if self._policy else 0
        if version is not None and version != current:
            raise StaleCheck("the policy changed while the tenant's tier was checked; retry")

    def _require(self, tenant_id: str) -> Tenant:
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            raise tenant_missing(tenant_id)
        return tenant

    async def create_tenant(
        self, tenant: Tenant, *, over_unreadable: bool = False, policy_version: int | None = None
    ) -> Tenant:
        if tenant.id in self._tenants:
            raise Conflict(f"tenant {tenant.id!r} already exists", param="id")
        self._check_policy(policy_version)
        self._tenants[tenant.id] = tenant
        self._changed("tenant", tenant.id)
        return tenant

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    async def list_tenants(self) -> list[Tenant]:
        return sorted(self._tenants.values(), key=lambda t: t.id)

    async def update_tenant(
        self, tenant_id: str, changes: dict[str, object], *, policy_version: int | None = None
    ) -> Tenant:
        tenant = apply_tenant_changes(self._require(tenant_id), changes)
        self._check_policy(policy_version)
        self._tenants[tenant_id] = tenant
        self._changed("tenant", tenant_id)
        return tenant

    async def delete_tenant(self, tenant_id: str) -> bool:
        if self._tenants.pop(tenant_id, None) is None:
            return False
        for key_hash in self._of_tenant.pop(tenant_id, {}).values():
            del self._keys[key_hash]
            self._keys_changed.add(key_hash)
        self._changed("tenant", tenant_id)
        return True

    async def rotate_salt(self, tenant_id: str) -> SaltRotation:
        tenant = self._require(tenant_id)
        group = tenant.salt_group
        if group is not None:
            epoch = self._group_epochs.get(group, 0) + 1
            self._group_epochs[group] = epoch
            rotation = SaltRotation(tenant_id, "group", group, epoch)
        else:
            epoch = tenant.salt_epoch + 1
            self._tenants[tenant_id] = with_epoch(tenant, epoch)
            rotation = SaltRotation(tenant_id, "tenant", None, epoch)
        self._changed("salt", tenant_id)
        return rotation

    async def add_key(self, record: KeyRecord) -> None:
        self._require(record.tenant_id)
        # as `RedisStore.add_key` refuses it; looked up, not searched: a scan of every key
        # made creating 10,000 keys slow down as they grew
        held = self._of_tenant.setdefault(record.tenant_id, {})
        if record.key_hash in self._keys or record.key_id in held:
            if not held:
                del self._of_tenant[record.tenant_id]
            raise key_taken(record)
        self._keys[record.key_hash] = record
        held[record.key_id] = record.key_hash
        self._keys_changed.add(record.key_hash)
        self._changed("key", record.tenant_id)

    async def revoke_key(self, tenant_id: str, key_id: str) -> bool:
        held = self._of_tenant.get(tenant_id, {})
        key_hash = held.pop(key_id, None)
        if key_hash is None:
            return False
        if not held:
            del self._of_tenant[tenant_id]
        del self._keys[key_hash]
        self._keys_changed.add(key_hash)
        self._changed("key", tenant_id)
        return True

    async def list_keys(self, tenant_id: str) -> list[KeyRecord]:
        found = [self._keys[h] for h in self._of_tenant.get(tenant_id, {}).values()]
        return sorted(found, key=lambda r: (r.created_at, r.key_id))

    async def salt_group_epochs(self) -> dict[str, int | None]:
        return dict(self._group_epochs)

    async def get_policy(self) -> PolicySnapshot | None:
        return self._policy

    async def put_policy(
        self, doc: PolicyDoc, *, if_version: int | None = None, keep_unknown: bool = False,
        tenants_at: int | None = None,
    ) -> PolicySnapshot:
        current = self._policy.version if self._policy else 0
        check_policy_version(current, if_version)
        if tenants_at is not None and self._tenants_at > tenants_at:
            raise StaleCheck("a tenant changed while the policy was checked against the "
                             "tenants' tiers; retry")
        self._policy = PolicySnapshot(current + 1, doc)
        self._changed("policy", None)
        return self._policy

    async def append_audit(self, entry: AuditEntry) -> None:
        self._audit.append(entry)

    async def list_audit(self, limit: int = 100) -> list[AuditEntry]:
        return list(reversed(self._audit))[:limit]

    async def generation(self) -> int:
        return self._generation

    async def snapshot(self) -> StoreSnapshot:
        keys, changed = dict(self._keys), frozenset(self._keys_changed)
        base, self._handed = self._handed, keys
        self._keys_changed.clear()
        return StoreSnapshot(
            generation=self._generation,
            tenants=dict(self._tenants),
            keys=keys,
            policy=self._policy,
            group_epochs=dict(self._group_epochs),
            keys_from=base,
            keys_changed=changed,
        )

    async def mark_seeded(self) -> None:
        if self._mark is None:
            self._mark = secrets.token_hex(8)

    async def seed_mark(self) -> str | None:
        return self._mark

"""The shared store on Redis: every gateway replica reads and writes the same state.

Layout under a namespace (default ``kvgate``): ``:tenants`` hash id -> JSON, ``:keys`` hash
key-hash -> JSON, ``:tkeys:<id>`` hash key-id -> key-hash, ``:policy`` hash {version, doc},
``:salt_groups`` hash group -> epoch (the tenants and keys hashes also hold a ``.`` field,
`PRESENT`, from the first seed on, and ``:present`` says they do: a hash without it was lost,
not emptied, `restore_lost`),
``:audit`` capped list, ``:gen`` counter, the ``:seeded`` bootstrap marker (its absence means
the store was never seeded, or was wiped) and the ``:changes`` pub/sub channel. Conditional
writes are Lua scripts that also bump ``:gen``, publish, and journal the records they changed
in ``:journal`` (a capped list, newest first, ``"<gen> <kind> <name>"``: ``tenant <id>``,
``key <hash>`` -- one per key a tenant's deletion removes --, ``policy``, ``salt <group>``), so a
change, its notification and its journal entry are one atomic step.

A reload after a write (`changes_since`) reads the counter, the journal's newest entries, the
tenants, the policy and the salt groups in one transaction, and only the key records the
journal names in a second one: a write's cost no longer grows with the keys stored. The key
records were the one part read whole on every reload (the others are small): whole reads
enforced that a revoked key, or the keys of a deleted tenant, are gone everywhere, and that a
record written by another process is seen; the journal names every key record a write removes
or adds, and anything it does not account for (a generation without an entry: a write behind
the store's back; an entry trimmed away; a write between the two reads) makes a whole read,
as does a reload 30 s after the last whole one (`resolver.WHOLE_RELOAD_S`).

The scripts are in `redis_scripts`, the reading of stored values in `redis_records`; the
store's parts: `redis_base` (what they share), `redis_listen` (lifecycle, pub/sub),
`redis_sync` (generation, snapshots, journal, restores), this module (the records).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Collection
from typing import Any

from gateway.errors import Conflict, StaleCheck
from gateway.policy_doc import PolicyDoc
from gateway.tenancy.audited import RESULT
from gateway.tenancy.models import (
    AuditEntry,
    Change,
    KeyRecord,
    PolicySnapshot,
    SaltRotation,
    SkippedRecord,
    Tenant,
)
from gateway.tenancy.redis_auth_failures import auth_failure_level
from gateway.tenancy.redis_base import PRESENT, records
from gateway.tenancy.redis_conn import redis_unavailable
from gateway.tenancy.redis_listen import RedisListening
from gateway.tenancy.redis_records import (
    audit_from_json,
    parsed_before,
    policy_from,
    read_epoch,
    read_record,
    readable_records,
    text,
    texts,
    unreadable_policy,
)
from gateway.tenancy.redis_sync import RedisSync
from gateway.tenancy.salts import fresh_epoch
from gateway.tenancy.store import (
    apply_tenant_changes,
    check_policy_version,
    key_from_json,
    key_taken,
    read_tenant,
    tenant_from_json,
    tenant_missing,
    tenant_to_json,
    with_epoch,
)
from gateway.tenancy.unknown import keep_unknown as with_unknown_of

__all__ = ["PRESENT", "RedisStore"]

log = logging.getLogger(__name__)


def _stale_tier() -> StaleCheck:
    return StaleCheck("the policy changed while the tenant's tier was checked; retry")



class RedisStore(RedisListening, RedisSync):
    label = "the tenancy store (Redis)"

    # -- tenants -----------------------------------------------------------------------------
    async def create_tenant(
        self, tenant: Tenant, *, over_unreadable: bool = False, policy_version: int | None = None
    ) -> Tenant:
        change = Change("tenant", tenant.id)
        new = tenant_to_json(tenant)
        at = "" if policy_version is None else str(policy_version)
        keys = [self._k("tenants"), self._k("policy")]
        created = await self._run("create", keys, [tenant.id, new, at], change)
        if created < 0:
            raise _stale_tier()
        if created:
            return tenant
        if over_unreadable:  # replaced only if it is still the unreadable value read here
            raw = await self._get_raw(tenant.id)
            if raw is not None and read_record(raw, tenant_from_json) is None:
                replaced = await self._run("cas", keys, [tenant.id, raw, new, at], change)
                if replaced < 0:
                    raise _stale_tier()
                if replaced:
                    return tenant
        raise Conflict(f"tenant {tenant.id!r} already exists", param="id")

    async def _get_raw(self, tenant_id: str) -> str | None:
        if tenant_id == PRESENT:
            return None
        with redis_unavailable():
            raw = await self._r.hget(self._k("tenants"), tenant_id)
        return None if raw is None else text(raw)

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        raw = await self._get_raw(tenant_id)
        return read_tenant(tenant_id, raw) if raw is not None else None

    async def list_tenants(self) -> list[Tenant]:
        with redis_unavailable():
            raw = records(await self._r.hgetall(self._k("tenants")))
        skipped: list[SkippedRecord] = []
        tenants = readable_records(raw, tenant_from_json, "tenant", skipped)
        return sorted(tenants.values(), key=lambda t: t.id)

    async def tenant_page(self, after: str | None, limit: int) -> tuple[list[Tenant], bool]:
        """The ids only, sorted, then the page's records: a page parses `limit` records,
        not every tenant. An unreadable one is left out (as from `list_tenants`) and the
        page reads on past it: a page of unreadable records only came back empty with more
        to follow and no last id to follow them by."""
        with redis_unavailable():
            ids = sorted(i for i in map(text, await self._r.hkeys(self._k("tenants")))
                         if i != PRESENT)
        if after is not None:
            ids = ids[bisect_right(ids, after):]
        page: list[Tenant] = []
        read = 0
        while read < len(ids) and len(page) < limit:
            chunk = ids[read:read + limit - len(page)]
            read += len(chunk)
            with redis_unavailable():
                raws = await self._r.hmget(self._k("tenants"), chunk)
            stored = {tid: text(raw) for tid, raw in zip(chunk, raws, strict=True)
                      if raw is not None}
            tenants = readable_records(stored, tenant_from_json, "tenant", [])
            page += [tenants[tid] for tid in chunk if tid in tenants]
        return page, read < len(ids)

    async def _replace(
        self, tenant_id: str, change: Change, update: Any, policy_version: int | None = None,
        audit: Any = None,
    ) -> Tenant:
        """Optimistic read-modify-write: retry while another writer got there first. Fields of
        the stored record this kvgate does not know (a newer one wrote them) are kept.
        `audit(new)`: what the write's audit entry says of it."""
        at = "" if policy_version is None else str(policy_version)
        while True:
            raw = await self._get_raw(tenant_id)
            if raw is None:
                raise tenant_missing(tenant_id)
            new = update(read_tenant(tenant_id, raw))
            args = [tenant_id, raw, with_unknown_of(raw, tenant_to_json(new), Tenant), at]
            written = await self._run("cas", [self._k("tenants"), self._k("policy")], args,
                                      change, **({} if audit is None else audit(new)))
            if written < 0:
                raise _stale_tier()
            if written:
                return new  # type: ignore[no-any-return]

    async def update_tenant(
        self, tenant_id: str, changes: dict[str, object], *, policy_version: int | None = None
    ) -> Tenant:
        return await self._replace(
            tenant_id, Change("tenant", tenant_id), lambda t: apply_tenant_changes(t, changes),
            policy_version,
        )

    async def delete_tenant(self, tenant_id: str) -> bool:
        keys = [self._k("tenants"), self._k("keys"), self._k("tkeys", tenant_id)]
        args = [tenant_id, *self._viewed_keys({tenant_id})]
        return bool(await self._run("delete", keys, args, Change("tenant", tenant_id)))

    async def rotate_salt(self, tenant_id: str) -> SaltRotation:
        tenant = await self.get_tenant(tenant_id)
        if tenant is None:
            raise tenant_missing(tenant_id)
        change = Change("salt", tenant_id)
        if tenant.salt_group is not None:
            group = tenant.salt_group
            epoch = await self._run("group", [self._k("salt_groups")], [group, fresh_epoch()],
                                    change, scope="group", salt_group=group, epoch=RESULT)
            return SaltRotation(tenant_id, "group", group, epoch)
        new = await self._replace(
            tenant_id, change, lambda t: with_epoch(t, t.salt_epoch + 1),
            audit=lambda t: {"scope": "tenant", "salt_group": None, "epoch": t.salt_epoch})
        return SaltRotation(tenant_id, "tenant", None, new.salt_epoch)

    # -- keys --------------------------------------------------------------------------------
    async def add_key(self, record: KeyRecord) -> None:
        tid = record.tenant_id
        keys = [self._k("tenants"), self._k("keys"), self._k("tkeys", tid)]
        args = [tid, record.key_id, record.key_hash, record.model_dump_json()]
        added = await self._run("add_key", keys, args, Change("key", tid))
        if added < 0:
            raise key_taken(record)
        if not added:
            raise tenant_missing(tid)

    async def revoke_key(self, tenant_id: str, key_id: str) -> bool:
        keys = [self._k("tenants"), self._k("keys"), self._k("tkeys", tenant_id)]
        held = self._tenant_keys.get(tenant_id, {})
        seen = [h for h, kid in held.items() if kid == key_id]  # this tenant's keys only
        args = [tenant_id, key_id, seen[0] if seen else ""]
        return bool(await self._run("revoke", keys, args, Change("key", tenant_id)))

    def _viewed_keys(self, tenant_ids: Collection[str]) -> list[str]:
        """The hashes of these tenants' keys in the last view loaded (`snapshot`): what their
        key indexes (``:tkeys:<id>``) name, unless an index was lost (evicted by an
        `allkeys-*` Redis, deleted by hand) while the records stayed. The admin API's reads
        and writes of a tenant's keys take these with the index's. Read from the view's
        index by tenant (`_tenant_keys`): a scan of every key made each revocation cost
        ~8 ms of gateway CPU at 10,000 keys."""
        return [h for tid in tenant_ids for h in self._tenant_keys.get(tid, {})]

    async def list_keys(self, tenant_id: str) -> list[KeyRecord]:
        return (await self._keys_of([tenant_id]))[tenant_id]

    async def keys_by_tenant(
        self, tenant_ids: Collection[str] | None = None
    ) -> dict[str, list[KeyRecord]]:
        """One read of every key record, not two per tenant; for a page of tenants, their
        key indexes in one round trip and their records in a second."""
        if tenant_ids is not None:
            return await self._keys_of(tenant_ids)
        with redis_unavailable():
            raw = records(await self._r.hgetall(self._k("keys")))
        found: dict[str, list[KeyRecord]] = {}
        for record in parsed_before(raw, self._parsed_keys, key_from_json).values():
            found.setdefault(record.tenant_id, []).append(record)
        return {tid: sorted(records, key=lambda r: (r.created_at, r.key_id))
                for tid, records in found.items()}

    async def _keys_of(self, tenant_ids: Collection[str]) -> dict[str, list[KeyRecord]]:
        with redis_unavailable():
            async with self._r.pipeline(transaction=False) as pipe:
                for tid in tenant_ids:
                    pipe.hvals(self._k("tkeys", tid))
                hashes = [text(h) for found in await pipe.execute() for h in found]
            hashes += self._viewed_keys(set(tenant_ids))
            hashes = list(dict.fromkeys(hashes))
            raws = await self._r.hmget(self._k("keys"), hashes) if hashes else []
        stored = {h: text(r) for h, r in zip(hashes, raws, strict=True) if r is not None}
        found: dict[str, list[KeyRecord]] = {tid: [] for tid in tenant_ids}
        for record in parsed_before(stored, self._parsed_keys, key_from_json).values():
            if record.tenant_id in found:
                found[record.tenant_id].append(record)
        return {tid: sorted(records, key=lambda r: (r.created_at, r.key_id))
                for tid, records in found.items()}

    async def salt_group_epochs(self) -> dict[str, int | None]:
        with redis_unavailable():
            raw = texts(await self._r.hgetall(self._k("salt_groups")))
        return {group: read_record(value, read_epoch) for group, value in raw.items()}

    # -- policy ------------------------------------------------------------------------------
    async def _policy_raw(self) -> dict[str, str]:
        with redis_unavailable():
            return texts(await self._r.hgetall(self._k("policy")))

    async def get_policy(self) -> PolicySnapshot | None:
        skipped: list[SkippedRecord] = []
        snap = policy_from(await self._policy_raw(), skipped)
        if skipped:
            raise unreadable_policy()
        return snap

    async def put_policy(
        self, doc: PolicyDoc, *, if_version: int | None = None, keep_unknown: bool = False,
        tenants_at: int | None = None,
    ) -> PolicySnapshot:
        expected = "" if if_version is None else str(if_version)
        new = doc.model_dump_json(exclude_unset=True)
        if keep_unknown and if_version is not None:
            # the version check below makes this the document of `if_version`, or a 412
            stored = await self._policy_raw()
            if stored.get("version") == expected and "doc" in stored:
                new = with_unknown_of(stored["doc"], new, PolicyDoc)
        args = [expected, new, "" if tenants_at is None else str(tenants_at)]
        version = await self._run("policy", [self._k("policy")], args, Change("policy"),
                                  version=RESULT)
        if version < 0:
            check_policy_version(-1 - version, if_version)  # raises PreconditionFailed
        if version == 0:
            raise StaleCheck("a tenant changed while the policy was checked against the "
                             "tenants' tiers; retry")
        return PolicySnapshot(version, doc)

    # -- audit -------------------------------------------------------------------------------
    async def append_audit(self, entry: AuditEntry) -> None:
        with redis_unavailable():
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.lpush(self._k("audit"), entry.model_dump_json())
                pipe.ltrim(self._k("audit"), 0, self._audit_cap - 1)
                await pipe.execute()

    async def list_audit(self, limit: int = 100) -> list[AuditEntry]:
        with redis_unavailable():
            raws = await self._r.lrange(self._k("audit"), 0, max(0, limit - 1))
        entries = [read_record(text(r), audit_from_json) for r in raws]
        if None in entries:  # one garbage entry made the whole audit list a 500
            log.warning("tenancy store: %d unreadable audit entries left out of the answer",
                        entries.count(None))
        return [e for e in entries if e is not None]

    async def auth_failures(self, address: str, *, burst: float,
                            per_minute: float) -> float | None:
        if self.reach.down:  # each process counts alone: an admin request does not wait on it
            return None
        return await auth_failure_level(self._scripts["auth_failures"],
                                        self._k("admin_auth", address), burst=burst,
                                        per_minute=per_minute, channel=self._k("admin_auth"),
                                        address=address)


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

The scripts are in `redis_scripts`, the reading of stored values in `redis_records`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from bisect import bisect_right
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError, WatchError

from gateway.errors import Conflict, StaleCheck, StoreUnreachable
from gateway.policy_doc import PolicyDoc
from gateway.tenancy import redis_scripts as scripts
from gateway.tenancy.audited import AUDITING, RESULT
from gateway.tenancy.key_types import name_wrong_types
from gateway.tenancy.models import (
    AuditEntry,
    Change,
    KeyRecord,
    PolicySnapshot,
    SaltRotation,
    SkippedRecord,
    StoreSnapshot,
    Tenant,
)
from gateway.tenancy.reachability import Reachability
from gateway.tenancy.redis_auth_failures import (
    AUTH_FAILURES,
    auth_failure_level,
    throttled_address,
    throttled_now,
)
from gateway.tenancy.redis_conn import (
    failure_cause,
    redis_address,
    redis_tls,
    redis_unavailable,
    refusal_code,
)
from gateway.tenancy.redis_records import (
    ParsedOnce,
    audit_from_json,
    changed_keys,
    counter,
    parse_change,
    parsed_before,
    policy_from,
    read_epoch,
    read_record,
    readable_records,
    skipped_record,
    text,
    texts,
    unreadable_policy,
)
from gateway.tenancy.salts import fresh_epoch
from gateway.tenancy.store import (
    DEFAULT_AUDIT_CAP,
    TenantStore,
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

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_MAX_S = 2.0  # the pub/sub listener's reconnect back-off: 0.1 s doubling up to this
THROTTLES_WAIT_S = 2.0  # the longest an admin request waits for `throttles_read`
THROTTLES_CLOSED_S = 30.0  # how long admin requests are refused while they are not read

JOURNAL_READ = 256  # entries a reload reads: more changes since the last one, a whole reload

# A field of the tenants hash and of the keys hash from the first seed on (no tenant id or key
# hash is "."): the last record deleted (by the admin API, or by hand to revoke a key) leaves
# the hash there, so a hash that is gone was lost (deleted whole, evicted) -- `restore_lost`.
PRESENT = "."
# what a hash of a store without the ``:present`` flag (seeded before the field was kept) lacks
# says nothing; with it, a tenants or keys hash without `PRESENT` was lost (`StoreSnapshot.lost`)
KINDS = {"tenants": "tenant", "keys": "key"}

# the scripts of admin writes: they take the write's audit entry (`redis_scripts._audit`)
AUDITED_SCRIPTS = frozenset({"create", "cas", "delete", "add_key", "revoke", "policy", "group"})


def records(raw: dict[Any, Any]) -> dict[str, str]:
    """A tenants or keys hash's records: `texts` without the `PRESENT` field."""
    found = texts(raw)
    found.pop(PRESENT, None)
    return found


def _stale_tier() -> StaleCheck:
    return StaleCheck("the policy changed while the tenant's tier was checked; retry")


class RedisStore(TenantStore):
    label = "the tenancy store (Redis)"

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "kvgate",
        audit_cap: int = DEFAULT_AUDIT_CAP,
        listen: bool = True,
    ) -> None:
        super().__init__()
        self.reach: Reachability = Reachability(redis_address(client), retry_every_s=RETRY_MAX_S,
                                                tls=redis_tls(client.connection_pool))
        self._r = client
        self._ns = namespace
        self._audit_cap = audit_cap
        self._listen = listen
        # key hash -> (its record's JSON, the record or None: unreadable) as last read
        self._parsed_keys: dict[str, tuple[str, KeyRecord | None]] = {}
        self._tenant_records = ParsedOnce(tenant_from_json)  # each reload parses the changed
        # the key records as of `_view_generation` (the last snapshot made), readable ones
        # and the skipped: `changes_since` updates them from the journal
        self._keys: dict[str, KeyRecord] = {}
        self._bad_keys: dict[str, SkippedRecord] = {}
        self._view_generation: int | None = None
        self._journal_head: str | None = None  # the journal's newest entry at that generation
        self._listener: asyncio.Task[None] | None = None
        self._closing = False
        # why writes are refused though every read works (a read-only replica: READONLY),
        # as the probe of each `generation` check found; None while writes are taken
        self._read_only: str | None = None
        # the addresses found throttled while nobody listened (`tell_throttles_to` takes
        # them), and the first read of those throttled before this process listened: done
        # (or failed), so an admin request need not wait for it
        self._untold: dict[str, float] = {}
        self._throttles_read = asyncio.Event()
        self._throttles_since: float | None = None  # the first admin request's wait for it
        self._scripts = {
            name: client.register_script(src)
            for name, src in {
                "create": scripts.CREATE,
                "cas": scripts.CAS_TENANT,
                "delete": scripts.DELETE,
                "add_key": scripts.ADD_KEY,
                "revoke": scripts.REVOKE,
                "policy": scripts.PUT_POLICY,
                "group": scripts.ROTATE_GROUP,
                "lost": scripts.RESTORE_LOST,
                "mark": scripts.MARK_SEEDED,
                "auth_failures": AUTH_FAILURES,
            }.items()
        }

    def _k(self, *parts: str) -> str:
        return ":".join((self._ns, *parts))

    async def explain(self, cause: str) -> str:
        return await name_wrong_types(self._r, self._ns, cause)

    @property
    def channel(self) -> str:
        return self._k("changes")

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self._say_if_evicting()
        if self._listen and self._listener is None:
            self._listener = asyncio.create_task(self._listen_loop(), name="tenancy-pubsub")

    async def _say_if_evicting(self) -> None:
        """A Redis that evicts any key when full (``maxmemory-policy allkeys-*``) takes
        kvgate's tenants, keys, policy, its bootstrap marker (a wipe, each time) and leases
        with it: say so once at start. Nothing is said without a `maxmemory` (it never
        evicts), where CONFIG is refused (an ACL user without it, a managed Redis that renamed
        it) or Redis does not answer yet."""
        try:
            found = await self._r.config_get("maxmemory*")
        except (RedisError, OSError):
            return
        policy = text(found.get("maxmemory-policy") or "")
        if policy.startswith("allkeys-") and found.get("maxmemory") not in (None, "0"):
            log.warning("Redis at %s evicts any key when it is full (maxmemory-policy %s): "
                        "kvgate's tenants, API keys, policy and concurrency leases may be "
                        "evicted, each eviction of its bootstrap marker read as a wiped store; "
                        "give kvgate a Redis with maxmemory-policy noeviction", self.reach.address,
                        policy, extra={"redis": self.reach.address})

    async def close(self) -> None:
        self._closing = True
        if self._listener is not None:
            # redis-py may turn a cancellation inside a read into its own TimeoutError, so the
            # loop also checks `_closing`; cancel again until the task has really ended.
            while not self._listener.done():
                self._listener.cancel()
                await asyncio.wait({self._listener}, timeout=0.5)
            self._listener = None
        await self._r.aclose()

    async def _listen_loop(self) -> None:
        backoff = 0.1
        while not self._closing:
            pubsub = self._r.pubsub()
            try:
                await pubsub.subscribe(self.channel, self._k("admin_auth"))
                self.reach.connected()
                self._notify(Change("resync"))  # messages may have been missed while away
                backoff = 0.1
                await self._tell_throttled()  # the addresses throttled meanwhile
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None:
                        continue
                    if msg.get("channel") == self.channel:
                        self._notify(parse_change(msg.get("data")))
                    elif (said := throttled_address(str(msg.get("data")))) is not None:
                        self._tell(*said)
            except (RedisError, OSError) as exc:
                self._throttles_read.set()  # not read: an admin request does not wait on it
                if self._closing:
                    return
                self.reach.failed(failure_cause(exc))
                await asyncio.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2

    async def _tell_throttled(self) -> None:
        """The addresses throttled now, told (`_tell`). Refused (an ACL without SCAN): logged,
        and the failures published from now on are still told. Read at each subscription,
        whether anyone listens yet or not: the admin app that listens is built after the
        store starts, and the addresses were read only once it listened and the listener's
        next wait for a message had ended (up to a second after a gateway's start, when a
        throttled address's valid token got in)."""
        try:
            found = await throttled_now(self._r, self._k("admin_auth", ""))
        except ResponseError as exc:
            log.warning("tenancy store: the admin addresses throttled before this gateway "
                        "listened could not be read (%s): it throttles those that fail here "
                        "or are throttled from now on", failure_cause(exc),
                        extra={"redis": self.reach.address})
            found = []
        finally:
            self._throttles_read.set()
        for address, level in found:
            self._tell(address, level)

    def _tell(self, address: str, level: float) -> None:
        """`on_auth_throttled`, or kept for `tell_throttles_to` while nobody listens (the
        lowest level of an address: it throttles a little longer, never shorter)."""
        if self.on_auth_throttled is not None:
            self.on_auth_throttled(address, level)
        else:
            self._untold[address] = min(level, self._untold.get(address, level))

    def tell_throttles_to(self, tell: Callable[[str, float], None]) -> None:
        self.on_auth_throttled = tell
        untold, self._untold = self._untold, {}
        for address, level in untold.items():
            tell(address, level)

    async def throttles_read(self) -> None:
        """Wait (`THROTTLES_WAIT_S` at most) for the addresses throttled before this gateway
        listened. Not read by then, the admin request is a 503 with Retry-After, not let in
        unchecked (on a loaded machine the read took longer and a throttled address's valid
        token was taken), until `THROTTLES_CLOSED_S` after the first wait: a listener that
        neither reads nor fails (a Redis that takes the connection and answers nothing)
        keeps the admin API closed no longer."""
        if self._listener is None or self._throttles_read.is_set():
            return
        loop = asyncio.get_running_loop()
        if self._throttles_since is None:
            self._throttles_since = loop.time()
        left = self._throttles_since + THROTTLES_CLOSED_S - loop.time()
        try:
            await asyncio.wait_for(self._throttles_read.wait(), min(THROTTLES_WAIT_S, left))
        except TimeoutError:
            if loop.time() - self._throttles_since < THROTTLES_CLOSED_S:
                raise StoreUnreachable("timeout") from None
            self._throttles_read.set()
            log.warning("the addresses throttled before this gateway listened were not read "
                        "in %.0f s: admin requests are checked without them", THROTTLES_CLOSED_S,
                        extra={"redis": self.reach.address})

    async def _run(
        self, name: str, keys: list[str], args: list[Any], change: Change, **detail: Any
    ) -> int:
        """Run a write script; an admin write's (`AUDITING`) audit entry goes with it, in the
        same atomic step (`detail`: what the entry says of the write, `RESULT` for the
        script's result), and is marked written once the script says it wrote."""
        message = json.dumps({"kind": change.kind, "id": change.id})
        intent = AUDITING.get() if name in AUDITED_SCRIPTS else None
        entry = intent.pending(**detail) if intent is not None else None
        if name in AUDITED_SCRIPTS:
            keys = [*keys, self._k("audit")]
            args = [*args, self._audit_cap, entry or ""]
        with redis_unavailable():
            result = int(await self._scripts[name](
                keys=[self._k("gen"), self._k("journal"), *keys],
                args=[self.channel, message, *args],
            ))
        if intent is not None and entry is not None and result > 0:
            intent.written = True  # every audited script's result: > 0 when it wrote
        return result

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
        seen = [h for h in self._viewed_keys({tenant_id}) if self._keys[h].key_id == key_id]
        args = [tenant_id, key_id, seen[0] if seen else ""]
        return bool(await self._run("revoke", keys, args, Change("key", tenant_id)))

    def _viewed_keys(self, tenant_ids: Collection[str]) -> list[str]:
        """The hashes of these tenants' keys in the last view loaded (`snapshot`): what their
        key indexes (``:tkeys:<id>``) name, unless an index was lost (evicted by an
        `allkeys-*` Redis, deleted by hand) while the records stayed. The admin API's reads
        and writes of a tenant's keys take these with the index's."""
        return [h for h, record in self._keys.items() if record.tenant_id in tenant_ids]

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

    # -- synchronisation ---------------------------------------------------------------------
    async def generation(self) -> int:
        """The counter, read with a write that changes nothing (DEL of a key never set) in
        the same round trip: a Redis turned read-only (a failover left KVGATE_REDIS_URL on the
        old primary, now a replica) answers every read, in a MULTI too, and refuses only
        writes (READONLY): no load told, and /readyz said nothing while admin writes failed.
        A full Redis takes the DEL (it frees memory): that refusal is the loads' to tell."""
        with redis_unavailable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.get(self._k("gen"))
                pipe.delete(self._k("write_probe"))
                raw, probe = await pipe.execute(raise_on_error=False)
        if isinstance(raw, Exception):
            raise StoreUnreachable(failure_cause(raw))
        self._judge_writes(probe)
        return counter(raw)

    def _judge_writes(self, probe: object) -> None:
        """Note a read-only Redis from the probe's reply, and forget it once writes pass."""
        cause = failure_cause(probe) if isinstance(probe, RedisError) else None
        if cause is not None and refusal_code(cause) == "READONLY":
            self._read_only = self.refusing_writes = cause
        elif self._read_only is not None and isinstance(probe, int):
            if self.refusing_writes == self._read_only:
                self.refusing_writes = None
            self._read_only = None

    async def mark_seeded(self) -> None:
        mark = json.dumps({"id": secrets.token_hex(8), "at": time.time()})
        with redis_unavailable():
            await self._scripts["mark"](keys=[
                self._k("seeded"), self._k("tenants"), self._k("keys"), self._k("present")],
                args=[mark])

    async def seed_mark(self) -> str | None:
        with redis_unavailable():
            raw = await self._r.get(self._k("seeded"))
        return None if raw is None else text(raw)

    async def restore(self, snap: StoreSnapshot) -> bool:
        """MULTI/EXEC under WATCH of the marker and the counter: the marker still missing,
        the records are written over whatever a seed wrote meanwhile (the state restored is
        at least as new), the counter set past both, the journal started again with one
        entry (a reload reads the store whole), the marker set, a resync published. A
        concurrent write (a seed) retries; the marker set by another gateway gives up."""
        seeded, gen = self._k("seeded"), self._k("gen")
        tkeys: dict[str, dict[str, str]] = {}
        for key_hash, record in snap.keys.items():
            tkeys.setdefault(self._k("tkeys", record.tenant_id), {})[record.key_id] = key_hash
        with redis_unavailable():
            async with self._r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(seeded, gen)
                        if await pipe.exists(seeded):
                            return False
                        generation = max(counter(await pipe.get(gen)), snap.generation) + 1
                        mark = {"id": secrets.token_hex(8), "at": time.time(),
                                "restored": snap.generation}
                        pipe.multi()  # type: ignore[no-untyped-call, unused-ignore]
                        self._restore_records(pipe, snap, tkeys)
                        pipe.set(gen, generation)
                        pipe.delete(self._k("journal"))
                        pipe.lpush(self._k("journal"), f"{generation} restore *")
                        pipe.set(seeded, json.dumps(mark))
                        pipe.publish(self.channel, json.dumps({"kind": "resync", "id": None}))
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue  # a write meanwhile: look at the marker again

    async def restore_lost(self, kind: str, snap: StoreSnapshot) -> int | None:
        """One script (`redis_scripts.RESTORE_LOST`): the hash still missing, the records the
        journal does not name since `snap.generation` written back, journaled and published."""
        keys, args = [], [snap.generation, kind]
        if kind == "tenant":
            keys = [self._k("tenants")]
            for tid, tenant in snap.tenants.items():
                args += [tid, tenant_to_json(tenant)]
        else:
            keys = [self._k("keys")]
            for key_hash, record in snap.keys.items():
                keys.append(self._k("tkeys", record.tenant_id))
                args += [key_hash, record.model_dump_json(), record.key_id]
        written = await self._run("lost", keys, args, Change("resync"))
        return None if written == -2 else max(written, 0)

    def _restore_records(
        self, pipe: Any, snap: StoreSnapshot, tkeys: dict[str, dict[str, str]]
    ) -> None:
        pipe.hset(self._k("tenants"), mapping={
            PRESENT: "", **{tid: tenant_to_json(t) for tid, t in snap.tenants.items()}})
        pipe.hset(self._k("keys"), mapping={
            PRESENT: "", **{h: record.model_dump_json() for h, record in snap.keys.items()}})
        pipe.set(self._k("present"), "1")
        for name, ids in tkeys.items():
            pipe.hset(name, mapping=ids)
        if snap.policy is not None:
            pipe.hset(self._k("policy"), mapping={
                "version": max(snap.policy.version, 1),  # 0: "none stored"
                "doc": snap.policy.doc.model_dump_json(exclude_unset=True)})
        if snap.group_epochs:
            pipe.hset(self._k("salt_groups"), mapping=dict(snap.group_epochs))

    async def snapshot(self) -> StoreSnapshot:
        def reads(pipe: Any) -> None:
            pipe.get(self._k("gen"))
            pipe.hgetall(self._k("tenants"))
            pipe.hgetall(self._k("keys"))
            pipe.hgetall(self._k("policy"))
            pipe.hgetall(self._k("salt_groups"))
            pipe.lindex(self._k("journal"), 0)
            pipe.exists(self._k("present"))

        gen, tenants, keys, policy, groups, head, present = await self._read_together(reads)
        self._key_records(records(keys))
        self._journal_head = None if head is None else text(head)
        snap = self._snapshot(counter(gen), records(tenants), policy, groups)
        if not present:
            return snap
        lost = frozenset(KINDS[name] for name, raw in (("tenants", tenants), ("keys", keys))
                         if PRESENT not in raw and PRESENT.encode() not in raw)
        return replace(snap, lost=lost) if lost else snap

    async def changes_since(self, generation: int) -> StoreSnapshot | None:
        """The journal's way: the small records read whole, the key records only where the
        journal says they changed since `generation` (the last snapshot this store made). One
        transaction reads the counter, the journal's newest entries, the tenants, the policy
        and the salt groups; a second one the changed key records, checked against the same
        counter. None (make a whole `snapshot`) unless the journal accounts for every
        generation in between and goes on with the entry that was its newest at
        `generation`: a write behind the store's back (no journal entry), a trimmed journal,
        a wiped store written again as far, another write meanwhile."""
        if generation != self._view_generation:
            return None
        def reads(pipe: Any) -> None:
            pipe.get(self._k("gen"))
            pipe.lrange(self._k("journal"), 0, JOURNAL_READ - 1)
            pipe.hgetall(self._k("tenants"))
            pipe.hgetall(self._k("policy"))
            pipe.hgetall(self._k("salt_groups"))

        gen, journal, tenants, policy, groups = await self._read_together(reads)
        now = counter(gen)
        entries = [text(e) for e in journal]
        hashes = changed_keys(entries, generation, now, self._journal_head)
        if hashes is None:
            return None
        if hashes:
            def changed(pipe: Any) -> None:
                pipe.get(self._k("gen"))
                pipe.hmget(self._k("keys"), hashes)

            again, raws = await self._read_together(changed)
            if counter(again) != now:
                return None
            self._update_keys(dict(zip(hashes, raws, strict=True)))
        self._journal_head = entries[0]
        return self._snapshot(now, records(tenants), policy, groups)

    async def _read_together(self, reads: Callable[[Any], None]) -> list[Any]:
        """The replies of `reads` (queued on a pipeline) read in one MULTI/EXEC, so they see
        one state. A Redis full under ``noeviction`` refuses every command queued in a MULTI,
        reads included (OOM): then they are read pipelined without one. That is safe: the
        counter is read first, so a write landing between the reads (only a delete runs on a
        full Redis) leaves records newer than the counter, and the next check reloads. Without
        it a full Redis that still held every key and policy turned a gateway started then
        away from every request (503), and the running ones once `max_staleness_s` passed."""
        with redis_unavailable():
            try:
                async with self._r.pipeline(transaction=True) as pipe:
                    reads(pipe)
                    replies = list(await pipe.execute())
                self.refusing_writes = self._read_only  # (a full Redis reads in a MULTI no more)
                return replies
            except ResponseError as exc:
                if refusal_code(cause := failure_cause(exc)) != "OOM":
                    raise
                self.refusing_writes = cause
            async with self._r.pipeline(transaction=False) as pipe:
                reads(pipe)
                return list(await pipe.execute())

    def _snapshot(
        self, generation: int, tenants: dict[str, str], policy: dict[str, str],
        groups: dict[str, str],
    ) -> StoreSnapshot:
        # an unreadable record is left out (and reported), never the whole load failed: one
        # bad record must not turn every tenant away once the last good state is too stale
        skipped: list[SkippedRecord] = []
        readable = self._tenant_records.readable(tenants, "tenant", skipped)
        skipped.extend(self._bad_keys.values())
        self._view_generation = generation
        return StoreSnapshot(
            generation=generation,
            tenants=readable,
            keys=self._keys,  # never changed once handed out (`_update_keys` copies)
            policy=policy_from(policy, skipped),
            group_epochs=readable_records(groups, read_epoch, "salt_group", skipped),
            skipped=tuple(skipped),
        )

    def _key_records(self, raw: dict[str, str]) -> None:
        """The key records of a whole snapshot, each parsed once: a reload parses only the
        records that changed (~5 µs each)."""
        known = self._parsed_keys
        parsed = {k: seen if (seen := known.get(k)) is not None and seen[0] == v
                  else (v, read_record(v, key_from_json)) for k, v in raw.items()}
        self._parsed_keys = parsed
        self._bad_keys = {k: skipped_record("key", k, v) for k, (v, record) in parsed.items()
                          if record is None}
        self._keys = {k: record for k, (_, record) in parsed.items() if record is not None}

    def _update_keys(self, changed: dict[str, str | None]) -> None:
        """Apply the key records the journal named (None: gone) to a copy of the view."""
        keys = dict(self._keys)
        for key_hash, raw in changed.items():
            keys.pop(key_hash, None)
            self._bad_keys.pop(key_hash, None)
            self._parsed_keys.pop(key_hash, None)
            if raw is None:
                continue
            record = read_record(raw, key_from_json)
            self._parsed_keys[key_hash] = (raw, record)
            if record is None:
                self._bad_keys[key_hash] = skipped_record("key", key_hash, raw)
            else:
                keys[key_hash] = record
        self._keys = keys

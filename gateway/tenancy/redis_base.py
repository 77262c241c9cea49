"""What the parts of the Redis store share (`RedisBase`): its client, namespace and scripts, the
key names, and the runner of write scripts. The store is `redis_store.RedisStore` (its docstring
has the layout); `redis_listen` holds its lifecycle and pub/sub listener, `redis_sync` the reads
that keep a gateway in step (generation, snapshots, journal, restores)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

from gateway.tenancy import redis_scripts as scripts
from gateway.tenancy.audited import AUDITING
from gateway.tenancy.key_types import name_wrong_types
from gateway.tenancy.models import Change, KeyRecord, SkippedRecord
from gateway.tenancy.reachability import Reachability
from gateway.tenancy.redis_auth_failures import AUTH_FAILURES
from gateway.tenancy.redis_conn import redis_address, redis_tls, redis_unavailable
from gateway.tenancy.redis_records import ParsedOnce, texts
from gateway.tenancy.store import DEFAULT_AUDIT_CAP, TenantStore, tenant_from_json

__all__ = [
    "AUDITED_SCRIPTS", "EVICTION_CHECK_S", "JOURNAL_READ", "KINDS", "PRESENT", "RETRY_MAX_S",
    "THROTTLES_CLOSED_S", "THROTTLES_WAIT_S", "RedisBase", "records",
]

RETRY_MAX_S = 2.0  # the pub/sub listener's reconnect back-off: 0.1 s doubling up to this
THROTTLES_WAIT_S = 2.0  # the longest an admin request waits for `throttles_read`
THROTTLES_CLOSED_S = 30.0  # how long admin requests are refused while they are not read

EVICTION_CHECK_S = 60.0  # between two reads of Redis's eviction policy (`evicting`)
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


class RedisBase(TenantStore):
    """What every part of the Redis store shares (`redis_store.RedisStore` is the store)."""

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
        # the same readable key records by tenant (tenant -> key hash -> key id): a
        # revocation or deletion finds a tenant's keys in the view here; a scan of every key
        # cost ~8 ms of gateway CPU per revocation at 10,000 keys
        self._tenant_keys: dict[str, dict[str, str]] = {}
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
        self._evictions_due = float("-inf")  # the listener's next read of the eviction policy
        # CONFIG refused (an ACL user without it, a managed Redis that renamed it): a refusal
        # that does not change, not asked again (each one was an entry in Redis's ACL LOG)
        self._config_refused = False
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
        timeout = self._r.connection_pool.connection_kwargs.get("socket_timeout")
        if cause == "timed out" and timeout and not redis_tls(self._r.connection_pool):
            # a Redis farther away than the timeout answers a PING and never a load: it read
            # "timed out" alone (a TLS URL has its own hint: `reachability._tls_hint`)
            return f"timed out (no answer within tenancy.redis_timeout_s, {timeout:g} s)"
        return await name_wrong_types(self._r, self._ns, cause)

    @property
    def channel(self) -> str:
        return self._k("changes")


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


"""The tenancy store interface: tenants, keys, the policy document, the audit log, changes.

Two implementations behave identically (one behavioural test table runs against both):
`InMemoryStore` for a single process and `RedisStore` shared by N gateway replicas. Every
mutation bumps a store-wide `generation` and notifies subscribers; readers on the hot path use
`TenantResolver`'s cache, never the store directly.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from pydantic import ValidationError

from gateway.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PreconditionFailed,
    UnreadableRecord,
    shown_name,
)
from gateway.policy_doc import PolicyDoc
from gateway.tenancy.models import (
    AuditEntry,
    Change,
    KeyRecord,
    PolicySnapshot,
    SaltRotation,
    StoreSnapshot,
    Tenant,
    fresh_incarnation,
)
from gateway.tenancy.reachability import Reachability

__all__ = [
    "DEFAULT_AUDIT_CAP",
    "BootstrapResult",
    "ChangeCallback",
    "TenantStore",
    "apply_tenant_changes",
    "bootstrap",
    "invalid_from",
    "key_from_json",
    "key_taken",
    "policy_from_json",
    "read_tenant",
    "restored_from",
    "tenant_from_json",
    "tenant_missing",
    "tenant_to_json",
    "with_epoch",
]

ChangeCallback = Callable[[Change], None]
DEFAULT_AUDIT_CAP = 10_000


class TenantStore(ABC):
    """Async CRUD over tenants, keys, policy and audit, plus change notifications.

    Errors: `Conflict` (exists), `NotFound` (missing tenant), `PreconditionFailed` (policy
    version), `BackendUnavailable` (Redis unreachable), `UnreadableRecord` (a stored record
    this process cannot read, asked for by name: only the Redis store meets one).
    """

    label = "the tenancy store"  # in messages to clients: what has not answered

    def __init__(self) -> None:
        self._subscribers: list[ChangeCallback] = []
        # told (address, level) when a failed admin authentication at any gateway left that
        # address throttled (`auth_failures`)
        self.on_auth_throttled: Callable[[str, float], None] | None = None
        # a store that can be away (Redis): what the log says about reaching it, one voice
        # for every part that tries (the change listener, the resolver's loads)
        self.reach: Reachability | None = None
        # why the store answers reads but refuses writes (a full Redis: "server replied OOM"),
        # seen at its last load; None while it takes them
        self.refusing_writes: str | None = None
        # why the store may lose records by itself (a Redis evicting any key when full), as
        # last checked; None: it keeps them, or cannot tell
        self.evicting: str | None = None

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect and start listening for changes (idempotent)."""

    async def explain(self, cause: str) -> str:
        """A failure's cause for the log, with what only the store can tell (Redis: which
        of its keys hold another type)."""
        return cause

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop listening and disconnect."""

    # -- tenants ---------------------------------------------------------------------------
    @abstractmethod
    async def create_tenant(
        self, tenant: Tenant, *, over_unreadable: bool = False, policy_version: int | None = None
    ) -> Tenant:
        """`Conflict` if it exists. `over_unreadable`: a stored record of that id this process
        cannot read is replaced (its keys kept) -- an operator's way out, never bootstrap's
        (an older gateway starting must not overwrite what a newer one wrote).
        `policy_version`: the policy version the tenant's tier was checked against; another
        one stored meanwhile is a `StaleCheck`, nothing written."""

    @abstractmethod
    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        """None when missing; `UnreadableRecord` when stored but unreadable."""

    @abstractmethod
    async def list_tenants(self) -> list[Tenant]: ...

    async def tenant_page(self, after: str | None, limit: int) -> tuple[list[Tenant], bool]:
        """At most `limit` tenants in id order, those after the id `after` (None: from the
        first; it need not exist: a tenant deleted between two pages), and whether more
        follow."""
        tenants = await self.list_tenants()
        if after is not None:
            tenants = tenants[bisect_right([t.id for t in tenants], after):]
        return tenants[:limit], len(tenants) > limit

    @abstractmethod
    async def update_tenant(
        self, tenant_id: str, changes: dict[str, object], *, policy_version: int | None = None
    ) -> Tenant:
        """Apply `changes` (tier, limits, salt_group) atomically; returns the new tenant.
        `policy_version`: as for `create_tenant`."""

    @abstractmethod
    async def delete_tenant(self, tenant_id: str) -> bool:
        """Delete a tenant and revoke all its keys. False when it did not exist."""

    @abstractmethod
    async def rotate_salt(self, tenant_id: str) -> SaltRotation:
        """Bump the tenant's salt epoch, or its salt group's epoch if it is in a group."""

    # -- keys ------------------------------------------------------------------------------
    @abstractmethod
    async def add_key(self, record: KeyRecord) -> None:
        """`NotFound` for a tenant missing; `Conflict` for a key id of the
        tenant's, or a key hash, already stored: nothing written over it."""

    @abstractmethod
    async def revoke_key(self, tenant_id: str, key_id: str) -> bool: ...

    @abstractmethod
    async def list_keys(self, tenant_id: str) -> list[KeyRecord]: ...

    async def keys_by_tenant(
        self, tenant_ids: Collection[str] | None = None
    ) -> dict[str, list[KeyRecord]]:
        """Every tenant's key records (as `list_keys` orders them), or those of
        `tenant_ids` (a page of tenants), for listing tenants."""
        if tenant_ids is None:
            tenant_ids = [t.id for t in await self.list_tenants()]
        return {tid: await self.list_keys(tid) for tid in tenant_ids}

    # -- salt groups -----------------------------------------------------------------------
    @abstractmethod
    async def salt_group_epochs(self) -> dict[str, int | None]:
        """Each rotated salt group's epoch (a group never rotated is at 0 and absent); None
        for one stored but unreadable."""

    # -- policy ----------------------------------------------------------------------------
    @abstractmethod
    async def get_policy(self) -> PolicySnapshot | None:
        """None when none is stored; `UnreadableRecord` when the stored one is unreadable."""

    @abstractmethod
    async def put_policy(
        self, doc: PolicyDoc, *, if_version: int | None = None, keep_unknown: bool = False,
        tenants_at: int | None = None,
    ) -> PolicySnapshot:
        """Store a new version. `if_version` (0 = "no policy yet") makes it compare-and-set;
        `keep_unknown` (with `if_version`: a read-modify-write of that version) keeps the
        stored document's fields this kvgate does not know (`gateway.tenancy.unknown`).
        `tenants_at`: the generation read before the tenants the document was checked
        against; a tenant written since (or a store that cannot tell) is a `StaleCheck`."""

    # -- audit -----------------------------------------------------------------------------
    @abstractmethod
    async def append_audit(self, entry: AuditEntry) -> None: ...

    @abstractmethod
    async def list_audit(self, limit: int = 100) -> list[AuditEntry]:
        """Newest first."""

    # -- failed admin authentications ------------------------------------------------------
    async def auth_failures(self, address: str, *, burst: float,
                            per_minute: float) -> float | None:
        """One failed admin authentication of `address` taken from its budget at every
        gateway sharing this store (a bucket of `burst` refilled at `per_minute`): what is
        left (below 1: throttled, then told to every gateway's `on_auth_throttled`). None:
        nothing shared (the in-memory store serves one process, whose own `AuthGuard`
        counts)."""
        return None

    def tell_throttles_to(self, tell: Callable[[str, float], None]) -> None:
        """From now on, tell `tell` (as `on_auth_throttled`) each address a failed admin
        authentication at any gateway left throttled, and at once those found throttled
        before anyone listened."""
        self.on_auth_throttled = tell

    async def throttles_read(self) -> None:  # noqa: B027 - optional hook
        """Returns once the addresses throttled before this process listened have been read
        and told (or could not be), so the first admin request of a gateway just started is
        checked against them: at once for a store that shares none."""

    # -- synchronisation -------------------------------------------------------------------
    @abstractmethod
    async def generation(self) -> int:
        """A counter bumped by every mutation (0: the store holds nothing yet)."""

    @abstractmethod
    async def snapshot(self) -> StoreSnapshot: ...

    async def changes_since(self, generation: int) -> StoreSnapshot | None:
        """A snapshot as `snapshot` would answer, made by reading only what changed since
        `generation` (that of the last snapshot this store made); None when this store cannot
        tell what changed (make a whole `snapshot`). The default: never."""
        return None

    @abstractmethod
    async def mark_seeded(self) -> None:
        """Set the bootstrap marker (a random id) unless it is already there: this store has
        been seeded from configuration."""

    @abstractmethod
    async def seed_mark(self) -> str | None:
        """The bootstrap marker's id, None when it is missing. A store that was seeded and has
        lost it was wiped (Redis FLUSHALL, a restart without persistence); a different id than
        before means it was wiped and re-seeded meanwhile."""

    async def up_for_s(self) -> float | None:
        """How long the store's server has been running, None when it does not say (the
        default: a store in process memory is never wiped)."""
        return None

    async def restore(self, snap: StoreSnapshot) -> bool:
        """Write `snap` (a gateway's last loaded state) back into a wiped store and set the
        bootstrap marker, in one atomic step, only while the marker is missing: False when it
        is there (another gateway restored or seeded the store first), nothing written. The
        generation counter is set past both `snap`'s and the store's. The default: a store
        that cannot be wiped (in memory) has nothing to restore."""
        return False

    async def restore_lost(self, kind: str, snap: StoreSnapshot) -> int | None:
        """The store kept its marker but lost every record of `kind` (``tenant`` or ``key``:
        its hash deleted by hand, or evicted): write `snap`'s records of that kind back (the
        state in force, read at `snap.generation`), only while there are still none (another
        gateway may have done it first: 0) and leaving out every record changed since
        `snap.generation` (an operator's deletion is never undone). The records written back;
        None when the store cannot tell what changed since (nothing written). The default: a
        store that cannot lose its records (in memory) has nothing to write back."""
        return 0

    def subscribe(self, callback: ChangeCallback) -> Callable[[], None]:
        """Call `callback` after every change (from any replica). Returns an unsubscriber."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def _notify(self, change: Change) -> None:
        for callback in list(self._subscribers):
            callback(change)


def restored_from(mark: str | None) -> int | None:
    """The generation of the state a bootstrap marker says was restored into the store
    (`TenantStore.restore` writes ``{"restored": <generation>, ...}``); None for a marker set
    by a seed from configuration."""
    try:
        found = json.loads(mark or "").get("restored")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, int) else None


def read_tenant(tenant_id: str, raw: str | bytes) -> Tenant:
    """A stored tenant record, or `UnreadableRecord` (409) saying how to replace it."""
    try:
        return tenant_from_json(raw)
    except ValueError:  # not JSON, or not a record (pydantic's ValidationError)
        raise UnreadableRecord(
            f"the stored record of tenant {tenant_id!r} is unreadable (corrupted, or written "
            "by another kvgate version in a form this one cannot read); write a new one over "
            f"it with POST /admin/tenants and its id (kvgate admin tenants create {tenant_id} "
            f"--tier TIER; its keys are kept), or delete it (kvgate admin tenants delete "
            f"{tenant_id})",
            param="id") from None


def tenant_missing(tenant_id: str) -> NotFound:
    """The 404 of a tenant id no store holds (the id as a client sent it, bounded)."""
    return NotFound(f"tenant {shown_name(tenant_id)!r} not found", param="id")


def key_taken(record: KeyRecord) -> Conflict:
    """The 409 of a key whose id its tenant already has, or whose hash is stored."""
    return Conflict(f"key id {record.key_id!r} (or the key itself) is already stored",
                    param="key_id")


def check_policy_version(current: int, if_version: int | None) -> None:
    if if_version is not None and if_version != current:
        raise PreconditionFailed(
            f"policy version is {current}, not {if_version}; fetch it again and retry",
            param="If-Match",
        )


_MUTABLE_FIELDS = ("tier", "limits", "salt_group")


def tenant_to_json(tenant: Tenant) -> str:
    """Only fields that were set: a limit left unset means "the tier's default"."""
    return tenant.model_dump_json(exclude_unset=True)


# Stored records are read with unknown fields ignored: a newer kvgate (a rolling upgrade) may
# have written a field this one does not know. What operators send the admin API is still
# validated strictly (`gateway.admin.schemas`, `PolicyDoc`): a typo there is a 400.
def tenant_from_json(raw: str | bytes) -> Tenant:
    return Tenant.model_validate_json(raw, extra="ignore")


def key_from_json(raw: str | bytes) -> KeyRecord:
    return KeyRecord.model_validate_json(raw, extra="ignore")


def policy_from_json(raw: str | bytes) -> PolicyDoc:
    return PolicyDoc.model_validate_json(raw, extra="ignore")


def invalid_from(exc: ValidationError) -> BadRequest:
    """The first pydantic error as a 400 naming the field (never echoing the input)."""
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err["loc"])
    return BadRequest(f"{loc}: {err['msg']}" if loc else str(err["msg"]), param=loc or None)


def apply_tenant_changes(tenant: Tenant, changes: dict[str, object]) -> Tenant:
    """`tenant` with `changes` applied; `limits` merges into the existing overrides."""
    data = tenant.model_dump(mode="json", exclude_unset=True)
    for name, value in changes.items():
        if name not in _MUTABLE_FIELDS:
            raise BadRequest(f"{name}: cannot be changed", param=name)
        if name == "limits" and isinstance(value, dict):
            # null drops the override (the tier's limit again): kept, it read as "unlimited"
            # and silently lifted the tier's limit, with no way back to the tier default
            merged = {**data.get("limits", {}), **value}
            data["limits"] = {k: v for k, v in merged.items() if v is not None}
        else:
            data[name] = value
    try:
        return Tenant.model_validate(data)
    except ValidationError as exc:
        raise invalid_from(exc) from None


def with_epoch(tenant: Tenant, epoch: int) -> Tenant:
    data = tenant.model_dump(mode="json", exclude_unset=True)
    data["salt_epoch"] = epoch
    return Tenant.model_validate(data)


@dataclass(frozen=True, slots=True)
class BootstrapResult:
    created_tenants: tuple[str, ...]
    policy_seeded: bool
    seeded_before: bool = False  # the store had its bootstrap marker: seeded at an earlier start


async def bootstrap(
    store: TenantStore, *, tenants: Iterable[Tenant], policy: PolicyDoc | None
) -> BootstrapResult:
    """Seed tenants and the policy from configuration; safe to run on every replica's start,
    and again whenever the store has lost its bootstrap marker (wiped).

    The store owns this state afterwards: existing tenants are left alone, and the policy is
    written only when the store has none (compare-and-set against version 0, so concurrent
    replicas starting together seed it once). The marker is set last, so a store is marked
    only once everything is in it.

    A tenant it creates draws an incarnation, as the admin API's do: seeded without one, a
    tenant deleted through the admin API and seeded again at the next start kept its rate
    limits under its id, and inherited the deleted one's spent budget and the leases of its
    streams still running (a 429 on its first request).
    """
    seeded_before = await store.seed_mark() is not None
    seeded = False
    if policy is not None:
        try:
            await store.put_policy(policy, if_version=0)
            seeded = True
        except PreconditionFailed:
            pass
    created: list[str] = []
    for tenant in tenants:
        if tenant.incarnation is None:
            tenant = Tenant.model_validate({**tenant.model_dump(exclude_unset=True),
                                            "incarnation": fresh_incarnation()})
        try:
            await store.create_tenant(tenant)
            created.append(tenant.id)
        except Conflict:
            pass
    await store.mark_seeded()
    return BootstrapResult(tuple(created), seeded, seeded_before)

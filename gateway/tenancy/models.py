"""The values the tenancy store keeps: tenants, key records, policy snapshots, audit entries."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy_doc import NAME_PATTERN, NAME_RULE, Limits, PolicyDoc

__all__ = [
    "NAME_PATTERN",
    "NAME_RULE",
    "AuditEntry",
    "Change",
    "KeyRecord",
    "PolicySnapshot",
    "SaltRotation",
    "SkippedRecord",
    "StoreSnapshot",
    "Tenant",
    "fresh_incarnation",
]

# Tenant ids and salt-group names: names as pools' and tiers' (`policy_doc.NAME_PATTERN`)
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


class Tenant(BaseModel):
    """A tenant. `limits` holds only overrides of its tier's defaults (unset = tier default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: Name
    tier: Annotated[str, Field(min_length=1, max_length=64)]
    limits: Limits = Field(default_factory=Limits)
    salt_group: Name | None = None  # tenants in one group share a cache salt
    salt_epoch: Annotated[int, Field(ge=0)] = 0
    # drawn when the admin API creates the tenant, never changed: it names its rate-limit
    # state (`limits_key`), so a tenant created again under a deleted one's id starts with
    # full buckets and none of the deleted one's leases (None: a tenant seeded from the
    # configuration, or stored by an older kvgate -- its state is named by its id alone)
    incarnation: Annotated[str, Field(pattern=r"^[0-9a-f]{1,32}$")] | None = None

    @property
    def limits_key(self) -> str:
        """What its rate limits are kept under: ``<id>#<incarnation>`` (``#`` is in no id)."""
        return self.id if self.incarnation is None else f"{self.id}#{self.incarnation}"


def fresh_incarnation() -> str:
    """A new tenant's `Tenant.incarnation`: 64 random bits."""
    return secrets.token_hex(8)


class KeyRecord(BaseModel):
    """A stored API key: its hash, never the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key_id: str
    tenant_id: str
    key_hash: str
    created_at: float


class AuditEntry(BaseModel):
    """One admin change: who (admin token id), what (action + target + detail), when, and the
    id of the admin request that made it (its answer's ``X-Request-Id``; None before kvgate
    kept it): a 503 whose outcome is unknown names it, so the operator can look it up."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    at: float
    who: str
    action: str
    target: str
    detail: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """One version of the policy document; requests take one snapshot and keep it."""

    version: int
    doc: PolicyDoc


@dataclass(frozen=True, slots=True)
class SaltRotation:
    """What `rotate_salt` changed: the tenant's own epoch, or its whole salt group's."""

    tenant_id: str
    scope: str  # "tenant" | "group"
    salt_group: str | None
    epoch: int


@dataclass(frozen=True, slots=True)
class Change:
    """A change notification. Receivers reload; `kind` is informational."""

    kind: str  # tenant | key | policy | salt | resync
    id: str | None = None


@dataclass(frozen=True, slots=True)
class SkippedRecord:
    """A stored record this process cannot read (corrupted, or not a record at all), left out
    of a snapshot. `name` is safe to log and show: a tenant's id, a key's hash cut to its
    first 8 characters, ``policy``; `fingerprint` tells one bad value from another."""

    kind: str  # tenant | key | policy | salt_group
    name: str
    fingerprint: str

    @property
    def label(self) -> str:
        """The record in words, for logs and /readyz: ``tenant 'acme'``, ``salt group 'pub'``,
        ``the policy document`` (there is one: its name says nothing more)."""
        if self.kind == "policy":
            return "the policy document"
        return f"{self.kind.replace('_', ' ')} {self.name!r}"


@dataclass(frozen=True, slots=True)
class StoreSnapshot:
    """Everything the hot-path cache needs, read consistently in one go."""

    generation: int
    tenants: dict[str, Tenant] = field(default_factory=dict)
    keys: dict[str, KeyRecord] = field(default_factory=dict)  # key_hash -> record
    policy: PolicySnapshot | None = None
    group_epochs: dict[str, int] = field(default_factory=dict)
    skipped: tuple[SkippedRecord, ...] = ()  # records left out: unreadable
    # the kinds ("tenant", "key") whose every record the store lost (its hash deleted whole,
    # evicted), perhaps written again since: the Redis store's whole read (`redis_store.PRESENT`)
    lost: frozenset[str] = frozenset()
    # `keys` as an update of an earlier snapshot's (that snapshot's `keys` object, None: not
    # one) changed only at `keys_changed`: the resolver updates its index of keys where they
    # changed. It rebuilt it whole after each admin write, O(keys) per write: creating 10,000
    # keys through the admin API went from 5 to 35 ms a key.
    keys_from: dict[str, KeyRecord] | None = field(default=None, compare=False, repr=False)
    keys_changed: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

"""Request bodies of the admin API, and the views its answers are built from (one per kind of
object, the same on every route that returns one: docs/admin-api.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from gateway.policy_doc import RESERVED_NAME, RESERVED_RULE, Limits
from gateway.tenancy.models import NAME_PATTERN, AuditEntry, KeyRecord, Tenant

__all__ = ["NoFields", "TenantCreate", "TenantPatch", "audit_view", "iso_time", "key_view",
           "tenant_view"]


def iso_time(ts: float) -> str:
    """Seconds since the epoch as ISO 8601 in UTC: ``2026-12-03T05:24:46.123Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )


def _refuse_reserved(value: str) -> str:
    """`none` as a tenant id or salt-group name: refused (RESERVED_RULE). For a salt group
    also because the CLI's `--salt-group none` means "leave the group" (null), so a group
    named `none` could be made here but never set or told apart there."""
    if value == RESERVED_NAME:
        raise PydanticCustomError("reserved_name", RESERVED_RULE)
    return value


# a tenant's id or salt group's name, as the store takes them (`tenancy.models.Name`), but
# never `none` (the store still reads one written before this rule)
_NewName = Annotated[str, Field(pattern=NAME_PATTERN), AfterValidator(_refuse_reserved)]


def audit_view(entry: AuditEntry) -> dict[str, Any]:
    return {**entry.model_dump(), "at": iso_time(entry.at)}


class NoFields(BaseModel):
    """The body of a route that takes none (key creation, salt rotation): absent or ``{}``;
    a field is refused as on every other route, not silently ignored (a client sending
    ``{"name": ...}`` would believe it was kept)."""

    model_config = ConfigDict(extra="forbid")


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: _NewName
    tier: Annotated[str, Field(min_length=1, max_length=64)] = "default"  # as config tenants
    limits: Limits = Field(default_factory=Limits)
    salt_group: _NewName | None = None


class TenantPatch(BaseModel):
    """Only the fields sent change; ``"salt_group": null`` leaves the group, ``"limits":
    null`` drops every override (as a null limit drops one: the tier's limits apply)."""

    model_config = ConfigDict(extra="forbid")
    tier: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    limits: Limits | None = None
    salt_group: _NewName | None = None

    def changes(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in self.model_fields_set:
            if name == "limits":
                out[name] = (dict.fromkeys(Limits.model_fields) if self.limits is None
                             else self.limits.model_dump(exclude_unset=True))
            else:
                out[name] = getattr(self, name)
        return out


def key_view(record: KeyRecord) -> dict[str, Any]:
    """A key as the admin API shows it: never the key, never its hash (creation's answer
    adds ``key``, once)."""
    return {"object": "key", "id": record.key_id, "tenant": record.tenant_id,
            "created_at": iso_time(record.created_at)}


def tenant_view(
    tenant: Tenant, keys: list[KeyRecord], group_epochs: dict[str, int | None]
) -> dict[str, Any]:
    """A tenant as every admin route shows it (create, get, update, list, rotate-salt): limit
    overrides only, its keys' ids, never a salt or key. ``salt_epoch`` is the epoch its salt
    comes from: its salt group's for a tenant in one (null: the group's stored epoch is
    unreadable), as rotate-salt answers it."""
    group = tenant.salt_group
    return {
        "object": "tenant",
        "id": tenant.id,
        "tier": tenant.tier,
        "limits": tenant.limits.model_dump(exclude_unset=True),
        "salt_group": group,
        "salt_epoch": tenant.salt_epoch if group is None else group_epochs.get(group, 0),
        "keys": [key_view(k) for k in keys],
    }

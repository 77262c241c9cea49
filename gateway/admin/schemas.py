"""Request bodies of the admin API (responses are plain JSON built from store values)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.policy_doc import Limits
from gateway.tenancy.models import NAME_PATTERN, AuditEntry, Tenant

__all__ = ["TenantCreate", "TenantPatch", "audit_view", "iso_time", "tenant_view"]


def iso_time(ts: float) -> str:
    """Seconds since the epoch as ISO 8601 in UTC: ``2026-12-03T05:24:46.123Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )


def audit_view(entry: AuditEntry) -> dict[str, Any]:
    return {**entry.model_dump(), "at": iso_time(entry.at)}


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Annotated[str, Field(pattern=NAME_PATTERN)]
    tier: Annotated[str, Field(min_length=1, max_length=64)] = "default"  # as config tenants
    limits: Limits = Field(default_factory=Limits)
    salt_group: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None


class TenantPatch(BaseModel):
    """Only the fields sent change; ``"salt_group": null`` leaves the group."""

    model_config = ConfigDict(extra="forbid")
    tier: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    limits: Limits | None = None
    salt_group: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None

    def changes(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in self.model_fields_set:
            if name == "limits" and self.limits is not None:
                out[name] = self.limits.model_dump(exclude_unset=True)
            else:
                out[name] = getattr(self, name)
        return out


def tenant_view(tenant: Tenant, keys: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A tenant as the admin API shows it: limit overrides only, never a salt or key."""
    view: dict[str, Any] = {
        "id": tenant.id,
        "tier": tenant.tier,
        "limits": tenant.limits.model_dump(exclude_unset=True),
        "salt_group": tenant.salt_group,
        "salt_epoch": tenant.salt_epoch,
    }
    if keys is not None:
        view["keys"] = keys
    return view

"""The policy document: pools, public model names and tiers.

This is the part of the configuration operators change at runtime (`GET|PUT /admin/policy`);
it is validated as a whole so a bad document never half-applies. Errors name the field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_TIER = "default"


class Limits(BaseModel):
    """Per-tenant limits (a tier's defaults, or a tenant's overrides). None = unlimited."""

    model_config = ConfigDict(extra="forbid")
    rpm: Annotated[int, Field(gt=0)] | None = None
    tpm: Annotated[int, Field(gt=0)] | None = None
    max_concurrency: Annotated[int, Field(gt=0)] | None = None


class PoolConfig(BaseModel):
    """Replicas serving the same weights under one served model name."""

    model_config = ConfigDict(extra="forbid")
    served_model: str | None = None  # None: learn it from the replicas' /v1/models
    replicas: list[str] = Field(default_factory=list)
    discovery: dict[str, dict[str, object]] | None = None  # {kubernetes: {...}} | {dns: {...}}
    api_key_env: str | None = None
    priority: bool = False  # the pool runs --scheduling-policy priority

    @model_validator(mode="after")
    def _has_replicas(self) -> PoolConfig:
        if not self.replicas and not self.discovery:
            raise ValueError("a pool needs 'replicas' or 'discovery'")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://: {url!r}")
        return self


class TierConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limits: Limits = Field(default_factory=Limits)
    priority: int = 0  # vLLM `priority` for pools that run --scheduling-policy priority
    spill_to: str | None = None  # a pool this tier may overflow to when its own is saturated


class PolicyDoc(BaseModel):
    """`pools`, `models`, `tiers`: validated together, versioned by the store."""

    model_config = ConfigDict(extra="forbid")
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    models: dict[str, dict[str, str]] = Field(default_factory=dict)  # public -> {tier: pool}
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {DEFAULT_TIER: TierConfig()})

    @model_validator(mode="after")
    def _references_resolve(self) -> PolicyDoc:
        for model, per_tier in self.models.items():
            for tier, pool in per_tier.items():
                where = f"models.{model}.{tier}"
                if pool not in self.pools:
                    raise ValueError(f"{where}: unknown pool {pool!r}")
                if tier != DEFAULT_TIER and tier not in self.tiers:
                    raise ValueError(f"{where}: unknown tier {tier!r}")
        for name, tier_cfg in self.tiers.items():
            if tier_cfg.spill_to is not None and tier_cfg.spill_to not in self.pools:
                raise ValueError(f"tiers.{name}.spill_to: unknown pool {tier_cfg.spill_to!r}")
        return self

    def pool_for(self, model: str, tier: str) -> str | None:
        """The pool serving public `model` for `tier` (falling back to the 'default' tier)."""
        per_tier = self.models.get(model)
        if per_tier is None:
            return None
        return per_tier.get(tier) or per_tier.get(DEFAULT_TIER)

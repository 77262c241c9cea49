"""Tenancy: tenants, API keys, cache salts, tiers and rate limits (see README.md here)."""

from gateway.errors import StaleCheck
from gateway.tenancy.fallback import FallbackRateLimiter
from gateway.tenancy.keys import generate_key, hash_key
from gateway.tenancy.limits import Admission, MemoryRateLimiter, RateLimiter
from gateway.tenancy.memory import InMemoryStore
from gateway.tenancy.models import (
    AuditEntry,
    Change,
    KeyRecord,
    PolicySnapshot,
    SaltRotation,
    StoreSnapshot,
    Tenant,
)
from gateway.tenancy.redis_conn import connect_redis
from gateway.tenancy.redis_limits import RedisRateLimiter
from gateway.tenancy.redis_store import RedisStore
from gateway.tenancy.resolver import Principal, TenancyHealth, TenantResolver, parse_bearer
from gateway.tenancy.salts import SaltDeriver
from gateway.tenancy.service import Tenancy, TenancySettings, build_tenancy
from gateway.tenancy.store import TenantStore, bootstrap
from gateway.tenancy.tiers import ReplicaLoad, TierRoute, resolve_tier

__all__ = [
    "Admission",
    "AuditEntry",
    "Change",
    "FallbackRateLimiter",
    "InMemoryStore",
    "KeyRecord",
    "MemoryRateLimiter",
    "PolicySnapshot",
    "Principal",
    "RateLimiter",
    "RedisRateLimiter",
    "RedisStore",
    "ReplicaLoad",
    "SaltDeriver",
    "SaltRotation",
    "StaleCheck",
    "StoreSnapshot",
    "Tenancy",
    "TenancyHealth",
    "TenancySettings",
    "Tenant",
    "TenantResolver",
    "TenantStore",
    "TierRoute",
    "bootstrap",
    "build_tenancy",
    "connect_redis",
    "generate_key",
    "hash_key",
    "parse_bearer",
    "resolve_tier",
]

"""Tenancy: tenants, API keys, cache salts, tiers and rate limits (see README.md here)."""

from gateway.tenancy.errors import (
    AuthError,
    BackendUnavailable,
    Conflict,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    PreconditionFailed,
    RateLimited,
    TenancyError,
)
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
from gateway.tenancy.salts import SaltDeriver, rewrite_body
from gateway.tenancy.service import Tenancy, TenancySettings, build_tenancy
from gateway.tenancy.store import TenantStore, bootstrap
from gateway.tenancy.tiers import ReplicaLoad, TierRoute, resolve_tier

__all__ = [
    "Admission",
    "AuditEntry",
    "AuthError",
    "BackendUnavailable",
    "Change",
    "Conflict",
    "FallbackRateLimiter",
    "InMemoryStore",
    "InvalidRequest",
    "KeyRecord",
    "MemoryRateLimiter",
    "NotFound",
    "PermissionDenied",
    "PolicySnapshot",
    "PreconditionFailed",
    "Principal",
    "RateLimited",
    "RateLimiter",
    "RedisRateLimiter",
    "RedisStore",
    "ReplicaLoad",
    "SaltDeriver",
    "SaltRotation",
    "StoreSnapshot",
    "Tenancy",
    "TenancyError",
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
    "rewrite_body",
]

"""Who is calling (`Principal`), the tenancy health that /readyz reports (`TenancyHealth`), and
the reading of an ``Authorization: Bearer`` header (`parse_bearer`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.policy_doc import Limits
from gateway.tenancy.models import PolicySnapshot

__all__ = ["CONFLICTING_KEYS", "INVALID_KEY", "Principal", "TenancyHealth", "parse_bearer"]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant, its effective limits and its cache salt (never printed)."""

    tenant_id: str
    tier: str
    limits: Limits  # tier defaults with the tenant's overrides applied
    salt_group: str | None
    cache_salt: str = field(repr=False)
    # The policy this principal was built from: use it for the whole request, so one request
    # never mixes two policy versions.
    policy: PolicySnapshot | None = field(default=None, repr=False, compare=False)
    tier_known: bool = True  # False: the policy does not define `tier` (never admitted)
    refused: str | None = None  # why this tenant cannot be served now (503), e.g. no salt
    incarnation: str | None = None  # its tenant's (`Tenant.incarnation`)

    @property
    def limits_key(self) -> str:
        """What its rate limits are kept under (`Tenant.limits_key`)."""
        return self.tenant_id if self.incarnation is None else (
            f"{self.tenant_id}#{self.incarnation}")


@dataclass(frozen=True, slots=True)
class TenancyHealth:
    loaded: bool
    degraded: bool
    reason: str | None
    generation: int
    policy_version: int
    staleness_s: float  # since the store last confirmed our state
    store_resets: int = 0  # wiped stores noticed (restored or re-seeded) since start
    store_wiped: bool = False  # a wipe noticed within the last `WIPE_NOTICE_S`, restored or not
    # whether the store answered the last load (False until its first answer): reachability
    # only -- a wiped store or an unreadable record answers
    store_answers: bool = False
    # why not, as one of `redis_conn.CAUSE_LABELS` (None while it answers)
    store_cause: str | None = None
    records_skipped: dict[str, int] = field(default_factory=dict)  # kind -> count since start


# the key of a request that presented several different ones (`gateway.apikey`); no issued key
# equals it (kvgate's keys are base64url), and a client sending it gets the same 401
CONFLICTING_KEYS = "\x00conflicting"
# a key no tenant holds (never created, revoked, its tenant deleted): what the client can do
INVALID_KEY = ("invalid or revoked API key: send a key an operator created for your tenant "
               "(`kvgate admin keys create`)")


def parse_bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, else None."""
    if not authorization:
        return None
    # HTTP's whitespace in a field value is a space or a tab: ``Bearer<TAB><key>`` presents
    # the key too (split on spaces only, it read as no key: "missing API key")
    cut = min((i for i in (authorization.find(" "), authorization.find("\t")) if i >= 0),
              default=len(authorization))
    scheme, token = authorization[:cut], authorization[cut + 1:]
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()

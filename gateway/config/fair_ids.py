"""`fairness.tenants` ids no tenant has, at start: a typo there gave that tenant no share, in
silence (the weight is looked up by tenant id, and an id nobody sends under matches nothing).

At start the file cannot be refused for it: with Redis the store holds tenants the admin API
created, which the file does not list (the admin API refuses a new unknown id in a policy
write: `gateway.admin.policy_routes`). What the gateway can know, it says: without
authentication every request is tenant `default`; with the in-memory store the tenants are
the file's `tenants:` (not `default`: no-auth gateways create it) until the admin API creates more.
"""

from __future__ import annotations

from gateway.config.model import KvgateConfig
from gateway.policy_doc import DEFAULT_TIER

__all__ = ["unknown_fairness_tenants"]


def unknown_fairness_tenants(cfg: KvgateConfig) -> list[str]:
    """One warning line per `fairness.tenants` id no tenant of this gateway has at start;
    none where the store may hold tenants the file does not list (Redis)."""
    ids = sorted(cfg.fairness.tenants)
    if not cfg.tenancy.auth:
        return [f"fairness.tenants.{i}: without authentication every request is tenant "
                f"'{DEFAULT_TIER}': no request gets this weight" for i in ids if i != DEFAULT_TIER]
    if cfg.redis_url is not None:
        return []
    # `default` as any other id: an authenticated gateway has a tenant `default` only if one
    # is created (the admin API refuses the id in a write then, as here)
    known = {t.id for t in cfg.tenants}
    return [f"fairness.tenants.{i}: no tenant {i!r} in the file's tenants (the in-memory store "
            "starts with those only): it gets this weight only once the admin API creates it; "
            "a typo gets no share" for i in ids if i not in known]

"""A tenancy store that went back in time: what the log and /readyz say of it.

Redis restarted from a snapshot older than its last writes (RDB persistence, Redis's default,
loses the writes since its last save on a crash; a backup restored) keeps its bootstrap
marker, so it is no wipe, but its generation counter is behind the state the gateways loaded.
They reloaded it without a word: keys revoked since the snapshot worked again, keys and
tenants made since got 401 and 404, and /readyz said all was well. The gateway follows the
store (it is the truth the admin API writes to), and says what changed, by key id and tenant
id (never a key), so that an operator can revoke and re-issue what the snapshot undid.
"""

from __future__ import annotations

from gateway.tenancy.models import KeyRecord, StoreSnapshot

__all__ = ["went_back"]

_SHOWN = 5  # names per list in a line; the rest counted


def _names(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(sorted(items)[:_SHOWN]) + more


def _keys(records: list[KeyRecord]) -> str:
    return _names([f"{r.tenant_id}/{r.key_id}" for r in records])


def went_back(before: StoreSnapshot, after: StoreSnapshot) -> str:
    """What a store that went from ``before`` (the state in force) back to ``after`` (its
    generation lower, its marker the same) undid, in a sentence."""
    revived = [r for h, r in after.keys.items() if h not in before.keys]
    lost = [r for h, r in before.keys.items() if h not in after.keys]
    tenants_lost = [t for t in before.tenants if t not in after.tenants]
    tenants_back = [t for t in after.tenants if t not in before.tenants]
    parts = []
    if revived:
        parts.append(f"{len(revived)} API key(s) revoked since work again ({_keys(revived)}: "
                     "revoke them again)")
    if lost:
        parts.append(f"{len(lost)} API key(s) made since are gone ({_keys(lost)}: issue them "
                     "again)")
    if tenants_lost:
        parts.append(f"{len(tenants_lost)} tenant(s) made since are gone "
                     f"({_names(tenants_lost)})")
    if tenants_back:
        parts.append(f"{len(tenants_back)} tenant(s) deleted since are back "
                     f"({_names(tenants_back)})")
    if (before.policy and after.policy and before.policy.version != after.policy.version):
        parts.append(f"the policy is version {after.policy.version} again (was "
                     f"{before.policy.version})")
    undone = "; ".join(parts) if parts else "no tenant or API key differs"
    return (f"the tenancy store went back from generation {before.generation} to "
            f"{after.generation} (Redis restarted from an older snapshot, or a backup "
            f"restored): the admin changes made since are lost from it; {undone}")

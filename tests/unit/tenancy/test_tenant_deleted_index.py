"""A tenant deleted (or created) updates each gateway's key index where its keys changed, as a
key's creation or revocation does: it rebuilt the index whole, a step for every key of every
tenant. A deleted tenant's key record left over (not journaled: written by hand) still gets
the whole rebuild, so it is never served."""

from __future__ import annotations

import pytest

from gateway.errors import AuthError
from gateway.policy_doc import parse_policy
from gateway.tenancy import (
    InMemoryStore,
    KeyRecord,
    SaltDeriver,
    Tenant,
    TenantResolver,
    bootstrap,
    generate_key,
    hash_key,
)
from gateway.tenancy.resolver_apply import ResolverApply

POLICY = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                       "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}})


async def _resolver(monkeypatch: pytest.MonkeyPatch
                    ) -> tuple[InMemoryStore, TenantResolver, dict[str, str], list[int]]:
    store = InMemoryStore()
    await bootstrap(store, tenants=[Tenant(id=t, tier="free") for t in ("acme", "beta")],
                    policy=POLICY)
    keys = {}
    for n, tenant in enumerate(("acme", "acme", "beta")):
        keys[f"{tenant}{n}"] = key = generate_key()
        await store.add_key(KeyRecord(key_id=f"k{n}", tenant_id=tenant, key_hash=hash_key(key),
                                      created_at=1.0))
    resolver = TenantResolver(store, SaltDeriver("s" * 32), poll_interval_s=3600)
    await resolver.refresh()
    whole: list[int] = []
    rebuild = ResolverApply._whole_index

    def counted(*args: object) -> object:
        whole.append(1)
        return rebuild(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(ResolverApply, "_whole_index", staticmethod(counted))
    return store, resolver, keys, whole


async def test_a_deleted_tenant_leaves_the_index_by_its_own_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, resolver, keys, whole = await _resolver(monkeypatch)
    assert await store.delete_tenant("beta")
    assert await resolver.refresh()
    with pytest.raises(AuthError):
        resolver.authenticate(keys["beta2"])
    assert resolver.authenticate(keys["acme0"]).tenant_id == "acme"
    assert not resolver.has_keys("beta")
    await store.create_tenant(Tenant(id="beta", tier="free"))  # again: none of its old keys
    assert await resolver.refresh()
    with pytest.raises(AuthError):
        resolver.authenticate(keys["beta2"])
    assert whole == []  # neither rebuilt the index whole


async def test_a_deleted_tenants_unjournaled_key_is_not_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, resolver, keys, whole = await _resolver(monkeypatch)
    kept = store._keys[hash_key(keys["beta2"])]
    assert await store.delete_tenant("beta")
    store._keys[kept.key_hash] = kept  # left behind, as if written by hand
    assert await resolver.refresh()
    with pytest.raises(AuthError):
        resolver.authenticate(keys["beta2"])
    assert whole == [1]

"""One behavioural table for the tenancy store, run against InMemoryStore and RedisStore."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from gateway.errors import BadRequest, Conflict, NotFound, PreconditionFailed
from gateway.policy_doc import Limits, PolicyDoc, parse_policy
from gateway.tenancy import (
    AuditEntry,
    Change,
    InMemoryStore,
    KeyRecord,
    RedisStore,
    StaleCheck,
    Tenant,
    TenantStore,
    bootstrap,
    connect_redis,
)
from tests.support.procs import redis_proc

POLICY: PolicyDoc = parse_policy(
    {
        "pools": {"p": {"served_model": "m-p", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"m": {"default": "p"}},
        "tiers": {"free": {"limits": {"rpm": 5}}, "premium": {}},
    }
)


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    proc, url = redis_proc()
    with proc:
        yield url


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[TenantStore]:
    s: TenantStore
    if request.param == "memory":
        s = InMemoryStore(audit_cap=5)
    else:
        url = request.getfixturevalue("shared_redis")
        s = RedisStore(connect_redis(url, timeout_s=5), namespace=f"t{secrets.token_hex(4)}",
                       audit_cap=5)
    await s.start()
    yield s
    await s.close()


async def _until(cond: Callable[[], bool]) -> None:
    """Poll a condition (a deadline guards against hanging, it is not the assertion)."""
    async with asyncio.timeout(10):
        while not cond():  # noqa: ASYNC110 - polling a condition with a deadline
            await asyncio.sleep(0.01)


def _key(tenant: str, kid: str) -> KeyRecord:
    return KeyRecord(key_id=kid, tenant_id=tenant, key_hash=f"h-{tenant}-{kid}", created_at=1.0)


async def test_tenant_create_get_list_and_conflict(store: TenantStore) -> None:
    acme = Tenant(id="acme", tier="premium", limits=Limits(rpm=7))
    await store.create_tenant(acme)
    await store.create_tenant(Tenant(id="beta", tier="free"))
    assert await store.get_tenant("acme") == acme
    assert await store.get_tenant("nope") is None
    assert [t.id for t in await store.list_tenants()] == ["acme", "beta"]
    with pytest.raises(Conflict):
        await store.create_tenant(Tenant(id="acme", tier="free"))


async def test_update_merges_limit_overrides_and_validates(store: TenantStore) -> None:
    await store.create_tenant(Tenant(id="acme", tier="free", limits=Limits(rpm=7)))
    t = await store.update_tenant("acme", {"limits": {"tpm": 100}, "salt_group": "pub"})
    assert t.limits.model_dump(exclude_unset=True) == {"rpm": 7, "tpm": 100}
    assert (await store.get_tenant("acme")) == t and t.salt_group == "pub"
    with pytest.raises(BadRequest):
        await store.update_tenant("acme", {"salt_epoch": 9})
    with pytest.raises(BadRequest):
        await store.update_tenant("acme", {"limits": {"rpm": -1}})
    with pytest.raises(NotFound):
        await store.update_tenant("nope", {"tier": "free"})


async def test_keys_add_list_revoke_and_delete_with_tenant(store: TenantStore) -> None:
    await store.create_tenant(Tenant(id="acme", tier="free"))
    await store.add_key(_key("acme", "k1"))
    await store.add_key(_key("acme", "k2"))
    with pytest.raises(NotFound):
        await store.add_key(_key("ghost", "k3"))
    assert [k.key_id for k in await store.list_keys("acme")] == ["k1", "k2"]
    assert await store.revoke_key("acme", "k1") is True
    assert await store.revoke_key("acme", "k1") is False
    assert set((await store.snapshot()).keys) == {"h-acme-k2"}
    assert await store.delete_tenant("acme") is True
    assert await store.delete_tenant("acme") is False
    snap = await store.snapshot()
    assert snap.keys == {} and snap.tenants == {}
    assert await store.list_keys("acme") == []


async def test_rotate_salt_bumps_tenant_or_group_epoch(store: TenantStore) -> None:
    await store.create_tenant(Tenant(id="solo", tier="free"))
    await store.create_tenant(Tenant(id="g1", tier="free", salt_group="pub"))
    r1 = await store.rotate_salt("solo")
    r2 = await store.rotate_salt("solo")
    assert (r1.scope, r1.epoch, r2.epoch) == ("tenant", 1, 2)
    solo = await store.get_tenant("solo")
    assert solo is not None and solo.salt_epoch == 2
    g = await store.rotate_salt("g1")
    assert (g.scope, g.salt_group, g.epoch) == ("group", "pub", 1)
    assert (await store.snapshot()).group_epochs == {"pub": 1}
    with pytest.raises(NotFound):
        await store.rotate_salt("nope")


async def test_policy_versions_and_compare_and_set(store: TenantStore) -> None:
    assert await store.get_policy() is None
    v1 = await store.put_policy(POLICY, if_version=0)
    assert v1.version == 1
    with pytest.raises(PreconditionFailed):
        await store.put_policy(POLICY, if_version=0)
    v2 = await store.put_policy(POLICY, if_version=1)
    v3 = await store.put_policy(POLICY)  # unconditional
    assert (v2.version, v3.version) == (2, 3)
    got = await store.get_policy()
    assert got is not None and got.version == 3 and got.doc == POLICY


async def test_tier_and_policy_writes_refuse_a_stale_check(store: TenantStore) -> None:
    """A tenant written only while the policy is at the version its tier was checked
    against; a policy only if no tenant was written since the generation its check read."""
    first = await store.put_policy(POLICY)
    await store.create_tenant(Tenant(id="acme", tier="free"), policy_version=first.version)
    at = await store.generation()
    await store.put_policy(POLICY, tenants_at=at)  # no tenant since: stored
    with pytest.raises(StaleCheck):
        await store.create_tenant(Tenant(id="beta", tier="free"), policy_version=first.version)
    with pytest.raises(StaleCheck):
        await store.update_tenant("acme", {"tier": "premium"}, policy_version=first.version)
    assert await store.get_tenant("beta") is None
    assert (await store.get_tenant("acme")) == Tenant(id="acme", tier="free")
    at = await store.generation()
    await store.update_tenant("acme", {"limits": {"rpm": 1}})
    await store.rotate_salt("acme")  # a tenant's own epoch: its record written again
    with pytest.raises(StaleCheck):
        await store.put_policy(POLICY, tenants_at=at)
    await store.add_key(_key("acme", "k1"))  # a key is no tenant write
    assert (await store.put_policy(POLICY, tenants_at=await store.generation())).version == 3


async def test_audit_is_newest_first_and_capped(store: TenantStore) -> None:
    for i in range(7):
        await store.append_audit(AuditEntry(at=float(i), who="ops", action="a", target=str(i)))
    entries = await store.list_audit(100)
    assert [e.target for e in entries] == ["6", "5", "4", "3", "2"]  # cap = 5
    assert [e.target for e in await store.list_audit(2)] == ["6", "5"]


async def test_every_mutation_bumps_generation_and_notifies(store: TenantStore) -> None:
    seen: list[Change] = []
    store.subscribe(seen.append)
    if isinstance(store, RedisStore):  # the subscriber announces itself once attached
        await _until(lambda: any(c.kind == "resync" for c in seen))
    g0 = await store.generation()
    await store.create_tenant(Tenant(id="acme", tier="free"))
    await store.add_key(_key("acme", "k1"))
    await store.put_policy(POLICY)
    await store.rotate_salt("acme")
    assert await store.generation() == g0 + 4
    kinds = {"tenant", "key", "policy", "salt"}
    await _until(lambda: kinds <= {c.kind for c in seen})


async def test_bootstrap_is_idempotent_and_never_overwrites(store: TenantStore) -> None:
    tenants = [Tenant(id="acme", tier="premium"), Tenant(id="beta", tier="free")]
    first = await bootstrap(store, tenants=tenants, policy=POLICY)
    assert first.created_tenants == ("acme", "beta") and first.policy_seeded
    await store.update_tenant("acme", {"tier": "free"})
    second = await bootstrap(store, tenants=tenants, policy=POLICY)
    assert second.created_tenants == () and not second.policy_seeded
    acme, policy = await store.get_tenant("acme"), await store.get_policy()
    assert acme is not None and acme.tier == "free"
    assert policy is not None and policy.version == 1

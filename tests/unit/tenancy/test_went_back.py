"""`went_back`: what a store back from an older snapshot undid, by key id and tenant id."""

from __future__ import annotations

from gateway.tenancy.models import KeyRecord, StoreSnapshot, Tenant
from gateway.tenancy.went_back import went_back


def _key(n: int) -> tuple[str, KeyRecord]:
    return f"hash{n}", KeyRecord(key_id=f"key_{n}", tenant_id="t", key_hash=f"hash{n}",
                                 created_at=0.0)


def test_what_the_older_snapshot_undid_is_named() -> None:
    tenant = Tenant(id="t", tier="free")
    before = StoreSnapshot(9, tenants={"t": tenant, "new": Tenant(id="new", tier="free")},
                           keys=dict([_key(2)]))
    after = StoreSnapshot(4, tenants={"t": tenant, "gone": Tenant(id="gone", tier="free")},
                          keys=dict([_key(1)]))
    said = went_back(before, after)
    assert said.startswith("the tenancy store went back from generation 9 to 4 ")
    assert "1 API key(s) revoked since work again (t/key_1: revoke them again)" in said
    assert "1 API key(s) made since are gone (t/key_2: issue them again)" in said
    assert "1 tenant(s) made since are gone (new)" in said
    assert "1 tenant(s) deleted since are back (gone)" in said
    assert "hash" not in said


def test_long_lists_are_cut() -> None:
    before = StoreSnapshot(20, keys=dict(_key(n) for n in range(12)))
    said = went_back(before, StoreSnapshot(3))
    assert "12 API key(s) made since are gone (" in said and "and 7 more" in said
    assert went_back(StoreSnapshot(5), StoreSnapshot(3)).endswith("no tenant or API key differs")

"""Cache salts: vLLM-safe, keyed, rotated by epoch, shared by group; no leaks."""

from __future__ import annotations

import re
from typing import Any

import pytest

from gateway.tenancy.models import Tenant
from gateway.tenancy.salts import SaltDeriver

SECRET = "s3cret-s3cret-s3cret-0123456789"
VLLM_FORBIDDEN = re.compile(r"[@/\\\x00]")


@pytest.mark.parametrize(("encoding", "length"), [("hex", 64), ("base64url", 43)])
def test_salt_is_vllm_safe(encoding: Any, length: int) -> None:
    deriver = SaltDeriver(SECRET, encoding=encoding)
    for i in range(200):
        salt = deriver.derive(f"tenant:t{i}", i % 3)
        assert 0 < len(salt) == length <= 128
        assert not VLLM_FORBIDDEN.search(salt)


def test_salt_depends_on_secret_subject_and_epoch() -> None:
    a, b = SaltDeriver(SECRET), SaltDeriver(SECRET + "x")
    acme, other = Tenant(id="acme", tier="free"), Tenant(id="other", tier="free")
    rotated = Tenant(id="acme", tier="free", salt_epoch=1)
    assert a.for_tenant(acme, {}) == a.for_tenant(acme, {})
    assert (
        len(
            {
                a.for_tenant(acme, {}),
                b.for_tenant(acme, {}),
                a.for_tenant(other, {}),
                a.for_tenant(rotated, {}),
            }
        )
        == 4
    )


def test_group_members_share_a_salt_until_the_group_rotates() -> None:
    d = SaltDeriver(SECRET)
    x = Tenant(id="x", tier="free", salt_group="public", salt_epoch=5)
    y = Tenant(id="y", tier="free", salt_group="public")
    assert d.for_tenant(x, {}) == d.for_tenant(y, {})
    assert d.for_tenant(x, {"public": 1}) != d.for_tenant(x, {})
    assert d.for_tenant(x, {}) != d.for_tenant(Tenant(id="x", tier="free"), {})


def test_short_secret_is_refused_and_repr_hides_the_secret() -> None:
    with pytest.raises(ValueError, match="at least"):
        SaltDeriver("short")
    d = SaltDeriver(SECRET)
    assert SECRET not in repr(d) and SECRET not in str(d)

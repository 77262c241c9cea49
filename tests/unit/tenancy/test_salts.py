"""Cache salts: vLLM-safe, keyed, rotated by epoch, shared by group; body rewrite; no leaks."""

from __future__ import annotations

import re
from typing import Any

import pytest

from gateway.tenancy.errors import InvalidRequest
from gateway.tenancy.models import Tenant
from gateway.tenancy.salts import SaltDeriver, rewrite_body

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


REWRITES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    ("salt added", {"model": "m"}, {}, {"model": "m", "cache_salt": "S"}),
    (
        "client salt stripped",
        {"model": "m", "cache_salt": "evil"},
        {},
        {"model": "m", "cache_salt": "S"},
    ),
    (
        "model rewritten",
        {"model": "m"},
        {"served_model": "m-fp8"},
        {"model": "m-fp8", "cache_salt": "S"},
    ),
    (
        "priority injected",
        {"model": "m", "priority": -100},
        {"priority": 10},
        {"model": "m", "cache_salt": "S", "priority": 10},
    ),
    (
        "client priority dropped",
        {"model": "m", "priority": -100},
        {},
        {"model": "m", "cache_salt": "S"},
    ),
]


@pytest.mark.parametrize(("case", "body", "kw", "expected"), REWRITES, ids=[r[0] for r in REWRITES])
def test_rewrite_body(
    case: str, body: dict[str, Any], kw: dict[str, Any], expected: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body["messages"] = messages
    rewrite_body(body, cache_salt="S", **kw)
    assert body.pop("messages") is messages  # rewritten in place, nothing re-parsed
    assert body == expected


def test_reject_mode_refuses_a_client_salt_without_echoing_it() -> None:
    body = {"model": "m", "cache_salt": "client-secret-salt"}
    with pytest.raises(InvalidRequest) as info:
        rewrite_body(body, cache_salt="S", client_salt="reject")
    assert info.value.param == "cache_salt" and info.value.status == 400
    assert "client-secret-salt" not in str(info.value.to_dict())

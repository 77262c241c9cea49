"""An admin request with two `Authorization` headers that differ is refused, as a tenant's
request is: kvgate read the first, so a valid token first let the request in whatever a proxy
in front had checked (often the last header)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway import AUTH_SECRET, gateway_proc
from tests.support.procs import sim_proc

ADMIN = "two-auth-admin-token-0123456789a"
OTHER = "Bearer not-the-admin-token-000000"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with sim, gw:
        yield base


def _headers(*values: str) -> list[tuple[str, str]]:
    return [("authorization", v) for v in values]


@pytest.mark.parametrize("order", ["valid first", "valid last"])
def test_two_different_authorizations_are_refused(base: str, order: str) -> None:
    values = [f"Bearer {ADMIN}", OTHER]
    if order == "valid last":
        values.reverse()
    r = httpx.get(f"{base}/admin/tenants", headers=_headers(*values), timeout=10)
    assert r.status_code == 401, r.text
    assert "two Authorization headers" in r.json()["error"]["message"]
    assert ADMIN not in r.text
    # a write is refused before its body is read: nothing made
    made = httpx.post(f"{base}/admin/tenants", headers=_headers(*values),
                      json={"id": f"dup-{order[-4:]}"}, timeout=10)
    assert made.status_code == 401, made.text
    one = _headers(f"Bearer {ADMIN}")
    assert httpx.get(f"{base}/admin/tenants/dup-{order[-4:]}", headers=one,
                     timeout=10).status_code == 404


def test_the_same_token_twice_is_one(base: str) -> None:
    r = httpx.get(f"{base}/admin/tenants", headers=_headers(f"Bearer {ADMIN}", f"Bearer {ADMIN}"),
                  timeout=10)
    assert r.status_code == 200, r.text

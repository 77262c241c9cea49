"""The admin API's ``If-Match`` uses the strong comparison (RFC 9110 13.1.1): a weak
entity-tag never matches, so a write sent with one is a 412 and changes nothing; a list of
tags matches when one of its strong tags names the version in force; ``*`` matches a stored
policy. The ETag the admin API sends is a strong one.

Before, ``W/"3"`` was read as ``"3"`` (the write went through) and a list of tags was a 400.

A real gateway (in-memory store), a simulated replica, the admin API over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

ADMIN = "if-match-strong-admin-0123456789"


def _rpm(rpm: int) -> dict[str, object]:
    return {"tiers": {"default": {"limits": {"rpm": rpm}}}}


def _etag(admin: httpx.Client) -> str:
    etag = admin.get("/policy").headers["etag"]
    assert etag.startswith('"') and etag.endswith('"') and etag[1:-1].isdigit(), etag
    return etag


def test_a_weak_entity_tag_never_matches(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env)
    with gw, admin_client(base, ADMIN) as admin:
        etag = _etag(admin)
        doc = admin.get("/policy").json()
        for method, body in (("PATCH", _rpm(7)), ("PUT", {**doc, **_rpm(7)})):
            for value in ("W/" + etag, f"W/{etag}, W/\"99\""):
                resp = admin.request(method, "/policy", json=body, headers={"If-Match": value})
                assert resp.status_code == 412, (method, value, resp.text)
                error = resp.json()["error"]
                assert error["param"] == "If-Match" and "weak" in error["message"], error
        assert _etag(admin) == etag  # nothing was written

        # a list matches when one of its strong tags is the version in force
        listed = f'"99", , W/"98", {etag},'  # (empty elements are ignored)
        resp = admin.patch("/policy", json=_rpm(8), headers={"If-Match": listed})
        assert resp.status_code == 200, resp.text
        etag = resp.headers["etag"]
        assert admin.patch("/policy", json=_rpm(9),
                           headers={"If-Match": '"99", "98"'}).status_code == 412
        resp = admin.put("/policy", json={**doc, **_rpm(9)},
                         headers={"If-Match": f'"1000", {etag}'})
        assert resp.status_code == 200, resp.text
        etag = resp.headers["etag"]
        for method, body in (("PATCH", _rpm(10)), ("PUT", {**doc, **_rpm(11)})):
            resp = admin.request(method, "/policy", json=body, headers={"If-Match": "*"})
            assert resp.status_code == 200, (method, resp.text)
        assert admin.get("/policy").json()["tiers"]["default"]["limits"] == {"rpm": 11}
        assert "Traceback" not in gw.output()


def test_a_write_to_an_object_without_entity_tags_is_refused_on_a_named_one(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    """Tenants and keys carry no ETag, so an ``If-Match`` naming a tag matches none of them
    (RFC 9110 13.1.1: the method must not be performed): a 412 saying so, nothing changed.
    ``*`` matches a tenant that exists. Before, the header was ignored and the write made: a
    client relying on it to avoid a lost update overwrote the tenant it had not read."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env)
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "acme"}).status_code == 201
        tagged = {"If-Match": '"1"'}
        writes = [("PATCH", "/tenants/acme", {"limits": {"rpm": 5}}),
                  ("POST", "/tenants/acme/rotate-salt", None),
                  ("POST", "/tenants/acme/keys", None),
                  ("DELETE", "/tenants/acme", None)]
        before = admin.get("/tenants/acme").json()
        for method, path, body in writes:
            resp = admin.request(method, path, json=body, headers=tagged)
            assert resp.status_code == 412, (method, path, resp.text)
            assert resp.json()["error"]["param"] == "If-Match"
        assert admin.get("/tenants/acme").json() == before
        assert admin.get("/audit").json()["data"][0]["action"] == "tenant.create"
        resp = admin.patch("/tenants/acme", json={"limits": {"rpm": 5}},
                           headers={"If-Match": "*"})
        assert resp.status_code == 200 and resp.json()["limits"] == {"rpm": 5}, resp.text
        assert "Traceback" not in gw.output()

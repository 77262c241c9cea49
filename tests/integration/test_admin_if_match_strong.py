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
        listed = f'"99", W/"98", {etag}'
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

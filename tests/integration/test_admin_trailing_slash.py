"""An admin path with a trailing slash is a path the admin API does not know: an OpenAI-shaped
404 naming the path without it, never Starlette's redirect.

It was a 307 with an empty body to an absolute URL built from the Host header, ``http://``
even behind a proxy that ends TLS (a client that follows it sends its admin token and body
over plain HTTP).

A real gateway (in-memory store), a simulated replica, the admin API over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

ADMIN = "trailing-slash-admin-token-0123456789"


def test_a_trailing_slash_is_a_404_not_a_redirect(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env)
    with gw, admin_client(base, ADMIN) as admin:
        for method, path, body in (("POST", "/tenants/", {"id": "slash"}),
                                   ("GET", "/tenants/", None), ("GET", "/policy/", None)):
            resp = admin.request(method, path, json=body,
                                 headers={"host": "gw.example.com"})
            assert resp.status_code == 404, (method, path, resp.status_code)
            assert "location" not in resp.headers
            message = resp.json()["error"]["message"]
            bare = "/admin" + path.rstrip("/")
            assert message == f"unknown admin path /admin{path} (without the trailing " \
                              f"slash: {bare})", message
        assert admin.get("/tenants/slash").status_code == 404  # nothing was created
        nowhere = admin.get("/nowhere/")
        assert nowhere.json()["error"]["message"] == "unknown admin path /admin/nowhere/"

"""An ``If-Match`` that names no policy version is a 400 naming the header, never a 500.

The version was checked with `str.isdigit`, which takes a superscript two (the header byte
0xB2, read as Latin-1) and any number of digits, and then converted with `int`, which refuses
both: each was a 500 "internal error in the admin API" with a traceback in the gateway's log.

A real gateway (in-memory store), a simulated replica, the admin API over HTTP.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

ADMIN = "if-match-admin-token-0123456789"
NO_VERSION = [b'"\xb2"', b'"' + b"1" * 5000 + b'"', b'"-1"', b'"v1"', b""]


def test_an_if_match_that_names_no_version_is_a_400(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env)
    with gw, admin_client(base, ADMIN) as admin:
        got = admin.get("/policy")
        doc, version = got.json(), got.headers["etag"]
        for value in NO_VERSION:
            for method, body in (("PATCH", {}), ("PUT", doc)):
                resp = admin.request(method, "/policy", json=body, headers={b"If-Match": value})
                assert resp.status_code == 400, (method, value[:20], resp.text)
                assert resp.json()["error"]["param"] == "If-Match"
        # a version of any other number is a 412, the one in force goes through
        resp = admin.patch("/policy", json={}, headers={"If-Match": '"99999999999999999999"'})
        assert resp.status_code == 412, resp.text
        for good in (version, "*"):
            assert admin.patch("/policy", json={}, headers={"If-Match": good}).status_code == 200
        assert "Traceback" not in gw.output()


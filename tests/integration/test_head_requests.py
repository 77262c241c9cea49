"""HEAD is GET without the body (RFC 9110 9.3.2) on every GET route: the same status and
headers, Content-Length included, and no body. Other methods on a route get 405 with an Allow
header listing what the route does take."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "head-admin-token-0123456789"
PAGES = ["/v1/models", "/healthz", "/readyz", "/health", "/ping", "/version"]
ADMIN_GETS = ["/admin/tenants", "/admin/tenants/default", "/admin/policy", "/admin/replicas",
              "/admin/audit"]


def _same_but_the_body(client: httpx.Client, path: str) -> None:
    get, head = client.get(path), client.head(path)
    assert (head.status_code, head.headers.get("content-type")) == (
        get.status_code, get.headers.get("content-type")), (path, head.text)
    assert get.status_code == 200, (path, get.text)
    assert head.content == b""
    if path not in ("/metrics", "/readyz", "/admin/replicas"):  # (their figures move)
        assert head.headers["content-length"] == str(len(get.content)), path


def test_head_answers_as_get_without_the_body(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", "--enable-store")
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, httpx.Client(base_url=base, timeout=10,
                          headers={"authorization": f"Bearer {ADMIN}"}) as client:
        stored = client.post("/v1/responses", json={"model": "sim-model", "input": "hi",
                                                    "max_output_tokens": 2}).json()["id"]
        for path in [*PAGES, "/metrics", f"/v1/responses/{stored}", *ADMIN_GETS]:
            _same_but_the_body(client, path)
        missing = client.head("/v1/responses/resp_unknown")  # as GET: 404
        assert (missing.status_code, missing.content) == (404, b"")
        for method, path, allow in (
            ("HEAD", "/v1/chat/completions", "POST"),
            ("HEAD", f"/v1/responses/{stored}/cancel", "POST"),
            ("POST", "/healthz", "GET, HEAD"),
            ("HEAD", "/admin/route/explain", "POST"),
            ("DELETE", "/admin/tenants", "GET, HEAD, POST"),
            ("POST", "/admin/replicas", "GET, HEAD"),
        ):
            r = client.request(method, path)
            assert (r.status_code, r.headers.get("allow")) == (405, allow), (method, path)
            if method != "HEAD":
                assert r.json()["error"]["type"] == "MethodNotAllowedError"


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_the_admin_port_pages_take_get_and_head_only(sim_factory: SimFactory, path: str) -> None:
    _, sim = sim_factory("--time-scale", "50")
    admin_port = free_port()
    gw, _ = gateway_proc(config={"pools": {"p": {"served_model": "sim-model", "replicas": [sim]}},
                                 "server": {"admin_port": admin_port}})
    with gw, httpx.Client(base_url=f"http://127.0.0.1:{admin_port}", timeout=10) as client:
        _same_but_the_body(client, path)
        r = client.post(path)
        assert (r.status_code, r.headers.get("allow")) == (405, "GET, HEAD")

"""A probe or `curl` that asks kvgate's own pages with a trailing slash (`/healthz/`, as a
client following vLLM's redirect does) reaches them on the admin port as on the API port:
the admin port answered `/healthz/`, `/livez/`, `/readyz/` and `/metrics/` 404 while the API
port served them."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.gateway import gateway_proc
from tests.support.procs import free_port


def test_trailing_slash_on_both_ports() -> None:
    admin_port = free_port()
    config: dict[str, Any] = {"pools": {"p": {"served_model": "m",
                                              "replicas": ["http://127.0.0.1:9"]}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_SERVER__ADMIN_PORT": str(admin_port)},
                            ready=False)
    admin = f"http://127.0.0.1:{admin_port}"
    with gw:
        for at, pages in ((base, ("/healthz", "/livez", "/readyz", "/health")),
                          (admin, ("/healthz", "/livez", "/readyz", "/metrics"))):
            for page in pages:
                plain = httpx.get(f"{at}{page}", timeout=5)
                slashed = httpx.get(f"{at}{page}/", timeout=5)
                assert slashed.status_code == plain.status_code != 404, (at, page, slashed.text)
                if page != "/metrics":
                    assert slashed.json()["status"] == plain.json()["status"], (at, page)
        assert "kvgate_requests_total" in httpx.get(f"{admin}/metrics/", timeout=5).text
        # the admin API's unknown paths stay 404s
        assert httpx.get(f"{admin}/healthzz/", timeout=5).status_code == 404

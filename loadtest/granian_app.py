"""kvgate's ASGI app for a server other than uvicorn (`bench_overhead --granian`).

    KVGATE_BENCH_UPSTREAMS=http://127.0.0.1:9001,... granian --interface asgi \
        loadtest.granian_app:app

The same `GatewayApp` `kvgate serve --no-auth` runs, without the HTTP guards kvgate adds to
uvicorn's protocol (header limits, read timeouts): for measuring the server's cost only.
"""

from __future__ import annotations

import os

from gateway.app import GatewayApp
from gateway.config import load_config

__all__ = ["app"]

_urls = os.environ.get("KVGATE_BENCH_UPSTREAMS", "").split(",")
app = GatewayApp(load_config(None, environ={}, overrides={
    "pools": {"bench": {"served_model": os.environ.get("KVGATE_BENCH_MODEL", "bench-model"),
                        "replicas": [u for u in _urls if u]}},
    "tenancy": {"auth": False},
}))

"""A replica refusing kvgate's key (kvgate started without the replica's vLLM --api-key): the
quick form cannot learn the pool's model from its /v1/models, and /readyz said only "served
model not known yet (no replica answered)" -- the 401 was in the log alone. It names the
refusal now. And a replica URL written with an upper-case scheme (``HTTP://...``) was refused
at the config check: the scheme and the host are case-insensitive, so it is taken, lowered."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from gateway.config import load_config
from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

KEY = "replica-key-0123456789"


def test_readyz_names_a_replica_refusing_the_gateways_key(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, url = sim_factory("--time-scale", "50", "--api-key", KEY, model="keyed")
    gw, base = gateway_proc(upstreams=[url], ready=False)  # no key given to the pool
    with gw:
        def named() -> bool:
            return "credentials (401)" in httpx.get(f"{base}/readyz", timeout=5).text

        wait_for(named, timeout=20, what="/readyz to name the replica's 401")
        ready = httpx.get(f"{base}/readyz", timeout=5)
        assert ready.status_code == 503
        assert "refused the gateway's credentials (401) on /v1/models" in ready.text
        assert KEY not in ready.text


def test_an_upper_case_scheme_and_host_are_taken_lowered() -> None:
    cfg = load_config("", overrides={"pools": {"p": {
        "served_model": "m", "replicas": ["HTTP://LocalHost:8001", "Https://10.0.0.1:8002/"]}},
        "models": {}}, environ={})
    assert cfg.pools["p"].replicas == ["http://localhost:8001", "https://10.0.0.1:8002/"]

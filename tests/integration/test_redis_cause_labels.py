"""`kvgate_redis_down_cause` and `kvgate_sync_down_cause` name a database number past the
server's `databases` (`dbindex`) as /readyz and the log do: the label said `other`, so an alert
and `kvgate doctor` could only say "read the log"."""

from __future__ import annotations

import re
from typing import Any

import httpx

from gateway.doctor.redis_causes import refusal
from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import redis_proc


def _causes(base: str) -> dict[str, str]:
    """metric -> the cause label whose series reads 1."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return {m: c for m, c in re.findall(r'^(kvgate_\w+_down_cause)\{cause="(\w+)"\} 1\.0$',
                                         text, re.M)}


def test_a_database_number_past_databases_is_labelled_dbindex() -> None:
    redis, url = redis_proc()
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    gw, base = gateway_proc(config=config, auth=True, ready=False, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": "cause-admin-token-0123456789",
        "KVGATE_REDIS_URL": url.rsplit("/", 1)[0] + "/99"})
    with redis, gw:
        wait_for(lambda: len(_causes(base)) == 2, timeout=20, what="both causes exported")
        assert _causes(base) == {"kvgate_redis_down_cause": "dbindex",
                                 "kvgate_sync_down_cause": "dbindex"}
        reason = httpx.get(f"{base}/readyz", timeout=5).json()["tenancy"]["reason"]
        assert "DB index is out of range" in reason
    what = refusal("dbindex")
    assert what is not None and "KVGATE_REDIS_URL" in what[1]

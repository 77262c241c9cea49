"""What a client is told while the tenancy store (Redis) does not answer: a clean OpenAI-shaped
503 with Retry-After, never the OS error or Redis's address (those go to the log)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import redis

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    persistent_redis,
    wait_for,
)
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "store-outage-admin-token-0123456789"
CONFIG = {
    "pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
    "models": {"llama": {"free": "p"}},
    "tiers": {"free": {}},
    "tenants": [{"id": "acme", "tier": "free"}],
}


def _on_redis(url: str) -> tuple[Proc, str]:
    """A gateway with authentication and the admin API on Redis at `url` (not started; not
    waiting to be ready: Redis may not answer)."""
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN, "KVGATE_REDIS_URL": url}
    return gateway_proc(config=CONFIG, env=env, auth=True, ready=False)


def _clean_503(answer: httpx.Response, port: int) -> None:
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert error["code"] == "store_unavailable"
    for detail in ("connection refused", "ConnectionError", "127.0.0.1", str(port), "errno",
                   "Traceback"):
        assert detail not in error["message"], error["message"]
    assert int(answer.headers["retry-after"]) >= 1


def test_admin_write_while_redis_is_down_is_a_clean_503(tmp_path: Path) -> None:
    redis, url, port = persistent_redis(str(tmp_path))
    gw, base = _on_redis(url)
    with redis, gw, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants/acme/keys").status_code == 201
        redis.stop()
        refused = admin.post("/tenants/acme/keys")
        _clean_503(refused, port)
        # a write's outcome is not known: the message says so, naming the request's id
        assert refused.json()["error"]["message"].startswith(
            "the tenancy store (Redis) did not answer: this change may have been applied")
        assert repr(refused.headers["x-request-id"]) in refused.json()["error"]["message"]
        read = admin.get("/tenants")
        _clean_503(read, port)
        assert read.json()["error"]["message"] == (
            "the tenancy store (Redis) did not answer; retry shortly")
        assert "admin request failed: the tenancy store (Redis) did not answer (" in gw.output()


def test_requests_before_redis_ever_answered_get_a_clean_503() -> None:
    port = free_port()  # nothing listens there
    gw, base = _on_redis(f"redis://127.0.0.1:{port}/0")
    with gw:
        answer = httpx.post(f"{base}/v1/chat/completions", json={"model": "llama"},
                            headers={"authorization": "Bearer kvg-anything"}, timeout=10)
        _clean_503(answer, port)
        assert "has not answered yet" in answer.json()["error"]["message"]
        assert "connection refused" in gw.output()


def test_admin_writes_redis_refuses_name_the_refusal_and_succeed_after(redis_url: str) -> None:
    """A Redis that answers but refuses writes (out of memory under noeviction, a read-only
    replica): each admin write is a clean 503 naming the refusal (it said "did not answer;
    retry shortly", as for a Redis that is down), nothing claims success, and the same write
    succeeds once the refusal ends."""
    gw, base = _on_redis(redis_url)
    r = redis.Redis.from_url(redis_url)
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.get("/tenants").status_code == 200
        faults: dict[str, tuple[list[str], list[str]]] = {
            "OOM": (["CONFIG", "SET", "maxmemory", "1"], ["CONFIG", "SET", "maxmemory", "0"]),
            "READONLY": (["REPLICAOF", "127.0.0.1", str(free_port())], ["REPLICAOF", "NO", "ONE"]),
        }
        for code, (start, end) in faults.items():
            _command(r, start)
            try:
                refused = admin.post("/tenants", json={"id": f"t-{code.lower()}", "tier": "free"})
            finally:
                _command(r, end)
            _clean_503(refused, int(redis_url.rsplit(":", 1)[1].split("/")[0]))
            message = refused.json()["error"]["message"]
            assert f"refused the request ({code})" in message
            # it said "may have been applied, or may still be": Redis refuses a script whole
            assert "this change was not made" in message and "may have been" not in message
            assert refused.headers["x-request-id"] in message
            assert admin.get(f"/tenants/t-{code.lower()}").status_code == 404
            assert admin.post("/tenants", json={"id": f"t-{code.lower()}", "tier": "free"}
                              ).status_code == 201
    r.close()


def _command(r: redis.Redis, words: list[str]) -> None:
    r.execute_command(*words)  # type: ignore[no-untyped-call]


def test_a_tier_unknown_for_want_of_a_stored_policy_is_a_503_to_retry(redis_url: str) -> None:
    """The policy lost (evicted, deleted by hand) where the gateway cannot write it back: Redis
    a read-only replica (after a failover). Creating a tenant cannot check its tier: a 503 to
    retry (it was a 400 "unknown tier", blaming a request that was fine), nothing created;
    once Redis takes writes again the policy is written back and the same request succeeds."""
    gw, base = _on_redis(redis_url)
    r = redis.Redis.from_url(redis_url)
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.get("/policy").status_code == 200
        with r.pipeline(transaction=False) as pipe:  # one write: no write-back between
            pipe.delete("kvgate:policy")
            pipe.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # type: ignore[no-untyped-call]
            pipe.execute()
        try:
            refused = admin.post("/tenants", json={"id": "later", "tier": "free"})
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert "no policy is stored" in refused.json()["error"]["message"]
        finally:
            _command(r, ["REPLICAOF", "NO", "ONE"])
        # a write makes the gateways reload (else the next whole reload, within 30 s), and
        # the reload finds the policy lost and writes it back
        assert admin.post("/tenants/acme/rotate-salt").status_code == 200
        wait_for(lambda: admin.get("/policy").status_code == 200, what="the policy written back")
        assert admin.post("/tenants", json={"id": "later", "tier": "free"}).status_code == 201
    r.close()

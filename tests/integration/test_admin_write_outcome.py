"""An admin write whose answer from Redis came too late (Redis paused with SIGSTOP past the
gateway's `tenancy.redis_timeout_s`, then resumed): the 503 says the outcome is unknown and
names a request id, and a write Redis ran after all is in the audit log with that id (its
entry is written by the write's own script). Real redis-server, a real `kvgate serve`."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "admin-token-0123456789abcdef"
ODD = "odd-admin-token-0123456789abcdef"  # its id is the entry's placeholder, `$result`
PAUSE_S = 1.2  # past the 0.5 s redis_timeout_s: the gateway gives up, Redis runs it later
WARM = 8


@pytest.fixture(scope="module")
def redis_server() -> Iterator[tuple[Proc, str]]:
    proc, url = redis_proc()
    with proc:
        yield proc, url


@pytest.fixture(scope="module")
def gateway(redis_server: tuple[Proc, str]) -> Iterator[tuple[Proc, str]]:
    procs: list[Proc] = []
    rproc, url = redis_server
    try:
        sim, sim_url = sim_proc()
        procs.append(sim.start())
        gw, base = gateway_proc(
            config={"pools": {"p": {"served_model": "sim-model", "replicas": [sim_url]}}},
            auth=True, env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_REDIS_URL": url,
                            "KVGATE_ADMIN_TOKEN": f"ops:{ADMIN},$result:{ODD}"})
        procs.append(gw.start())
        yield rproc, base
    finally:
        for proc in reversed(procs):
            proc.stop()


def _paused(
    server: Proc, admin: httpx.Client, send: Callable[[], httpx.Response]
) -> httpx.Response:
    """`send()` while Redis is stopped; Redis resumed `PAUSE_S` later (after the gateway gave
    up on it), so it runs what the gateway wrote into its socket meanwhile. Concurrent reads
    first leave the gateway idle connections to Redis: a new one's handshake would time out
    before the write is even sent (its background tasks take one each meanwhile)."""
    with ThreadPoolExecutor(WARM) as pool:
        assert all(r.status_code == 200 for r in pool.map(
            lambda _: admin.get("/tenants"), range(WARM)))
    answer: list[httpx.Response] = []
    server.signal(signal.SIGSTOP)
    try:
        worker = threading.Thread(target=lambda: answer.append(send()))
        worker.start()
        time.sleep(PAUSE_S)
    finally:
        server.signal(signal.SIGCONT)
    worker.join(15)
    return answer[0]


def _audited(admin: httpx.Client, request_id: str) -> list[dict[str, Any]]:
    entries = admin.get("/audit", params={"limit": 50}).json()["data"]
    return [e for e in entries if e.get("request_id") == request_id]


def _unknown_outcome(answer: httpx.Response) -> str:
    """The 503's request id, after checking the answer says what it means."""
    assert answer.status_code == 503, answer.text
    request_id = answer.headers["x-request-id"]
    message = answer.json()["error"]["message"]
    assert "may have been applied" in message and request_id in message, message
    return request_id


def test_a_key_created_while_redis_answered_too_late_is_audited_with_the_503s_id(
    gateway: tuple[Proc, str],
) -> None:
    server, base = gateway
    with admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "late"}).status_code == 201
        first = admin.post("/tenants/late/keys")  # Redis has the script (EVALSHA) from now on
        assert admin.delete(f"/tenants/late/keys/{first.json()['id']}").status_code == 204
        answer = _paused(server, admin, lambda: admin.post("/tenants/late/keys"))
        request_id = _unknown_outcome(answer)
        keys = admin.get("/tenants/late").json()["keys"]
        assert len(keys) == 1, keys  # Redis ran it: the key exists, never shown
        entries = _audited(admin, request_id)
        assert [(e["action"], e["detail"]) for e in entries] == [
            ("key.create", {"key_id": keys[0]["id"]})], entries


def test_a_tenant_deleted_while_redis_answered_too_late_is_audited_with_the_503s_id(
    gateway: tuple[Proc, str],
) -> None:
    server, base = gateway
    with admin_client(base, ADMIN) as admin:
        for tid in ("first", "doomed"):  # the first deletion gives Redis the script
            assert admin.post("/tenants", json={"id": tid}).status_code == 201
        assert admin.delete("/tenants/first").status_code == 204
        answer = _paused(server, admin, lambda: admin.delete("/tenants/doomed"))
        request_id = _unknown_outcome(answer)
        assert admin.get("/tenants/doomed").status_code == 404
        entries = _audited(admin, request_id)
        assert [(e["action"], e["target"]) for e in entries] == [
            ("tenant.delete", "doomed")], entries


def test_a_write_answered_is_audited_with_the_id_its_answer_names(
    gateway: tuple[Proc, str],
) -> None:
    _, base = gateway
    with admin_client(base, ADMIN) as admin:
        created = admin.post("/tenants", json={"id": "named"})
        assert created.status_code == 201
        entries = _audited(admin, created.headers["x-request-id"])
        assert [(e["action"], e["target"]) for e in entries] == [
            ("tenant.create", "named")], entries


def test_an_entry_written_by_the_script_says_what_its_result_was(
    gateway: tuple[Proc, str], redis_server: tuple[Proc, str],
) -> None:
    """The epoch of a group's rotation and a policy's version are known only once Redis ran
    the write: the script puts them in the entry, as large as they come (a fresh epoch from
    2**40 on: Lua 5.1's own formatting writes a 16-digit double as ``4.5e+15``)."""
    _, base = gateway
    raw = redis.Redis.from_url(redis_server[1])
    with admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "grouped", "salt_group": "g"}).status_code \
            == 201
        raw.hset("kvgate:salt_groups", "g", "not-an-epoch")  # rotated to a fresh random one
        rotated = admin.post("/tenants/grouped/rotate-salt")
        assert rotated.status_code == 200, rotated.text
        assert rotated.json()["salt_epoch"] >= 2**40
        [entry] = _audited(admin, rotated.headers["x-request-id"])
        assert entry["detail"] == {"scope": "group", "salt_group": "g",
                                   "epoch": rotated.json()["salt_epoch"]}, entry
        policy = admin.get("/policy")
        put = admin.put("/policy", json=policy.json())
        assert put.status_code == 200, put.text
        [entry] = _audited(admin, put.headers["x-request-id"])
        assert f'"{entry["detail"]["version"]}"' == put.headers["etag"], entry
    raw.close()


def test_a_name_that_is_the_placeholder_is_left_as_it_is(
    gateway: tuple[Proc, str],
) -> None:
    """The script puts its result where the entry says ``"$result"`` last: an admin token id
    ``$result`` (the entry's `who`) comes before it and stays a name."""
    _, base = gateway
    with admin_client(base, ODD) as admin:
        made = admin.post("/tenants", json={"id": "placeholder", "salt_group": "odd"})
        assert made.status_code == 201, made.text
        rotated = admin.post("/tenants/placeholder/rotate-salt")
        assert rotated.status_code == 200, rotated.text
        [entry] = _audited(admin, rotated.headers["x-request-id"])
        assert entry["who"] == "$result", entry
        assert entry["detail"] == {"scope": "group", "salt_group": "odd",
                                   "epoch": rotated.json()["salt_epoch"]}, entry

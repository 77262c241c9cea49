"""The admin API over real HTTP (uvicorn on a loopback port), against both stores."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import pytest
import redis
import uvicorn

from gateway.admin import AdminDeps, AdminToken, create_admin_app
from gateway.errors import NAME_CHARS
from gateway.policy_doc import parse_policy
from gateway.tenancy import (
    InMemoryStore,
    RedisStore,
    SaltDeriver,
    TenantResolver,
    TenantStore,
    connect_redis,
)
from gateway.tenancy.salts import FRESH_EPOCH_MIN
from tests.support.procs import free_port, redis_proc

ADMIN_TOKEN = "admin-" + secrets.token_urlsafe(24)
SECRET = "admin-test-salt-secret-0123456789"
POLICY_DOC: dict[str, Any] = {
    "pools": {
        "fp8": {
            "served_model": "llama-70b-fp8",
            "replicas": ["http://127.0.0.1:9001"],
            "priority": True,
        },
        "awq": {"served_model": "llama-70b-awq", "replicas": ["http://127.0.0.1:9002"]},
    },
    "models": {"llama-70b": {"premium": "fp8", "free": "awq"}},
    "tiers": {
        "premium": {"limits": {"rpm": 600}, "priority": 0, "spill_to": "awq"},
        "free": {"limits": {"rpm": 60, "max_concurrency": 4}, "priority": 10},
    },
}


@dataclass
class Admin:
    url: str
    store: TenantStore
    client: httpx.AsyncClient


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    proc, url = redis_proc()
    with proc:
        yield url


async def _explain(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": body.get("model"), "pool": "fp8", "replica": "fp8/a", "reason": "tier"}


async def serve_admin(
    store: TenantStore, tokens: list[AdminToken], **deps_kw: Any
) -> AsyncGenerator[str, None]:
    deps = AdminDeps(
        store=store,
        tokens=tokens,
        explain=_explain,
        replicas=lambda: {"object": "list", "data": [{"id": "fp8/a"}]},
        **deps_kw,
    )
    port = free_port()
    config = uvicorn.Config(
        create_admin_app(deps), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:  # noqa: ASYNC110 - uvicorn exposes no started event
            await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@pytest.fixture(params=["memory", "redis"])
async def admin(request: pytest.FixtureRequest) -> AsyncIterator[Admin]:
    store: TenantStore
    if request.param == "memory":
        store = InMemoryStore()
    else:
        url = request.getfixturevalue("shared_redis")
        store = RedisStore(connect_redis(url, timeout_s=5), namespace=f"t{secrets.token_hex(4)}")
    await store.start()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=headers) as client:
            yield Admin(url, store, client)
    await store.close()


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


async def test_admin_auth_failures(admin: Admin) -> None:
    async with httpx.AsyncClient(base_url=admin.url) as anon:
        r = await anon.get("/admin/tenants")
        assert _error(r, 401)["type"] == "AuthenticationError"
        assert r.headers["www-authenticate"] == "Bearer"
        _error(await anon.get("/admin/tenants", headers={"authorization": "Bearer wrong"}), 401)
        _error(await anon.get("/admin/policy", headers={"authorization": ADMIN_TOKEN}), 401)
        tenant_key = {"authorization": "Bearer kvg-" + "a" * 43}
        assert _error(await anon.get("/admin/tenants", headers=tenant_key), 403)["code"]


async def test_admin_disabled_without_tokens() -> None:
    async for url in serve_admin(InMemoryStore(), []):
        async with httpx.AsyncClient(base_url=url) as anon:
            r = await anon.get("/admin/tenants", headers={"authorization": "Bearer anything"})
            assert "disabled" in _error(r, 403)["message"]


async def test_tenant_lifecycle(admin: Admin) -> None:
    c = admin.client
    r = await c.post(
        "/admin/tenants",
        json={"id": "acme", "tier": "premium", "limits": {"rpm": 100}, "salt_group": "pub"},
    )
    assert r.status_code == 201, r.text
    assert r.json() == {
        "object": "tenant",
        "id": "acme",
        "tier": "premium",
        "limits": {"rpm": 100},
        "salt_group": "pub",
        "salt_epoch": 0,
        "keys": [],
    }
    assert _error(await c.post("/admin/tenants", json={"id": "acme", "tier": "free"}), 409)
    gold = _error(await c.post("/admin/tenants", json={"id": "x", "tier": "gold"}), 400)
    assert gold["param"] == "tier"
    assert gold["message"].endswith("(known: default, free, premium)")  # 'default' needs no entry
    slash = _error(await c.post("/admin/tenants", json={"id": "a/b", "tier": "free"}), 400)
    assert slash["param"] == "id"
    # what a name is in words, not pydantic's "String should match pattern '^[A-Za-z0-9]..."
    assert slash["message"] == ("id: 'a/b' is not a name: 1 to 64 letters, digits, '.', '_' "
                                "or '-', starting with a letter or digit")
    assert (
        _error(
            await c.post("/admin/tenants", json={"id": "x", "tier": "free", "limits": {"rpm": 0}}),
            400,
        )["param"]
        == "limits.rpm"
    )
    for body in (b"{not json", b'{"id": "x", "tier":'):
        bad_json = _error(await c.post("/admin/tenants", content=body), 400)
        assert bad_json["message"] == "The request body is not valid JSON." \
            and bad_json["param"] is None, bad_json  # not "6: JSON decode error", param "6"
    empty = _error(await c.post("/admin/tenants"), 400)
    assert "request body" in empty["message"] and empty["param"] is None, empty
    r = await c.patch(
        "/admin/tenants/acme", json={"tier": "free", "limits": {"tpm": 5}, "salt_group": None}
    )
    assert r.status_code == 200, r.text
    assert r.json()["limits"] == {"rpm": 100, "tpm": 5} and r.json()["salt_group"] is None
    own = r.json()["salt_epoch"]  # out of its group: its own epoch, fresh at its creation
    assert own >= FRESH_EPOCH_MIN
    assert _error(await c.patch("/admin/tenants/acme", json={"salt_epoch": 3}), 400)
    assert _error(await c.patch("/admin/tenants/nope", json={"tier": "free"}), 404)
    listed = (await c.get("/admin/tenants")).json()
    assert listed["object"] == "list" and [t["id"] for t in listed["data"]] == ["acme"]
    r = await c.post("/admin/tenants/acme/rotate-salt")
    assert r.json() == {"object": "tenant", "id": "acme", "tier": "free",
                        "limits": {"rpm": 100, "tpm": 5}, "salt_group": None,
                        "salt_epoch": own + 1,
                        "keys": [], "scope": "tenant"}
    assert (await c.delete("/admin/tenants/acme")).status_code == 204
    assert _error(await c.get("/admin/tenants/acme"), 404)
    assert _error(await c.delete("/admin/tenants/acme"), 404)


async def test_every_route_shows_a_tenant_the_same_way(admin: Admin) -> None:
    """Create, get, update, list and rotate-salt answer one tenant object: create answered
    `keys: []` while update and list had no `keys` at all, and a grouped tenant's
    `salt_epoch` was its own unused one (0) where rotate-salt answered its group's."""
    c = admin.client
    created = (await c.post("/admin/tenants", json={"id": "acme", "tier": "free",
                                                    "salt_group": "pub"})).json()
    key = (await c.post("/admin/tenants/acme/keys")).json()
    assert set(key) == {"object", "id", "tenant", "created_at", "key"}
    shown_key = {k: v for k, v in key.items() if k != "key"}
    rotated = (await c.post("/admin/tenants/acme/rotate-salt")).json()
    assert rotated.pop("scope") == "group" and rotated["salt_epoch"] == 1
    got = (await c.get("/admin/tenants/acme")).json()
    patched = (await c.patch("/admin/tenants/acme", json={"limits": {"rpm": 7}})).json()
    listed = (await c.get("/admin/tenants")).json()["data"]
    assert created["keys"] == [] and set(created) == set(got)
    for view in (rotated, got, patched, *listed):
        assert set(view) == set(created), view
        assert view["keys"] == [shown_key] and view["salt_epoch"] == 1, view
    assert patched == {**got, "limits": {"rpm": 7}} == listed[0]


async def test_key_lifecycle(admin: Admin) -> None:
    c = admin.client
    await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    r = await c.post("/admin/tenants/acme/keys")
    assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    created = r.json()
    key, key_id = created["key"], created["id"]
    assert key.startswith("kvg-") and len(key) >= 4 + 43
    shown = (await c.get("/admin/tenants/acme")).text
    assert key_id in shown and key not in shown
    assert _error(await c.post("/admin/tenants/ghost/keys"), 404)
    assert (await c.delete(f"/admin/tenants/acme/keys/{key_id}")).status_code == 204
    assert _error(await c.delete(f"/admin/tenants/acme/keys/{key_id}"), 404)["param"] == "key_id"


async def test_policy_get_put_with_if_match(admin: Admin) -> None:
    c = admin.client
    r = await c.get("/admin/policy")
    assert r.status_code == 200 and r.headers["etag"] == '"1"'
    doc = r.json()
    assert doc["models"] == POLICY_DOC["models"]
    doc["tiers"]["free"]["limits"]["rpm"] = 30
    r = await c.put("/admin/policy", json=doc, headers={"if-match": '"1"'})
    assert r.status_code == 200 and r.headers["etag"] == '"2"'
    assert _error(await c.put("/admin/policy", json=doc, headers={"if-match": '"1"'}), 412)
    assert _error(await c.put("/admin/policy", json=doc, headers={"if-match": "x"}), 400)
    bad = {**doc, "models": {"llama-70b": {"premium": "fp9"}}}
    err = _error(await c.put("/admin/policy", json=bad), 400)
    assert err["param"] == "models.llama-70b.premium" and "fp9" in err["message"]
    await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    no_free = {
        **doc,
        "models": {"llama-70b": {"premium": "fp8"}},
        "tiers": {"premium": doc["tiers"]["premium"]},
    }
    assert _error(await c.put("/admin/policy", json=no_free), 400)["param"] == "tiers"
    empties: list[dict[str, Any]] = [{}, {"pools": {}, "models": {}}]
    for empty in empties:  # would leave no model served
        assert _error(await c.put("/admin/policy", json=empty), 400)["param"] == "pools"
    assert (await c.get("/admin/policy")).headers["etag"] == '"2"'


async def test_policy_patch_merges_into_the_policy_in_force(admin: Admin) -> None:
    """PATCH /admin/policy is a JSON merge patch (RFC 7396) on the stored document: what it
    names changes, the rest stays; null removes a key; the result is validated as a PUT is."""
    c = admin.client
    r = await c.patch("/admin/policy", json={"tiers": {"free": {"limits": {"rpm": 30}}}},
                      headers={"if-match": '"1"'})
    assert r.status_code == 200 and r.headers["etag"] == '"2"', r.text
    doc = r.json()
    assert doc["tiers"]["free"]["limits"] == {"rpm": 30, "max_concurrency": 4}
    assert doc["tiers"]["free"]["priority"] == 10
    assert doc["pools"] == POLICY_DOC["pools"] and doc["models"] == POLICY_DOC["models"]
    assert (await c.get("/admin/policy")).json() == doc
    stale = await c.patch("/admin/policy", json={"tiers": {"free": {"priority": 1}}},
                          headers={"if-match": '"1"'})
    assert _error(stale, 412)
    merge = {"content-type": "application/merge-patch+json"}  # the RFC's media type
    r = await c.patch("/admin/policy", content=b'{"tiers": {"premium": {"spill_to": null}}}',
                      headers=merge)
    assert r.status_code == 200 and "spill_to" not in r.json()["tiers"]["premium"], r.text
    bad = await c.patch("/admin/policy", json={"models": {"llama-70b": {"free": "fp9"}}})
    assert _error(bad, 400)["param"] == "models.llama-70b.free"
    await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    in_use = await c.patch("/admin/policy", json={"tiers": {"free": None},
                                                  "models": {"llama-70b": {"free": None}}})
    assert _error(in_use, 400)["param"] == "tiers"
    assert _error(await c.patch("/admin/policy", json=[1]), 400)
    assert (await c.get("/admin/policy")).headers["etag"] == '"3"'
    entries = (await c.get("/admin/audit", params={"limit": 10})).json()["data"]
    patched = [e["detail"]["version"] for e in entries if e["action"] == "policy.patch"]
    assert patched == [3, 2]


async def test_audit_replicas_explain_and_openapi(admin: Admin) -> None:
    c = admin.client
    await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    key = (await c.post("/admin/tenants/acme/keys")).json()["key"]
    await c.post("/admin/tenants/acme/rotate-salt")
    r = await c.get("/admin/audit", params={"limit": 10})
    entries = r.json()["data"]
    assert [e["action"] for e in entries] == ["tenant.rotate_salt", "key.create", "tenant.create"]
    assert {e["who"] for e in entries} == {"ops"}
    for entry in entries:  # ISO 8601 in UTC, and now
        at = datetime.fromisoformat(entry["at"])
        assert entry["at"].endswith("Z") and abs(at.timestamp() - time.time()) < 600
    assert key not in r.text
    assert (await c.get("/admin/replicas")).json()["data"] == [{"id": "fp8/a"}]
    r = await c.post("/admin/route/explain", json={"model": "llama-70b", "messages": []})
    assert r.json()["pool"] == "fp8"
    # the documented `curl -d '{...}'` (README, docs/flow-control.md): a JSON body sent with
    # curl's form content type
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = await c.post("/admin/route/explain", headers=form,
                     content=b'{"model": "llama-70b", "messages": []}')
    assert r.status_code == 200 and r.json()["pool"] == "fp8", r.text
    spec = (await c.get("/openapi.json")).json()
    assert {"/admin/tenants", "/admin/policy", "/admin/audit"} <= set(spec["paths"])


async def test_keys_salts_and_secrets_never_leak(
    admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    """Everything an operator or a log reader can see, except the one key-creation answer."""
    caplog.set_level(logging.DEBUG)
    c = admin.client
    seen: list[str] = []
    for path, body in [
        ("/admin/tenants", {"id": "acme", "tier": "free"}),
        ("/admin/tenants/acme/rotate-salt", None),
    ]:
        seen.append((await c.post(path, json=body)).text)
    created = await c.post("/admin/tenants/acme/keys")
    key = created.json()["key"]
    salts = SaltDeriver(SECRET)
    resolver = TenantResolver(admin.store, salts)
    await resolver.start()
    try:
        principal = resolver.authenticate(key)
        for path in ("/admin/tenants", "/admin/tenants/acme", "/admin/audit", "/admin/policy"):
            r = await c.get(path)
            seen.append(r.text + str(dict(r.headers)))
        seen.append(
            (await c.get("/admin/tenants", headers={"authorization": f"Bearer {key}"})).text
        )
        for bad in (key + "x", None):
            try:
                resolver.authenticate(bad)
            except Exception as exc:
                seen.append(repr(exc) + str(getattr(exc, "to_dict", dict)()))
        seen += [repr(principal), str(principal), repr(salts), repr(resolver.health())]
    finally:
        await resolver.close()
    seen.append(caplog.text)
    blob = "\n".join(seen)
    for secret in (key, principal.cache_salt, SECRET, ADMIN_TOKEN):
        assert secret not in blob


async def test_limits_are_positive_integers_within_bounds(admin: Admin) -> None:
    """Before: `true` was read as 1 (a tenant limited to 1 request a minute) and any size
    was stored; from 10**309 (a float infinity in the admission's arithmetic) every request
    of the tenant was a 500, and above 2**53 `x-ratelimit-remaining` exceeded the limit."""
    c = admin.client
    for limit in (True, 10**12 + 1, 10**400):
        err = _error(await c.post("/admin/tenants", json={
            "id": "acme", "tier": "free", "limits": {"rpm": limit}}), 400)
        assert err["param"] == "limits.rpm", err
    await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    big = await c.patch("/admin/tenants/acme", json={"limits": {"tpm": 10**12}})
    assert big.status_code == 200 and big.json()["limits"] == {"tpm": 10**12}, big.text
    err = _error(await c.patch("/admin/tenants/acme", json={"limits": {"tpm": 10**13}}), 400)
    assert err["param"] == "limits.tpm"
    patch = {"tiers": {"free": {"limits": {"max_concurrency": False}}}}
    err = _error(await c.patch("/admin/policy", json=patch), 400)
    assert err["param"] == "tiers.free.limits.max_concurrency", err


# a number or boolean of the policy document sent as a string, and where the 400 points
QUOTED = {
    "tier limit": ({"tiers": {"free": {"limits": {"rpm": "60"}}}}, "tiers.free.limits.rpm"),
    # equal to the stored 60 and 10 as Python compares them: a patch that changed nothing was
    # answered 200 before it was validated
    "the stored limit as a float": ({"tiers": {"free": {"limits": {"rpm": 60.0}}}},
                                    "tiers.free.limits.rpm"),
    "the stored priority as a float": ({"tiers": {"free": {"priority": 10.0}}},
                                       "tiers.free.priority"),
    "tier priority": ({"tiers": {"free": {"priority": "5"}}}, "tiers.free.priority"),
    "operator fields": ({"tiers": {"free": {"operator_fields": "true"}}},
                        "tiers.free.operator_fields"),
    "spill threshold": ({"tiers": {"free": {"spill_when": {"waiting": "8", "kv_usage": 0.9}}}},
                        "tiers.free.spill_when.waiting"),
    "flow band": ({"tiers": {"free": {"flow": {"band": "1"}}}}, "tiers.free.flow.band"),
    "flow weight": ({"tiers": {"free": {"flow": {"weight": "2"}}}}, "tiers.free.flow.weight"),
    "flow wait": ({"tiers": {"free": {"flow": {"max_wait_s": "10"}}}},
                  "tiers.free.flow.max_wait_s"),
    "min share": ({"fairness": {"min_share": {"1": "0.2"}}}, "fairness.min_share.1"),
    "tenant weight": ({"fairness": {"tenants": {"acme": "2"}}}, "fairness.tenants.acme"),
    "pool priority": ({"pools": {"awq": {"priority": "true"}}}, "pools.awq.priority"),
    "priority as 1": ({"pools": {"awq": {"priority": 1}}}, "pools.awq.priority"),
}
# a pool's discovery is checked as a whole: the param is the pool, the message names the field
DNS_PORT = {"pools": {"dns": {"discovery": {"dns": {"name": "v.local", "port": "8000"}}}}}


async def test_numbers_and_booleans_sent_as_strings_are_refused(admin: Admin) -> None:
    """`"rpm": "100"` was taken as 100 (pydantic's lax mode), `"priority": "true"` as true and
    a float as an integer: every number and boolean of a tenant or the policy is now refused
    unless it is one, with a 400 naming the field; nothing is stored."""
    c = admin.client
    for limits in ({"rpm": "100"}, {"tpm": "5000"}, {"max_concurrency": "4"}, {"rpm": 10.0}):
        err = _error(await c.post("/admin/tenants", json={
            "id": "acme", "tier": "free", "limits": limits}), 400)
        assert err["param"] == f"limits.{next(iter(limits))}", err
        assert err["type"] == "BadRequestError"
    assert (await c.get("/admin/tenants/acme")).status_code == 404
    await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    err = _error(await c.patch("/admin/tenants/acme", json={"limits": {"tpm": "5"}}), 400)
    assert err["param"] == "limits.tpm"
    for patch, field in QUOTED.values():
        err = _error(await c.patch("/admin/policy", json=patch), 400)
        assert err["param"] == field and err["message"].startswith(f"{field}: "), err
    err = _error(await c.patch("/admin/policy", json=DNS_PORT), 400)
    assert err["message"].startswith("pools.dns: discovery.dns.port: "), err
    r = await c.get("/admin/policy")
    assert r.headers["etag"] == '"1"', r.text  # nothing was stored


async def test_a_null_limits_drops_every_override(admin: Admin) -> None:
    """As a null limit drops one override (the tier's limit again), `"limits": null` drops
    them all: it was a 400 naming pydantic's model ("instance of Limits")."""
    c = admin.client
    await c.post("/admin/tenants", json={"id": "acme", "tier": "free",
                                         "limits": {"rpm": 5, "tpm": 9}})
    r = await c.patch("/admin/tenants/acme", json={"limits": None})
    assert r.status_code == 200 and r.json()["limits"] == {}, r.text
    assert (await c.get("/admin/tenants/acme")).json()["limits"] == {}


async def test_concurrent_policy_patches_through_two_gateways_all_land(
    shared_redis: str,
) -> None:
    """Two gateways (two stores on one redis-server) PATCH the policy at once, without
    If-Match: each patch is merged onto the version in force and none is lost. Before, a
    patch whose read was overtaken by another write got 412 "policy version is N, not M"
    for a version its client never sent."""
    namespace = f"t{secrets.token_hex(4)}"
    stores = [RedisStore(connect_redis(shared_redis, timeout_s=5), namespace=namespace)
              for _ in range(2)]
    await stores[0].put_policy(parse_policy(POLICY_DOC))
    tokens = [AdminToken("ops", ADMIN_TOKEN)]
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    servers = [serve_admin(store, tokens) for store in stores]
    try:
        urls = [await anext(server) for server in servers]
        async with httpx.AsyncClient(headers=headers) as c:
            for n in range(10):  # patches in step kept overtaking one: 2-10 409s in 30 rounds
                answers = await asyncio.gather(*(
                    c.patch(f"{urls[i % 2]}/admin/policy",
                            json={"models": {f"m{n}-{i}": {"free": "awq"}}}) for i in range(16)))
                assert [r.status_code for r in answers] == [200] * 16, [r.text for r in answers]
            doc = (await c.get(f"{urls[0]}/admin/policy")).json()
        assert {f"m{n}-{i}" for n in range(10) for i in range(16)} <= set(doc["models"])
    finally:
        for server in servers:
            await server.aclose()
        for store in stores:
            await store.close()


async def test_an_unreadable_audit_entry_is_left_out(shared_redis: str) -> None:
    """One garbage entry in the audit list made `GET /admin/audit` a 500 (plain text, the
    connection dropped after it), hiding every other entry."""
    namespace = f"t{secrets.token_hex(4)}"
    store = RedisStore(connect_redis(shared_redis, timeout_s=5), namespace=namespace)
    await store.put_policy(parse_policy(POLICY_DOC))
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    server = serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)])
    try:
        url = await anext(server)
        async with httpx.AsyncClient(base_url=url, headers=headers) as c:
            await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
            raw = redis.Redis.from_url(shared_redis)
            try:
                raw.lpush(f"{namespace}:audit", "{garbage")
            finally:
                raw.close()
            await c.post("/admin/tenants/acme/rotate-salt")
            r = await c.get("/admin/audit")
            assert r.status_code == 200, r.text
            assert [e["action"] for e in r.json()["data"]] == [
                "tenant.rotate_salt", "tenant.create"]
    finally:
        await server.aclose()
        await store.close()


async def test_a_fault_inside_the_admin_api_is_an_openai_shaped_500() -> None:
    """A kvgate fault behind a route (here the doctor's) is a JSON 500 without the traceback
    (the log has it), and the connection stays usable."""

    def broken(window_s: float) -> Any:
        raise RuntimeError("secret detail of the fault")

    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    async for url in serve_admin(InMemoryStore(), [AdminToken("ops", ADMIN_TOKEN)],
                                 doctor=broken):
        async with httpx.AsyncClient(base_url=url, headers=headers) as c:
            r = await c.get("/admin/doctor")
            err = _error(r, 500)
            assert err["type"] == "InternalServerError" and "secret" not in r.text, r.text
            assert (await c.get("/admin/tenants")).status_code == 200  # same connection


async def test_a_body_that_is_not_utf8_is_a_400_not_a_500(admin: Admin) -> None:
    """FastAPI refuses a body it cannot decode with its own 400; the catch-all for kvgate's
    faults took it for one (a 500, and a traceback in the log for the client's mistake)."""
    for method, path in (("POST", "/admin/tenants"), ("PATCH", "/admin/policy")):
        r = await admin.client.request(method, path, content=b'{"id": "\xff\xfe"}',
                                       headers={"content-type": "application/json"})
        err = _error(r, 400)
        assert err["type"] == "BadRequestError" and "UTF-8" in err["message"], err
    assert await admin.store.list_tenants() == []


async def test_a_policy_kvgate_could_not_serve_is_refused(admin: Admin) -> None:
    """A tier's priority past 64 bits was stored, then every request of the tier was a 500
    (the body rewrite cannot write it); a tier name no tenant can take (empty, or past the 64
    characters of a tenant's tier) was stored too."""
    c = admin.client
    for priority in (2**63, -(2**63) - 1, 10**400):
        err = _error(await c.patch("/admin/policy", json={
            "tiers": {"premium": {"priority": priority}}}), 400)
        assert err["param"] == "tiers.premium.priority", err
    for name in ("", "t" * 65):
        assert _error(await c.patch("/admin/policy", json={"tiers": {name: {}}}), 400)
    ok = await c.patch("/admin/policy", json={"tiers": {"t" * 64: {"priority": -(2**63)}}})
    assert ok.status_code == 200, ok.text
    assert (await c.post("/admin/tenants", json={"id": "a", "tier": "t" * 64})).status_code == 201


async def test_a_public_model_name_no_request_can_name_is_refused(admin: Admin) -> None:
    """An empty public model name was stored: no request can name it (its `model` must be a
    non-empty string), so the operator's alias was dead without a word."""
    err = _error(await admin.client.patch("/admin/policy", json={
        "models": {"": {"free": "awq"}}}), 400)
    assert err["param"] == "models", err
    assert "" not in (await admin.client.get("/admin/policy")).json()["models"]


async def test_an_infinite_threshold_is_refused_not_stored_unreadable(admin: Admin) -> None:
    """`Infinity` (Python's JSON parser takes it) was accepted as a spill threshold and stored
    as null: the stored policy was then unreadable on every gateway."""
    c = admin.client
    body = b'{"tiers": {"free": {"spill_when": {"waiting": Infinity, "kv_usage": 0.5}}}}'
    err = _error(await c.patch("/admin/policy", content=body), 400)
    assert err["param"] == "tiers.free.spill_when.waiting", err
    r = await c.get("/admin/policy")
    assert r.status_code == 200 and r.headers["etag"] == '"1"', r.text  # still readable


async def test_routes_without_a_body_refuse_fields_rather_than_ignore_them(
    admin: Admin,
) -> None:
    """Key creation and salt rotation ignored whatever body came (`{"name": "ci"}` looked
    kept); every other route refuses an unknown field with a 400 naming it."""
    c = admin.client
    created = await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    for path in ("/admin/tenants/acme/keys", "/admin/tenants/acme/rotate-salt"):
        err = _error(await c.post(path, json={"name": "ci"}), 400)
        assert err["param"] == "name" and err["message"].startswith("name: "), err
        assert _error(await c.post(path, json=["x"]), 400)["param"] is None
        assert (await c.post(path, json={})).status_code in (200, 201)
    tenant = (await c.get("/admin/tenants/acme")).json()
    assert len(tenant["keys"]) == 1  # the `{}` ones only
    assert tenant["salt_epoch"] == created.json()["salt_epoch"] + 1


async def test_an_empty_patch_changes_nothing_and_is_not_audited(admin: Admin) -> None:
    """`PATCH {}` wrote the tenant back, and stored the policy as a new version, each with an
    audit entry for a change that changed nothing: it answers the object as it is."""
    c = admin.client
    created = (await c.post("/admin/tenants", json={"id": "acme", "tier": "free"})).json()
    before = (await c.get("/admin/audit")).json()["data"]
    r = await c.patch("/admin/tenants/acme", json={})
    assert r.status_code == 200 and r.json() == created, r.text
    assert _error(await c.patch("/admin/tenants/ghost", json={}), 404)["param"] == "id"
    for patch in ({}, {"tiers": {"free": {"priority": 10}}}):  # the second: a value it has
        r = await c.patch("/admin/policy", json=patch)
        assert r.status_code == 200 and r.headers["etag"] == '"1"', r.text
        assert r.json() == (await c.get("/admin/policy")).json()
    assert _error(await c.patch("/admin/policy", json={}, headers={"if-match": '"7"'}), 412)
    assert (await c.get("/admin/audit")).json()["data"] == before


async def test_a_tenant_created_without_a_tier_gets_the_default_tier(admin: Admin) -> None:
    """`tier` is optional in `POST /admin/tenants` (as in the config's `tenants`): without
    it the create was a 500 (the dump that keeps only the fields sent left `tier` out)."""
    c = admin.client
    for body in ({"id": "solo"}, {"id": "grouped", "salt_group": "team"}):
        r = await c.post("/admin/tenants", json=body)
        assert r.status_code == 201, r.text
        assert r.json()["tier"] == "default", r.text
    assert (await c.get("/admin/tenants/grouped")).json()["salt_group"] == "team"


async def test_a_patch_with_the_values_a_tenant_has_is_not_a_change(admin: Admin) -> None:
    """A PATCH whose values equal the tenant's (its tier, a limit it has, a limit it does not
    override dropped, its group) was written back, bumping the store's generation (every
    gateway reloads) and audited as a change: it is answered as the tenant is. Validation
    still comes first, and a real change among them is written and audited once."""
    c = admin.client
    created = (await c.post("/admin/tenants", json={
        "id": "acme", "tier": "premium", "limits": {"rpm": 100}, "salt_group": "pub"})).json()
    before = (await c.get("/admin/audit")).json()["data"]
    generation = await admin.store.generation()
    for patch in ({"tier": "premium"}, {"limits": {"rpm": 100}}, {"limits": {"tpm": None}},
                  {"salt_group": "pub"},
                  {"tier": "premium", "limits": {"rpm": 100, "max_concurrency": None},
                   "salt_group": "pub"}):
        r = await c.patch("/admin/tenants/acme", json=patch)
        assert r.status_code == 200 and r.json() == created, (patch, r.text)
    assert (await c.get("/admin/audit")).json()["data"] == before
    assert await admin.store.generation() == generation
    assert _error(await c.patch("/admin/tenants/acme", json={"tier": "gold"}), 400)["param"] \
        == "tier"
    assert _error(await c.patch("/admin/tenants/ghost", json={"tier": "premium"}), 404)
    r = await c.patch("/admin/tenants/acme", json={"tier": "premium", "limits": {"rpm": 50}})
    assert r.status_code == 200 and r.json()["limits"] == {"rpm": 50}
    after = (await c.get("/admin/audit")).json()["data"]
    assert len(after) == len(before) + 1
    assert after[0]["action"] == "tenant.update" and after[0]["detail"]["fields"] == ["limits"]


async def test_tenants_are_listed_in_pages(admin: Admin) -> None:
    """`GET /admin/tenants` answered every tenant at once, keys included: `limit` (1-1000,
    100 by default) and `after` (the last id of the previous page) page through them in id
    order, as OpenAI's lists do (`has_more`, `first_id`, `last_id`)."""
    c = admin.client
    ids = [f"t{i:02d}" for i in range(7)]
    for tid in reversed(ids):
        assert (await c.post("/admin/tenants", json={"id": tid, "tier": "free"})).status_code \
            == 201
    key = (await c.post("/admin/tenants/t03/keys")).json()
    seen: list[str] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 3, **({"after": after} if after else {})}
        page = (await c.get("/admin/tenants", params=params)).json()
        assert page["object"] == "list" and len(page["data"]) <= 3
        seen += [t["id"] for t in page["data"]]
        if page["data"]:
            assert (page["first_id"], page["last_id"]) == (page["data"][0]["id"],
                                                           page["data"][-1]["id"])
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids
    whole = (await c.get("/admin/tenants")).json()  # 100 by default: all of these
    assert [t["id"] for t in whole["data"]] == ids and whole["has_more"] is False
    t03 = next(t for t in whole["data"] if t["id"] == "t03")
    assert [k["id"] for k in t03["keys"]] == [key["id"]]
    # a cursor that is no tenant (deleted since) still pages on from where it sorts
    page = (await c.get("/admin/tenants", params={"after": "t025", "limit": 2})).json()
    assert [t["id"] for t in page["data"]] == ["t03", "t04"] and page["has_more"] is True
    last = (await c.get("/admin/tenants", params={"after": "t06"})).json()
    assert last["data"] == [] and last["has_more"] is False
    assert last["first_id"] is None and last["last_id"] is None


@pytest.mark.parametrize(("params", "param"), [
    ({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"limit": "ten"}, "limit"),
    ({"limit": ""}, "limit"), ({"after": ""}, "after"), ({"after": "-x"}, "after"),
    ({"after": "a" * 65}, "after"), ({"after": "a/b"}, "after"),
])
async def test_bad_paging_values_are_400s(
    admin: Admin, params: dict[str, Any], param: str
) -> None:
    err = _error(await admin.client.get("/admin/tenants", params=params), 400)
    assert err["param"] == param and err["type"] == "BadRequestError", err


async def test_pages_go_past_unreadable_tenant_records(shared_redis: str) -> None:
    """Unreadable records are left out of a page: a page whose records were all unreadable
    came back empty with `has_more` true and `last_id` null, so a client (and `kvgate admin
    tenants list`) could not page past them, and the tenants after them were never listed."""
    namespace = f"t{secrets.token_hex(4)}"
    store = RedisStore(connect_redis(shared_redis, timeout_s=5), namespace=namespace)
    await store.put_policy(parse_policy(POLICY_DOC))
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    server = serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)])
    try:
        url = await anext(server)
        async with httpx.AsyncClient(base_url=url, headers=headers) as c:
            for tid in ("t0", "t3", "t4"):
                await c.post("/admin/tenants", json={"id": tid, "tier": "free"})
            raw = redis.Redis.from_url(shared_redis)
            try:  # written by hand, or by a kvgate whose records this one cannot read
                raw.hset(f"{namespace}:tenants", mapping={"t1": "{garbage", "t2": "[]"})
            finally:
                raw.close()
            seen: list[str] = []
            after: str | None = None
            for _ in range(5):
                params: dict[str, Any] = {"limit": 2, **({"after": after} if after else {})}
                page = (await c.get("/admin/tenants", params=params)).json()
                seen += [t["id"] for t in page["data"]]
                if not page["has_more"]:
                    break
                assert page["last_id"] is not None, page
                after = page["last_id"]
            assert seen == ["t0", "t3", "t4"]
    finally:
        await server.aclose()
        await store.close()


async def test_a_key_sent_twice_in_one_object_is_a_400_naming_it(admin: Admin) -> None:
    """`{"id": "a", "id": "b"}` created tenant `b`: the parser kept the last value without a
    word, where a proxy or an operator reading the call may take the first."""
    c = admin.client
    for method, path, body, param in (
        ("POST", "/admin/tenants", b'{"id": "dup1", "id": "dup2", "tier": "free"}', "id"),
        ("POST", "/admin/tenants",
         b'{"id": "dup3", "tier": "free", "limits": {"rpm": 5, "rpm": 500}}', "rpm"),
        ("PATCH", "/admin/policy",
         b'{"tiers": {"free": {"priority": 1}}, "tiers": {}}', "tiers"),
        ("PUT", "/admin/policy", b'{"pools": {}, "pools": {}}', "pools"),
    ):
        r = await c.request(method, path, content=body)
        err = _error(r, 400)
        assert err["param"] == param and "twice" in err["message"], err
    assert await admin.store.list_tenants() == []
    assert (await c.get("/admin/policy")).headers["etag"] == '"1"'
    r = await c.post("/admin/tenants", content=b'{"id": "ok", "tier": "free", "limits": {}}')
    assert r.status_code == 201, r.text  # the same key in two objects is no duplicate
    # route explain dry-runs an OpenAI request as the proxy reads it: the last value wins
    r = await c.post("/admin/route/explain",  # (this test's explainer answers its "model")
                     content=b'{"tier": "free", "model": "a", "model": "llama-70b"}')
    assert r.status_code == 200 and r.json()["model"] == "llama-70b", r.text


async def test_a_key_id_no_key_can_have_is_refused_not_echoed(admin: Admin) -> None:
    """A 60,000-character key id was echoed whole in the 404."""
    await admin.client.post("/admin/tenants", json={"id": "acme", "tier": "free"})
    r = await admin.client.delete("/admin/tenants/acme/keys/" + "k" * 60_000)
    assert _error(r, 400)["param"] == "key_id"
    assert len(r.content) < 1000, len(r.content)


async def test_a_public_model_name_past_the_shown_length_is_refused(admin: Admin) -> None:
    """A 5,000-character public model name was stored; names up to `NAME_CHARS` are kept."""
    c = admin.client
    pools = {"named": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}
    for name in ("é" * 5000, "m" * (NAME_CHARS + 1)):
        err = _error(await c.patch("/admin/policy", json={
            "pools": pools, "models": {name: {"default": "named"}}}), 400)
        assert err["param"] == "models" and str(NAME_CHARS) in err["message"], err
        assert len(err["message"]) < 200, err
    ok = await c.patch("/admin/policy", json={"pools": pools,
                                              "models": {"m" * NAME_CHARS: {"default": "named"}}})
    assert ok.status_code == 200, ok.text


async def test_a_number_of_too_many_digits_is_named_as_such(admin: Admin) -> None:
    """A 5,000-digit integer (past Python's limit on an integer's digits) was answered "send
    JSON text (UTF-8)", which it was."""
    for method, path in (("POST", "/admin/tenants"), ("PATCH", "/admin/policy")):
        r = await admin.client.request(method, path, content=b'{"limits": {"rpm": %s}}'
                                       % (b"9" * 5000))
        err = _error(r, 400)
        assert "digits" in err["message"] and "UTF-8" not in err["message"], err
    assert await admin.store.list_tenants() == []

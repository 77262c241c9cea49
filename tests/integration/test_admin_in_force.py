"""An admin write's answer says whether the write is in force on the gateway that answered
(`x-kvgate-in-force`): Redis gone between the write and the answering gateway's reload leaves
a revoked key working there, and the 204 used to claim otherwise. Real Redis, stopped at that
moment; the admin app over real HTTP (uvicorn on a loopback port)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.admin import AdminDeps, AdminToken, create_admin_app
from gateway.admin.writes import read_your_writes
from gateway.asgi import Receive, Scope, Send
from gateway.policy_doc import parse_policy
from gateway.tenancy import RedisStore, SaltDeriver, Tenant, TenantResolver, connect_redis
from tests.support.procs import Proc, free_port, redis_proc

TOKEN = "in-force-admin-token-0123456789"
POLICY = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
                       "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}})


class StopRedisBeforeAnswer:
    """Once armed, stops Redis when the admin app starts a successful answer: after the
    write, before the reload `read_your_writes` makes before passing the answer on."""

    def __init__(self, app: Any, redis: Proc) -> None:
        self.app, self.redis, self.armed = app, redis, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stopping(message: dict[str, Any]) -> None:
            if self.armed and message["type"] == "http.response.start" \
                    and message["status"] < 400:
                self.armed = False
                await asyncio.to_thread(self.redis.stop)
            await send(message)

        await self.app(scope, receive, stopping)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, TenantResolver, StopRedisBeforeAnswer]]:
    redis, url = redis_proc()
    with redis:
        store = RedisStore(connect_redis(url, timeout_s=5), namespace="inforce")
        await store.put_policy(POLICY)
        await store.create_tenant(Tenant(id="acme", tier="free"))
        resolver = TenantResolver(store, SaltDeriver("in-force-salt-secret-0123456789"))
        assert await resolver.refresh()  # loaded (no background sync: nothing races the test)
        fault = StopRedisBeforeAnswer(
            create_admin_app(AdminDeps(store, [AdminToken("ops", TOKEN)])), redis)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(
            read_your_writes(fault, resolver.refresh), host="127.0.0.1", port=port,
            log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve())
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes no started event
                await asyncio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}", resolver, fault
        finally:
            server.should_exit = True
            await task
            await store.close()


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gateway.admin.writes"]


async def test_a_write_not_in_force_on_the_answering_gateway_says_so(
    served: tuple[str, TenantResolver, StopRedisBeforeAnswer], caplog: pytest.LogCaptureFixture,
) -> None:
    base, resolver, fault = served
    caplog.set_level(logging.WARNING, logger="gateway.admin.writes")
    headers = {"authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=10) as admin:
        made = await admin.post("/admin/tenants/acme/keys")
        assert made.status_code == 201 and made.headers["x-kvgate-in-force"] == "true"
        key = made.json()["key"]
        assert resolver.authenticate(key).tenant_id == "acme"  # in force: the key works here
        assert _said(caplog) == []

        fault.armed = True
        revoked = await admin.delete(f"/admin/tenants/acme/keys/{made.json()['id']}")
        assert revoked.status_code == 204  # stored: Redis ran the revocation
        assert revoked.headers["x-kvgate-in-force"] == "false"
        assert resolver.authenticate(key).tenant_id == "acme"  # still works on this gateway
        assert _said(caplog) == [
            "admin write stored but not in force on this gateway yet: the tenancy store did "
            "not answer the reload after it (in force once it answers; the answer says "
            "x-kvgate-in-force: false)"]


async def test_the_admin_cli_warns_when_a_write_is_not_in_force(
    served: tuple[str, TenantResolver, StopRedisBeforeAnswer],
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gateway.cli import main

    base, _, fault = served
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", TOKEN)
    assert await asyncio.to_thread(main, ["admin", "--url", base, "keys", "create", "acme"]) == 0
    made = capsys.readouterr()
    assert "not in force" not in made.err
    fault.armed = True
    key_id = json.loads(made.out)["id"]
    assert await asyncio.to_thread(
        main, ["admin", "--url", base, "keys", "revoke", "acme", key_id]) == 0
    said = capsys.readouterr().err
    assert "warning: stored, but the answering gateway could not reload it" in said, said

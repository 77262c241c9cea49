"""A replica on loopback whose chat answers a test writes (an aiohttp app on its own thread):
`/v1/models` serves model ``m``, `/health` and `/metrics` answer empty, and every POST to
`/v1/chat/completions` goes to the subclass's `_post`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Self

from aiohttp import web

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import free_port

__all__ = ["LoopReplica", "acme_gateway"]


class LoopReplica:
    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _post(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 4096}]})

    async def _empty(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._empty)
        app.router.add_get("/metrics", self._empty)
        app.router.add_post("/v1/chat/completions", self._post)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> Self:
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@contextlib.contextmanager
def acme_gateway(replica: LoopReplica, admin_token: str) -> Iterator[tuple[str, str]]:
    """A gateway with authentication in front of ``replica`` (model ``llama``): its base URL
    and a key of its one tenant, ``acme`` (salt secret `AUTH_SECRET`, salt epoch 0)."""
    config = {"pools": {"p": {"served_model": "m", "replicas": [replica.url]}},
              "models": {"llama": {"default": "p"}},
              "tenants": [{"id": "acme", "tier": "default"}]}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": admin_token})
    with gw.start(), admin_client(base, admin_token) as admin:
        yield base, admin.post("/tenants/acme/keys").json()["key"]

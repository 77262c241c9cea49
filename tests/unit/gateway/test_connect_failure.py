"""A replica whose host name does not resolve is named as such ("cannot resolve host NAME"), not as
"cannot connect", in the health monitor's "replica down" line, the proxy's "replica did not
answer" line and the pool's not-ready reason (`/readyz`, `/v1/models`). The resolver's failure
is raised through the transport seam (a real lookup would leave loopback): `socket.gaierror` as
kvgate's HTTP/1.1 client gets it from asyncio, `aiohttp.ClientConnectorDNSError` as the health
checks' aiohttp client wraps it."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from gateway.config import KvgateConfig
from gateway.health import HealthMonitor
from gateway.pool import Pools
from gateway.transport import UpstreamResponse, connect_failure

URL = "http://replica-a.svc:8000"
NO_NAME = socket.gaierror(socket.EAI_NONAME, "Name or service not known")


def _dns_error() -> aiohttp.ClientConnectorDNSError:
    key = ConnectionKey("replica-a.svc", 8000, False, True, None, None, None, None)
    return aiohttp.ClientConnectorDNSError(key, NO_NAME)


@pytest.mark.parametrize(
    ("exc", "why"),
    [
        (NO_NAME, "cannot resolve host replica-a.svc"),
        (_dns_error(), "cannot resolve host replica-a.svc"),
        (ConnectionRefusedError(111, "Connection refused"), "cannot connect"),
    ],
)
def test_connect_failure_names_an_unresolvable_host(exc: BaseException, why: str) -> None:
    assert connect_failure(exc, URL + "/health") == why


class Unresolvable:
    """A transport whose every exchange fails as a name that does not resolve fails."""

    closed = False

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    async def get(self, url: str, timeout_s: float, headers: dict[str, str]) -> tuple[int, bytes]:
        raise self._exc

    async def post(
        self, url: str, body: bytes, headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        raise self._exc

    async def open(
        self, url: str, headers: dict[str, str], method: str = "GET",
    ) -> UpstreamResponse:
        raise self._exc

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("exc", [NO_NAME, _dns_error()], ids=["gaierror", "aiohttp"])
def test_health_says_the_host_does_not_resolve(
    exc: BaseException, caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = KvgateConfig.model_validate({"pools": {"p": {"served_model": "m", "replicas": [URL]}}})

    async def run() -> None:
        pools = Pools(cfg, transport=lambda *_: Unresolvable(exc))
        try:
            await HealthMonitor(pools, cfg.health, lambda: 0.0).poll_once()
            assert pools.by_name["p"].replicas[0].state == "ejected"
            # /readyz and /v1/models name the pool as not ready, and why
            assert pools.not_ready(0.0) == {"p": "no healthy replica (replica-a.svc:8000: "
                                                 "/health: cannot resolve host replica-a.svc)"}
        finally:
            await pools.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    reasons = [getattr(r, "reason", "") for r in caplog.records
               if r.getMessage() == "replica down"]
    assert reasons == ["/health: cannot resolve host replica-a.svc"]


def test_a_pool_without_replicas_says_so() -> None:
    """Discovery that found none (or a relist that left none): the reason said "no healthy
    replica", as if some were there and down."""
    cfg = KvgateConfig.model_validate({"pools": {
        "p": {"served_model": "m", "discovery": {"dns": {"name": "vllm.svc"}}},
        "q": {"discovery": {"dns": {"name": "vllm-q.svc"}}}}})

    async def run() -> None:
        pools = Pools(cfg, transport=lambda *_: Unresolvable(NO_NAME))
        try:
            assert pools.not_ready(0.0) == {"p": "no replica listed or discovered",
                                            "q": "no replica listed or discovered"}
        finally:
            await pools.close()

    asyncio.run(run())

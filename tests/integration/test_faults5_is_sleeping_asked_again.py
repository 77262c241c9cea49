"""A replica without vLLM's dev-mode `/is_sleeping` (404) that gains it without ever being
found down (restarted in dev mode between two health probes, or its dev mode turned on
behind a proxy): its `/is_sleeping` is asked again in time, so an engine put to sleep there
is taken out. Before, a 404 meant never asking again until the replica was found down: its
requests waited, unanswered, for their first-byte timeout while it slept. A loopback replica
with no `vllm:*` series (``--disable-log-stats``), a real gateway.
"""

from __future__ import annotations

import threading

from aiohttp import web

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.loop_replica import LoopReplica


class DevModeLater(LoopReplica):
    """Answers `/is_sleeping` 404 until `dev` is set, then ``{"is_sleeping": true}``."""

    def __init__(self) -> None:
        super().__init__()
        self.dev = threading.Event()
        self.asked_404 = threading.Event()

    async def _is_sleeping(self, _: web.Request) -> web.Response:
        if not self.dev.is_set():
            self.asked_404.set()
            return web.Response(status=404, text='{"detail":"Not Found"}')
        return web.json_response({"is_sleeping": True})

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._empty)
        app.router.add_get("/metrics", self._empty)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()


def _healthy(base: str) -> float:
    return sum(metric_values(base, "kvgate_replica_healthy").values())


def test_a_replica_that_gains_is_sleeping_is_asked_again() -> None:
    with DevModeLater() as replica:
        gw, base = gateway_proc(config={"pools": {"p": {"served_model": "m",
                                                        "replicas": [replica.url]}}},
                                env={"KVGATE_HEALTH__INTERVAL_S": "0.2"})
        with gw.start():
            assert replica.asked_404.wait(30)
            assert _healthy(base) == 1
            replica.dev.set()  # its engine now sleeps, and says so
            wait_for(lambda: _healthy(base) == 0, timeout=30, what="taken out asleep")

"""vLLM's development-mode routes (``VLLM_SERVER_DEV_MODE=1``) the simulator serves: sleep
mode (``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``) and ``POST
/reset_prefix_cache``. Asleep, the engine schedules nothing (a request waits for the wake-up)
and its KV cache is discarded, so after waking its prefix cache is empty, as vLLM's; the
simulator keeps the blocks of requests already running (vLLM would recompute them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from loadtest.sim.asgi import Receive, Scope, Send, send_bytes, send_json
from loadtest.sim.errors import SimError

if TYPE_CHECKING:
    from loadtest.sim.app import Handler, SimApp

__all__ = ["DevRoutes"]

_EMPTY = (b"content-type", b"application/json")


class DevRoutes:
    def __init__(self, app: SimApp) -> None:
        self.app = app

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {("POST", "/sleep"): self._sleep, ("POST", "/wake_up"): self._wake_up,
                ("GET", "/is_sleeping"): self._is_sleeping,
                ("POST", "/reset_prefix_cache"): self._reset_prefix_cache}

    def _set_sleep(self, level: int) -> None:
        self.app.faults.sleeping = level
        for runner in self.app.runners:
            runner.hold(self.app.faults.engine_held)
        if level:
            for engine in self.app.engines:
                engine.cache.discard()

    async def _sleep(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope["query_string"].decode("latin-1"))
        raw = query.get("level", ["1"])[0]
        if raw not in ("1", "2"):
            raise SimError(400, f"Invalid sleep level {raw!r}: 1 or 2.")
        self._set_sleep(int(raw))
        await send_bytes(send, 200, b"", _EMPTY)

    async def _wake_up(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._set_sleep(0)
        await send_bytes(send, 200, b"", _EMPTY)

    async def _is_sleeping(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"is_sleeping": self.app.faults.sleeping > 0})

    async def _reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        for engine in self.app.engines:
            engine.cache.discard()
        await send_bytes(send, 200, b"", _EMPTY)

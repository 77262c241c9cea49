"""The simulator's own test hooks: `/sim/faults`, `/sim/requests`, `/sim/stats` (not vLLM's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from loadtest.sim.asgi import Receive, Scope, Send, read_body, send_json
from loadtest.sim.errors import SimError

if TYPE_CHECKING:
    from loadtest.sim.app import Handler, SimApp

__all__ = ["SimControl"]


class SimControl:
    def __init__(self, app: SimApp) -> None:
        self.app = app

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {("GET", "/sim/faults"): self._get_faults,
                ("POST", "/sim/faults"): self._set_faults,
                ("GET", "/sim/requests"): self._get_requests,
                ("DELETE", "/sim/requests"): self._clear_requests,
                ("GET", "/sim/stats"): self._stats}

    async def _get_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, self.app.faults.to_dict())

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        try:
            changes = orjson.loads(body or b"{}")
            if not isinstance(changes, dict):
                raise ValueError("the body must be a JSON object")
            self.app.faults.update(changes)
        except (ValueError, orjson.JSONDecodeError) as exc:
            raise SimError(400, str(exc)) from None
        for runner in self.app.runners:
            runner.hold(self.app.faults.engine_held)
        if self.app.faults.sleeping:  # asleep: its KV cache discarded, as vLLM's sleep mode
            for engine in self.app.engines:
                engine.cache.discard()
        if self.app.faults.dead or self.app.faults.drop_connections:
            for runner in self.app.runners:
                runner.abort_all()
        await send_json(send, 200, self.app.faults.to_dict())

    async def _get_requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
        n = int(query.get("n", "0") or 0) if query.get("n", "").isdigit() else 0
        items = list(self.app.requests)[-n:] if n > 0 else list(self.app.requests)
        await send_json(send, 200, {"requests": items})

    async def _clear_requests(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.app.requests.clear()
        await send_json(send, 200, {"requests": []})

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = [e.stats for e in self.app.engines]

        def total(name: str) -> int:
            return sum(int(getattr(s, name)) for s in stats)

        finished = {k: sum(s.finished[k] for s in stats) for k in stats[0].finished}
        await send_json(send, 200, {
            "received": total("received"), "aborted": finished["abort"], "finished": finished,
            "preemptions": total("preemptions"), "cached_tokens": total("prefix_cache_hits"),
            "prefix_cache_queries": total("prefix_cache_queries"),
            "prompt_tokens": total("prompt_tokens"),
            "generation_tokens": total("generation_tokens"), "running": self.app.num_running,
            "waiting": self.app.num_waiting,
            "kv_usage": max(e.kv_usage for e in self.app.engines), "steps": total("steps"),
            "engines": [{"running": e.num_running, "waiting": e.num_waiting,
                         "kv_usage": e.kv_usage, "received": e.stats.received}
                        for e in self.app.engines],
            "in_flight": self.app.in_flight, **self.app.counters})

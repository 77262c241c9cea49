"""Responses API state: which replica holds a stored response.

With vLLM's response store on, a response lives only on the replica that created it; every
other replica answers 404 for it (as ``previous_response_id``, or on ``GET /v1/responses/{id}``
and ``POST /v1/responses/{id}/cancel``). The gateway remembers the id of every response it
relayed -> (tenant, pool, replica) in a bounded LRU, pins follow-ups to that replica and sends
the GET and cancel there. A tenant only ever reaches its own responses: an id remembered for
another tenant is answered as unknown, a follow-up naming it included (vLLM's store is keyed
by id alone and would continue the other tenant's conversation).

With Redis (`KVGATE_REDIS_URL`), every gateway and worker also writes each id's home there
(`SharedHomes`, in the background, kept a day), and one that meets an id it did not relay
looks it up there before routing: a follow-up or a GET may reach any gateway, and another
tenant's id is refused there too. Only Responses API requests naming an unknown id wait for
Redis, at most `SharedHomes.timeout_s`; with Redis down (or without it, or for an id evicted
from the LRU) an id this process never relayed cannot be checked and is routed as unknown.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from typing import NamedTuple

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

__all__ = ["ResponseHome", "ResponseStore", "SharedHomes", "response_id"]

log = logging.getLogger(__name__)

# the response's own id (``resp_...``); the top-level `id` is the body's first field, and a
# stream's first event (``response.created``) carries it as ``response.id``. Items inside a
# response have other prefixes (``msg_``, ``rs_``, ``fc_``...).
_RESP_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_.\-]{1,200})"')


def response_id(blob: bytes) -> str | None:
    m = _RESP_ID.search(blob)
    return m.group(1).decode() if m else None


class ResponseHome(NamedTuple):
    tenant: str
    pool: str
    replica: str


class SharedHomes:
    """Response homes in Redis, for the gateways and workers that did not relay them."""

    KEY = "kvgate:response:"
    TTL_S = 86_400  # vLLM keeps stored responses in memory until it restarts
    MAX_PENDING = 1024  # writes in flight; past it a write is dropped (Redis slow or down)

    def __init__(self, redis: aioredis.Redis, timeout_s: float = 0.25) -> None:
        self._redis = redis
        self.timeout_s = timeout_s
        self._pending: set[asyncio.Task[None]] = set()
        self.errors = 0

    def put(self, rid: str, home: ResponseHome) -> None:
        if len(self._pending) >= self.MAX_PENDING:
            self.errors += 1
            return
        task = asyncio.get_running_loop().create_task(self._put(rid, home))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _put(self, rid: str, home: ResponseHome) -> None:
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                await self._redis.set(self.KEY + rid, orjson.dumps(list(home)), ex=self.TTL_S)
        except (RedisError, OSError, TimeoutError) as exc:
            self.errors += 1
            log.debug("response home not shared", extra={"error": type(exc).__name__})

    async def get(self, rid: str) -> ResponseHome | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._redis.get(self.KEY + rid)
            if raw is None:
                return None
            tenant, pool, replica = orjson.loads(raw)
            return ResponseHome(str(tenant), str(pool), str(replica))
        except (RedisError, OSError, TimeoutError, ValueError) as exc:
            self.errors += 1
            log.debug("response home lookup failed", extra={"error": type(exc).__name__})
            return None

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._redis.aclose()


class ResponseStore:
    """A bounded LRU: response id -> where it lives (and `shared`, with Redis)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._homes: OrderedDict[str, ResponseHome] = OrderedDict()
        self.shared: SharedHomes | None = None

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, rid: str, tenant: str, pool: str, replica: str) -> None:
        home = ResponseHome(tenant, pool, replica)
        self._keep(rid, home)
        if self.shared is not None:
            self.shared.put(rid, home)

    def _keep(self, rid: str, home: ResponseHome) -> None:
        self._homes[rid] = home
        self._homes.move_to_end(rid)
        if len(self._homes) > self._capacity:
            self._homes.popitem(last=False)

    async def fetch(self, rid: object) -> None:
        """Learn where ``rid`` lives from the other gateways (Redis) when this one does not
        know it; `home` answers from memory afterwards."""
        if self.shared is None or not isinstance(rid, str) or rid in self._homes:
            return
        found = await self.shared.get(rid)
        if found is not None:
            self._keep(rid, found)

    def foreign(self, rid: str, tenant: str) -> bool:
        """`rid` is known here as another tenant's response."""
        found = self._homes.get(rid)
        return found is not None and found.tenant != tenant

    def home(self, rid: str, tenant: str) -> ResponseHome | None:
        """Where `rid` lives, if it was created for `tenant` (else None)."""
        found = self._homes.get(rid)
        if found is None or found.tenant != tenant:
            return None
        self._homes.move_to_end(rid)
        return found

"""Responses API state: which replica holds a stored response, and whose it is.

With vLLM's response store on, a response lives only on the replica that created it; every
other replica answers 404 for it (as ``previous_response_id``, or on ``GET /v1/responses/{id}``
and ``POST /v1/responses/{id}/cancel``). The gateway remembers the id of every response it
relayed -> (owner, pool, replica) in a bounded LRU, pins follow-ups to that replica and sends
the GET and cancel there. A tenant only ever reaches its own responses: an id remembered for
another owner is answered as unknown, a follow-up naming it included (vLLM's store is keyed
by id alone and would continue the other tenant's conversation). The owner is the tenant's
incarnation (``<id>#<incarnation>``, `ResponseStore.owner`), not its id alone: a tenant
deleted and created again under the same id does not reach its predecessor's responses.

With Redis (`KVGATE_REDIS_URL`), every gateway and worker also writes each id's home there
(`SharedHomes`, in the background, kept a day), and one that meets an id it did not relay
looks it up there before routing: a follow-up or a GET may reach any gateway, and another
tenant's id is refused there too. Only Responses API requests naming an unknown id wait for
Redis, at most `SharedHomes.timeout_s`; a lookup Redis does not answer (down, timed out) is
`ResponseLookupFailed`, a 503 to retry: the id may well exist (`gateway/prepare.py` and
`gateway/stored.py` decide what an id found nowhere is).

Without authentication (one tenant: nothing to isolate) an id this gateway cannot place --
it restarted, or another gateway without Redis relayed it -- is asked of the replicas
(`ReplicaSearch`): vLLM's GET answers 200 only where the response is stored. Sent on as
unknown, a follow-up reached its replica only when the pick landed there (one in two with two
replicas), and a GET was a 404 while the replica still held the response. An id no replica
that answered holds, while one could not be asked (down, frozen), is a 503 to retry, as a
known home that is down: it may be there.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import NoReplicaAvailable, ResponseLookupFailed, shown_name
from gateway.pool import Pool, Pools
from gateway.replicas import Replica
from gateway.transport import TRANSPORT_ERRORS

# what an ask of a replica may fail with: no answer, not in time
_ASK_FAILED: tuple[type[BaseException], ...] = (*TRANSPORT_ERRORS, TimeoutError)

__all__ = ["RESPONSE_ID", "ReplicaSearch", "ResponseHome", "ResponseStore", "SharedHomes",
           "home_out", "response_id"]

log = logging.getLogger(__name__)

# the response's own id (``resp_...``); the top-level `id` is the body's first field, and a
# stream's first event (``response.created``) carries it as ``response.id``. Items inside a
# response have other prefixes (``msg_``, ``rs_``, ``fc_``...).
RESPONSE_ID = re.compile(r"[A-Za-z0-9_.\-]{1,256}")  # what an id in a path or a body may be
_RESP_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_.\-]{1,200})"')


def response_id(blob: bytes) -> str | None:
    m = _RESP_ID.search(blob)
    return m.group(1).decode() if m else None


def home_out(pool: Pool, replica: Replica, rid: str, now: float,
             follow_up: bool) -> NoReplicaAvailable | None:
    """The 503 for response `rid` while `replica`, its only holder, cannot serve it: found
    down (refused, its /health failing, frozen); for a follow-up (`follow_up`: it runs the
    engine) also stalled or asleep. It may come back with the response (a frozen process, a
    cut network): a 503 with `Retry-After`, not vLLM's 404 that says it is gone, nor the
    502 of a refused connection or a wait until the first-byte timeout on a frozen one."""
    if not (replica.down or (follow_up and (replica.stalled or replica.asleep))):
        return None
    replica.stored_unavailable()  # kvgate_stored_response_unavailable_total
    return NoReplicaAvailable(
        f"The replica holding the response with id '{shown_name(rid)}' is unavailable "
        f"({replica.condition(now)}); a stored response lives on that replica alone: "
        "try again once it is back.", retry_after=pool.retry_after(now, [replica]))


class ResponseHome(NamedTuple):
    tenant: str  # its owner: ``<tenant id>#<incarnation>``, or the id of one without any
    pool: str
    replica: str


class SharedHomes:
    """Response homes in Redis, for the gateways and workers that did not relay them."""

    TTL_S = 86_400  # vLLM keeps stored responses in memory until it restarts
    MAX_PENDING = 64  # writes in flight; past it a write is dropped (Redis slow or down)
    CLOSE_WAIT_S = 0.5  # at shutdown, for the ids relayed last

    def __init__(self, redis: aioredis.Redis, namespace: str, timeout_s: float = 0.25) -> None:
        self._redis = redis
        self._key = f"{namespace}:response:"  # `tenancy.namespace`: deployments apart
        self.timeout_s = timeout_s
        self._pending: set[asyncio.Task[None]] = set()
        self.errors = 0
        self._failing = False

    def put(self, rid: str, home: ResponseHome) -> asyncio.Task[None] | None:
        """Write in the background; the task, or None when too many writes wait already."""
        if len(self._pending) >= self.MAX_PENDING:
            self._failed("too many writes waiting")
            return None
        task = asyncio.get_running_loop().create_task(self._put(rid, home))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _put(self, rid: str, home: ResponseHome) -> None:
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                await self._redis.set(self._key + rid, orjson.dumps(list(home)), ex=self.TTL_S)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(type(exc).__name__)
        else:
            self._answered()

    async def get(self, rid: str) -> ResponseHome | None:
        """`rid`'s home; None when Redis has none (or one that does not parse: counted).
        `ResponseLookupFailed` when Redis does not answer within `timeout_s`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._redis.get(self._key + rid)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed(type(exc).__name__)
            raise ResponseLookupFailed(rid) from None
        self._answered()
        if raw is None:
            return None
        try:
            tenant, pool, replica = orjson.loads(raw)
        except (ValueError, TypeError) as exc:
            self._failed(type(exc).__name__)
            return None
        return ResponseHome(str(tenant), str(pool), str(replica))

    def _answered(self) -> None:
        if self._failing:  # the outage's one warning gets its one line of recovery
            self._failing = False
            log.info("Responses API ids shared through Redis again")

    def _failed(self, why: str) -> None:
        self.errors += 1
        if not self._failing:  # once per outage, not once per request
            self._failing = True
            log.warning("Responses API ids not shared through Redis: other gateways may not "
                        "find the responses relayed here", extra={"error": why})

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self.CLOSE_WAIT_S)
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
        # tenant id -> the owner its responses are kept under (`TenantGate.owner`: its
        # incarnation's); the id itself until the gate is known
        self.owner: Callable[[str], str] = str
        # where an id found nowhere else is looked for: the replicas, without authentication
        self.finder: Callable[[str], Awaitable[ResponseHome | None]] | None = None

    def __len__(self) -> int:
        return len(self._homes)

    def remember(
        self, rid: str, tenant: str, pool: str, replica: str, *, stored: bool = True,
    ) -> asyncio.Task[None] | None:
        """Remember where ``rid`` lives; with Redis, also share it (unless the request said
        ``store: false``: the replica keeps nothing). Returns the write, if one started."""
        home = ResponseHome(self.owner(tenant), pool, replica)
        self._keep(rid, home)
        if self.shared is None or not stored:
            return None
        return self.shared.put(rid, home)

    def _keep(self, rid: str, home: ResponseHome) -> None:
        self._homes[rid] = home
        self._homes.move_to_end(rid)
        if len(self._homes) > self._capacity:
            self._homes.popitem(last=False)

    async def fetch(self, rid: object) -> None:
        """Learn where ``rid`` lives from the other gateways (Redis), then from the replicas
        (`finder`), when this one does not know it; `home` answers from memory afterwards.
        `ResponseLookupFailed` when Redis does not answer."""
        if not isinstance(rid, str) or rid in self._homes or not RESPONSE_ID.fullmatch(rid):
            return
        found = await self.shared.get(rid) if self.shared is not None else None
        if found is None and self.finder is not None:
            found = await self.finder(rid)
        if found is not None:
            self._keep(rid, found)

    def known(self, rid: str) -> bool:
        """`rid` is known here (relayed by this process, or found in Redis), whoever's."""
        return rid in self._homes

    def foreign(self, rid: str, tenant: str) -> bool:
        """`rid` is known here as another owner's response."""
        found = self._homes.get(rid)
        return found is not None and not self._owns(found, tenant)

    def home(self, rid: str, tenant: str) -> ResponseHome | None:
        """Where `rid` lives, if it was created for `tenant` as it is now (else None)."""
        found = self._homes.get(rid)
        if found is None or not self._owns(found, tenant):
            return None
        self._homes.move_to_end(rid)
        return found

    def _owns(self, home: ResponseHome, tenant: str) -> bool:
        # a home written by a kvgate that kept the tenant's id alone (no '#': shared in
        # Redis for a day) is its tenant's by id, as there
        return home.tenant == self.owner(tenant) or (
            "#" not in home.tenant and home.tenant == tenant)


class ReplicaSearch:
    """Finds which replica holds a response by asking each replica of every pool for it at
    once (``GET /v1/responses/{id}``: 200 where it is stored, vLLM's 404 elsewhere); the
    first to answer 200 with that response is its home, the other asks are dropped. Only
    for a gateway without authentication: with keys, whose response an id is cannot be told
    from a replica."""

    def __init__(self, pools: Pools, owner: Callable[[], str], timeout_s: float) -> None:
        self._pools = pools
        self._owner = owner  # the one tenant's owner (`ResponseStore.owner`), read per search
        self._timeout_s = timeout_s

    async def __call__(self, rid: str) -> ResponseHome | None:
        """Its home, or None when every replica answered without it. `NoReplicaAvailable`
        (503) when none holds it but some could not be asked (refused, timed out: down or
        frozen): the response may live there, as a known home that is down (`home_out`)
        answers; a 404 then told the client it was gone, a 503 from the gateway that
        relayed it."""
        asked = [(pool, replica) for pool in list(self._pools.by_name.values())
                 for replica in pool.replicas]
        asks = [asyncio.ensure_future(self._holds(pool, replica, rid)) for pool, replica in asked]
        unasked: list[tuple[Pool, Replica]] = []
        try:
            for answer in asyncio.as_completed(asks):
                found = await answer
                if isinstance(found, tuple):
                    return ResponseHome(self._owner(), found[0], found[1])
                if found is not None:
                    unasked.append(next(a for a in asked if a[1] is found))
        finally:
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
        if unasked:
            raise _unplaced(rid, unasked)
        return None

    async def _holds(
        self, pool: Pool, replica: Replica, rid: str,
    ) -> tuple[str, str] | Replica | None:
        """(pool, replica id) where it is stored; None where the replica says it is not;
        the replica itself when it could not be asked."""
        headers = {k: v for k, v in pool.headers.items() if k != "Content-Type"}
        try:
            status, body = await pool.transport.get(
                f"{replica.url}/v1/responses/{rid}", self._timeout_s, headers)
        except _ASK_FAILED:
            return replica
        # the response itself, its id first (a proxy or a stub answering 200 to any path
        # holds nothing)
        return (pool.name, replica.id) if status == 200 and response_id(body) == rid else None


def _unplaced(rid: str, unasked: list[tuple[Pool, Replica]]) -> NoReplicaAvailable:
    """The 503 for response `rid` found on no replica that answered, while `unasked` did
    not answer the search."""
    now = time.monotonic()  # (`Replica` times are monotonic seconds)
    retry = min(pool.retry_after(now, [replica]) for pool, replica in unasked)
    return NoReplicaAvailable(
        f"The response with id '{shown_name(rid)}' is on none of the replicas that answered, "
        f"and {len(unasked)} that may hold it could not be asked; a stored response lives on "
        "one replica alone: try again once it is back.", retry_after=retry)

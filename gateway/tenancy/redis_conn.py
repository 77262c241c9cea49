"""One way to open Redis for tenancy: short timeouts, no hidden retries, errors mapped.

Redis sits on the request path only for rate-limit admission, so a dead Redis must fail fast
(the caller then falls back) instead of stalling requests behind redis-py's retry loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.errors import BackendUnavailable

__all__ = ["connect_redis", "redis_unavailable"]


def connect_redis(
    url: str, *, timeout_s: float = 0.5, max_connections: int | None = None,
) -> aioredis.Redis:
    """A client (lazy: nothing connects until the first command)."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        url,
        max_connections=max_connections,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
    )
    return client


@contextmanager
def redis_unavailable() -> Iterator[None]:
    """Map every Redis failure to `BackendUnavailable` (without the URL, which may hold a
    password, and without chaining the original exception into logs): connection errors and
    timeouts, but also server replies such as READONLY after a failover or MISCONF, which must
    degrade the same way (last known state, per-process limits), never answer a 500."""
    try:
        yield
    except (RedisError, OSError) as exc:
        kind = type(exc).__name__
        raise BackendUnavailable(f"the tenancy store (Redis) failed ({kind})") from None

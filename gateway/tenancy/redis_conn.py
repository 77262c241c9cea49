"""One way to open Redis for tenancy: short timeouts, no hidden retries, errors mapped.

Redis sits on the request path only for rate-limit admission, so a dead Redis must fail fast
(the caller then falls back) instead of stalling requests behind redis-py's retry loop.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from gateway.errors import StoreUnreachable

__all__ = ["connect_redis", "failure_cause", "redis_address", "redis_unavailable"]


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


def redis_address(client: aioredis.Redis) -> str:
    """Where a client connects, for logs: ``host:port`` or a socket path (never the user name
    or the password its URL may carry)."""
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return str(kw["path"])
    host = str(kw.get("host", "localhost"))
    return f"[{host}]:{kw.get('port', 6379)}" if ":" in host else f"{host}:{kw.get('port', 6379)}"


def failure_cause(exc: BaseException) -> str:
    """A Redis failure in a few words: the OS error under it (``connection refused``, ``name
    or service not known``, ``timed out``), a server reply's first word (``READONLY``,
    ``WRONGPASS``: replies never echo a password), else the exception's class name."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TimeoutError):
            return "timed out"
        if isinstance(seen, OSError) and seen.errno is not None:
            if seen.errno in errno.errorcode:
                return os.strerror(seen.errno).lower()
            if seen.strerror:  # getaddrinfo's own codes (negative)
                return seen.strerror.lower()
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, ResponseError):
        # redis-py keeps a known reply's code apart (OOM, READONLY, ...: the message then
        # starts with the reply's second word)
        words = str(exc).split()
        code = getattr(exc, "status_code", None) or (words[0] if words else None)
        if code:
            return f"server replied {code}"
    return type(exc).__name__


@contextmanager
def redis_unavailable() -> Iterator[None]:
    """Map every Redis failure to `StoreUnreachable`, a `BackendUnavailable` (without the URL,
    which may hold a password, and without chaining the original exception into logs):
    connection errors and timeouts, but also server replies such as READONLY after a failover
    or MISCONF, which must degrade the same way (last known state, per-process limits), never
    answer a 500."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise StoreUnreachable(failure_cause(exc)) from None

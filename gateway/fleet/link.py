"""One raw Redis connection for the shared routing state's two loops.

redis-py's client (pool checkout, command parsing, retry machinery) costs ~90 µs of CPU per
command on this project's benchmark machine; a bare connection sending RESP2 and reading the
reply costs ~40 µs (loadtest/bench_sync.py measures the sharing's cost per request). Each
loop (publish, read) owns one link, so no locking is needed; a failed command drops the
connection and the next call reconnects.

A process frozen (SIGSTOP, a paused VM, a blocked event loop) while a call was in flight finds
its timeout long past at resume, with Redis's reply waiting in the socket: the timeout is then
given one more short grace (`_LATE_S`), so the reply is read rather than taken for Redis down
(every call in flight failed at resume: the process reported degraded, backed off, and routed
the requests queued meanwhile on a view as old as the freeze while the peers' backlog waited).

The read timeout is the link's own (`asyncio.timeout` around the whole round trip), not the
connection's ``socket_timeout``: with one set, redis-py writes through `asyncio.wait_for`, which
on Python 3.11 swallows a cancellation that lands as the write completes, and a cancelled loop
went on forever (a gateway's shutdown hung).
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.tenancy.redis_conn import redis_address, redis_tls

__all__ = ["Link"]

# a timeout that fires this late was not waited for: the process (its event loop) stood
# still, or was busy. Small: on uvloop (what `kvgate serve` runs) a timeout expired at once
# runs before the loop reads its sockets, so a reply that came during a stall of any length
# was lost unless the grace was given (a 0.25 s threshold lost it for late timers under that)
_LATE_S = 0.01
_GRACE_S = 0.1  # what a call in flight is given after such a stall to read a waiting reply


class Link:
    def __init__(self, url: str, timeout_s: float, read_timeout_s: float) -> None:
        # RESP2: replies are plain lists whatever the server's default protocol
        self._pool = ConnectionPool.from_url(
            url, protocol=2, socket_timeout=None, socket_connect_timeout=timeout_s)
        self._timeout = read_timeout_s
        # where it connects, for logs (never the URL's credentials); the client is not used
        self.address = redis_address(aioredis.Redis(connection_pool=self._pool))
        self.tls = redis_tls(self._pool)
        self._conn: AbstractConnection | None = None

    async def call(self, *args: bytes | str | int) -> object:
        return (await self.pipeline(args))[0]

    async def pipeline(self, *commands: tuple[bytes | str | int, ...]) -> list[object]:
        """Several commands in one write, their replies in order (one round trip); the
        builtin `TimeoutError` (an `OSError`) after the link's read timeout.

        A connection opened by an earlier call that turns out closed (Redis restarted, or a
        proxy dropped the idle connection) is the one failure a new connection cures: the
        commands are sent once more, on a new one. Without that the call that discovered it
        lost its batch (the first routes after every Redis restart). A retried XADD may, if
        the old server wrote it before the connection went, land twice: harmless, a route
        applied twice is the same route and loads are latest-wins. A timeout is not retried
        (a slow Redis would only be asked twice as long); a new connection's failure is
        final (Redis is down)."""
        if self._conn is None:
            return await self._round_trip(commands)
        try:
            return await self._round_trip(commands)
        except BusyLoadingError:  # the server answered: still loading its data
            raise
        except (RedisConnectionError, ConnectionError):
            return await self._round_trip(commands)  # the link has a new connection now

    async def _round_trip(
        self, commands: tuple[tuple[bytes | str | int, ...], ...]
    ) -> list[object]:
        try:
            # a new connection's handshake too: redis-py reads the reply to its CLIENT SETINFO
            # without a timeout, and a server that accepts and never answers (stopped, or a
            # proxy holding connections while its backend comes up) held a retry for ever
            async with asyncio.timeout(None) as timeout:
                due = _expire_after(timeout, self._timeout)
                try:
                    conn = self._conn
                    if conn is None:
                        conn = self._conn = self._pool.make_connection()  # type: ignore[no-untyped-call]
                        await conn.connect()
                    await conn.send_packed_command(conn.pack_commands(commands),
                                                   check_health=False)
                    return [await conn.read_response() for _ in commands]
                finally:
                    due.cancel()
        except BaseException:  # a half-read reply leaves the connection unusable
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.disconnect(nowait=True)  # never wait on a broken socket


def _expire_after(timeout: asyncio.Timeout, delay_s: float) -> asyncio.TimerHandle:
    """Expire ``timeout`` ``delay_s`` from now on the loop's clock, unless the loop stood
    still past that moment: then once more after a grace, the replies that arrived during the
    stall read first (the loop handles them before the grace's timer). The caller cancels the
    handle returned when its block ends."""
    loop = asyncio.get_running_loop()
    when = loop.time() + delay_s

    def due() -> None:
        now = loop.time()
        timeout.reschedule(now + _GRACE_S if now - when > _LATE_S else now)

    return loop.call_at(when, due)

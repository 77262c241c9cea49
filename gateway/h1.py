"""kvgate's own HTTP/1.1 client for the hot path: `POST` to a replica, relay the answer.

Why not aiohttp's client here: per proxied request it builds a `ClientRequest`, header
multidicts, cookie and tracing hooks, timers and a payload object; measured under load that
was about a quarter of kvgate's CPU per request (`loadtest/bench_overhead.py`). This client
keeps raw asyncio keep-alive connections per replica, writes the request as one bytes object
and parses the answer with httptools (the parser uvicorn uses), so a proxied exchange costs a
few Python calls. Health checks and the Responses-API lookups stay on
aiohttp (`ReplicaTransport`): they are rare.

Rules it keeps:
- at most `max_connections` exchanges with one replica at once, more wait (the caller bounds
  the wait, `upstream.connection_wait_s`, and is told when it ends: `on_send`): per replica, so
  one that takes requests and answers nothing cannot hold its healthy peers' slots; a replica
  with none in use or kept alive is forgotten (a churning discovery does not grow the pool);
- a connection is reused only when its answer was read to the end and both sides said
  keep-alive; one idle for longer than `IDLE_S` (under uvicorn's and so vLLM's 5 s default)
  is closed instead of reused;
- a request sent on a reused connection that the replica closed before answering anything is
  sent again once on a new connection (the replica closed an idle connection; it never saw
  the request);
- an answer is read and paced by its connection (`gateway.h1conn`: its head's bounds, a
  slow client's back-pressure);
- a URL's userinfo (``http://user:password@host``) is sent as Basic credentials, as aiohttp
  does for the health checks and scrapes, unless the request carries its own `Authorization`
  (a pool's API key), and never in the `Host` header;
- failures raise `ConnectionError`s (`UpstreamClosed`, `UpstreamProtocolError`) or
  `TimeoutError`, which `gateway.transport.TRANSPORT_ERRORS` covers.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from gateway.h1conn import H1Conn, UpstreamClosed, UpstreamProtocolError

__all__ = ["H1Pool", "H1Response", "UpstreamClosed", "UpstreamProtocolError"]

IDLE_S = 4.0  # an idle keep-alive connection older than this is not reused
MAX_TARGETS = 4096  # replica URLs whose parsed form is kept (all are, past a churn)


class H1Response:
    """`gateway.transport.UpstreamResponse` of one exchange on an `H1Conn`."""

    __slots__ = ("_conn", "_pool", "content_length", "content_type", "passed", "retry_after",
                 "status")

    def __init__(self, conn: H1Conn, pool: H1Pool) -> None:
        self._conn = conn
        self._pool = pool
        self.status = conn.status
        self.content_type = conn.content_type
        self.content_length = conn.content_length
        self.retry_after = conn.retry_after
        self.passed = conn.passed

    async def read_chunk(self) -> bytes:
        return await self._conn.read_chunk()

    def at_hand(self) -> bool:
        return self._conn.at_hand()

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self._conn.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        self._pool.done_with(self._conn, reuse=True)

    def abort(self) -> None:
        self._pool.done_with(self._conn, reuse=False)


class _Replica:
    """One replica's slots and idle connections, kept while any is in use (or waited for)."""

    __slots__ = ("idle", "slots", "users")

    def __init__(self, limit: int) -> None:
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[H1Conn] = []
        self.users = 0  # exchanges holding or waiting for a slot


class H1Pool:
    """Keep-alive connections to the replicas of one pool; at most `max_connections` carry an
    exchange with one replica at once (more wait), so a replica that stalls holds its own
    slots only. A replica's slots and idle connections are forgotten once none is in use: a
    discovery that churns replicas does not grow the pool."""

    def __init__(self, *, max_connections: int, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._limit = max_connections
        self._replicas: dict[tuple[str, int, bool], _Replica] = {}
        self._targets: dict[str, tuple[tuple[str, int, bool], bytes, bytes]] = {}
        self._busy: set[H1Conn] = set()
        self._ssl: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self.closed = False

    async def post(
        self, url: str, body: bytes, headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> H1Response:
        return await self.send("POST", url, body, headers, on_send)

    async def send(
        self, method: str, url: str, body: bytes, headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> H1Response:
        """Send a request; returns once the answer's head has arrived. `on_send` is called
        once the request has one of the replica's slots (the caller bounds the wait)."""
        if self.closed:
            raise UpstreamClosed("the transport is closed")
        key, host_line, auth_line, path = self._target(url)
        head = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), host_line]
        if auth_line and not any(k.lower() == "authorization" for k in headers):
            head.append(auth_line)
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1"))
        request = b"".join(head) + body
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._replicas[key] = _Replica(self._limit)
        replica.users += 1
        try:
            await replica.slots.acquire()
        except BaseException:  # cancelled while waiting
            self._leave(key, replica)
            raise
        try:
            if on_send is not None:
                on_send()
            conn = await self._exchange(replica, key, request)
        except BaseException:
            replica.slots.release()
            self._leave(key, replica)
            raise
        return H1Response(conn, self)

    def _leave(self, key: tuple[str, int, bool], replica: _Replica) -> None:
        """An exchange no longer holds or waits for one of the replica's slots."""
        replica.users -= 1
        if not replica.users and not replica.idle:
            del self._replicas[key]

    async def _exchange(self, replica: _Replica, key: tuple[str, int, bool],
                        request: bytes) -> H1Conn:
        """Send ``request``; return the connection once the answer's head has arrived."""
        conn = self._take_idle(replica)
        if conn is not None:
            self._busy.add(conn)
            conn.start(request)
            try:
                await conn.head
                return conn
            except UpstreamClosed:
                self._busy.discard(conn)
                if conn.any_byte:
                    raise
                # closed while idle (the replica's keep-alive timeout): it never saw it
            except BaseException:
                self._busy.discard(conn)
                conn.close()
                raise
        conn = await self._connect(key)
        self._busy.add(conn)
        conn.start(request)
        try:
            await conn.head
        except BaseException:
            self._busy.discard(conn)
            conn.close()
            raise
        return conn

    def _target(self, url: str) -> tuple[tuple[str, int, bool], bytes, bytes, str]:
        """(connection key, Host header line, Authorization line or b"", path) of a URL;
        bases are parsed once."""
        cut = url.find("/", url.find("//") + 2)
        base, path = (url, "/") if cut < 0 else (url[:cut], url[cut:])
        found = self._targets.get(base)
        if found is None:
            parts = urlsplit(base)
            tls = parts.scheme == "https"
            host = parts.hostname or "127.0.0.1"
            port = parts.port or (443 if tls else 80)
            userinfo, at, hostport = parts.netloc.rpartition("@")
            auth = b""
            if at:
                user, _, password = userinfo.partition(":")
                text = f"{unquote(user)}:{unquote(password)}"
                try:  # Latin-1, as aiohttp's BasicAuth sends it for the health checks
                    pair = text.encode("latin-1")
                except UnicodeEncodeError:  # beyond Latin-1: UTF-8 (RFC 7617's charset)
                    pair = text.encode()
                auth = b"Authorization: Basic " + base64.b64encode(pair) + b"\r\n"
            found = ((host, port, tls), f"Host: {hostport}\r\n".encode("latin-1"), auth)
            if len(self._targets) >= MAX_TARGETS:  # replicas come and go: forget the old
                self._targets.clear()
            self._targets[base] = found
        return found[0], found[1], found[2], path

    @staticmethod
    def _take_idle(replica: _Replica) -> H1Conn | None:
        idle = replica.idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> H1Conn:
        host, port, tls = key
        loop = asyncio.get_running_loop()
        context = None
        if tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: H1Conn(key), host, port, ssl=context,
                    server_hostname=host if tls else None)
        except UnicodeError as exc:
            # a host name the IDNA codec refuses (a label over 63 characters, an empty one):
            # a name that cannot resolve, as a failed lookup is (a policy stored before such
            # names were refused on input got a text/plain 500 out of the request path)
            raise socket.gaierror(socket.EAI_NONAME, f"invalid host name: {exc}") from exc
        return conn

    def done_with(self, conn: H1Conn, *, reuse: bool) -> None:
        """The exchange on ``conn`` is over: keep the connection for the next one, or close."""
        if conn not in self._busy:
            return  # released twice
        self._busy.discard(conn)
        replica = self._replicas[conn.key]  # kept while this exchange holds its slot
        if reuse and conn.complete and conn.keep_alive and not conn.closed and not self.closed:
            conn.idle_since = time.monotonic()
            replica.idle.append(conn)
            if self._sweep is None:
                self._sweep = asyncio.get_running_loop().call_later(IDLE_S, self._sweep_idle)
        else:
            conn.close()
        replica.slots.release()
        self._leave(conn.key, replica)

    def _sweep_idle(self) -> None:
        """Close connections idle too long to be reused (a replica gone without closing
        them holds them otherwise), and forget replicas left with nothing in use."""
        self._sweep = None
        now = time.monotonic()
        for key, replica in list(self._replicas.items()):
            for conn in replica.idle:
                if conn.closed or now - conn.idle_since >= IDLE_S:
                    conn.close()
            replica.idle = [conn for conn in replica.idle if not conn.closed]
            if not replica.users and not replica.idle:
                del self._replicas[key]
        if any(replica.idle for replica in self._replicas.values()):
            self._sweep = asyncio.get_running_loop().call_later(IDLE_S, self._sweep_idle)

    async def close(self) -> None:
        self.closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for replica in self._replicas.values():
            for conn in replica.idle:
                conn.close()
            replica.idle.clear()
        for conn in list(self._busy):
            conn.close()
        await asyncio.sleep(0)

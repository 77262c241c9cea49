"""kvgate's HTTP/1.1 client (gateway/h1.py) against raw loopback servers that answer exactly
what each test needs: keep-alive reuse, a replica closing an idle connection, bodies
delimited by length, chunks or the end of the connection, invalid answers, back-pressure."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway import h1, h1conn
from gateway.h1 import H1Pool, UpstreamClosed, UpstreamProtocolError
from gateway.transport import TRANSPORT_ERRORS, connect_failure, refused

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


class Server:
    """A loopback server; counts connections and requests; runs ``handler`` per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


def keep_alive(answer: bytes = OK) -> Callable[[Server], Handler]:
    def make(server: Server) -> Handler:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            while True:
                server.requests.append(await read_request(r))
                w.write(answer)
                await w.drain()
        return handler
    return make


def serve(make: Callable[[Server], Handler]) -> Server:
    server = Server(lambda r, w, n: asyncio.sleep(0))
    server.handler = make(server)
    return server


def pool() -> H1Pool:
    return H1Pool(max_connections=8, connect_timeout_s=2.0)


def test_a_finished_answer_returns_its_connection_for_reuse() -> None:
    async def run() -> None:
        server = serve(keep_alive())
        async with server as base:
            p = pool()
            for _ in range(3):
                resp = await p.post(base + "/v1/x", b'{"a":1}', {"X-Request-Id": "r"})
                assert resp.status == 200 and await resp.read_all() == b"{}"
                resp.release()
            await p.close()
        assert server.connections == 1 and len(server.requests) == 3
        first = server.requests[0]
        assert first.startswith(b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"X-Request-Id: r\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')

    asyncio.run(run())


def test_an_aborted_or_unfinished_answer_closes_its_connection() -> None:
    async def run() -> None:
        server = Server(lambda r, w, n: asyncio.sleep(0))

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            while True:
                server.requests.append(await read_request(r))
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")  # half the body
                await w.drain()
                await asyncio.sleep(0.05)
                w.write(b"cd")
                await w.drain()

        server.handler = handler
        async with server as base:
            p = pool()
            (await p.post(base + "/v1/x", b"{}", {})).abort()  # aborted: closed
            resp = await p.post(base + "/v1/x", b"{}", {})
            resp.release()  # released before its answer was complete: closed
            resp = await p.post(base + "/v1/x", b"{}", {})
            assert await resp.read_all() == b"abcd"
            resp.release()  # complete: kept
            resp = await p.post(base + "/v1/x", b"{}", {})
            assert await resp.read_all() == b"abcd"
            resp.release()
            await p.close()
        assert server.connections == 3 and len(server.requests) == 4

    asyncio.run(run())


def test_a_connection_the_replica_closed_while_idle_is_replaced_transparently() -> None:
    async def run() -> None:
        def make(server: Server) -> Handler:
            async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
                server.requests.append(await read_request(r))
                w.write(OK)  # keep-alive answer, then the replica closes the idle connection
                await w.drain()
            return handler

        server = serve(make)
        async with server as base:
            p = pool()
            for i in range(6):
                resp = await p.post(base + "/v1/x", b"{}", {})
                assert await resp.read_all() == b"{}"
                resp.release()
                # the close reaches us before the next request, or after it was sent: the
                # request then goes again on a new connection; both must work
                await asyncio.sleep(0.05 if i % 2 else 0)
            await p.close()
        assert len(server.requests) == 6 and server.connections == 6

    asyncio.run(run())


def test_a_connection_idle_too_long_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h1, "IDLE_S", 0.01)

    async def run() -> None:
        server = serve(keep_alive())
        async with server as base:
            p = pool()
            for _ in range(2):
                resp = await p.post(base + "/v1/x", b"{}", {})
                await resp.read_all()
                resp.release()
                await asyncio.sleep(0.05)
            await p.close()
        assert server.connections == 2

    asyncio.run(run())


@pytest.mark.parametrize(("answer", "body"), [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
     b"5\r\ndata:\r\n3\r\n x\n\r\n0\r\n\r\n", b"data: x\n"),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", b"until the end"),
])
def test_bodies_by_chunks_or_by_the_end_of_the_connection(answer: bytes, body: bytes) -> None:
    async def run() -> None:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await read_request(r)
            w.write(answer)
            await w.drain()

        async with Server(handler) as base:
            p = pool()
            resp = await p.post(base + "/v1/x", b"{}", {})
            assert await resp.read_all() == body
            resp.release()
            await p.close()

    asyncio.run(run())


def test_a_reset_after_the_head_raises_a_transport_error_while_reading() -> None:
    async def run() -> None:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            await w.drain()

        async with Server(handler) as base:
            p = pool()
            resp = await p.post(base + "/v1/x", b"{}", {})
            assert await resp.read_chunk() == b"partial"
            with pytest.raises(UpstreamClosed) as info:
                await resp.read_chunk()
            assert isinstance(info.value, TRANSPORT_ERRORS)
            resp.abort()
            await p.close()

    asyncio.run(run())


def test_an_invalid_answer_is_a_transport_error() -> None:
    async def run() -> None:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await read_request(r)
            w.write(b"SMTP ready\r\n\r\n")
            await w.drain()
            await asyncio.sleep(1)

        async with Server(handler) as base:
            p = pool()
            with pytest.raises(UpstreamProtocolError) as info:
                await p.post(base + "/v1/x", b"{}", {})
            assert isinstance(info.value, TRANSPORT_ERRORS)
            await p.close()

    asyncio.run(run())


def test_nothing_listening_is_refused() -> None:
    async def run() -> None:
        async with Server(lambda r, w, n: asyncio.sleep(0)) as base:
            pass  # closed: nothing listens on that port any more
        p = pool()
        with pytest.raises(TRANSPORT_ERRORS) as info:
            await p.post(base + "/v1/x", b"{}", {})
        assert refused(info.value)
        await p.close()

    asyncio.run(run())


def test_a_host_name_the_idna_codec_refuses_cannot_resolve() -> None:
    """A label over 63 characters (a policy stored before such URLs were refused on input):
    the codec's UnicodeError is no transport error, and escaped the request path as a 500."""

    async def run() -> None:
        p = pool()
        url = "http://" + "a" * 64 + ".example:8000"
        with pytest.raises(TRANSPORT_ERRORS) as info:
            await p.post(url + "/v1/x", b"{}", {})
        assert refused(info.value)
        assert connect_failure(info.value, url) == "cannot resolve host " + "a" * 64 + ".example"
        await p.close()

    asyncio.run(run())


def test_a_slow_reader_pauses_reading_and_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h1conn, "HIGH_WATER", 1024)
    payload = bytes(range(256)) * 32768  # 8 MiB

    async def run() -> None:
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload))
            w.write(payload)
            await w.drain()

        async with Server(handler) as base:
            p = pool()
            resp = await p.post(base + "/v1/x", b"{}", {})
            got, most = [], 0
            while chunk := await resp.read_chunk():
                got.append(chunk)
                most = max(most, len(chunk))
                await asyncio.sleep(0.2 if len(got) == 1 else 0.001)  # a slow client
            assert b"".join(got) == payload
            # reading paused: at most about one socket read (256 KiB) beyond the mark buffered
            assert most <= 1024 * 1024
            resp.release()
            await p.close()

    asyncio.run(run())


def test_at_most_max_connections_exchanges_at_once() -> None:
    async def run() -> None:
        gate = asyncio.Event()
        active = most = 0

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
            nonlocal active, most
            while True:
                await read_request(r)
                active += 1
                most = max(most, active)
                await gate.wait()
                active -= 1
                w.write(OK)
                await w.drain()

        async with Server(handler) as base:
            p = H1Pool(max_connections=2, connect_timeout_s=2.0)

            async def one() -> None:
                resp = await p.post(base + "/v1/x", b"{}", {})
                await resp.read_all()
                resp.release()

            tasks = [asyncio.create_task(one()) for _ in range(5)]
            await asyncio.sleep(0.2)
            gate.set()
            await asyncio.gather(*tasks)
            await p.close()
        assert most == 2

    asyncio.run(run())


def test_a_urls_credentials_go_as_basic_auth_never_in_the_host_header() -> None:
    """``http://user:password@host`` (e.g. a proxy in front of vLLM): the health checks and
    scrapes (aiohttp) sent Basic credentials from it and proxied requests did not, while the
    Host header carried the password. A request's own Authorization (a pool's API key) wins."""
    async def run() -> None:
        server = serve(keep_alive())
        async with server as base:
            p = pool()
            url = base.replace("http://", "http://al%40ice:pa%3Ass@") + "/v1/x"
            for headers in ({}, {"Authorization": "Bearer pool-key"}):
                resp = await p.post(url, b"{}", headers)
                await resp.read_all()
            latin = base.replace("http://", "http://u:%C3%A9@") + "/v1/x"  # 'é', as aiohttp
            await (await p.post(latin, b"{}", {})).read_all()
            await p.close()
        plain, keyed, accented = (r.split(b"\r\n\r\n")[0].split(b"\r\n")
                                  for r in server.requests)
        assert b"Authorization: Basic dTrp" in accented  # b64 of b"u:\xe9" (Latin-1)
        hostport = base.removeprefix("http://").encode()
        assert f"Host: {hostport.decode()}".encode() in plain and b"pa" not in plain[1]
        assert b"Authorization: Basic YWxAaWNlOnBhOnNz" in plain  # al@ice:pa:ss
        assert [h for h in keyed if h.lower().startswith(b"authorization")] == [
            b"Authorization: Bearer pool-key"]

    asyncio.run(run())

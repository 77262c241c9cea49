"""A real HTTP/1.1 server on loopback that answers the way a faulty replica (or a proxy in
front of one) does, for the answers `kvgate sim` cannot give: a stream the server ends
cleanly but too early, half an SSE event, a body cut after the headers.

It runs its own event loop in a thread, so synchronous tests (and the official `openai`
client) can use it beside a `kvgate serve` process. `/health` answers 200, `/metrics` an empty
page and `/v1/models` the model (a GET of a path in ``pages``, that page); every POST (and,
when ``get_answer`` is set, every GET of a stored response, ``/v1/responses/...``) gets the
bytes of ``answer`` then, when ``rest`` is set, ``rest`` once the test sets ``gate`` (so a
test can read the first bytes through the gateway before the replica sends more: streamed, not
buffered, with no timing involved); ``drip`` is sent after ``answer``, one part every
``drip_s`` seconds (a body that arrives slowly but keeps moving); then, per ``end``, the
connection stays open for the next request (``"keep"``), is closed (``"close"``: a FIN) or
reset (``"reset"``: a TCP RST; bytes not sent yet are dropped). With ``reset_upload`` set, a
POST is reset as soon as its head has arrived, its body unread (a replica that dies, or a proxy
that refuses the upload, while the gateway still sends it).

An exchange takes these settings as its request arrives: what a test sets after that, for its
next request, is not what an exchange still running here does (an answer the client has whole
may still be on its way out: a drip's pause, this thread not scheduled yet -- the next test's
``rest`` read then held the connection on a gate nobody would set, and the gateway's next
request on it waited for its first-byte timeout).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Literal

import orjson

from tests.support.gateway import gateway_proc

__all__ = ["CHAT_ANSWER", "BadReplica", "End", "behind_a_gateway", "chunked", "sse_head", "whole"]

End = Literal["keep", "close", "reset"]

# a whole chat completion of model "m", as vLLM answers one
CHAT_ANSWER = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hello"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def sse_head(*, chunked_body: bool = True) -> bytes:
    """A 200 event-stream head: chunked, or delimited by the end of the connection."""
    framing = b"transfer-encoding: chunked" if chunked_body else b"connection: close"
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + framing + b"\r\n\r\n"


def chunked(*parts: bytes, last: bool = True) -> bytes:
    """`parts` as HTTP/1.1 chunks, with the final empty chunk when `last`."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + (b"0\r\n\r\n" if last else b"")


async def _read_chunked(reader: asyncio.StreamReader) -> None:
    """Read (and drop) a chunked request body, its trailers included."""
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        await reader.readexactly(size + 2)
    while await reader.readuntil(b"\r\n") != b"\r\n":
        pass


def whole(*parts: bytes, status: int = 200, declared: bool = True) -> bytes:
    """A JSON answer of `parts`: with its content-length (`declared`), else chunked."""
    if not declared:
        return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n" % status + chunked(*parts))
    return _plain(status, b"".join(parts))


def _plain(status: int, body: bytes) -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (status, len(body)) + body)


class BadReplica:
    """``with BadReplica("m") as replica: replica.url ...``; set ``answer``/``end`` any time."""

    def __init__(self, model: str, answer: bytes = b"", end: End = "keep") -> None:
        self.model = model
        self.answer = answer
        self.get_answer: bytes | None = None
        self.pages: dict[bytes, bytes] = {}  # path -> the 200 JSON body a GET of it gets
        self.rest = b""
        self.drip: list[bytes] = []
        self.drip_s = 0.0
        self.gate = threading.Event()
        self.end: End = end
        self.reset_upload = False
        self.posts = 0
        self.gets: list[bytes] = []  # the paths (with query) of stored-response GETs
        self.get_ids: list[bytes] = []  # ... and the x-request-id each came with (b"": none)
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> BadReplica:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(5)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def refuse(self) -> None:
        """Take no new connection from now on (a connection to it is refused); the ones open
        stay (answered with ``end="close"``, none is left open)."""
        async def stop() -> None:
            assert self._server is not None
            self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length, chunked_body, req_id = 0, False, b""
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"x-request-id":
                        req_id = value.strip()
                    elif name.strip().lower() == b"content-length":
                        length = int(value)
                    elif name.strip().lower() == b"transfer-encoding":
                        chunked_body = b"chunked" in value.lower()
                if method == b"POST" and self.reset_upload:
                    self.posts += 1
                    _reset(writer)
                    return
                if chunked_body:  # (Envoy sends the picker's body so)
                    await _read_chunked(reader)
                else:
                    await reader.readexactly(length)
                stored = path.startswith(b"/v1/responses/") and self.get_answer is not None
                if method != b"POST" and not stored:
                    writer.write(self._page(path))
                    await writer.drain()
                    continue
                answer = self.answer if method == b"POST" else self.get_answer or b""
                drip, drip_s, rest, gate, end = (
                    list(self.drip), self.drip_s, self.rest, self.gate, self.end)
                if method == b"POST":
                    self.posts += 1
                else:
                    self.gets.append(path)
                    self.get_ids.append(req_id)
                writer.write(answer)
                await writer.drain()
                for part in drip:
                    await asyncio.sleep(drip_s)
                    writer.write(part)
                    await writer.drain()
                if rest:
                    loop = asyncio.get_running_loop()
                    if not await loop.run_in_executor(None, gate.wait, 30):
                        break
                    writer.write(rest)
                    await writer.drain()
                if end == "reset":
                    _reset(writer)
                    return
                if end == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def _page(self, path: bytes) -> bytes:
        if path in self.pages:
            return _plain(200, self.pages[path])
        if path == b"/v1/models":
            return _plain(200, orjson.dumps(
                {"object": "list", "data": [{"id": self.model, "object": "model"}]}))
        if path == b"/metrics":
            return _plain(200, b"")
        return _plain(200, b"{}")


def _reset(writer: asyncio.StreamWriter) -> None:
    """A TCP reset (RST), not a close (FIN): no lingering."""
    writer.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextmanager
def behind_a_gateway(
    model: str, env: dict[str, str] | None = None,
) -> Iterator[tuple[BadReplica, str]]:
    """One BadReplica and a `kvgate serve` in front of it: (replica, the gateway's base URL).
    Its failures never eject it (a module's cases share the two)."""
    with BadReplica(model) as replica:
        proc, base = gateway_proc(upstreams=[replica.url], env={
            "KVGATE_HEALTH__FAILURE_THRESHOLD": "1000", **(env or {})})
        with proc:
            yield replica, base

"""A TCP relay on loopback that delays every byte by a fixed time each way: a gateway whose
Redis is farther away (another zone) than another gateway's.

It runs its own event loop in a thread, so synchronous tests can put it between a `kvgate
serve` process and a redis-server. Order is kept; nothing is dropped, until `cut()`: then
every connection through it is closed and new ones are closed at once (a partition that the
peer sees as refused), until `heal()`. `delay_s` can be changed while it runs (chunks read
after the change wait the new delay).
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType

from tests.support.procs import free_port

__all__ = ["SlowLink"]


class SlowLink:
    """``with SlowLink(target_port, delay_s) as link:`` connect to ``link.port``."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.port = free_port()
        self._target = target_port
        self.delay_s = delay_s
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> SlowLink:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", self.port), self._loop).result(10)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def cut(self) -> None:
        """Close every connection through the link; refuse new ones until `heal()`."""
        def close_all() -> None:
            self._cut = True
            for writer in list(self._writers):
                writer.close()
        self._loop.call_soon_threadsafe(close_all)

    def heal(self) -> None:
        """Let connections through again."""
        self._loop.call_soon_threadsafe(setattr, self, "_cut", False)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        self._writers.add(writer)
        up_writer = None
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
            self._writers.add(up_writer)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer),
                                 return_exceptions=True)
        except (OSError, asyncio.CancelledError):  # (cancelled: the link is closing)
            # ended quietly: a connection task that ends cancelled is logged by asyncio's
            # server as an error ("Exception in callback ... connection_made")
            writer.close()
        finally:
            self._writers.discard(writer)
            if up_writer is not None:
                self._writers.discard(up_writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Each chunk read goes out `delay_s` after it was read, in order."""
        loop = asyncio.get_running_loop()
        due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                at, data = await due.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await reader.read(65536)
                due.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()

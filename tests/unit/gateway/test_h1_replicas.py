"""`H1Pool`'s connection slots are per replica: a replica that takes requests and answers
nothing holds its own slots, not its pool's; and the slots and idle connections of replicas no
longer used are forgotten (a discovery churning through replica addresses does not grow it)."""

from __future__ import annotations

import asyncio

import pytest

from gateway import h1
from gateway.h1 import H1Pool, H1Response
from tests.unit.gateway.test_h1 import OK, Handler, Server, keep_alive, read_request, serve

CLOSE = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"


def stalling(seen: list[bytes], arrived: asyncio.Event) -> Handler:
    """Takes each request and answers nothing until the client leaves; sets `arrived` at
    each one."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        seen.append(await read_request(r))
        arrived.set()
        await r.read()
    return handler


async def exchange(p: H1Pool, url: str) -> bytes:
    resp = await p.post(url, b"{}", {})
    body = await resp.read_all()
    resp.release()
    return body


def test_a_stalled_replica_holds_its_own_slots_not_the_pools() -> None:
    async def run() -> None:
        seen: list[bytes] = []
        arrived = asyncio.Event()

        async def sent_to_stalled(count: int) -> None:
            while len(seen) < count:
                arrived.clear()
                await arrived.wait()

        async with Server(stalling(seen, arrived)) as stalled, serve(keep_alive()) as good:
            p = H1Pool(max_connections=2, connect_timeout_s=2.0)
            held = [asyncio.create_task(p.post(stalled + "/v1/x", b"{}", {})) for _ in range(2)]
            await asyncio.wait_for(sent_to_stalled(2), 10)
            # the healthy replica of the same pool answers meanwhile (was: waited for a slot)
            assert await asyncio.wait_for(exchange(p, good + "/v1/x"), 10) == b"{}"
            third = asyncio.create_task(p.post(stalled + "/v1/x", b"{}", {}))
            assert await asyncio.wait_for(exchange(p, good + "/v1/x"), 10) == b"{}"
            assert len(seen) == 2 and not third.done()  # the stalled one's third waits
            held[0].cancel()  # one exchange ends: its slot goes to the waiting one
            await asyncio.wait_for(sent_to_stalled(3), 10)
            for task in (held[1], third):
                task.cancel()
            await asyncio.gather(*held, third, return_exceptions=True)
            assert list(p._replicas) == [("127.0.0.1", int(good.rsplit(":", 1)[1]), False)]
            await p.close()

    asyncio.run(run())


def test_a_waiter_cancelled_or_refused_leaves_nothing_behind() -> None:
    async def run() -> None:
        async with serve(keep_alive(CLOSE)) as base:
            p = H1Pool(max_connections=1, connect_timeout_s=2.0)
            first: H1Response = await p.post(base + "/v1/x", b"{}", {})
            waiting = asyncio.create_task(p.post(base + "/v1/x", b"{}", {}))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            assert await first.read_all() == b"{}"
            first.release()  # its answer said close: nothing idle, nothing in use
            assert not p._replicas
        with pytest.raises(ConnectionRefusedError):  # the server is gone
            await p.post(base + "/v1/x", b"{}", {})
        assert not p._replicas
        await p.close()

    asyncio.run(run())


def test_a_thousand_replicas_used_once_each_are_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(h1, "IDLE_S", 0.05)
    monkeypatch.setattr(h1, "MAX_TARGETS", 100)

    async def run() -> None:
        # 100 connections at once, accepted by servers on the same loop: on a loaded machine
        # a connect took longer than 2 s (a TimeoutError; the connect timeout is not tested)
        p = H1Pool(max_connections=4, connect_timeout_s=30.0)
        servers: list[Server] = []  # kept listening: every address is a new one
        for batch in range(10):  # 100 replicas at a time
            answer = CLOSE if batch % 2 else OK  # closed after the answer, or kept alive
            servers += [serve(keep_alive(answer)) for _ in range(100)]
            bases = [await server.__aenter__() for server in servers[-100:]]
            assert await asyncio.gather(*(exchange(p, b + "/v1/x") for b in bases)) == [
                b"{}"] * 100
            if answer is CLOSE:  # nothing idle, nothing in use: forgotten at once
                ports = {int(b.rsplit(":", 1)[1]) for b in bases}
                assert not ports & {port for _, port, _ in p._replicas}
            assert len(p._targets) <= 100
        for _ in range(200):  # the kept-alive ones go once idle too long to be reused
            if not p._replicas:
                break
            await asyncio.sleep(0.05)
        assert not p._replicas
        assert p._sweep is None  # nothing idle: no timer left either
        await p.close()
        for server in servers:
            await server.__aexit__()

    asyncio.run(asyncio.wait_for(run(), 60))

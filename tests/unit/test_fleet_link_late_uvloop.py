"""The sharing link's grace for a timeout that fires late, on uvloop (the loop `kvgate
serve` runs): uvloop runs a timeout expired at once before it reads its sockets, so a reply
that arrived while the loop was blocked was lost when the timer fired less than 0.25 s late
(the grace was given only past that). Real redis-server; the loop is blocked by a callback
while the call waits for its reply, as a busy request handler would."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvloop

from gateway.fleet.link import Link


def _blocked_call(url: str, stall_s: float) -> object:
    async def trial() -> object:
        link = Link(url, 1.0, 1.0)
        try:
            await link.call(b"PING")  # connected
            # Redis answers 50 ms after the call; from 10 ms on an I/O callback (a request
            # handler's) blocks the loop
            loop = asyncio.get_running_loop()
            busy, poke = socket.socketpair()
            busy.setblocking(False)

            def handler() -> None:
                busy.recv(1)
                time.sleep(stall_s)

            loop.add_reader(busy.fileno(), handler)
            loop.call_later(0.01, poke.send, b"x")
            try:
                return await link.call(b"BLPOP", b"kvgate-test-nothing", b"0.05")
            finally:
                loop.remove_reader(busy.fileno())
                busy.close()
                poke.close()
        finally:
            await link.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(trial())


@pytest.mark.parametrize("stall_s", [1.05, 1.15])  # the timer fires 0.05-0.15 s late
def test_a_reply_that_came_while_the_loop_was_blocked_is_read(
    redis_url: str, stall_s: float,
) -> None:
    assert _blocked_call(redis_url, stall_s) is None  # BLPOP's answer: nothing came

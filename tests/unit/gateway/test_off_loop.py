"""Large bodies are parsed in worker threads, at most a few at once (their parsed objects are
~20x the bytes). A request cancelled while its body is parsed cannot stop the thread: its slot
stays taken until the thread ends, or cancelled requests would let any number parse at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.prepare import OffLoop


def test_a_cancelled_caller_holds_its_slot_until_its_thread_ends() -> None:
    started, finish = threading.Event(), threading.Event()
    ran: list[str] = []

    def parse(name: str) -> str:
        ran.append(name)
        started.set()
        finish.wait(10)
        return name

    async def run() -> None:
        slots = OffLoop(1)
        first = asyncio.create_task(slots.run(parse, "first"))
        assert await asyncio.to_thread(started.wait, 10)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.create_task(slots.run(parse, "second"))
        await asyncio.sleep(0.1)
        assert ran == ["first"] and not second.done()  # the first thread still runs
        finish.set()
        assert await asyncio.wait_for(second, 10) == "second"

    try:
        asyncio.run(run())
    finally:
        finish.set()

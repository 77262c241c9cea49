"""The streams the picker leaves open for Envoy to end after an immediate response
(`Processor._ended`) are bounded: past `MAX_ENDED_WAITS` the next returns at once. Before, a
data plane that left refused streams open held every one of them (~37 KB each) for up to
`ENDED_WAIT_S`: a flood of refused requests held memory without bound."""

from __future__ import annotations

import asyncio
from typing import cast

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.epp.exchange import PickerCore
from gateway.epp.server import MAX_ENDED_WAITS, Processor

Inbox = asyncio.Queue[pb.ProcessingRequest | None]


async def test_streams_left_open_are_bounded_and_end_with_the_data_plane() -> None:
    processor = Processor(cast(PickerCore, object()))  # `_ended` never reads the core
    inboxes: list[Inbox] = [asyncio.Queue() for _ in range(MAX_ENDED_WAITS)]
    held = [asyncio.create_task(processor._ended(inbox)) for inbox in inboxes]
    await asyncio.sleep(0)  # each has registered its wait
    assert not any(t.done() for t in held)
    # one more: it does not wait (its stream gets its status at once)
    await asyncio.wait_for(processor._ended(asyncio.Queue()), 10)
    # the held ones still end when the data plane ends their streams
    inboxes[0].put_nowait(None)
    await asyncio.wait_for(held[0], 10)
    # and a slot freed is a slot to wait in again
    again: Inbox = asyncio.Queue()
    waiting = asyncio.create_task(processor._ended(again))
    await asyncio.sleep(0)
    assert not waiting.done()
    processor.stop_waiting()  # the picker stops: every one ends
    await asyncio.wait_for(asyncio.gather(waiting, *held[1:]), 10)

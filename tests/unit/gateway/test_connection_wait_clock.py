"""`Canceller`: an attempt waiting for one of its replica's connections is cut after
`connection_wait_s` ("connection wait", taken back for another try like a first-byte cut),
and the first-byte clock starts when the request is sent, not when the attempt began."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.config import UpstreamConfig
from gateway.timeouts import Canceller, cut_error


async def _connected() -> dict[str, Any]:
    await asyncio.sleep(3600)  # the client stays
    return {"type": "http.disconnect"}


async def _cut_after(cfg: UpstreamConfig, send_after_s: float | None) -> tuple[str | None, float]:
    """Start an attempt, send its request after `send_after_s` (None: never): the cut's
    reason and when it came."""
    ctl = Canceller(cfg, _connected)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ctl.attempt_started()
    if send_after_s is not None:
        loop.call_later(send_after_s, ctl.sent)
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(5)
        return ctl.reason, loop.time() - t0
    finally:
        ctl.close()


def test_the_wait_for_a_connection_is_bounded() -> None:
    cfg = UpstreamConfig(connection_wait_s=0.1, first_byte_timeout_s=5, total_timeout_s=9)
    reason, at = asyncio.run(_cut_after(cfg, None))
    assert reason == "connection wait" and 0.09 < at < 0.5
    exc = cut_error(reason)
    assert exc.status == 503 and exc.retry_after == 1
    assert "upstream.max_connections" in exc.message


def test_the_first_byte_clock_starts_when_the_request_is_sent() -> None:
    cfg = UpstreamConfig(connection_wait_s=5, first_byte_timeout_s=0.1, total_timeout_s=9)
    reason, at = asyncio.run(_cut_after(cfg, 0.3))
    assert reason == "first byte" and 0.39 < at < 0.8


def test_a_connection_wait_cut_is_taken_back_for_another_try() -> None:
    async def scenario() -> tuple[bool, str | None]:
        cfg = UpstreamConfig(connection_wait_s=0.05, first_byte_timeout_s=5, total_timeout_s=9)
        ctl = Canceller(cfg, _connected)
        try:
            ctl.attempt_started()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(5)
            return ctl.retry_first_byte(), ctl.reason
        finally:
            ctl.close()
    assert asyncio.run(scenario()) == (True, None)

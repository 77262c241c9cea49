"""`Canceller.retry_first_byte`: a first-byte cut is taken back for another try, with the
first-byte clock started anew, unless the client left or shutdown came meanwhile."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.config import UpstreamConfig
from gateway.drain import SHUTDOWN
from gateway.timeouts import Canceller

CFG = UpstreamConfig(first_byte_timeout_s=0.05, total_timeout_s=5.0)


async def _connected() -> dict[str, Any]:
    await asyncio.sleep(3600)  # the client stays
    return {"type": "http.disconnect"}


async def _cut_then(later: str | None) -> tuple[bool, str | None, int]:
    """Wait for the first-byte cut (and `later` firing too), then ask for a retry: (taken
    back?, the reason left, first-byte cuts seen before the next try's deadline)."""
    ctl = Canceller(CFG, _connected)
    cuts = 0
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(1)
        cuts += 1
        assert ctl.reason == "first byte"
        if later is not None:
            ctl.fire(later)
        retried = ctl.retry_first_byte()
        if not retried:
            return retried, ctl.reason, cuts
        ctl.sent()  # the next try's request goes out (its first-byte clock starts then)
        try:  # the next try gets its own first-byte deadline
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            cuts += 1
        return retried, ctl.reason, cuts
    finally:
        ctl.close()


def test_a_first_byte_cut_is_taken_back_and_the_clock_restarts() -> None:
    assert asyncio.run(_cut_then(None)) == (True, "first byte", 2)


@pytest.mark.parametrize("later", ["disconnect", SHUTDOWN])
def test_no_retry_once_the_client_left_or_shutdown_came(later: str) -> None:
    assert asyncio.run(_cut_then(later)) == (False, later, 1)

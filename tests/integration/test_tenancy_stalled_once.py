"""Leases whose release failed while Redis was away go with the tenant's next admission, in
its script. Several admissions arriving together once Redis answers each took the whole
list: every one sent the same releases and logged "concurrency leases released after Redis
answered again" with the same count (seen: four lines of 35 leases for one batch). Now one
admission takes them, and gives them back if its call fails. A real redis-server, stopped
with SIGSTOP; the limiter as the gateway builds it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import pytest

from gateway.errors import BackendUnavailable
from gateway.policy_doc import Limits
from gateway.tenancy.redis_conn import connect_redis
from gateway.tenancy.redis_limits import RedisRateLimiter
from tests.support.procs import redis_proc

SAID = "concurrency leases released after Redis answered again"


async def test_stalled_releases_go_with_one_admission_and_are_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    proc, url = redis_proc()
    with proc:
        limiter = RedisRateLimiter(connect_redis(url, timeout_s=0.5))  # (no retry loop)
        limits = Limits(max_concurrency=16)
        held = [await limiter.admit("acme", limits, tokens=0) for _ in range(3)]
        assert proc.popen is not None
        proc.popen.send_signal(signal.SIGSTOP)
        try:
            for admission in held:
                with contextlib.suppress(BackendUnavailable):
                    await limiter.release(admission)
            assert limiter.unreleased == 3
        finally:
            proc.popen.send_signal(signal.SIGCONT)
        with caplog.at_level(logging.INFO, logger="gateway.tenancy.redis_limits"):
            admitted = await asyncio.gather(
                *(limiter.admit("acme", limits, tokens=0) for _ in range(4)))
        assert all(a.allowed for a in admitted)
        said = [r for r in caplog.records if r.getMessage() == SAID]
        assert [r.__dict__["leases"] for r in said] == [3]
        assert limiter.unreleased == 0
        await limiter.close()

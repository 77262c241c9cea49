"""One replica whose health check fails in a way the monitor did not foresee is that replica's
failure alone: it is down, and every other replica is still checked. A host name with a label
over 63 characters (a policy stored before replica URLs were checked on input) made the
resolver raise `UnicodeError`; it ended the health checks' task, and no replica of any pool
was checked again (the down ones never came back)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.config import KvgateConfig
from gateway.health import HealthMonitor
from gateway.policy_doc import PolicyDoc
from gateway.pool import Pools
from tests.support.procs import free_port

LONG_LABEL = "http://" + "a" * 64 + ":8000"  # the resolver refuses it before any lookup


def test_a_check_failing_unforeseen_leaves_the_others_checked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused
    cfg = KvgateConfig.model_validate({"pools": {"p": {"served_model": "m",
                                                       "replicas": [closed]}}})
    # a stored document is not held to the input checks (`PolicyDoc`, not `parse_policy`)
    doc = PolicyDoc.model_validate({"pools": {"p": {"served_model": "m",
                                                    "replicas": [LONG_LABEL, closed]}}})

    async def run() -> None:
        pools = Pools(cfg, doc)
        try:
            monitor = HealthMonitor(pools, cfg.health, lambda: 0.0)
            await monitor.poll_once()
            await monitor.poll_once()  # a second round: still no exception, logged once
            bad, down = pools.by_name["p"].replicas
            assert (bad.state, bad.reason) == ("ejected", "/health: UnicodeError")
            assert (down.state, down.reason) == ("ejected", "/health: cannot connect")
        finally:
            await pools.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    failed = [r for r in caplog.records if r.getMessage() == "replica health check failed"]
    assert len(failed) == 1
    assert all("Traceback" not in r.getMessage() and r.exc_info is None for r in failed)

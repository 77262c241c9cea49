"""Entries another application writes to the routes stream (no format version: no kvgate
writes one without it) are dropped as malformed, and the log says something else writes to the
stream. They were counted as `reason="version"` and said as "entries of format version '' from
? are dropped ... a kvgate of another version?", sending an operator after a rolling upgrade
that was not there. Real processes: redis-server, the simulator, a gateway."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.integration.test_sync_other_versions import (
    _dropped,
    _warnings,
    _xadd,
    sharing_gateway,
)
from tests.support.gateway import wait_for
from tests.support.procs import Proc


def test_entries_without_a_version_are_malformed_not_another_version(
    sim_factory: Callable[..., tuple[Proc, str]], redis_url: str,
) -> None:
    with sharing_gateway(sim_factory, redis_url) as (gw, base, port):
        for n in range(2):
            _xadd(port, "event", f"order-{n}", "amount", "12")  # someone else's entries
        wait_for(lambda: _dropped(base, "malformed") == 2, 30, "the entries dropped")
        assert _dropped(base, "version") == 0
        said = _warnings(gw)
        assert not httpx.get(f"{base}/readyz", timeout=5).json()["sync"]["degraded"]
    assert not [m for m in said if "format version" in m], said
    malformed = [m for m in said if "malformed" in m]
    assert len(malformed) == 1 and "something else writes to it?" in malformed[0], said
    assert "order-" not in "".join(said)

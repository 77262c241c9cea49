"""A restart whose configuration names other replicas than the policy stored in Redis keeps
the stored policy (operators may have changed it through the admin API) and says so at start;
a restart with the same configuration says nothing."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

WARNING = "the policy in the tenancy store differs from this configuration's"


def _start(redis_url: str, upstream: str) -> tuple[str, str]:
    """(its log, the replica that answered) for one gateway started and stopped."""
    proc, base = gateway_proc(upstreams=[upstream], env={"KVGATE_REDIS_URL": redis_url})
    with proc:
        r = httpx.post(f"{base}/v1/completions", timeout=30,
                       json={"model": "sim-model", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        proc.stop()
        return proc.output(), r.headers["x-kvgate-replica"]


def test_a_restart_with_other_upstreams_keeps_the_stored_policy_and_says_so(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, first = sim_factory()
    _, second = sim_factory()
    log, replica = _start(redis_url, first)
    assert WARNING not in log  # the store was empty: seeded from this configuration
    log, replica = _start(redis_url, first)
    assert WARNING not in log, log  # the same configuration again: nothing to say
    log, replica = _start(redis_url, second)
    assert WARNING in log, log
    assert "pools" in log.split(WARNING, 1)[1].splitlines()[0]  # which sections differ
    assert replica.endswith(first.removeprefix("http://"))  # the stored policy is used

"""An Envoy frozen with a request in flight (SIGSTOP: in production a node or a network gone)
is found by the picker's HTTP/2 pings, and its exchange ended (499): the replica's in-flight
count and the tenant's concurrency lease given back. At 20 s between pings and 10 s for the
answer that took 30 s from the freeze (Envoy's own pings to the picker, each 0.5 s, are
reads that restart gRPC's keepalive timer, so the picker's first ping went out a whole
interval after the freeze): the tenant's next requests through another Envoy were refused
its concurrency limit's 429 meanwhile. Now at most 5 s + 5 s. A real Envoy, a real picker
with API keys, a simulated replica.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, inflight, request_statuses, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
ADMIN = "epp5-frozen-envoy-admin-0123456789"
# a completion running for minutes at the simulator's speed
LONGER = {"model": MODEL, "prompt": "x", "max_tokens": 20_000, "ignore_eos": True}
# past the pings' 5 s + 5 s, well short of the 30 s they took
FOUND_WITHIN_S = 20.0


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            proc.stop()


def test_a_frozen_envoy_gives_back_the_tenants_concurrency_soon(procs: list[Proc]) -> None:
    sim, url = sim_proc(None, "--time-scale", "1", model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}},
                   auth=True, env={"KVGATE_SALT_SECRET": AUTH_SECRET,
                                   "KVGATE_ADMIN_TOKEN": ADMIN})
    procs.append(epp.start())
    with admin_client(epp.base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "one", "tier": "default",
                                            "limits": {"max_concurrency": 1}}).status_code == 201
        key = admin.post("/tenants/one/keys").json()["key"]
    frozen, frozen_base = envoy_proc(epp.picker)
    procs.append(frozen.start())
    other, other_base = envoy_proc(epp.picker)
    procs.append(other.start())
    assert frozen.popen is not None
    auth = {"authorization": f"Bearer {key}"}
    short = {**LONGER, "max_tokens": 5}
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{frozen_base}/v1/completions", json=LONGER,
                           headers=auth, timeout=120)
        wait_for(lambda: inflight(epp.base) == 1, timeout=30, what="the request in flight")
        frozen.popen.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            # the tenant's one request is held by the frozen Envoy: refused elsewhere
            refused = httpx.post(f"{other_base}/v1/completions", json=short, headers=auth,
                                 timeout=30)
            assert refused.status_code == 429, refused.text
            wait_for(lambda: inflight(epp.base) == 0, timeout=60, what="the exchange ended")
            found_after = time.monotonic() - frozen_at
            served = httpx.post(f"{other_base}/v1/completions", json=short, headers=auth,
                                timeout=30)
        finally:
            frozen.popen.send_signal(signal.SIGCONT)
        assert held.result().status_code == 503  # (its exchange ended: the FailClose 503)
    assert found_after < FOUND_WITHIN_S, f"the frozen Envoy was found after {found_after:.1f} s"
    assert served.status_code == 200, served.text
    assert request_statuses(epp.base) == {"200": 1, "429": 1, "499": 1}

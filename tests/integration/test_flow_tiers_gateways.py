"""Tier priority across two gateways sharing state: a slot that frees goes to the premium
request queued on the other gateway, not to a free one queued where the slot freed.

One simulated replica whose streams hang after two tokens, ``max_inflight: 1`` fleet-wide.
Gateway B runs a free stream and queues another free request; gateway A queues a premium one
after it. When B's stream ends, B sees the slot free at once (its own count), A only once
B's record arrives: B sent its free request into it, and the premium one waited on A while the
pool took free requests. Now a gateway with live peers lets a lower band's request into a
slot only after the slot has stayed free for two records' lags (a peer's higher-band request
is picked, and its record back, within them): the premium request takes it.

Meanwhile the top band's own requests queued where the slot freed go at once: a lower band
owed its minimum share waits out the two lags without holding them back.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any

import httpx
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

ADMIN = "flow-tiers-gateways-admin-token-0123456789"


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def _fleet_inflight(base: str) -> int:
    """What `base` counts in flight on the fleet (its own and its peers' records)."""
    with admin_client(base, ADMIN) as admin:
        pools = admin.get("/replicas").json()["data"]
    return sum(int(r["inflight_fleet"]) for p in pools for r in p["replicas"])


def _peers(base: str) -> int:
    return int(httpx.get(f"{base}/readyz", timeout=5).json()["sync"]["peers"])


def _send(base: str, key: str, text: str) -> socket.socket:
    body = json.dumps({"model": "llama", "max_tokens": 50, "stream": True,
                       "messages": [{"role": "user", "content": text}]}).encode()
    client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                   b"content-type: application/json\r\nauthorization: Bearer " + key.encode()
                   + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    return client


def two_gateways(stack: ExitStack, config: dict[str, Any], redis_url: str, admin_token: str,
                 ) -> tuple[list[str], dict[str, str]]:
    """Two gateways with flow control over `redis_url` (entered in `stack`), seeing each
    other, and a premium and a free tenant: (their bases, each tenant's key)."""
    env = {"KVGATE_REDIS_URL": redis_url, "KVGATE_SALT_SECRET": AUTH_SECRET,
           "KVGATE_ADMIN_TOKEN": admin_token}
    bases = []
    for _ in range(2):
        proc, base = gateway_proc(config=config, env=env, auth=True)
        stack.enter_context(proc)
        bases.append(base)
    wait_for(lambda: all(_peers(b) == 1 for b in bases), 20, "the gateways to see each other")
    keys = {}
    with admin_client(bases[0], admin_token) as admin:
        for tenant, tier in (("prem", "premium"), ("free", "free")):
            assert admin.post("/tenants", json={"id": tenant, "tier": tier}).status_code == 201
            keys[tenant] = str(admin.post(f"/tenants/{tenant}/keys").json()["key"])
    return bases, keys


def _queued(base: str, n: int) -> bool:
    return _depth(base) == n


def _taken(sim: str, n: int) -> bool:
    return len(_prompts(sim)) >= n


def _prompts(sim: str) -> list[str]:
    items = httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]
    return [r["body"]["messages"][0]["content"] for r in items
            if r["path"] == "/v1/chat/completions"]


@pytest.fixture
def fleet(redis_url: str, sim_factory: Callable[..., tuple[Proc, str]]
          ) -> Iterator[tuple[list[str], str, dict[str, str]]]:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"premium": {"flow": {"band": 0}}, "free": {"flow": {"band": 1}}},
              "flow": {"enabled": True, "max_inflight": 1, "peer_lag_ms": 500},
              # the free band is owed its floor after two premium dispatches it waited through
              "fairness": {"min_share": {1: 0.9}}}
    with ExitStack() as stack:
        bases, keys = two_gateways(stack, config, redis_url, ADMIN)
        yield bases, sim, keys


def test_a_freed_slot_goes_to_the_premium_request_queued_on_the_other_gateway(
        fleet: tuple[list[str], str, dict[str, str]]) -> None:
    (a, b), sim, keys = fleet
    holder = _send(b, keys["free"], "free, running")
    assert holder.recv(4096).startswith(b"HTTP/1.1 200")  # it runs (and hangs)
    # A has B's record of it (a short prompt's load goes with a heartbeat)
    wait_for(lambda: _fleet_inflight(a) == 1, 10, "A to see B's stream")
    waiting = _send(b, keys["free"], "free, queued first")
    wait_for(lambda: _depth(b) == 1, 10, "the free request to queue on B")
    premium = _send(a, keys["prem"], "premium, queued on A")
    wait_for(lambda: _depth(a) == 1, 10, "the premium request to queue on A")
    time.sleep(1.5)  # every record has long arrived
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    holder.close()  # its slot frees (on B)
    wait_for(lambda: len(_prompts(sim)) >= 2, 20, "the freed slot to be taken")
    time.sleep(1.5)  # (a second request sent into it would show now)
    assert _prompts(sim) == ["free, running", "premium, queued on A"]
    assert _depth(b) == 1 and _depth(a) == 0
    waiting.close()
    premium.close()


def test_premium_requests_queued_here_go_while_an_owed_free_band_waits_the_lags(
        fleet: tuple[list[str], str, dict[str, str]]) -> None:
    (a, _), sim, keys = fleet
    # long prompts: a stream cut after its first tokens keeps the credit its prompt earned
    pad = " word" * 400
    holder = _send(a, keys["prem"], "p-run-1" + pad)
    assert holder.recv(4096).startswith(b"HTTP/1.1 200")
    time.sleep(1.5)  # its pick is past the unseen-sends window
    queued = [_send(a, keys["free"], "f-1" + pad)]
    wait_for(lambda: _depth(a) == 1, 10, "the free request to queue")
    for n in (2, 3, 4):
        queued.append(_send(a, keys["prem"], f"p-{n}" + pad))
        wait_for(partial(_queued, a, n), 10, f"premium request {n} to queue")
    running = holder
    for n in (2, 3):  # each freed slot goes to the next premium request (top band first)
        running.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        running.close()
        wait_for(partial(_taken, sim, n), 20, f"slot {n} to be taken")
        assert _prompts(sim)[-1].split()[0] == f"p-{n}"
        running = queued[n - 1]
        time.sleep(1.5)
    # two premium dispatches later the free band is owed its floor: it waits two lags for a
    # peer's top band, and the premium request queued here takes the slot meanwhile (it
    # waited those lags too, behind the owed band, and the band took the slot after them)
    running.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    running.close()
    wait_for(lambda: len(_prompts(sim)) >= 4, 20, "slot 4 to be taken")
    assert [p.split()[0] for p in _prompts(sim)] == ["p-run-1", "p-2", "p-3", "p-4"]
    assert _depth(a) == 1  # the free request, still owed
    for sock in queued:
        sock.close()

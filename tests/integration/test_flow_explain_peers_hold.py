"""Route explain says a lower band's request would queue while dispatch holds it for peers.

With other gateways live, a band below the policy's top one goes into a pool that had no room
only once the room has lasted two of their records' lags (a premium request queued on another
gateway gets the slot first). Explain did not apply that rule: right after the pool had room
again it answered ``would_queue: false`` for a free request that dispatch then queued for the
two lags. One simulated replica whose streams hang, ``max_inflight: 1``, two gateways sharing
Redis, ``peer_lag_ms`` long enough that the hold is seen.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import openai
import pytest

from tests.integration.test_flow_tiers_gateways import _depth, _send, two_gateways
from tests.support.gateway import (
    admin_client,
    inflight,
    wait_for,
)
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

ADMIN = "flow-explain-peers-admin-token-0123456789"


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _explain(base: str, tenant: str) -> dict[str, Any]:
    with admin_client(base, ADMIN) as admin:
        resp = admin.post("/route/explain", json={"tenant": tenant, "request": {
            "model": "llama", "messages": [{"role": "user", "content": "hi"}]}})
        assert resp.status_code == 200, resp.text
        flow: dict[str, Any] = resp.json()["flow"]
        return flow


@pytest.fixture
def fleet(redis_url: str, sim_factory: Callable[..., tuple[Proc, str]]
          ) -> Iterator[tuple[str, dict[str, str]]]:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"premium": {"flow": {"band": 0}}, "free": {"flow": {"band": 1}}},
              "flow": {"enabled": True, "max_inflight": 1, "peer_lag_ms": 1000}}
    with ExitStack() as stack:
        bases, keys = two_gateways(stack, config, redis_url, ADMIN)
        yield bases[0], keys


def test_explain_says_a_free_request_waits_for_room_to_last(
        fleet: tuple[str, dict[str, str]]) -> None:
    base, keys = fleet
    holder = _send(base, keys["free"], "running")
    assert holder.recv(4096).startswith(b"HTTP/1.1 200")  # it holds the only seat, and hangs
    queued = _send(base, keys["free"], "queued")
    wait_for(lambda: _depth(base) == 1, 10, "a request to queue: the pool had no room")
    _reset(queued)
    wait_for(lambda: _depth(base) == 0, 10, "the queued request to leave")
    _reset(holder)
    wait_for(lambda: inflight(base) == 0, 10, "the seat to free")
    # past this gateway's own unseen-sends margin the pool has room again
    wait_for(lambda: not _explain(base, "free")["saturated"], 20, "room")
    free = _explain(base, "free")
    assert free["queued"] == 0
    assert free["would_queue"] is True  # held while the room has not lasted two lags
    assert _explain(base, "prem")["would_queue"] is False  # the top band goes at once
    # and dispatch agrees: the free request waits, then is served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=keys["free"], max_retries=0,
                           timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "after"}], max_tokens=1)
    assert raw.status_code == 200 and raw.headers["x-kvgate-route"] == "queued"

"""A request queued in flow control whose client leaves is counted the same way at both edges:
out of the queue at once, `kvgate_flow_abandoned_total` + 1, logged 499, never sent to a
replica afterwards. At the picker gRPC cancels the exchange's handler when Envoy ends the
stream (the HTTP edge's disconnect watch signals the queue instead): the queue's cleanup of
a cancelled waiter removed it and counted nothing. Both edges (`kvgate serve`; the picker
behind a real Envoy), a simulated replica whose stream hangs after a few tokens (the pool
saturated at one request in flight), a raw socket that resets its connection.

Nor is a request still queued when the picker shuts down counted abandoned: it is
answered 503 and recorded "interrupted", as the HTTP edge answers it (gRPC cancelled it, and
Envoy answered its own 503, "The endpoint picker is unavailable", logged 499).
"""

from __future__ import annotations

import json
import signal
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support.edges import running_edge
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    inflight,
    metric_values,
    request_statuses,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "flow-abandoned-admin-token-0123456789"
BODY = json.dumps({"model": "llama", "max_tokens": 50, "stream": True,
                   "messages": [{"role": "user", "content": "hello"}]}).encode()


def _config(sim: str) -> dict[str, Any]:
    return {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
            "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
            "tenants": [{"id": "holder", "tier": "free"}, {"id": "leaver", "tier": "free"}],
            "flow": {"enabled": True, "max_inflight": 1}}


@pytest.fixture(params=["serve", "envoy"])
def edge(request: pytest.FixtureRequest,
         sim_factory: Callable[..., tuple[Proc, str]]) -> Iterator[tuple[str, str, str]]:
    """(the base clients call, the base with /metrics and the admin API, the replica)."""
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with running_edge(request.param, config=_config(sim), env=env, auth=True) as (base, admin):
        yield base, admin, sim


def _key(admin_base: str, tenant: str) -> str:
    with admin_client(admin_base, ADMIN) as admin:
        return str(admin.post(f"/tenants/{tenant}/keys").json()["key"])


def _total(base: str, name: str) -> float:
    return sum(metric_values(base, name).values())


def _received(sim: str) -> int:
    return int(httpx.get(f"{sim}/sim/stats", timeout=10).json()["received"])


def _send(base: str, key: str) -> socket.socket:
    """A streamed chat request written on a raw connection (its answer never read)."""
    client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                   b"content-type: application/json\r\nauthorization: Bearer "
                   + key.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)
    return client


def _reset(client: socket.socket) -> None:
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()


def test_a_client_leaving_the_queue_is_counted_abandoned(edge: tuple[str, str, str]) -> None:
    base, admin_base, sim = edge
    holder, leaver = _key(admin_base, "holder"), _key(admin_base, "leaver")
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", f"{base}/v1/chat/completions", content=BODY,
            headers={"authorization": f"Bearer {holder}",
                     "content-type": "application/json"}) as held:
        assert held.status_code == 200
        chunks = held.iter_raw()  # (kept: a dropped iterator closes the response)
        next(chunks)  # it runs (and hangs): the pool is saturated
        sent = _received(sim)
        client = _send(base, leaver)
        wait_for(lambda: _total(admin_base, "kvgate_flow_queue_depth") == 1, 10,
                 "the request to queue")
        _reset(client)
        wait_for(lambda: _total(admin_base, "kvgate_flow_queue_depth") == 0, 10,
                 "the queue to empty")
        wait_for(lambda: request_statuses(admin_base).get("499", 0) == 1, 10,
                 "the abandoned request counted 499")
        assert _total(admin_base, "kvgate_flow_abandoned_total") == 1
        assert metric_values(admin_base, "kvgate_flow_abandoned_total") == {
            '{pool="p",tier="free"}': 1.0}
    # the held stream left: the pool has room again, and the abandoned request stayed away
    wait_for(lambda: inflight(admin_base) == 0, 10, "the held stream to end")
    assert _received(sim) == sent
    assert _total(admin_base, "kvgate_flow_queued_total") == 1


def test_a_request_queued_at_the_end_of_the_pickers_grace_is_interrupted(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    epp = epp_proc(config={**_config(sim), "server": {"shutdown_grace_s": 1}}, auth=True,
                   env=env)
    with epp:
        envoy, base = envoy_proc(epp.picker)
        with envoy, httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{base}/v1/chat/completions", content=BODY,
                headers={"authorization": f"Bearer {_key(epp.base, 'holder')}",
                         "content-type": "application/json"}) as held:
            chunks = held.iter_raw()
            next(chunks)
            client = _send(base, _key(epp.base, "leaver"))
            wait_for(lambda: _total(epp.base, "kvgate_flow_queue_depth") == 1, 10,
                     "the request to queue")
            epp.signal(signal.SIGTERM)  # with the request still queued
            client.settimeout(30)
            head, _, body = client.recv(65536).partition(b"\r\n\r\n")
            client.close()
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after:" in head.lower(), head
            assert b"shutting down" in body, body
            assert epp.popen is not None and epp.popen.wait(30) == 0
        line = next(ln for ln in epp.output(None).splitlines() if '"tenant":"leaver"' in ln)
        assert '"status":503' in line and '"route":"interrupted"' in line, line
